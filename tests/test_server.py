"""``lily serve``, request by request over loopback with scripted engines (exact outputs): the OpenAI
endpoints' fields (thinking, tools, logprobs, tool_choice, response_format, model names), errors shaped
as each API shapes them, context limits; end to end on a tiny checkpoint with prefix reuse."""

from __future__ import annotations

import json

import numpy as np
import pytest
from lily.generate import Prefill
from server_helpers import FakeEngine, http, model_for, running, scripted, sse, tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}]
CALL = ("Let me check.</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
USER = [{"role": "user", "content": "Weather in Paris?"}]


def chat(server, body):
    status, headers, text = http(server, "POST", "/v1/chat/completions", {"model": "test-model", **body})
    return status, headers, text


def test_chat_with_thinking_and_a_tool_call():
    with running(scripted(CALL)) as server:
        status, headers, text = chat(server, {"messages": USER, "tools": TOOLS, "temperature": 0})
        assert status == 200 and headers["content-type"] == "application/json", text
        out = json.loads(text)
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["logprobs"] is None
        msg = choice["message"]
        assert msg["reasoning_content"] == "Let me check." and msg["content"] is None
        (call,) = msg["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
        assert out["usage"]["completion_tokens"] == len(tokenizer().encode(CALL)) + 1


def test_chat_stream_sends_reasoning_then_tool_calls():
    with running(scripted(CALL)) as server:
        status, headers, text = chat(server, {"messages": USER, "tools": TOOLS, "stream": True, "temperature": 0,
                                              "stream_options": {"include_usage": True}})
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        ev = [p for _, p in sse(text)]
        assert ev[-1] == "[DONE]"
        deltas = [e["choices"][0]["delta"] for e in ev[:-1] if e["choices"]]
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "Let me check."
        assert "".join(d.get("content", "") for d in deltas) == ""
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert [c["function"]["name"] for c in calls] == ["get_weather"] and calls[0]["index"] == 0
        assert [e["choices"][0]["finish_reason"] for e in ev[:-1] if e["choices"]][-1] == "tool_calls"
        assert ev[-2]["usage"]["completion_tokens"] > 0


def test_thinking_off_plain_content_and_completions():
    with running(scripted("Blue, because of Rayleigh scattering.")) as server:
        status, _, text = chat(server, {"messages": USER, "chat_template_kwargs": {"enable_thinking": False},
                                        "temperature": 0})
        msg = json.loads(text)["choices"][0]["message"]
        assert status == 200 and msg["content"] == "Blue, because of Rayleigh scattering."
        assert "reasoning_content" not in msg and "tool_calls" not in msg
        status, _, text = http(server, "GET", "/v1/models")
        assert [m["id"] for m in json.loads(text)["data"]] == ["test-model"]
    with running(scripted("one two three four")) as server:
        status, _, text = http(server, "POST", "/v1/completions", {"prompt": "Count:", "max_tokens": 2,
                                                                   "temperature": 0})
        out = json.loads(text)
        assert status == 200 and out["choices"][0]["text"] == "one two"
        assert out["choices"][0]["finish_reason"] == "length"
    with running(scripted("one two three four")) as server:
        status, _, text = http(server, "POST", "/v1/completions", {"prompt": "Count:", "stream": True,
                                                                   "temperature": 0, "stop": [" three"]})
        ev = [p for _, p in sse(text)]
        assert "".join(e["choices"][0]["text"] for e in ev[:-1]) == "one two"
        assert ev[-2]["choices"][0]["finish_reason"] == "stop"


def test_logprobs_are_the_models_own():
    """FakeEngine rows are 30 at the scripted token and -30 elsewhere: the logprob of the token is
    30 - logsumexp(row), and the next best are -60 below it."""
    vocab = 248_077  # ids past the tokenizer are padding, never counted
    row = np.full(vocab, -30.0)
    row[0] = 30.0
    want = float(30.0 - (np.log(np.exp(row - 30.0).sum()) + 30.0))
    with running(scripted("a b")) as server:
        status, _, text = chat(server, {"messages": USER, "logprobs": True, "top_logprobs": 2, "temperature": 0,
                                        "chat_template_kwargs": {"enable_thinking": False}})
        content = json.loads(text)["choices"][0]["logprobs"]["content"]
        assert status == 200 and [c["token"] for c in content] == ["a", " b", "<|im_end|>"]
        for c in content:
            assert c["logprob"] == pytest.approx(want, abs=1e-4)
            assert len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["token"] == c["token"]
            assert c["top_logprobs"][1]["logprob"] == pytest.approx(want - 60, abs=1e-3)
            assert bytes(c["bytes"]).decode() == c["token"]
    with running(scripted("a b")) as server:
        status, _, text = http(server, "POST", "/v1/completions", {"prompt": "x", "logprobs": 1, "max_tokens": 2,
                                                                   "temperature": 0})
        lp = json.loads(text)["choices"][0]["logprobs"]
        assert lp["tokens"] == ["a", " b"] and lp["text_offset"] == [0, 1]
        assert lp["token_logprobs"][0] == pytest.approx(want, abs=1e-4) and list(lp["top_logprobs"][1]) == [" b"]


def test_tool_choice_required_and_named_are_enforced():
    """The script writes plain text; the grammar makes it a call anyway (parameters per their schema)."""
    tools = [{"type": "function", "function": {"name": "set_unit", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"],
        "additionalProperties": False}}}, {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["days"], "additionalProperties": False}}}]
    for choice in ("required", {"type": "function", "function": {"name": "set_unit"}}):
        with running(scripted("I will not call anything.")) as server:
            status, _, text = chat(server, {"messages": USER, "tools": tools, "tool_choice": choice,
                                            "temperature": 0, "max_tokens": 200,
                                            "chat_template_kwargs": {"enable_thinking": False}})
            out = json.loads(text)["choices"][0]
            assert status == 200 and out["finish_reason"] == "tool_calls", text
            call = out["message"]["tool_calls"][0]["function"]
            if choice != "required":
                assert call["name"] == "set_unit"
            if call["name"] == "set_unit":
                assert json.loads(call["arguments"])["unit"] in ("celsius", "fahrenheit")
    with running(scripted(CALL)) as server:  # "none": the call the model wants is never produced
        status, _, text = chat(server, {"messages": USER, "tools": TOOLS, "tool_choice": "none", "temperature": 0,
                                        "max_tokens": 40})
        msg = json.loads(text)["choices"][0]["message"]
        assert status == 200 and "tool_calls" not in msg and "<tool_call>" not in (msg["content"] or "")


