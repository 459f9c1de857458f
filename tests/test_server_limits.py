"""``lily serve`` under clients that misbehave, over real loopback sockets: one that stops reading,
ones that disconnect, oversized and slow bodies, slow headers, bursts of 50, foreign Host headers,
wrong content types, and a kept-alive connection after a 404."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from lily.server.app import Limits
from server_helpers import SlowEngine, http, model_for, raw_socket, running, scripted, tokenizer

USER = [{"role": "user", "content": "Hi"}]


def request_bytes(path: str, body: dict | bytes, *, host: str = "localhost", extra: str = "") -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n{extra}\r\n")
    return head.encode() + data


def read_response(sock: socket.socket, already: bytes = b"") -> tuple[int, dict]:
    """Status and JSON body of the HTTP response coming on ``sock`` (Content-Length framed)."""
    data = already
    sock.settimeout(10)
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        if not more:
            break
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    length = int({k.lower(): v for k, v in headers.items()}.get("content-length", "0"))
    while len(body) < length:
        more = sock.recv(65536)
        if not more:
            break
        body += more
    return int(lines[0].split()[1]), json.loads(body)


def answer(server, request: bytes) -> tuple[int, dict]:
    """Status and JSON body of the server's answer to the raw bytes ``request`` on a new connection."""
    s = raw_socket(server)
    s.sendall(request)
    try:
        return read_response(s)
    finally:
        s.close()


def long_token() -> int:
    """A token whose text is long, so that a stream fills socket buffers quickly."""
    tok = tokenizer()

    def length(i: int) -> int:
        text = tok.token_bytes(i).decode("utf-8", errors="replace")
        return len(text) if i not in tok.special_ids and text.strip() == text and "\ufffd" not in text else 0

    return max(range(len(tok) - 100), key=length)


