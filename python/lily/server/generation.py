"""What every endpoint shares: the model's name and aliases, prompts prepared and checked before any
generation starts, generations run on the engine thread, and their output gathered into one turn.

A prompt is refused (``context_length_exceeded``) before tokenization when its text is longer than the
context could hold even at the longest token (a bound of the vocabulary, so the cost of refusing does
not grow with the prompt), and after it when its tokens leave no room to generate. ``max_tokens`` is
capped by the context left.
"""

from __future__ import annotations

import asyncio
import dataclasses
import fnmatch
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lily._lily import ContextFullError, LilyError
from lily.arguments import strings
from lily.generate import Steps, generation
from lily.model import Model
from lily.outputs import Chunk
from lily.sampling import Sampler
from lily.server.errors import ApiError
from lily.server.output import Delta, OutputParser
from lily.server.worker import Job, Scheduler
from lily.structured import Grammar, tool_call_grammar
from lily.tools import tool_call_arguments_as_mappings

__all__ = ["Plan", "Service", "Turn", "collect", "engine_error"]


@dataclasses.dataclass
class Plan:
    """A generation ready to run: the prompt's ids and everything ``Model.stream`` needs."""

    ids: list[int]
    thinking: bool  # the prompt ends inside <think>: the output starts with reasoning
    tools: list[dict[str, Any]] | None  # OpenAI-format tools whose calls are parsed (None: no parsing)
    max_tokens: int
    stop: list[str]
    sampler: Sampler
    grammar: Grammar | None
    logprobs: bool = False
    top_logprobs: int = 0
    chunks: Steps | None = None  # the generation, checked and not started (``Service.generation``)


