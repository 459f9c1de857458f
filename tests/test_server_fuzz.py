"""``lily serve`` under hostile request bodies: whatever the fields hold, every answer is a 2xx or a 4xx in the
shape of the endpoint's API, never a 5xx, and the server keeps serving. Every field of every endpoint is tried
with each edge value that broke servers before (huge and negative integers, NaN and infinities, lone surrogates,
empty and nested containers), on an otherwise valid request; then hypothesis fills a few fields at a time with
random JSON built from the APIs' own key names."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import FakeEngine, http, model_for, running, tokenizer
from test_generate import IM_END

FIELDS = {
    "/v1/chat/completions": ["messages", "model", "tools", "tool_choice", "response_format", "logprobs",
                             "top_logprobs", "stream", "stream_options", "max_tokens", "max_completion_tokens",
                             "temperature", "top_p", "top_k", "min_p", "seed", "stop", "logit_bias", "n",
                             "presence_penalty", "frequency_penalty", "repetition_penalty", "parallel_tool_calls",
                             "chat_template_kwargs", "enable_thinking", "reasoning_effort"],
    "/v1/completions": ["prompt", "model", "logprobs", "echo", "suffix", "best_of", "stream", "max_tokens", "stop",
                        "temperature", "seed", "logit_bias"],
    "/v1/responses": ["input", "model", "instructions", "tools", "tool_choice", "text", "reasoning",
                      "max_output_tokens", "temperature", "top_p", "stream", "store", "previous_response_id",
                      "include", "top_logprobs", "parallel_tool_calls"],
    "/v1/messages": ["model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p",
                     "top_k", "tools", "tool_choice", "thinking", "output_config", "metadata"],
    "/v1/messages/count_tokens": ["model", "messages", "system", "tools", "tool_choice", "thinking"],
}
KEYS = sorted({k for fields in FIELDS.values() for k in fields} | {
    "role", "content", "type", "text", "name", "function", "parameters", "arguments", "tool_calls", "schema",
    "json_schema", "input_schema", "tool_use_id", "id", "call_id", "output", "thinking", "format", "effort",
    "budget_tokens", "properties", "strict", "description", "include_usage"})
EDGE = st.sampled_from([0, -1, 1, 2, 10**30, -(10**30), 2**63, 2**64, 0.5, -0.0, 1e308, float("nan"), float("inf"),
                        "", "\ud800", "user", "assistant", "system", "tool", "function", "text", "auto", "required",
                        "none", "any", "json_schema", "json_object", "enabled", "disabled", "test-model",
                        "<tool_call>",
                        "</think>", True, False, None])
SCALARS = st.one_of(EDGE, st.integers(), st.floats(), st.text(max_size=8), st.booleans(), st.none())
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.sampled_from(KEYS), inner, max_size=4)),
                      max_leaves=12)
USER = [{"role": "user", "content": "Hi"}]
MINIMAL = {"/v1/chat/completions": {"messages": USER, "max_tokens": 2}, "/v1/completions": {"prompt": "x",
                                                                                           "max_tokens": 2},
           "/v1/responses": {"input": "x", "max_output_tokens": 2},
           "/v1/messages": {"model": "test-model", "max_tokens": 2, "messages": USER},
           "/v1/messages/count_tokens": {"model": "test-model", "messages": USER}}
HOSTILE = [0, -1, 10**30, -(10**30), 2**64, float("nan"), float("-inf"), "", "\ud800", True, None, [], {},
           ["\ud800"], [10**30], {"10000000000000000000000": 1}, {"type": "\ud800"}, [[[[]]]]]


@st.composite
def requests(draw):
    path = draw(st.sampled_from(sorted(FIELDS)))
    body = dict(MINIMAL[path]) if draw(st.integers(0, 3)) else {}  # mostly valid but for the fuzzed fields
    body.update(draw(st.dictionaries(st.sampled_from(FIELDS[path]), VALUES, min_size=1, max_size=2)))
    return path, body


@pytest.fixture(scope="module")
def server():
    # A short context bounds every generation (the script ends; then token 0 repeats until max_tokens or the end).
    model = model_for(FakeEngine(tokenizer().encode("ok") + [IM_END], max_seq=160))
    with running(model) as s:
        yield s


def check(server, path: str, body: dict) -> str | None:
    """None when the answer is a 2xx or an API-shaped 4xx; else what went wrong."""
    data = json.dumps(body).encode()  # NaN / Infinity as Python writes them: the server must refuse or take them
    status, _, text = http(server, "POST", path, data)
    if status >= 500:
        return f"{status} {path} {body!r}: {text[:200]}"
    if status >= 400:
        out = json.loads(text)
        error = out.get("error") or {}
        if (path.startswith("/v1/messages") and out.get("type") != "error") or not (error.get("type")
                                                                                   and error.get("message")):
            return f"{status} {path} {body!r}: not an API error object: {text[:200]}"
    return None


@pytest.mark.parametrize("path", sorted(FIELDS))
def test_every_field_with_hostile_values(server, path):
    problems = [p for field in FIELDS[path] for value in HOSTILE
                if (p := check(server, path, {**MINIMAL[path], field: value})) is not None]
    assert not problems, "\n".join(problems)
    assert check(server, path, MINIMAL[path]) is None


NESTED = {  # a hostile value deeper in: message contents, tool schemas, tool calls, response formats
    "/v1/chat/completions": lambda v: [
        {"messages": [{"role": "user", "content": v}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": v}]}]},
        {"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": v}}]},
        {"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
            "type": "object", "properties": {"a": v}}}}]},
        {"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": v}}]}, {"role": "tool", "tool_call_id": "c", "content": v}]},
        {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": v}}},
        {"messages": USER, "chat_template_kwargs": {"enable_thinking": v}}],
    "/v1/messages": lambda v: [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": v}]}]},
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": v}]}]},
        {"tools": [{"name": "f", "input_schema": v}], "tool_choice": {"type": "any"}},
        {"system": [{"type": "text", "text": v}]},
        {"output_config": {"format": {"type": "json_schema", "schema": v}}}],
}


@pytest.mark.parametrize("path", sorted(NESTED))
def test_nested_hostile_values(server, path):
    problems = [p for value in HOSTILE for change in NESTED[path](value)
                if (p := check(server, path, {**MINIMAL[path], **change})) is not None]
    assert not problems, "\n".join(problems)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(request=requests())
def test_fuzzed_bodies_get_2xx_or_api_shaped_4xx(server, request):
    problem = check(server, *request)
    assert problem is None, problem
