"""``lily serve``: an OpenAI-compatible HTTP API over one loaded model, for coding agents and any
OpenAI client pointed at ``http://HOST:PORT/v1``.

    lily serve mlx-community/Qwen3.6-35B-A3B-4bit --port 8000

Endpoints: ``GET /v1/models``, ``POST /v1/chat/completions`` (messages, tools, streaming,
``reasoning_content`` for the thinking part, ``chat_template_kwargs={"enable_thinking": false}``
or ``enable_thinking`` to turn thinking off) and ``POST /v1/completions`` (raw prompts). Sampling:
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``presence_penalty``, ``frequency_penalty``,
``repetition_penalty``, ``logit_bias``, ``seed``, ``stop``, ``max_tokens`` /
``max_completion_tokens``. One sequence runs at a time (requests queue on a lock); the next turn of
a conversation reuses the engine state of the previous one (prefix reuse), so agents that resend
the whole history only pay for what is new. Bad requests get an OpenAI-style error object and a 4xx
status; the server never binds beyond the address it is given (default 127.0.0.1).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from lily import command
from lily._lily import ContextFullError, LilyError
from lily.command import ArgParser, CommandError
from lily.loading import BACKENDS
from lily.model import Model

__all__ = ["ApiError", "LilyServer", "main", "make_server"]

_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
)
_MAX_BODY = 64 << 20


class ApiError(Exception):
    """A request problem, reported as an OpenAI error object with an HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}}


def _number(body: Mapping[str, Any], key: str, lo: float, hi: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ApiError(f"`{key}` must be a number in [{lo}, {hi}], got {value!r}", param=key)
    return value


def _sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    """Sampling options of a request, validated, in ``Model.stream`` terms."""
    out: dict[str, Any] = {}
    limits = {
        "temperature": (0, 2),
        "top_p": (0, 1),
        "top_k": (0, 1 << 30),
        "min_p": (0, 1),
        "presence_penalty": (-2, 2),
        "frequency_penalty": (-2, 2),
        "repetition_penalty": (1e-3, 100),
        "seed": (-(1 << 63), (1 << 64) - 1),
    }
    for key in _SAMPLING_FIELDS:
        value = _number(body, key, *limits[key])
        if value is not None:
            out[key] = int(value) if key in ("top_k", "seed") else float(value)
    if "seed" in out:
        out["seed"] %= 1 << 64
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, Mapping):
            raise ApiError("`logit_bias` must map token ids to biases", param="logit_bias")
        try:
            out["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
        except (TypeError, ValueError):
            raise ApiError("`logit_bias` must map token ids to numbers", param="logit_bias") from None
    return out


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ApiError(f"`{key}` must be a positive integer, got {value!r}", param=key)
            return value
    return None


def _stop(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise ApiError("`stop` must be a string or a list of strings", param="stop")


def _common(body: Mapping[str, Any]) -> None:
    n = body.get("n", 1)
    if n != 1:
        raise ApiError("only `n` = 1 is supported", param="n")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, Mapping) or fmt.get("type") not in (None, "text")):
        raise ApiError("`response_format` other than text is not supported yet", param="response_format")