def test_response_format_json_schema_is_enforced():
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "score": {
        "type": "integer", "minimum": 0, "maximum": 9}}, "required": ["answer", "score"],
        "additionalProperties": False}
    with running(scripted("Sure! Here is some prose, not JSON.")) as server:
        for fmt in ({"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}},
                    {"type": "json_object"}):
            status, _, text = chat(server, {"messages": USER, "response_format": fmt, "temperature": 0,
                                            "max_tokens": 60, "chat_template_kwargs": {"enable_thinking": False}})
            content = json.loads(text)["choices"][0]["message"]["content"]
            assert status == 200, text
            if fmt["type"] == "json_schema":
                value = json.loads(content)
                assert value["answer"] in ("yes", "no") and 0 <= value["score"] <= 9 and len(value) == 2
            else:
                assert content.startswith("{")


def test_model_names_and_aliases():
    with running(scripted("ok"), aliases=["claude-*", "gpt-local"]) as server:
        for name in ("test-model", "claude-sonnet-4-5", "gpt-local"):
            assert chat(server, {"model": name, "messages": USER, "max_tokens": 1})[0] == 200
        status, _, text = chat(server, {"model": "gpt-4o", "messages": USER})
        err = json.loads(text)["error"]
        assert status == 404 and err["code"] == "model_not_found" and err["param"] == "model"
        for method, path, body in [("POST", "/v1/completions", {"model": "gpt-4o", "prompt": "x"}),
                                   ("POST", "/v1/responses", {"model": "gpt-4o", "input": "x"}),
                                   ("GET", "/v1/models/gpt-4o", None),
                                   ("POST", "/v1/messages/count_tokens", {"model": "gpt-4o", "messages": USER})]:
            assert http(server, method, path, body)[0] == 404, path
        assert http(server, "GET", "/v1/models/claude-opus-4-6")[0] == 200
        assert [m["id"] for m in json.loads(http(server, "GET", "/v1/models")[2])["data"]] == ["test-model",
                                                                                               "gpt-local"]


BAD = [
    (b"{not json", None),
    (b"[1, 2]", None),
    (b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": USER, "n": 2}, "n"),
    ({"messages": USER, "temperature": "hot"}, "temperature"),
    ({"messages": USER, "temperature": True}, "temperature"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "stream": "false"}, "stream"),
    ({"messages": USER, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": USER, "tools": "x"}, "tools"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "response_format"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
    ({"messages": USER, "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"messages": USER, "stop": ["ok", "\ud800"]}, "stop.1"),
]


@pytest.mark.parametrize("body, param", BAD, ids=range(len(BAD)))
def test_bad_requests_get_openai_errors(body, param):
    with running(scripted("ok")) as server:
        status, headers, text = http(server, "POST", "/v1/chat/completions", body)
        err = json.loads(text)["error"]
        assert status == 400 and headers["content-type"] == "application/json", text
        assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param
        assert chat(server, {"messages": USER, "max_tokens": 2})[0] == 200  # still serving


def test_anthropic_errors_have_anthropic_shape():
    with running(scripted("ok")) as server:
        for body, status in [({"model": "test-model", "messages": USER}, 400),
                             ({"model": "test-model", "max_tokens": 5, "messages": USER, "stream": "yes"}, 400),
                             ({"model": "other", "max_tokens": 5, "messages": USER}, 404)]:
            got, _, text = http(server, "POST", "/v1/messages", body)
            out = json.loads(text)
            assert got == status and out["type"] == "error", text
            assert out["error"]["type"] == ("invalid_request_error" if status == 400 else "not_found_error")


def test_a_prompt_too_long_is_refused_before_any_stream(monkeypatch):
    model = scripted("word " * 50, max_seq=32)
    encoded = []
    real_encode = model.tokenizer.encode
    monkeypatch.setattr(model.tokenizer, "encode",
                        lambda text, **kw: encoded.append(len(text)) or real_encode(text, **kw))
    with running(model) as server:
        for stream in (False, True):
            status, headers, text = chat(server, {"messages": [{"role": "user", "content": "x " * 40}],
                                                  "stream": stream})
            err = json.loads(text)["error"]
            assert status == 400 and headers["content-type"] == "application/json"
            assert err["code"] == "context_length_exceeded" and err["type"] == "invalid_request_error"
        # Far past what the context could hold at the longest token: refused before tokenizing.
        before = len(encoded)
        status, _, text = chat(server, {"messages": [{"role": "user", "content": "x" * 2_000_000}]})
        assert status == 400 and json.loads(text)["error"]["code"] == "context_length_exceeded"
        assert len(encoded) == before
        # Anthropic too.
        status, _, text = http(server, "POST", "/v1/messages", {"model": "test-model", "max_tokens": 5, "stream": True,
                                                                "messages": [{"role": "user", "content": "x " * 40}]})
        assert status == 400 and json.loads(text)["error"]["type"] == "invalid_request_error"


def test_max_tokens_is_capped_by_the_context():
    model = model_for(FakeEngine([5] * 1000, max_seq=300))
    with running(model) as server:
        status, _, text = chat(server, {"messages": USER, "max_tokens": 10**9, "temperature": 0})
        out = json.loads(text)
        assert status == 200 and out["choices"][0]["finish_reason"] == "length"
        assert out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"] <= 300


def test_end_to_end_on_a_tiny_checkpoint_reuses_the_prefix(tmp_path_factory):
    import fixtures
    import lily

    folder = tmp_path_factory.mktemp("serve") / "ckpt"
    fixtures.write_hf_checkpoint(folder, preset="tiny", seed=0, real_tokenizer=True)
    model = lily.load(folder, backend="cpu", max_seq=1024, progress=False)
    with running(model, model_id="tiny") as server:
        msgs = [{"role": "user", "content": "Hello"}]
        s1, _, b1 = http(server, "POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 5, "seed": 1})
        first = json.loads(b1)
        assert s1 == 200 and first["usage"]["completion_tokens"] <= 5
        reply = first["choices"][0]["message"]
        msgs2 = [*msgs, reply, {"role": "user", "content": "More"}]
        s2, _, b2 = http(server, "POST", "/v1/chat/completions", {"messages": msgs2, "max_tokens": 5, "seed": 1})
        assert s2 == 200 and json.loads(b2)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        amsgs = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": reply["content"] or "x"},
                 {"role": "user", "content": "Again"}]
        body = {"model": "tiny", "max_tokens": 4, "messages": amsgs}
        http(server, "POST", "/v1/messages", body)
        more = [*amsgs, {"role": "assistant", "content": "y"}, {"role": "user", "content": "More"}]
        s3, _, b3 = http(server, "POST", "/v1/messages", {**body, "messages": more})
        usage = json.loads(b3)["usage"]
        assert s3 == 200 and usage["cache_read_input_tokens"] > 0 and usage["input_tokens"] > 0


def test_usage_reports_the_models_prefix_reuse():
    """Both APIs report as cached exactly what the generation reports (``stats.cached_prompt_tokens``, from the
    scheduler's answer to its ``Prefill``), streaming and not."""
    def reports_seven(steps):  # the generation is told 7 prompt tokens were reused
        reply = None
        while True:
            try:
                item = steps.send(reply)
            except StopIteration:
                return
            reply = yield item
            if isinstance(item, Prefill):
                reply = (reply[0], 7)

    body = {"messages": USER, "max_tokens": 5, "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}
    with running(scripted("ok")) as server:
        real = server.service.generation
        server.service.generation = lambda plan: reports_seven(real(plan))
        status, _, text = chat(server, body)
        usage = json.loads(text)["usage"]
        assert status == 200 and usage["prompt_tokens_details"]["cached_tokens"] == 7 and usage["prompt_tokens"] > 7
        _, _, text = chat(server, {**body, "stream": True, "stream_options": {"include_usage": True}})
        (usage,) = [p["usage"] for _, p in sse(text) if isinstance(p, dict) and p.get("usage")]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 7
        _, _, text = http(server, "POST", "/v1/completions", {"prompt": "a b c d e f g h i j", "max_tokens": 2})
        assert json.loads(text)["usage"]["prompt_tokens_details"]["cached_tokens"] == 7
        _, _, text = http(server, "POST", "/v1/responses", {"input": "Hi", "max_output_tokens": 5})
        assert json.loads(text)["usage"]["input_tokens_details"]["cached_tokens"] == 7
        anthropic_body = {"model": "test-model", "max_tokens": 5, "messages": USER, "thinking": {"type": "disabled"}}
        whole = json.loads(http(server, "POST", "/v1/messages", anthropic_body)[2])["usage"]
        assert whole["cache_read_input_tokens"] == 7 and whole["input_tokens"] > 0
        events = sse(http(server, "POST", "/v1/messages", {**anthropic_body, "stream": True})[2])
        streamed = [p["usage"] for n, p in events if n == "message_delta"][0]
        assert streamed["cache_read_input_tokens"] == 7 and streamed["input_tokens"] == whole["input_tokens"]


def test_fields_that_cannot_be_honoured_are_refused():
    """Issue 19: no field is silently dropped: what is not produced is a 400 naming it."""
    with running(scripted("ok")) as server:
        for path, body, param in [
            ("/v1/responses", {"input": "Hi", "top_logprobs": 2}, "top_logprobs"),
            ("/v1/responses", {"input": "Hi", "include": ["message.output_text.logprobs"]}, "include"),
            ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
            ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
            ("/v1/completions", {"prompt": "x", "best_of": 3}, "n"),
            ("/v1/chat/completions", {"messages": USER, "n": 3}, "n"),
            ("/v1/chat/completions", {"messages": USER, "logprobs": False, "top_logprobs": 2}, "top_logprobs"),
            ("/v1/chat/completions", {"messages": USER, "tool_choice": {"type": "function", "function": {
                "name": "nope"}}, "tools": TOOLS}, "tool_choice"),
            ("/v1/responses", {"input": "Hi", "tool_choice": "required"}, "tool_choice"),
        ]:
            status, _, text = http(server, "POST", path, body)
            err = json.loads(text)["error"]
            assert status == 400 and err["type"] == "invalid_request_error" and err["param"] == param, (path, text)
        # Asked for, logprobs are there, streaming too (never a silent null).
        events = sse(chat(server, {"messages": USER, "stream": True, "logprobs": True, "top_logprobs": 1,
                                   "chat_template_kwargs": {"enable_thinking": False}})[2])
        lps = [p["choices"][0]["logprobs"] for _, p in events if isinstance(p, dict) and p["choices"]]
        tokens = [c["token"] for lp in lps if lp for c in lp["content"]]
        assert tokens == ["ok", "<|im_end|>"] and all(len(c["top_logprobs"]) == 1 for lp in lps if lp
                                                      for c in lp["content"])
        assert http(server, "POST", "/v1/responses", {"input": "Hi", "include": ["reasoning.encrypted_content"],
                                                      "max_output_tokens": 2})[0] == 200


def test_strict_tools_are_enforced_under_tool_choice_auto():
    """OpenAI ``strict: true`` and Anthropic ``strict``: the model may answer or call, but a call's arguments
    follow the schema (the script's "kelvin" is not allowed)."""
    schema = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"],
              "additionalProperties": False}
    script = ("<tool_call>\n<function=set_unit>\n<parameter=unit>\nkelvin\n</parameter>\n</function>\n"
              "</tool_call>")
    tool = {"type": "function", "function": {"name": "set_unit", "parameters": schema, "strict": True}}
    with running(scripted(script)) as server:
        status, _, text = chat(server, {"messages": USER, "tools": [tool], "temperature": 0, "max_tokens": 200,
                                        "chat_template_kwargs": {"enable_thinking": False}})
        call = json.loads(text)["choices"][0]["message"]["tool_calls"][0]["function"]
        assert status == 200 and json.loads(call["arguments"])["unit"] in ("celsius", "fahrenheit"), text
    with running(scripted(script)) as server:
        status, _, text = http(server, "POST", "/v1/messages", {
            "model": "test-model", "max_tokens": 200, "messages": USER, "thinking": {"type": "disabled"},
            "temperature": 0, "tools": [{"name": "set_unit", "input_schema": schema, "strict": True}]})
        block = json.loads(text)["content"][-1]
        assert status == 200 and block["type"] == "tool_use" and block["input"]["unit"] in ("celsius", "fahrenheit")
    with running(scripted(script)) as server:  # not strict: the model's own (bad) value is passed on as it is
        status, _, text = chat(server, {"messages": USER, "tools": [{"type": "function", "function": {
            "name": "set_unit", "parameters": schema}}], "temperature": 0, "max_tokens": 200,
            "chat_template_kwargs": {"enable_thinking": False}})
        call = json.loads(text)["choices"][0]["message"]["tool_calls"][0]["function"]
        assert json.loads(call["arguments"])["unit"] == "kelvin"


def test_values_past_what_the_engine_takes_are_not_server_errors():
    """Found by sending odd values to every endpoint: a top_k past any vocabulary (it keeps every id) and a lone
    surrogate in a stop sequence reached the sampler / the engine thread and came back as 500s."""
    with running(scripted("ok")) as server:
        status, _, text = chat(server, {"messages": USER, "top_k": 10**30, "max_tokens": 2})
        assert status == 200, text
        body = {"model": "test-model", "max_tokens": 2, "messages": USER}
        assert http(server, "POST", "/v1/messages", {**body, "top_k": 10**30})[0] == 200
        for stream in (False, True):
            status, headers, text = http(server, "POST", "/v1/messages", {**body, "stream": stream,
                                                                          "stop_sequences": ["\ud800"]})
            out = json.loads(text)
            assert status == 400 and headers["content-type"] == "application/json", text
            assert out["error"]["type"] == "invalid_request_error" and "surrogate" in out["error"]["message"]


ECHOED = [  # fields a response sends back as they came: a value that JSON or UTF-8 cannot carry broke the response
    ("/v1/responses", {"input": "x", "metadata": {"note": float("nan")}}, None),
    ("/v1/responses", {"input": "x", "metadata": {"note": "\ud800"}}, "metadata.note"),
    ("/v1/responses", {"input": "x", "metadata": {"\udfff": "x"}}, "metadata.\\udfff"),
    ("/v1/responses", {"input": "x", "reasoning": {"effort": "\ud800"}}, "reasoning.effort"),
    ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_object", "name": "\ud800"}}},
     "text.format.name"),
    ("/v1/chat/completions", {"model": "claude-\ud800", "messages": USER}, "model"),
    ("/v1/messages", {"model": "claude-\ud800", "messages": USER}, "model"),
]


@pytest.mark.parametrize("path, body, param", ECHOED, ids=range(len(ECHOED)))
def test_values_json_or_utf8_cannot_carry_are_refused(path, body, param):
    """NaN / Infinity (not JSON, though Python's json writes them) and lone surrogates (no UTF-8 form) in a field a
    response echoes (metadata, reasoning.effort, a model name matching an alias...) came back as a 500, or a stream
    cut after its 200: they are a 400 naming the field wherever they are."""
    with running(scripted("ok"), aliases=["claude-*"]) as server:
        for stream in (False, True):
            extra = {"model": "test-model"} if path == "/v1/messages" and "model" not in body else {}
            req = {"max_tokens": 2, "max_output_tokens": 2, **extra, **body, "stream": stream}
            if path != "/v1/responses":
                req.pop("max_output_tokens")
            else:
                req.pop("max_tokens")
            status, headers, text = http(server, "POST", path, json.dumps(req).encode())
            assert status == 400 and headers["content-type"] == "application/json", text
            err = json.loads(text)["error"]
            assert err["type"] == "invalid_request_error", text
            if path != "/v1/messages":
                assert err["param"] == param, text
            assert ("surrogate" if param else "NaN") in err["message"]
        assert chat(server, {"messages": USER, "max_tokens": 2})[0] == 200  # still serving


def test_chat_template_kwargs_cannot_change_what_the_template_returns():
    """chat_template_kwargs {"tokenize": true} made the template return token ids, which the server took for the
    prompt text: a 500 (AssertionError). Keys that are apply_chat_template's own arguments are a 400."""
    with running(scripted("ok")) as server:
        for key, value in (("tokenize", True), ("add_generation_prompt", False), ("tools", [])):
            status, _, text = chat(server, {"messages": USER, "max_tokens": 2, "chat_template_kwargs": {key: value}})
            err = json.loads(text)["error"]
            assert status == 400 and err["param"] == f"chat_template_kwargs.{key}", text
        status, _, text = chat(server, {"messages": USER, "max_tokens": 2,
                                        "chat_template_kwargs": {"enable_thinking": False}})
        assert status == 200 and json.loads(text)["choices"][0]["message"]["content"] == "ok", text


def test_a_logit_bias_past_the_vocabulary_is_refused():
    """A bias on an id past the tokenizer's vocabulary was accepted and biased nothing."""
    with running(scripted("ok")) as server:
        status, _, text = chat(server, {"messages": USER, "max_tokens": 2, "logit_bias": {str(10**9): 5}})
        err = json.loads(text)["error"]
        assert status == 400 and err["type"] == "invalid_request_error" and "logit_bias" in err["message"], text
        body = {"prompt": "x", "max_tokens": 2, "logit_bias": {str(len(tokenizer())): 5}}
        assert http(server, "POST", "/v1/completions", body)[0] == 400
        body["logit_bias"] = {str(len(tokenizer()) - 1): 5}
        assert http(server, "POST", "/v1/completions", body)[0] == 200
