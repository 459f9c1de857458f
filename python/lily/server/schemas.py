"""Request bodies of the OpenAI and Anthropic APIs, as pydantic models: types are strict (``"stream":
"false"`` is an error, not true), unknown fields are ignored (clients send many we need not act on),
and a field we cannot honour is refused by the endpoint rather than silently dropped.

No ``from __future__ import annotations`` here: pydantic reads these annotations at run time, on
Python 3.9 too.
"""

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

Bool = Annotated[bool, Field(strict=True)]
Int = Annotated[int, Field(strict=True)]
Str = Annotated[str, Field(strict=True)]
PositiveInt = Annotated[int, Field(strict=True, ge=1)]
Temperature = Annotated[float, Field(strict=True, ge=0, le=2)]
Probability = Annotated[float, Field(strict=True, ge=0, le=1)]
TopP = Annotated[float, Field(strict=True, gt=0, le=1)]
Penalty = Annotated[float, Field(strict=True, ge=-2, le=2)]
Seed = Annotated[int, Field(strict=True, ge=-(1 << 63), lt=1 << 64)]
Object = dict[str, Any]


class Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---- OpenAI: chat completions


class TextPart(Model):
    type: Literal["text", "input_text", "output_text"]
    text: Str


class OtherPart(Model):
    """A content part we cannot take (images, audio, files): the endpoint refuses it by type."""

    type: Str


ContentPart = Union[TextPart, OtherPart]


class FunctionCall(Model):
    name: Str
    arguments: Union[Str, Object] = "{}"