class LilyServer:
    """The request logic, independent of HTTP: each handler returns a JSON body or an iterator of
    server-sent-event payloads."""

    def __init__(self, model: Model, model_id: str):
        self.model, self.model_id = model, model_id
        self.lock = threading.Lock()  # one sequence at a time: the engine holds one state
        self.created = int(time.time())

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": self.model_id, "object": "model", "created": self.created, "owned_by": "lily"}],
        }

    # ---- chat

    def chat(self, body: Mapping[str, Any]) -> dict[str, Any] | Iterator[dict[str, Any]]:
        _common(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError("`messages` must be a non-empty list", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise ApiError(f"`messages[{i}]` must be an object with a `role`", param="messages")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise ApiError("`tools` must be a list", param="tools")
        if body.get("tool_choice") == "none":
            tools = None
        kwargs = dict(body.get("chat_template_kwargs") or {})
        thinking = kwargs.pop("enable_thinking", body.get("enable_thinking", True))
        if not isinstance(thinking, bool):
            raise ApiError("`enable_thinking` must be true or false", param="enable_thinking")
        opts = dict(
            tools=tools,
            enable_thinking=thinking,
            max_tokens=_max_tokens(body),
            stop=_stop(body),
            template_kwargs=kwargs,
            **_sampling(body),
        )
        stream = bool(body.get("stream", False))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage", False))
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        if stream:
            return self._chat_stream(messages, opts, rid, created, include_usage, tools is not None)
        with self.lock:
            msg = self._run(lambda: self.model.chat(messages, stream=False, **opts))
        message: dict[str, Any] = {"role": "assistant", "content": msg.content or None}
        if msg.reasoning_content:
            message["reasoning_content"] = msg.reasoning_content
        if msg.tool_calls:
            message["tool_calls"] = msg.tool_calls
        finish = "tool_calls" if msg.tool_calls else msg.finish_reason
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": self.model_id,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": _usage(msg.stats),
        }

    def _chat_stream(
        self, messages: list, opts: dict, rid: str, created: int, include_usage: bool, has_tools: bool
    ) -> Iterator[dict[str, Any]]:
        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_id,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
            }

        with self.lock:
            chunks = self._run(lambda: self.model.chat(messages, stream=True, **opts))
            yield chunk({"role": "assistant", "content": ""})
            # With tools, content stops streaming where a tool call starts (`<tool_call>` is one
            # token, so it never straddles two chunks): the XML is parsed at the end and sent as
            # `tool_calls` (or, if malformed, as the rest of the content).
            streamed, held = "", False
            for c in self._iterate(chunks):
                if c.reasoning:
                    yield chunk({"reasoning_content": c.reasoning})
                if c.content and not held:
                    text = c.content
                    if has_tools and "<tool_call>" in text:
                        text, held = text[: text.index("<tool_call>")], True
                    if text:
                        streamed += text
                        yield chunk({"content": text})
                if c.message is None:
                    continue
                msg = c.message
                if msg.tool_calls:
                    calls = [{"index": i, **call} for i, call in enumerate(msg.tool_calls)]
                    yield chunk({"tool_calls": calls})
                elif held and msg.content.startswith(streamed.strip()):
                    rest = msg.content[len(streamed.strip()) :]
                    if rest:
                        yield chunk({"content": rest})
                yield chunk({}, "tool_calls" if msg.tool_calls else msg.finish_reason)
                if include_usage:
                    yield {**chunk({}), "choices": [], "usage": _usage(msg.stats)}

    # ---- completions

    def completions(self, body: Mapping[str, Any]) -> dict[str, Any] | Iterator[dict[str, Any]]:
        _common(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not (isinstance(prompt, str) and prompt) and not (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            raise ApiError("`prompt` must be a non-empty string or a list of token ids", param="prompt")
        opts = dict(max_tokens=_max_tokens(body) or 16, stop=_stop(body), **_sampling(body))
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def choice(text: str, finish: str | None) -> dict[str, Any]:
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}

        if body.get("stream"):

            def events() -> Iterator[dict[str, Any]]:
                base = {"id": rid, "object": "text_completion", "created": created, "model": self.model_id}
                with self.lock:
                    for c in self._iterate(self._run(lambda: self.model.stream(prompt, **opts))):
                        if c.text or c.finish_reason:
                            yield {**base, "choices": [choice(c.text, c.finish_reason)]}

            return events()
        with self.lock:
            out = self._run(lambda: self.model.generate(prompt, **opts))
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": self.model_id,
            "choices": [choice(out.text, out.finish_reason)],
            "usage": _usage(out.stats),
        }

    # ---- errors from the model layer

    @staticmethod
    def _run(call):
        try:
            return call()
        except ContextFullError as e:
            raise ApiError(str(e), param="messages", kind="context_length_exceeded") from None
        except (ValueError, TypeError) as e:
            raise ApiError(str(e)) from None
        except LilyError as e:
            raise ApiError(str(e), status=500, kind="server_error") from None

    @classmethod
    def _iterate(cls, it: Iterator) -> Iterator:
        """``it`` with the model layer's errors turned into ``ApiError``s."""
        while True:
            item = cls._run(lambda: next(it, None))
            if item is None:
                return
            yield item