def openai_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tools as the chat template and the parser want them: ``{"type": "function", "function": {...}}``."""
    if not tools:
        return None
    return [dict(t) if "function" in t else {"type": "function", "function": dict(t)} for t in tools]


class Service:
    """The model behind the endpoints. ``prepare_*`` run off the event loop (they tokenize); ``start``
    queues a plan on the engine thread."""

    def __init__(self, model: Model, model_id: str, *, aliases: Sequence[str] = (), worker: Scheduler):
        self.model, self.model_id, self.aliases, self.worker = model, model_id, list(aliases), worker
        self.max_seq = int(model.engine.max_seq)
        self._max_token_chars: int | None = None
        self._call_token = model.tokenizer.token_to_id("<tool_call>")

    # ---- names

    def names(self) -> list[str]:
        return [self.model_id, *(a for a in self.aliases if not any(c in a for c in "*?["))]

    def check_model(self, name: Any) -> None:
        """A request's ``model`` must be this model's id or match an alias (``--alias``, globs allowed)."""
        if name is None or name == self.model_id or any(fnmatch.fnmatchcase(str(name), a) for a in self.aliases):
            return
        raise ApiError(f"model {name!r} is not served here (this server has {self.model_id!r}; "
                       "add --alias NAME to answer to another name)", status=404, code="model_not_found",
                       param="model", type="not_found_error")

    # ---- prompts

    def max_prompt_chars(self) -> int:
        """No prompt of more characters fits the context: each token is at most this many characters."""
        if self._max_token_chars is None:
            tok = self.model.tokenizer
            self._max_token_chars = max(1, max(len(tok.token_bytes(i)) for i in range(len(tok))))
        return self.max_seq * self._max_token_chars

    def _too_long(self, n: int, what: str) -> ApiError:
        return ApiError(f"{what} of {n} tokens leaves no room to generate in the context of {self.max_seq} tokens",
                        code="context_length_exceeded", param="messages")

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               template_kwargs: Mapping[str, Any]) -> str:
        try:
            text = self.model.apply_chat_template(tool_call_arguments_as_mappings(messages), tools=tools,
                                                  add_generation_prompt=True, **dict(template_kwargs))
        except LilyError as e:  # no chat template in the checkpoint
            raise ApiError(str(e), status=400, param="messages") from None
        except (ValueError, TypeError, RecursionError) as e:  # the template refused the messages
            raise ApiError(f"the chat template rejected the messages: {e}", param="messages") from None
        assert isinstance(text, str)
        return text

    def tokenize(self, text: str, param: str = "messages") -> list[int]:
        if len(text) > self.max_prompt_chars():
            raise ApiError(f"the prompt has {len(text)} characters, more than a context of {self.max_seq} "
                           "tokens can hold", code="context_length_exceeded", param=param)
        try:
            return self.model.tokenizer.encode(text)
        except ValueError as e:  # not valid Unicode (a lone surrogate)
            raise ApiError(f"{param}: {e}", param=param) from None

    def plan(self, ids: list[int], *, thinking: bool, tools: list[dict[str, Any]] | None, max_tokens: int | None,
             stop: Sequence[str], sampling: Mapping[str, Any], grammar: Grammar | None, logprobs: bool = False,
             top_logprobs: int = 0) -> Plan:
        """Checks what the engine would only find later: room in the context, sampling values, the grammar."""
        if not ids:
            raise ApiError("the prompt is empty", param="prompt")
        room = self.max_seq - len(ids)
        if room < 1:
            raise self._too_long(len(ids), "the prompt")
        limit = room if max_tokens is None else min(max_tokens, room)
        try:
            sampler = self.model.sampler(**sampling)
        except (ValueError, TypeError, OverflowError) as e:
            raise ApiError(str(e)) from None
        try:
            stop = strings("stop", stop)
        except (ValueError, TypeError) as e:
            raise ApiError(str(e), param="stop") from None
        plan = Plan(ids, thinking, tools, limit, stop, sampler, grammar, logprobs, top_logprobs)
        # Made here, off the engine thread: every check the model makes (the grammar compiles, ...) is done before
        # the request is queued, so what it refuses is a 400 before any stream starts, not a failed generation.
        try:
            plan.chunks = self.generation(plan)
        except (ValueError, TypeError, OverflowError) as e:
            raise ApiError(str(e), param="response_format" if grammar is not None else None) from None
        return plan

    def prepare_chat(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                     tool_choice: str = "auto", parallel_tool_calls: bool = True, thinking: bool | None = None,
                     template_kwargs: Mapping[str, Any] | None = None, text: Grammar | None = None,
                     max_tokens: int | None = None, stop: Sequence[str] = (),
                     sampling: Mapping[str, Any] | None = None, logprobs: bool = False, top_logprobs: int = 0) -> Plan:
        """A chat turn: template, tokens and the grammar that ``tool_choice`` / ``text`` ask for.

        ``tool_choice``: "auto" (calls parsed; enforced only for tools marked ``strict``), "none" (tools
        stay in the prompt, calls are not produced), "required" or a function name (enforced).
        """
        kwargs = dict(template_kwargs or {})
        if thinking is not None:
            kwargs["enable_thinking"] = thinking
        prompt = self.render(messages, tools, kwargs)
        ids = self.tokenize(prompt)
        in_thinking = prompt.rstrip().endswith("<think>")
        sampling = dict(sampling or {})
        grammar = text
        parse = tools
        if tools and tool_choice == "none":
            parse = None
            if self._call_token is not None:
                bias = dict(sampling.get("logit_bias") or {})
                bias[self._call_token] = float("-inf")
                sampling["logit_bias"] = bias
        elif tools and (tool_choice != "auto" or any(_strict(t) for t in tools)):
            if text is not None and (tool_choice != "auto" or text.kind != "json_schema"):
                raise ApiError("a response format can only be combined with tool_choice auto and a JSON schema",
                               param="response_format")
            try:
                grammar = tool_call_grammar(tools, choice=tool_choice, parallel=parallel_tool_calls, text=text,
                                            thinking=in_thinking)
            except ValueError as e:
                raise ApiError(str(e), param="tool_choice" if "tool_choice" in str(e) else "tools") from None
            return self.plan(ids, thinking=in_thinking, tools=parse, max_tokens=max_tokens, stop=stop,
                             sampling=sampling, grammar=grammar, logprobs=logprobs, top_logprobs=top_logprobs)
        if grammar is not None and in_thinking:
            grammar = grammar.after_thinking()
        return self.plan(ids, thinking=in_thinking, tools=parse, max_tokens=max_tokens, stop=stop, sampling=sampling,
                         grammar=grammar, logprobs=logprobs, top_logprobs=top_logprobs)

    # ---- running

    async def prepare(self, fn: Callable[..., Plan], *args: Any, **kwargs: Any) -> Plan:
        """``fn(*args, **kwargs)`` (one of the ``prepare_*`` methods) off the event loop, once the queue has room:
        a request that would be refused with a 429 is refused before its prompt is rendered and tokenized."""
        self.worker.check_room()
        return await asyncio.to_thread(fn, *args, **kwargs)

    def start(self, plan: Plan) -> Job:
        """Queue ``plan``'s generation on the engine thread; its events are ``Chunk``s."""
        chunks = plan.chunks
        assert chunks is not None, "a plan is made by Service.plan"
        return self.worker.submit(lambda: chunks)

    def generation(self, plan: Plan) -> Steps:
        """The one place where the server asks the model for a generation. Called off the engine thread, it
        compiles the plan's grammar (what the model refuses is a 400 before any stream starts) and returns the
        generation unstarted (``lily.generate.generation``, the loop ``Model.stream`` runs too); the scheduler
        (``worker.py``) runs it in its batch, resuming the longest prefix of ``plan.ids`` that the model's prefix
        cache holds, and reports how many prompt tokens it reused in the last chunk's
        ``stats.cached_prompt_tokens``: that number, and only that, is what the APIs report (``cached_tokens``,
        ``cache_read_input_tokens``)."""
        constraint = None if plan.grammar is None else self.model.constrain(plan.grammar)
        return generation(self.model.tokenizer, plan.ids, plan.sampler, plan.max_tokens, plan.stop, plan.logprobs,
                          plan.top_logprobs, constraint)