class ToolCall(Model):
    id: Optional[Str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[Str, list[ContentPart], None] = None
    name: Optional[Str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[Str] = None
    reasoning_content: Optional[Str] = None


class FunctionDef(Model):
    name: Annotated[str, Field(strict=True, pattern=r"^[A-Za-z0-9_.:\-]{1,128}$")]
    description: Optional[Str] = None
    parameters: Optional[Object] = None
    strict: Optional[Bool] = None


class Tool(Model):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Model):
    name: Str


class NamedToolChoice(Model):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(Model):
    name: Optional[Str] = None
    schema_: Optional[Union[Object, Bool]] = Field(default=None, alias="schema")
    strict: Optional[Bool] = None


class ResponseFormat(Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StreamOptions(Model):
    include_usage: Bool = False


class Sampling(Model):
    """Sampling fields shared by chat completions and completions."""

    temperature: Optional[Temperature] = None
    top_p: Optional[TopP] = None
    top_k: Optional[Annotated[int, Field(strict=True, ge=0)]] = None
    min_p: Optional[Probability] = None
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    repetition_penalty: Optional[Annotated[float, Field(strict=True, gt=0, le=100)]] = None
    seed: Optional[Seed] = None
    logit_bias: Optional[dict[str, Annotated[float, Field(strict=True, ge=-100, le=100)]]] = None
    stop: Union[Str, Annotated[list[Str], Field(max_length=16)], None] = None
    n: Optional[Int] = None
    stream: Bool = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[PositiveInt] = None
    model: Optional[Str] = None


class ChatRequest(Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Optional[PositiveInt] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[Bool] = None
    response_format: Optional[ResponseFormat] = None
    logprobs: Optional[Bool] = None
    top_logprobs: Optional[Annotated[int, Field(strict=True, ge=0, le=20)]] = None
    chat_template_kwargs: Optional[Object] = None
    enable_thinking: Optional[Bool] = None
    reasoning_effort: Optional[Str] = None


class CompletionRequest(Sampling):
    prompt: Union[Str, list[Str], list[Int], list[list[Int]]]
    logprobs: Optional[Annotated[int, Field(strict=True, ge=0, le=20)]] = None
    echo: Optional[Bool] = None
    suffix: Optional[Str] = None
    best_of: Optional[Int] = None


# ---- OpenAI: responses


class InputMessage(Model):
    type: Optional[Literal["message"]] = None
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[Str, list[ContentPart]]


class FunctionCallItem(Model):
    type: Literal["function_call"]
    call_id: Str
    name: Str
    arguments: Str
    id: Optional[Str] = None


class FunctionCallOutputItem(Model):
    type: Literal["function_call_output"]
    call_id: Str
    output: Union[Str, list[ContentPart]]


class ReasoningItem(Model):
    type: Literal["reasoning"]
    id: Optional[Str] = None
    summary: list[Object] = []
    content: Optional[list[Object]] = None


InputItem = Union[InputMessage, FunctionCallItem, FunctionCallOutputItem, ReasoningItem]


class ResponseTool(FunctionDef):
    """A function tool of the Responses API: chat completions' ``function`` with its ``type`` beside it."""

    type: Literal["function"]


class ResponseToolChoice(NamedFunction):
    type: Literal["function"]


class TextFormat(JsonSchemaFormat):
    type: Literal["text", "json_object", "json_schema"]


class TextOptions(Model):
    format: Optional[TextFormat] = None


class Reasoning(Model):
    effort: Optional[Str] = None
    summary: Optional[Str] = None


class ResponsesRequest(Model):
    model: Optional[Str] = None
    input: Union[Str, list[InputItem]]
    instructions: Optional[Str] = None
    tools: Optional[list[ResponseTool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], ResponseToolChoice, None] = None
    parallel_tool_calls: Optional[Bool] = None
    text: Optional[TextOptions] = None
    reasoning: Optional[Reasoning] = None
    max_output_tokens: Optional[PositiveInt] = None
    temperature: Optional[Temperature] = None
    top_p: Optional[TopP] = None
    stream: Bool = False
    store: Optional[Bool] = None
    previous_response_id: Optional[Str] = None
    metadata: Optional[dict[str, Any]] = None
    include: Optional[list[Str]] = None
    top_logprobs: Optional[Annotated[int, Field(strict=True, ge=0, le=20)]] = None


# ---- Anthropic: messages


class AText(Model):
    type: Literal["text"]
    text: Str


class AThinking(Model):
    type: Literal["thinking"]
    thinking: Str
    signature: Optional[Str] = None


class ARedactedThinking(Model):
    type: Literal["redacted_thinking"]


class AToolUse(Model):
    type: Literal["tool_use"]
    id: Str
    name: Str
    input: Object


class AToolResult(Model):
    type: Literal["tool_result"]
    tool_use_id: Str
    content: Union[Str, list[Union[AText, OtherPart]], None] = None
    is_error: Optional[Bool] = None


class AOther(Model):
    """Images, documents, server tool results...: refused by type."""

    type: Str


ABlock = Union[AText, AThinking, ARedactedThinking, AToolUse, AToolResult, AOther]


class AMessage(Model):
    role: Literal["user", "assistant"]
    content: Union[Str, list[ABlock]]


class ATool(Model):
    type: Optional[Str] = None  # custom tools have none (or "custom"); server tools name their kind
    name: Str
    description: Optional[Str] = None
    input_schema: Optional[Object] = None
    strict: Optional[Bool] = None


class AToolChoice(Model):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[Str] = None
    disable_parallel_tool_use: Optional[Bool] = None


class AThinkingConfig(Model):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[Int] = None


class AOutputFormat(Model):
    type: Literal["json_schema"]
    schema_: Union[Object, Bool] = Field(alias="schema")


class AOutputConfig(Model):
    format: Optional[AOutputFormat] = None
    effort: Optional[Str] = None


class MessagesRequest(Model):
    model: Str
    messages: list[AMessage]
    max_tokens: PositiveInt
    system: Union[Str, list[AText], None] = None
    stop_sequences: Optional[Annotated[list[Str], Field(max_length=16)]] = None
    stream: Bool = False
    temperature: Optional[Annotated[float, Field(strict=True, ge=0, le=1)]] = None
    top_p: Optional[TopP] = None
    top_k: Optional[Annotated[int, Field(strict=True, ge=0)]] = None
    tools: Optional[list[ATool]] = None
    tool_choice: Optional[AToolChoice] = None
    thinking: Optional[AThinkingConfig] = None
    output_config: Optional[AOutputConfig] = None
    metadata: Optional[Object] = None


class CountTokensRequest(Model):
    model: Str
    messages: list[AMessage]
    system: Union[Str, list[AText], None] = None
    tools: Optional[list[ATool]] = None
    tool_choice: Optional[AToolChoice] = None
    thinking: Optional[AThinkingConfig] = None