def _usage(stats: Any) -> dict[str, Any]:
    prompt, gen = stats.prompt_tokens, stats.generated_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": gen,
        "total_tokens": prompt + gen,
        "prompt_tokens_details": {"cached_tokens": stats.cached_prompt_tokens},
    }


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        if self.server.verbose:
            super().log_message(format, *args)

    def _send_json(self, status: int, body: Mapping[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict[str, Any]:
        try:
            n = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            raise ApiError("bad Content-Length") from None
        if n > _MAX_BODY:
            raise ApiError(f"request body over {_MAX_BODY} bytes", status=413)
        try:
            body = json.loads(self.rfile.read(n) or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError("request body must be a JSON object")
        return body

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        path = self.path.split("?", 1)[0].rstrip("/")
        if path in ("/v1/models", "/models"):
            self._send_json(200, self.server.api.models())
        elif path in ("", "/health", "/v1/health"):
            self._send_json(200, {"status": "ok", "model": self.server.api.model_id})
        else:
            self._send_json(404, ApiError(f"no route GET {path}", status=404).body())

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        path = self.path.split("?", 1)[0].rstrip("/")
        routes = {
            "/v1/chat/completions": self.server.api.chat,
            "/chat/completions": self.server.api.chat,
            "/v1/completions": self.server.api.completions,
            "/completions": self.server.api.completions,
        }
        try:
            if path not in routes:
                raise ApiError(f"no route POST {path}", status=404)
            result = routes[path](self._body())
            if isinstance(result, dict):
                self._send_json(200, result)
            else:
                self._stream(result)
        except ApiError as e:
            self._send_json(e.status, e.body())
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away; the engine state stays consistent
        except Exception as e:  # a bug: report it as a 500 rather than dropping the connection
            self._send_json(500, ApiError(f"internal error: {e!r}", status=500, kind="server_error").body())

    def _stream(self, events: Iterator[dict[str, Any]]) -> None:
        # Pull the first event before the headers, so an early error still gets a proper status.
        first = next(events, None)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            if first is not None:
                self._event(first)
            for event in events:
                self._event(event)
        except ApiError as e:  # after the headers: report in the stream
            self._event(e.body())
        finally:
            events_close = getattr(events, "close", None)
            if events_close is not None:
                events_close()  # releases the model lock if the client went away mid-stream
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _event(self, payload: Mapping[str, Any]) -> None:
        self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        self.wfile.flush()


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], api: LilyServer | None, verbose: bool):
        self.api, self.verbose = api, verbose
        super().__init__(address, _Handler)


def make_server(model: Model, host: str = "127.0.0.1", port: int = 8000, *, model_id: str | None = None,
                verbose: bool = False) -> ThreadingHTTPServer:
    """An HTTP server for ``model`` (not started: call ``serve_forever()``; port 0 picks a free one)."""
    return _HTTPServer((host, port), _api(model, model_id), verbose)


def _api(model: Model, model_id: str | None) -> LilyServer:
    return LilyServer(model, model_id or (model.path.name if model.path is not None else "lily"))


def build_parser() -> ArgParser:
    ap = ArgParser(prog="lily serve", description="OpenAI-compatible HTTP server")
    ap.add_argument("model", help="checkpoint folder or Hugging Face repo id")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=command.PORT, default=8000, help="TCP port (0 picks a free one)")
    ap.add_argument("--backend", choices=BACKENDS, default="auto", help="compute backend")
    ap.add_argument("--max-seq", type=command.MAX_SEQ, default=None, help="context length (default: the engine's)")
    ap.add_argument("--model-id", default=None, help="name reported by /v1/models (default: the folder name)")
    ap.add_argument("--verbose", action="store_true", help="log every request")
    return ap


def main(argv: list[str] | None = None) -> int:
    from lily.loading import load

    args = build_parser().parse_args(argv)

    def serve() -> int:
        # Listen first: a bad --host or a port in use fails before the model loads.
        try:
            server = _HTTPServer((args.host, args.port), None, args.verbose)
        except OSError as e:
            raise CommandError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
        try:
            server.api = _api(load(args.model, backend=args.backend, max_seq=args.max_seq), args.model_id)
        except BaseException:
            server.server_close()
            raise
        host, port = server.server_address[:2]
        print(f"lily serve: serving {server.api.model_id} on http://{host}:{port}/v1 (Ctrl-C stops)", file=sys.stderr)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
        return 0

    return command.run("lily serve", serve)


if __name__ == "__main__":
    sys.exit(main())
