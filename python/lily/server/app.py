"""The HTTP layer: uvicorn + Starlette, hardened for a server that one slow client must never stall.

- Connections: a request head must arrive within ``header_timeout`` of the connection opening (or of the
  previous response), a body within ``body_timeout``; a connection whose client stops reading for
  ``write_timeout`` is aborted. Idle keep-alive connections close after ``keep_alive`` seconds. The
  listen backlog queues bursts of connections instead of resetting them.
- Requests: the ``Host`` header must name a loopback address unless the server was opened with
  ``--host``; POSTs must be ``application/json``; bodies are bounded before they are read (by
  ``Content-Length`` and by counting what arrives), then parsed with a bound on nesting.
- Every error is JSON in the shape of the API the path belongs to (Anthropic under ``/v1/messages``,
  OpenAI elsewhere), with a 4xx status for anything the client can cause.
- Generations run on the engine thread (``worker.py``); a response only relays their events, watching
  for the client's disconnect, which cancels the generation at its next step.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pydantic
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from lily.arguments import text
from lily.server.errors import ApiError
from lily.server.worker import Job

__all__ = ["EventStream", "Limits", "WatchedJson", "dialect_of", "parse_body", "run_uvicorn"]

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_LOOPBACK_NAMES = {"localhost", "localhost.", "ip6-localhost"}
_MAX_DEPTH = 64
_FIELD = re.compile(r"[a-z_][a-z0-9_]*\Z")
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


@dataclass
class Limits:
    """What one client may take. Times in seconds, sizes in bytes."""

    max_body: int = 32 << 20
    header_timeout: float = 30.0
    body_timeout: float = 60.0
    write_timeout: float = 30.0
    keep_alive: float = 5.0
    backlog: int = 2048
    ping_interval: float = 10.0
    opened: bool = False  # bound beyond loopback on purpose: any Host header is accepted


def dialect_of(path: str) -> str:
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def error_response(error: ApiError, dialect: str, *, close: bool = False) -> JSONResponse:
    headers = {**error.headers, "connection": "close"} if close else error.headers
    return JSONResponse(error.body(dialect), status_code=error.status, headers=headers or None)


# ---- request bodies


def _check_values(value: Any) -> None:
    """Refuse a body that nests more than ``_MAX_DEPTH`` levels or holds a str (a value or a key) that is not valid
    Unicode: a lone surrogate could neither be tokenized nor sent back in a response that echoes it (``metadata``,
    ``model``, ...); the error names its dotted path (``messages.0.content``). Checked without recursion."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        v, d, path = stack.pop()
        if d > _MAX_DEPTH:
            raise ApiError(f"request body nests more than {_MAX_DEPTH} levels")
        for k, c in enumerate(v) if isinstance(v, list) else v.items():
            here = f"{path}.{k}" if path else str(k)
            for s in (k, c):
                if isinstance(s, str):
                    try:
                        text("", s)  # named below: the path itself may hold the surrogate (a key)
                    except ValueError as e:
                        where = here.encode("utf-8", "backslashreplace").decode()
                        raise ApiError(f"{where}{e}", param=where) from None
            if isinstance(c, (dict, list)):
                stack.append((c, d + 1, here))


def _not_json(constant: str) -> Any:
    raise ApiError(f"request body is not valid JSON: {constant} is not a JSON number")


def parse_body(body: bytes) -> dict[str, Any]:
    """The JSON object of a request body, or a 400 (also for NaN / Infinity, which JSON does not have, and for
    text that is not valid Unicode)."""
    try:
        data = json.loads(body, parse_constant=_not_json)
    except RecursionError:
        raise ApiError(f"request body nests more than {_MAX_DEPTH} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(f"request body must be a JSON object, got {type(data).__name__}")
    _check_values(data)
    return data


def validation_error(e: pydantic.ValidationError) -> ApiError:
    """A pydantic error as a 400 naming the field."""
    first = e.errors()[0]
    loc: list[str] = []
    for part in first.get("loc", ()):
        # Past a field, pydantic names the union member it tried ("str", "list[...]", "TextPart"): stop there.
        if not isinstance(part, int) and (not _FIELD.match(str(part)) or part in _TYPE_TAGS):
            break
        loc.append(str(part))
    param = ".".join(loc) or None
    value = first.get("input")
    plain = isinstance(value, (str, int, float, bool)) or value is None
    shown = json.dumps(value)[:80] if plain else type(value).__name__
    msg = first.get("msg", "invalid value")
    return ApiError(f"{param or 'request'}: {msg} (got {shown})" if "input" in first else f"{param}: {msg}",
                    param=param)


def _loopback(host_header: str) -> bool:
    host = host_header.strip()
    if host.startswith("["):  # [::1]:port
        host = host[1 : host.find("]")] if "]" in host else ""
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Guard:
    """ASGI middleware: Host and content-type checks, bounded body reading, one error shape."""

    def __init__(self, app: Callable[..., Awaitable[None]], limits: Limits):
        self.app, self.limits = app, limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        dialect = dialect_of(scope["path"])
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        method = scope["method"]
        if not self.limits.opened and not _loopback(headers.get("host", "")):
            err = ApiError("the Host header must name this machine (the server listens on loopback only; "
                           "start it with --host to serve other names)", status=403, type="permission_error")
            await error_response(err, dialect, close=True)(scope, receive, send)
            return
        if method in ("POST", "PUT", "PATCH"):
            ctype = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if ctype != "application/json":
                err = ApiError(f"Content-Type must be application/json, got {ctype or 'none'!r}", status=415)
                await error_response(err, dialect, close=True)(scope, receive, send)
                return
        try:
            body = await self._read_body(headers, receive)
        except ApiError as err:
            await error_response(err, dialect, close=True)(scope, receive, send)
            return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only http.disconnect comes

        await self.app(scope, replay, send)

    async def _read_body(self, headers: dict[str, str], receive: Receive) -> bytes:
        """The whole body, refused before reading when its declared length is over the bound, and
        refused as soon as what arrives goes over it (chunked bodies declare nothing)."""
        limit = self.limits.max_body
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise ApiError(f"bad Content-Length {declared!r}")
            if int(declared) > limit:
                raise ApiError(f"request body of {declared} bytes is over the limit of {limit}", status=413)
        parts, size = [], 0
        deadline = time.monotonic() + self.limits.body_timeout
        while True:
            left = deadline - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), max(left, 0.001))
            except asyncio.TimeoutError:
                raise ApiError(f"request body not received within {self.limits.body_timeout:g} s",
                               status=408, type="timeout_error") from None
            if message["type"] == "http.disconnect":
                raise ApiError("client disconnected", status=400)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise ApiError(f"request body is over the limit of {limit} bytes", status=413)
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