def _strict(tool: Mapping[str, Any]) -> bool:
    fn = tool.get("function", tool)
    return isinstance(fn, Mapping) and fn.get("strict") is True


def engine_error(e: BaseException) -> ApiError:
    """An exception from the engine thread as the error a client gets."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ContextFullError):
        return ApiError(str(e), code="context_length_exceeded", param="messages")
    if isinstance(e, ValueError):  # e.g. a grammar that allows nothing at some step
        return ApiError(str(e), status=500, type="server_error")
    return ApiError(f"generation failed: {e!r}", status=500, type="server_error")


async def collect(job: Job, turn: Turn) -> None:
    """Feed all of ``job``'s events to ``turn`` (for a response sent whole at the end)."""
    try:
        async for chunk in job.events():
            turn.add(chunk)
    except Exception as e:
        raise engine_error(e) from None
    if not turn.done:
        raise ApiError("generation was cancelled", status=500, type="server_error")


class Turn:
    """The output of one generation as it streams: deltas of reasoning and text, then tool calls, the
    finish reason, the stop sequence that ended it (if one did) and the token counts."""

    def __init__(self, plan: Plan, service: Service):
        self.plan, self.service = plan, service
        self.parser = OutputParser(thinking=plan.thinking, tools=plan.tools)
        self.tokens: list[int] = []
        self.logprobs: list[tuple[int, float | None, list[tuple[int, float]] | None]] = []
        self.tool_calls: list[dict[str, Any]] = []
        self.finish_reason: str | None = None  # "stop", "length" or "tool_calls"
        self.stop_sequence: str | None = None
        self.prompt_tokens = len(plan.ids)
        self.cached_tokens = 0
        self.stats: Any = None

    def add(self, chunk: Chunk) -> list[Delta]:
        if chunk.token is not None:
            self.tokens.append(chunk.token)
            if self.plan.logprobs:
                self.logprobs.append((chunk.token, chunk.logprob, chunk.top_logprobs))
        deltas = self.parser.feed(chunk.text)
        if chunk.finish_reason is not None:
            tail, self.tool_calls = self.parser.finish()
            deltas += tail
            self.stats = chunk.stats
            self.cached_tokens = chunk.stats.cached_prompt_tokens if chunk.stats else 0
            self.finish_reason = "tool_calls" if self.tool_calls else chunk.finish_reason
            eos = self.service.model.eos_ids
            if chunk.finish_reason == "stop" and self.plan.stop and chunk.token not in eos:
                self.stop_sequence = self._which_stop()
        return deltas

    def _which_stop(self) -> str | None:
        text = self.service.model.tokenizer.decode(self.tokens)
        hits = [(text.find(s), s) for s in self.plan.stop if s and s in text]
        return min(hits)[1] if hits else None

    @property
    def completion_tokens(self) -> int:
        return self.stats.generated_tokens if self.stats is not None else len(self.tokens)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None
