"""``lily serve``: the OpenAI-compatible API, over loopback, with a scripted engine (exact outputs:
tool calls, thinking, stop reasons) and end to end with a real tiny checkpoint."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import lily
import pytest
from lily.server import make_server
from lily.template import ChatTemplate
from lily.tokenizer import Tokenizer
from test_generate import GEN_CONFIG, QWEN, FakeEngine

IM_END = 248_046


@pytest.fixture(scope="module")
def tok():
    t = Tokenizer.from_file(QWEN / "tokenizer.json", eos_ids=[IM_END, 248_044])
    t.detokenizer()
    return t


def serve(model):
    server = make_server(model, "127.0.0.1", 0, model_id="test-model")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def scripted(tok, text):
    engine = FakeEngine(tok.encode(text) + [IM_END])
    return lily.Model(engine, tok, ChatTemplate.from_dir(QWEN), GEN_CONFIG, QWEN)


def post(url, body, raw=False):
    data = body if raw else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode(), r.headers.get("Content-Type")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), e.headers.get("Content-Type")


def events(text):
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
CALL = (
    "Let me check.</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)


def test_chat_with_thinking_and_a_tool_call(tok):
    server, base = serve(scripted(tok, CALL))
    try:
        status, body, ctype = post(f"{base}/v1/chat/completions", {
            "model": "test-model", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
            "temperature": 0})
        assert status == 200 and ctype == "application/json", body
        out = json.loads(body)
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        msg = choice["message"]
        assert msg["reasoning_content"] == "Let me check." and msg["content"] is None
        (call,) = msg["tool_calls"]
        assert call["type"] == "function" and call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
        assert out["usage"]["completion_tokens"] == len(tok.encode(CALL)) + 1
        assert out["object"] == "chat.completion" and out["model"] == "test-model"
    finally:
        server.shutdown()


def test_chat_stream_sends_reasoning_content_then_tool_calls(tok):
    server, base = serve(scripted(tok, CALL))
    try:
        status, body, ctype = post(f"{base}/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0})
        assert status == 200 and ctype == "text/event-stream"
        ev = events(body)
        assert ev[-1] == "[DONE]"
        deltas = [e["choices"][0]["delta"] for e in ev[:-1] if e["choices"]]
        assert deltas[0] == {"role": "assistant", "content": ""}
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        content = "".join(d.get("content", "") for d in deltas)
        assert reasoning.strip() == "Let me check." and "<tool_call>" not in content and content.strip() == ""
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert [c["function"]["name"] for c in calls] == ["get_weather"] and calls[0]["index"] == 0
        finishes = [e["choices"][0]["finish_reason"] for e in ev[:-1] if e["choices"]]
        assert finishes[-1] == "tool_calls"
        assert ev[-2]["usage"]["completion_tokens"] > 0
    finally:
        server.shutdown()


def test_thinking_off_and_plain_content(tok):
    server, base = serve(scripted(tok, "Blue, because of Rayleigh scattering."))
    try:
        status, body, _ = post(f"{base}/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Sky colour?"}],
            "chat_template_kwargs": {"enable_thinking": False}, "temperature": 0})
        msg = json.loads(body)["choices"][0]["message"]
        assert status == 200 and msg["content"] == "Blue, because of Rayleigh scattering."
        assert "reasoning_content" not in msg and "tool_calls" not in msg
    finally:
        server.shutdown()


def test_completions_and_models(tok):
    server, base = serve(scripted(tok, "one two three four"))
    try:
        with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as r:
            models = json.loads(r.read())
        assert [m["id"] for m in models["data"]] == ["test-model"]
        status, body, _ = post(f"{base}/v1/completions", {"prompt": "Count:", "max_tokens": 2, "temperature": 0})
        out = json.loads(body)
        assert status == 200 and out["choices"][0]["text"] == "one two"
        assert out["choices"][0]["finish_reason"] == "length"
        status, body, _ = post(f"{base}/v1/completions", {"prompt": "Count:", "stream": True, "temperature": 0,
                                                          "stop": [" three"]})
        ev = events(body)
        text = "".join(e["choices"][0]["text"] for e in ev[:-1])
        assert text == "one two" and ev[-2]["choices"][0]["finish_reason"] == "stop"
    finally:
        server.shutdown()


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/chat/completions", b"{not json", 400, None),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400,
         "temperature"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "response_format": {"type": "json_object"}}, 400, "response_format"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/embeddings", {"input": "x"}, 404, None),
    ],
)
def test_bad_requests_get_openai_errors(tok, path, body, status, param):
    server, base = serve(scripted(tok, "ok"))
    try:
        got, text, ctype = post(base + path, body, raw=isinstance(body, bytes))
        err = json.loads(text)["error"]
        assert got == status and ctype == "application/json" and err["message"]
        assert err["param"] == param
        # the server still answers afterwards
        ok, _, _ = post(f"{base}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "temperature": 0})
        assert ok == 200
    finally:
        server.shutdown()


def test_context_full_is_a_400(tok):
    model = scripted(tok, "word " * 50)
    model.engine.max_seq = 8
    server, base = serve(model)
    try:
        status, body, _ = post(f"{base}/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 40}]})
        assert status == 400 and json.loads(body)["error"]["type"] == "context_length_exceeded"
    finally:
        server.shutdown()


def test_end_to_end_on_a_tiny_checkpoint_reuses_the_prefix(tmp_path_factory):
    import fixtures

    folder = tmp_path_factory.mktemp("serve") / "ckpt"
    fixtures.write_hf_checkpoint(folder, preset="tiny", seed=0, real_tokenizer=True)
    model = lily.load(folder, backend="cpu", max_seq=512)
    server, base = serve(model)
    try:
        msgs = [{"role": "user", "content": "Hello"}]
        s1, b1, _ = post(f"{base}/v1/chat/completions", {"messages": msgs, "max_tokens": 5, "seed": 1})
        first = json.loads(b1)
        assert s1 == 200 and first["usage"]["completion_tokens"] <= 5
        reply = first["choices"][0]["message"]
        msgs2 = msgs + [reply, {"role": "user", "content": "More"}]
        s2, b2, _ = post(f"{base}/v1/chat/completions", {"messages": msgs2, "max_tokens": 5, "seed": 1})
        assert s2 == 200 and json.loads(b2)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        server.shutdown()
