"""``lily serve``: the OpenAI and Anthropic HTTP APIs over one loaded model, for coding agents.

    lily serve mlx-community/Qwen3.6-35B-A3B-4bit --port 8000

Endpoints: ``GET /v1/models``; OpenAI's ``POST /v1/chat/completions``, ``/v1/completions`` and
``/v1/responses``; Anthropic's ``POST /v1/messages`` and ``/v1/messages/count_tokens``. Streaming,
tools (Qwen's XML calls parsed into each API's tool calls), thinking (``reasoning_content``, reasoning
items, thinking blocks), structured output enforced token by token (``response_format``, ``text.format``,
``strict`` tools, ``tool_choice`` required or named), logprobs, and prefix reuse across requests
(``cached_tokens`` / ``cache_read_input_tokens``).

Needs the ``serve`` extra: ``pip install "lily[serve]"`` (uvicorn, Starlette, pydantic).

Layers: ``app`` (HTTP: limits, timeouts, errors), ``worker`` (the engine thread), ``generation``
(prompts, limits, a turn's output), ``openai`` / ``anthropic`` (the two APIs), ``schemas`` (request
bodies).
"""

from __future__ import annotations

import ipaddress
import socket
import sys
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["Server", "build_parser", "main"]


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Server:
    """The HTTP server for ``model``: ``serve_forever()`` in this thread, or ``start()`` one in the background
    (``url`` says where; ``stop()`` ends it). Port 0 picks a free port."""

    def __init__(self, model: Any, host: str = "127.0.0.1", port: int = 8000, *, model_id: str | None = None,
                 aliases: Sequence[str] = (), limits: Any = None, max_waiting: int = 256, max_sequences: int = 4,
                 max_batch_tokens: int | None = None, verbose: bool = False, sock: socket.socket | None = None):
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        from lily.server.anthropic import Anthropic
        from lily.server.app import Limits, bind, make_starlette, run_uvicorn
        from lily.server.generation import Service
        from lily.server.openai import OpenAI
        from lily.server.worker import Scheduler

        self.limits = limits or Limits()
        if not _is_loopback(host):
            self.limits.opened = True  # --host opened the server: any Host header is accepted
        name = model_id or (model.path.name if getattr(model, "path", None) is not None else "lily")
        self.worker = Scheduler(model, max_sequences=max_sequences, max_batch_tokens=max_batch_tokens,
                                max_waiting=max_waiting)
        self.service = Service(model, name, aliases=aliases, worker=self.worker)
        self.openai = OpenAI(self.service, self.limits)
        self.anthropic = Anthropic(self.service, self.limits)

        async def health(request: Any) -> Any:
            return JSONResponse({"status": "ok", "model": name, "busy": self.worker.busy})

        routes = [Route("/health", health, methods=["GET"]), Route("/v1/health", health, methods=["GET"]),
                  *self.openai.routes(), *self.anthropic.routes()]
        self.app = make_starlette(routes, self.limits)
        self.socket = sock if sock is not None else bind(host, port, self.limits.backlog)
        self.host, self.port = self.socket.getsockname()[:2]
        self.uvicorn = run_uvicorn(self.app, self.socket, self.limits, log_level="info" if verbose else "warning")
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def serve_forever(self) -> None:
        try:
            self.uvicorn.run(sockets=[self.socket])
        finally:
            self.worker.close()

    def start(self) -> Server:
        self._thread = threading.Thread(target=self.serve_forever, name="lily-http", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.socket.close()


def build_parser() -> Any:
    from lily import command
    from lily.command import ArgParser
    from lily.loading import BACKENDS, KV_DTYPES

    ap = ArgParser(prog="lily serve", description="OpenAI- and Anthropic-compatible HTTP server")
    ap.add_argument("model", help="checkpoint folder or Hugging Face repo id")
    ap.add_argument("--host", default="127.0.0.1",
                    help="address to bind (default 127.0.0.1: this machine only; another address opens the server "
                         "to any Host header)")
    ap.add_argument("--port", type=command.PORT, default=8000, help="TCP port (0 picks a free one)")
    ap.add_argument("--backend", choices=BACKENDS, default="auto", help="compute backend")
    ap.add_argument("--max-seq", type=command.MAX_SEQ, default=None, help="context length (default: the engine's)")
    ap.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16",
                    help="element type of the stored keys and values (default bf16; f32 doubles the KV memory)")
    command.prefix_cache_args(ap)
    ap.add_argument("--model-id", default=None, help="name reported by /v1/models (default: the folder name)")
    ap.add_argument("--alias", action="append", default=[], metavar="NAME",
                    help="another model name to answer to (repeatable; globs such as 'claude-*' allowed)")
    ap.add_argument("--max-body", type=command.integer(1), default=32 << 20, metavar="BYTES",
                    help="largest request body")
    ap.add_argument("--header-timeout", type=command.number(0.001), default=30.0, metavar="S",
                    help="time to send a request head")
    ap.add_argument("--body-timeout", type=command.number(0.001), default=60.0, metavar="S",
                    help="time to send a request body")
    ap.add_argument("--write-timeout", type=command.number(0.001), default=30.0, metavar="S",
                    help="a client that reads nothing for this long is disconnected")
    ap.add_argument("--max-sequences", type=command.integer(1), default=4,
                    help="requests generating at once, in one batch (default 4; more wait: --max-queue)")
    ap.add_argument("--max-batch-tokens", type=command.integer(1), default=None, metavar="TOKENS",
                    help="prompt tokens prefilled per step across requests, between decode steps of the running "
                         "ones (default: the engine's prefill chunk)")
    ap.add_argument("--max-queue", type=command.integer(1), default=256,
                    help="requests that may wait, in arrival order, for a place in the batch (default 256); one more "
                         "is refused with a 429 and Retry-After")
    ap.add_argument("--verbose", action="store_true", help="log every request")
    return ap


def main(argv: list[str] | None = None) -> int:
    from lily import command
    from lily.loading import load

    args = build_parser().parse_args(argv)

    def serve() -> int:
        try:
            import starlette  # noqa: F401
            import uvicorn  # noqa: F401
        except ImportError:
            raise command.CommandError('lily serve needs the serve extra: pip install "lily[serve]"') from None
        from lily.server.app import Limits, bind

        limits = Limits(max_body=args.max_body, header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                        write_timeout=args.write_timeout)
        # Listen first: a bad --host or a port in use fails before the model loads.
        try:
            sock = bind(args.host, args.port, limits.backlog)
        except OSError as e:
            raise command.CommandError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
        try:
            model = load(args.model, backend=args.backend, max_seq=args.max_seq, kv_dtype=args.kv_dtype,
                         prefix_cache_dir=args.prefix_cache_dir, prefix_cache_dir_bytes=args.prefix_cache_dir_bytes,
                         prefix_cache_snapshot_every=args.prefix_cache_snapshot_every)
            server = Server(model, args.host, args.port, model_id=args.model_id, aliases=args.alias, limits=limits,
                            max_waiting=args.max_queue, max_sequences=args.max_sequences,
                            max_batch_tokens=args.max_batch_tokens, verbose=args.verbose, sock=sock)
        except BaseException:
            sock.close()
            raise
        print(f"lily serve: serving {server.service.model_id} on {server.url}/v1 (Anthropic: ANTHROPIC_BASE_URL="
              f"{server.url}; Ctrl-C stops)", file=sys.stderr)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        return 0

    return command.run("lily serve", serve)


if __name__ == "__main__":
    sys.exit(main())