# ---- responses that relay a generation


async def _watch_disconnect(receive: Receive, job: Job) -> None:
    """Cancel ``job`` when the client goes away (the request body is already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            job.cancel("client disconnected")
            return


class WatchedJson:
    """A JSON response built from a finished generation, cancelled if the client leaves first."""

    def __init__(self, job: Job, build: Callable[[], Awaitable[tuple[int, dict[str, Any]]]]):
        self.job, self.build = job, build

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.ensure_future(_watch_disconnect(receive, self.job))
        try:
            status, body = await self.build()
        except ApiError as err:
            status, body = err.status, err.body(dialect_of(scope["path"]))
        finally:
            watcher.cancel()
            if not self.job.cancelled:
                self.job.cancel("response sent")
        if self.job.cancel_reason == "client disconnected":
            return
        await JSONResponse(body, status_code=status)(scope, receive, send)


class EventStream:
    """A server-sent-event stream relaying a generation; the generation is cancelled when the client
    disconnects or the stream ends for any other reason."""

    def __init__(self, job: Job, events: AsyncIterator[bytes]):
        self.job, self.events = job, events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.ensure_future(_watch_disconnect(receive, self.job))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]})
            async for chunk in self.events:
                if self.job.cancel_reason == "client disconnected":
                    return  # nobody to send to; uvicorn closes the connection
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            self.job.cancel("stream ended")
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()


# ---- the server


class _Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with two timeouts it lacks: the request head must arrive within
    ``header_timeout`` (a client that dribbles header bytes keeps resetting the keep-alive timer), and
    a connection whose write buffer stays full for ``write_timeout`` (a client that stopped reading)
    is aborted, which its request sees as a disconnect."""

    limits = Limits()

    def connection_made(self, transport):  # type: ignore[no-untyped-def]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_timeout)

    def _head_timeout(self) -> None:
        if self.cycle is None or self.cycle.response_complete:
            self.transport.abort()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete and self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._arm_head_timer()
        super().on_response_complete()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._stall_timer = self.loop.call_later(self.limits.write_timeout, self.transport.abort)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._stall_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)


def make_starlette(routes: list[Route], limits: Limits) -> Guard:
    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(exc, dialect_of(request.url.path))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        method, path = request.method, request.url.path
        if exc.status_code == 404:
            err = ApiError(f"no route {method} {path}", status=404, type="not_found_error", code="unknown_url")
        elif exc.status_code == 405:
            err = ApiError(f"{path} does not accept {method}", status=405)
        else:
            err = ApiError(str(exc.detail), status=exc.status_code)
        return error_response(err, dialect_of(path))

    async def server_error(request: Request, exc: Exception) -> Response:  # a bug: still a JSON error object
        err = ApiError(f"internal error: {exc!r}", status=500, type="server_error")
        return error_response(err, dialect_of(request.url.path))

    app = Starlette(routes=routes, exception_handlers={ApiError: api_error, HTTPException: http_error,
                                                       Exception: server_error})
    return Guard(app, limits)


def bind(host: str, port: int, backlog: int) -> socket.socket:
    """A listening socket; port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


def run_uvicorn(app: Guard, sock: socket.socket, limits: Limits, *, log_level: str = "warning",
                started: threading.Event | None = None) -> uvicorn.Server:
    """A uvicorn server for ``app`` on ``sock`` (not running yet: call ``.run(sockets=[sock])``)."""
    protocol = type("LilyProtocol", (_Protocol,), {"limits": limits})
    config = uvicorn.Config(app, http=protocol, lifespan="off", log_level=log_level, access_log=log_level == "info",
                            timeout_keep_alive=int(max(1, limits.keep_alive)), backlog=limits.backlog,
                            h11_max_incomplete_event_size=64 << 10, server_header=False)
    return uvicorn.Server(config)