def settled(engine, seconds: float = 1.0) -> bool:
    """Whether the engine stops decoding (its job was cancelled) within ``seconds``, then stays idle."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        before = engine.decodes
        time.sleep(0.2)
        if engine.decodes == before:
            time.sleep(0.3)
            return engine.decodes == before
    return False


def test_a_client_that_stops_reading_does_not_hold_the_engine():
    engine = SlowEngine(long_token(), delay=0.0005)
    with running(model_for(engine), limits=Limits(write_timeout=2.0)) as server:
        stalled = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect((server.host, server.port))
        stalled.sendall(request_bytes("/v1/chat/completions", {"messages": USER, "stream": True,
                                                               "max_tokens": 10**6}))
        time.sleep(0.5)  # it is generating into a socket nobody reads
        t0 = time.monotonic()
        status, _, text = http(server, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 3}, timeout=60)
        waited = time.monotonic() - t0
        assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 3, text
        assert waited < 30, f"the second request waited {waited:.1f} s behind a stalled client"
        # It ran beside the stalled stream (one batch). The stalled one ends once the socket buffers are full (a few
        # MB on loopback) and the write timeout passes: within the 30 s the second request was allowed to wait for it
        # when requests ran one at a time.
        assert settled(engine, seconds=30), "the stalled generation is still running"
        stalled.close()


@pytest.mark.parametrize("stream", [True, False])
def test_a_disconnect_cancels_the_generation(stream):
    engine = SlowEngine(tokenizer().encode("a")[0], delay=0.005)
    with running(model_for(engine)) as server:
        s = raw_socket(server)
        s.sendall(request_bytes("/v1/chat/completions", {"messages": USER, "stream": stream, "max_tokens": 10**6}))
        if stream:
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
        while engine.decodes < 20:  # generating
            time.sleep(0.01)
        s.close()
        assert settled(engine), "generation went on after the client left"
        # Anthropic streams too, and the server goes on serving.
        s = raw_socket(server)
        s.sendall(request_bytes("/v1/messages", {"model": "test-model", "messages": USER, "stream": stream,
                                                 "max_tokens": 10**6}))
        before = engine.decodes
        while engine.decodes < before + 20:
            time.sleep(0.01)
        s.close()
        assert settled(engine)
        assert http(server, "GET", "/v1/models")[0] == 200


def test_bodies_are_bounded_before_they_are_read():
    with running(scripted("ok"), limits=Limits(max_body=4096)) as server:
        # A declared length over the bound: refused at once, with nothing read.
        status, body = answer(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                              b"Content-Type: application/json\r\nContent-Length: 1000000000000\r\n\r\n")
        assert status == 413 and body["error"]["message"]
        # A chunked body (no declared length) is counted as it arrives and refused past the bound.
        s = raw_socket(server)
        s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 1000
        for _ in range(50):  # 50 kB against a bound of 4 kB: the server answers before the end
            try:
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:
                break
        status, body = read_response(s)
        assert status == 413 and body["error"]["type"] == "request_too_large"
        s.close()
        assert http(server, "POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 1})[0] == 200


def test_slow_headers_and_bodies_time_out():
    with running(scripted("ok"), limits=Limits(header_timeout=1.0, body_timeout=1.0)) as server:
        s = raw_socket(server)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n")
        t0 = time.monotonic()
        closed = False
        while time.monotonic() - t0 < 5:
            try:
                s.sendall(b"X")  # a header byte every 0.2 s: keeps resetting a keep-alive timer, not this one
                s.settimeout(0.2)
                if s.recv(1024) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
        assert closed and time.monotonic() - t0 < 4, "a dribbling request head kept its connection"
        status, body = answer(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                              b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"messages\"")
        assert status == 408 and body["error"]["message"]


def test_a_burst_of_50_clients_queues():
    with running(scripted("ok")) as server:
        results: list[int] = []
        barrier = threading.Barrier(50)

        def client():
            barrier.wait()
            try:
                status = http(server, "POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 2},
                              timeout=120)[0]
            except OSError as e:  # a reset connection would show here
                status = repr(e)
            results.append(status)

        threads = [threading.Thread(target=client) for _ in range(50)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert results == [200] * 50


def test_host_header_must_be_loopback_unless_opened():
    with running(scripted("ok")) as server:
        for host in ("localhost", f"localhost:{server.port}", f"127.0.0.1:{server.port}", "[::1]:8000"):
            assert http(server, "GET", "/v1/models", headers={"Host": host})[0] == 200, host
        for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example", "10.0.0.1"):
            status, _, text = http(server, "POST", "/v1/chat/completions", {"messages": USER},
                                   headers={"Host": host})
            assert status == 403 and json.loads(text)["error"]["type"] == "permission_error", host
        status, _, text = http(server, "POST", "/v1/messages", {"messages": USER}, headers={"Host": "evil.example"})
        assert status == 403 and json.loads(text)["error"]["type"] == "permission_error"
    with running(scripted("ok"), limits=Limits(opened=True)) as server:
        assert http(server, "GET", "/v1/models", headers={"Host": "lily.example"})[0] == 200


def test_posts_must_be_json():
    with running(scripted("ok")) as server:
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
            headers = {"Content-Type": ctype} if ctype else {"Content-Type": ""}
            status, _, text = http(server, "POST", "/v1/chat/completions", json.dumps({"messages": USER}).encode(),
                                   headers=headers)
            assert status == 415 and json.loads(text)["error"]["message"], ctype
        ok = http(server, "POST", "/v1/chat/completions", {"messages": USER, "max_tokens": 1},
                  headers={"Content-Type": "application/json; charset=utf-8"})
        assert ok[0] == 200


def test_keep_alive_survives_unknown_routes_and_errors():
    import http.client

    with running(scripted("ok")) as server:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
        body = json.dumps({"input": "x" * 5000}).encode()
        for method, path, data, want in [
            ("POST", "/v1/embeddings", body, 404),
            ("GET", "/v1/models", None, 200),
            ("DELETE", "/v1/chat/completions", None, 405),
            ("POST", "/v1/chat/completions", b"{bad", 400),
            ("POST", "/v1/chat/completions", json.dumps({"messages": USER, "max_tokens": 1}).encode(), 200),
            ("POST", "/nowhere", body, 404),
            ("GET", "/health", None, 200),
        ]:
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
            resp = conn.getresponse()
            text = resp.read()
            assert resp.status == want, (path, text)
            if want != 200:
                assert json.loads(text)["error"]["message"]
        conn.close()


@pytest.mark.parametrize("path, stream", [("/v1/chat/completions", False), ("/v1/chat/completions", True),
                                          ("/v1/messages", False), ("/v1/messages", True)])
def test_a_disconnect_stops_the_generation_within_one_decode_step(path, stream):
    """With 0.3 s steps: the step running when the client leaves is the last one."""
    engine = SlowEngine(tokenizer().encode("a")[0], delay=0.3)
    with running(model_for(engine)) as server:
        s = raw_socket(server)
        s.sendall(request_bytes(path, {"model": "test-model", "messages": USER, "stream": stream,
                                       "max_tokens": 10**6}))
        while engine.decodes < 3:
            time.sleep(0.01)
        time.sleep(0.1)  # inside the next step
        at_close = engine.decodes
        s.close()
        time.sleep(1.5)  # five more steps' worth
        assert engine.decodes - at_close <= 1, f"{engine.decodes - at_close} steps after the client left"


def test_streams_stay_alive_through_a_long_prefill():
    """While the prompt is prefilled (no tokens yet) every stream sends a keep-alive each ``ping_interval``: an
    SSE comment (OpenAI) or a ``ping`` event (Anthropic), so clients and proxies with read timeouts wait."""

    class SlowPrefill(SlowEngine):
        def prefill(self, tokens, *, all_logits=False, seq=0):
            time.sleep(1.5)
            return super().prefill(tokens, all_logits=all_logits, seq=seq)

    engine = SlowPrefill(tokenizer().encode("a")[0], delay=0.0)
    # No prefix cache: a prompt sent again (the same messages) must be prefilled again here.
    with running(model_for(engine, prefix_cache_bytes=0), limits=Limits(ping_interval=0.2)) as server:
        for path, body in [("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "x"}),
                           ("/v1/responses", {"input": "x", "max_output_tokens": 2}),
                           ("/v1/messages", {"model": "test-model", "messages": USER})]:
            body = {"max_tokens": 2, **body, "stream": True} if path != "/v1/responses" else {**body, "stream": True}
            status, _, text = http(server, "POST", path, body)
            pings = text.count("event: ping") - 1 if path == "/v1/messages" else text.count("\n: ping\n")
            assert status == 200 and pings >= 3, (path, text[:400])  # Anthropic's first ping follows message_start
