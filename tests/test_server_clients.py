"""``lily serve`` driven by the official ``openai`` and ``anthropic`` clients (pinned in the test
requirements): every endpoint, streaming and not, with tools, thinking and schemas. The clients parse
every response into their own models and their stream helpers check the event order, so a field or an
event out of place fails here."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from server_helpers import http, running, scripted, sse, tokenizer

TOOL = {"name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]}}
CALL = ("Let me check.</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
ANSWER = "I should greet.</think>\n\nHello! How can I help?"
USER = [{"role": "user", "content": "Weather in Paris?"}]


def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


# ---- OpenAI


def test_openai_chat_with_tools_streaming_and_not():
    with running(scripted(CALL)) as server:
        out = oai(server).chat.completions.create(model="test-model", messages=USER, tools=[{"type": "function",
                                                  "function": TOOL}], temperature=0)
        call = out.choices[0].message.tool_calls[0]
        assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    with running(scripted(CALL)) as server:
        stream = oai(server).chat.completions.create(model="test-model", messages=USER, stream=True,
                                                     tools=[{"type": "function", "function": TOOL}],
                                                     stream_options={"include_usage": True})
        chunks = list(stream)
        calls = [c for ch in chunks if ch.choices for c in (ch.choices[0].delta.tool_calls or [])]
        assert calls[0].function.name == "get_weather" and chunks[-1].usage.completion_tokens > 0
        reasoning = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in chunks
                            if ch.choices)
        assert reasoning == "Let me check."


def test_openai_structured_output_and_logprobs():
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    with running(scripted("not json at all")) as server:
        out = oai(server).chat.completions.create(
            model="test-model", messages=USER, temperature=0, max_tokens=30, logprobs=True, top_logprobs=1,
            response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}},
            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        content = out.choices[0].message.content
        assert isinstance(json.loads(content)["ok"], bool)
        assert "".join(t.token for t in out.choices[0].logprobs.content).startswith(content)


def test_openai_completions():
    with running(scripted("one two three")) as server:
        out = oai(server).completions.create(model="test-model", prompt="Count:", max_tokens=2, temperature=0)
        assert out.choices[0].text == "one two" and out.usage.completion_tokens == 2
    with running(scripted("one two three")) as server:
        text = "".join(c.choices[0].text for c in oai(server).completions.create(
            model="test-model", prompt="Count:", stream=True, stop=[" three"]) if c.choices)
        assert text == "one two"


def test_openai_responses_with_reasoning_and_function_calls():
    tool = {"type": "function", **TOOL}
    with running(scripted(CALL)) as server:
        client = oai(server)
        resp = client.responses.create(model="test-model", input="Weather in Paris?", tools=[tool])
        kinds = [item.type for item in resp.output]
        assert kinds == ["reasoning", "function_call"] and resp.status == "completed"
        assert resp.output[0].content[0].text == "Let me check."
        call = resp.output[1]
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 3}
        # The next turn sends the call's output back; the conversation continues from the stored response.
        follow = client.responses.create(model="test-model", previous_response_id=resp.id, tools=[tool],
                                         input=[{"type": "function_call_output", "call_id": call.call_id,
                                                 "output": "sunny"}], max_output_tokens=5)
        assert follow.usage.input_tokens > resp.usage.input_tokens


def test_openai_responses_stream_events():
    with running(scripted(ANSWER)) as server:
        with oai(server).responses.stream(model="test-model", input="Hi", instructions="Be brief.") as stream:
            events = [e.type for e in stream]
            final = stream.get_final_response()
        assert events[:2] == ["response.created", "response.in_progress"] and events[-1] == "response.completed"
        assert "response.reasoning_text.delta" in events and "response.output_text.delta" in events
        assert final.output_text == "Hello! How can I help?"
        assert [i.type for i in final.output] == ["reasoning", "message"]
    with running(scripted(CALL)) as server:
        with oai(server).responses.stream(model="test-model", input="Weather?",
                                          tools=[{"type": "function", **TOOL}]) as stream:
            events = [e.type for e in stream]
            final = stream.get_final_response()
        assert "response.function_call_arguments.delta" in events
        assert final.output[-1].type == "function_call" and final.output[-1].name == "get_weather"


SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {
    "type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"], "additionalProperties": False}


def _follows_schema(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"city", "days"} and value["city"] in ("Paris", "Rome") and 1 <= value["days"] <= 7


def test_schemas_are_enforced_through_every_client_streaming_and_not():
    """The script writes prose; each API's structured-output field makes it JSON that follows the schema."""
    fmt = {"format": {"type": "json_schema", "name": "trip", "schema": SCHEMA, "strict": True}}
    with running(scripted("Prose, not JSON.")) as server:
        resp = oai(server).responses.create(model="test-model", input="Trip?", text=fmt, max_output_tokens=40,
                                            reasoning={"effort": "none"})
        assert _follows_schema(resp.output_text), resp.output_text
    with running(scripted("Prose, not JSON.")) as server:
        with oai(server).responses.stream(model="test-model", input="Trip?", text=fmt, max_output_tokens=40,
                                          reasoning={"effort": "none"}) as stream:
            final = stream.get_final_response()
        assert _follows_schema(final.output_text), final.output_text
    with running(scripted("Prose, not JSON.")) as server:
        chunks = oai(server).chat.completions.create(
            model="test-model", messages=USER, max_tokens=40, stream=True, response_format={
                "type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}},
            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert _follows_schema(text), text
    with running(scripted("Prose, not JSON.")) as server:
        with claude(server).messages.stream(model="test-model", max_tokens=40, thinking={"type": "disabled"},
                                            output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
                                            messages=USER) as stream:
            final = stream.get_final_message()
        assert _follows_schema(final.content[0].text), final.content


def test_openai_errors_are_raised_as_the_client_types():
    with running(scripted("ok")) as server:
        with pytest.raises(openai.BadRequestError) as e:
            oai(server).chat.completions.create(model="test-model", messages=USER, n=3)
        assert e.value.body["param"] == "n"
        with pytest.raises(openai.NotFoundError):
            oai(server).chat.completions.create(model="no-such-model", messages=USER)


# ---- Anthropic


ATOOL = {"name": "get_weather", "description": "Weather for a city", "input_schema": TOOL["parameters"]}


def test_anthropic_messages_with_thinking_and_tools():
    with running(scripted(CALL)) as server:
        msg = claude(server).messages.create(model="test-model", max_tokens=200, tools=[ATOOL],
                                             system="You are helpful.", messages=USER)
        assert [b.type for b in msg.content] == ["thinking", "tool_use"] and msg.stop_reason == "tool_use"
        assert msg.content[0].thinking == "Let me check."
        use = msg.content[1]
        assert use.name == "get_weather" and use.input == {"city": "Paris", "days": 3}
        assert msg.usage.input_tokens > 0 and msg.usage.output_tokens > 0
        # The result goes back as a tool_result block, the call as the assistant's tool_use.
        history = [*USER, {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
        # An image a tool returned becomes a note; a server tool (nothing here runs it) is not offered.
        history[-1]["content"][0]["content"] = [{"type": "text", "text": "sunny"}, {"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AAAA"}}]
        web = {"type": "web_search_20250305", "name": "web_search", "max_uses": 1}
        follow = claude(server).messages.create(model="test-model", max_tokens=5, tools=[ATOOL, web],
                                                messages=history)
        assert follow.usage.cache_read_input_tokens >= 0 and follow.stop_reason in ("max_tokens", "end_turn")
        assert claude(server).messages.count_tokens(model="test-model", messages=history, tools=[ATOOL]).input_tokens \
            > claude(server).messages.count_tokens(model="test-model", messages=USER).input_tokens


def test_anthropic_stream_has_the_exact_event_sequence():
    with running(scripted(ANSWER)) as server:
        with claude(server).messages.stream(model="test-model", max_tokens=100, messages=USER) as stream:
            final = stream.get_final_message()
        assert final.content[0].type == "thinking" and final.content[1].text == "Hello! How can I help?"
        assert final.stop_reason == "end_turn"
    with running(scripted(ANSWER)) as server:  # the raw events, pings included (the SDK's helper drops them)
        status, _, text = http(server, "POST", "/v1/messages", {"model": "test-model", "max_tokens": 100,
                                                                "messages": USER, "stream": True})
        events = sse(text)
        assert status == 200 and all(name == payload["type"] for name, payload in events)
        names = [name for name, _ in events]
        squeezed = [n for i, n in enumerate(names) if i == 0 or n != names[i - 1] or n != "content_block_delta"]
        assert squeezed == ["message_start", "ping",
                            "content_block_start", "content_block_delta", "content_block_stop",
                            "content_block_start", "content_block_delta", "content_block_stop",
                            "message_delta", "message_stop"]
        deltas = [p["delta"]["type"] for n, p in events if n == "content_block_delta"]
        assert deltas[0] == "thinking_delta" and "signature_delta" in deltas and deltas[-1] == "text_delta"
        assert events[0][1]["message"]["usage"]["input_tokens"] > 0
        assert events[-2][1]["usage"]["output_tokens"] == len(tokenizer().encode(ANSWER)) + 1
    with running(scripted(CALL)) as server:
        with claude(server).messages.stream(model="test-model", max_tokens=200, tools=[ATOOL],
                                            messages=USER) as stream:
            final = stream.get_final_message()
        assert final.content[-1].type == "tool_use" and final.content[-1].input["city"] == "Paris"
        assert final.stop_reason == "tool_use"


def test_anthropic_stop_sequences_sampling_and_thinking_off():
    with running(scripted("alpha beta gamma")) as server:
        msg = claude(server).messages.create(model="test-model", max_tokens=50, stop_sequences=[" gamma"],
                                             extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 20},
                                             thinking={"type": "disabled"}, messages=USER)
        assert msg.content[0].text == "alpha beta" and msg.stop_reason == "stop_sequence"
        assert msg.stop_sequence == " gamma"
    with running(scripted("alpha beta gamma")) as server:
        msg = claude(server).messages.create(model="test-model", max_tokens=2, thinking={"type": "disabled"},
                                             messages=USER)
        assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 2


def test_anthropic_tool_choice_is_enforced_and_errors_are_typed():
    tool = {"name": "pick", "input_schema": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 3}},
                                             "required": ["n"], "additionalProperties": False}}
    with running(scripted("No tools today.")) as server:
        msg = claude(server).messages.create(model="test-model", max_tokens=100, tools=[tool],
                                             tool_choice={"type": "tool", "name": "pick"},
                                             thinking={"type": "disabled"}, messages=USER)
        assert msg.stop_reason == "tool_use" and msg.content[-1].input["n"] in (1, 2, 3)
        with pytest.raises(anthropic.BadRequestError):
            claude(server).messages.create(model="test-model", max_tokens=10, messages=[
                {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                          "data": "AAAA"}}]}])
        with pytest.raises(anthropic.NotFoundError):
            claude(server).messages.create(model="claude-opus-4-6", max_tokens=10, messages=USER)
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"],
              "additionalProperties": False}
    with running(scripted("Prose, not JSON.")) as server:
        msg = claude(server).messages.create(model="test-model", max_tokens=50, thinking={"type": "disabled"},
                                             output_config={"format": {"type": "json_schema", "schema": schema}},
                                             messages=USER)
        assert json.loads(msg.content[0].text)["n"] in (1, 2)
    with running(scripted("ok"), aliases=["claude-*"]) as server:
        assert claude(server).messages.create(model="claude-opus-4-6", max_tokens=3, messages=USER).content
