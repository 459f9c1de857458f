"""Helpers for the server tests: a server on a free loopback port, raw HTTP over sockets, and engines
scripted to answer exactly (``FakeEngine`` from test_generate) or to generate forever at a set pace."""

from __future__ import annotations

import contextlib
import json
import socket
import time

import lily
import numpy as np
from lily.server import Server
from lily.server.app import Limits
from lily.template import ChatTemplate
from lily.tokenizer import Tokenizer
from test_generate import GEN_CONFIG, IM_END, QWEN, VOCAB, FakeEngine, FakeSnapshot

__all__ = ["FakeEngine", "SlowEngine", "http", "model_for", "running", "scripted", "sse", "tokenizer"]

_TOKENIZER: list[Tokenizer] = []


def tokenizer() -> Tokenizer:
    if not _TOKENIZER:
        t = Tokenizer.from_file(QWEN / "tokenizer.json", eos_ids=[IM_END, 248_044])
        t.detokenizer()
        _TOKENIZER.append(t)
    return _TOKENIZER[0]


def model_for(engine, **kw) -> lily.Model:
    return lily.Model(engine, tokenizer(), ChatTemplate.from_dir(QWEN), GEN_CONFIG, QWEN, **kw)


def scripted(text: str, **engine_kw) -> lily.Model:
    """A model whose every answer is ``text`` then <|im_end|> (the script restarts on a fresh sequence)."""
    return model_for(FakeEngine(tokenizer().encode(text) + [IM_END], **engine_kw))


class SlowEngine:
    """Generates ``token`` forever, ``delay`` seconds per step; counts its decodes."""

    def __init__(self, token: int, delay: float = 0.002, max_seq: int = 1 << 20):
        self.token, self.delay, self.max_seq = token, delay, max_seq
        self.position, self.decodes = 0, 0
        self.backend, self.config, self.vocab_size = "slow", {}, VOCAB

    def _row(self):
        row = np.full(VOCAB, -30.0, dtype=np.float32)
        row[self.token] = 30.0
        return row

    def prefill(self, tokens, *, all_logits=False):
        self.position += len(tokens)
        return self._row()

    def decode(self, token):
        time.sleep(self.delay)
        self.decodes += 1
        self.position += 1
        return self._row()

    def reset(self):
        self.position = 0

    def cached_prefix(self, tokens):
        return 0

    def snapshot(self):
        return FakeSnapshot(self.position, [], 0)

    def restore(self, snap):
        raise ValueError("no snapshots")

    # The prefix cache's copies of the sequence: a position (the logits never depend on the sequence).
    def fork(self, seq=0):
        self.copies = getattr(self, "copies", {})
        n = max(self.copies, default=0) + 1
        self.copies[n] = self.position
        return n

    def copy_sequence(self, src, dst):
        self.position = self.copies[src]

    def drop_sequence(self, seq):
        del self.copies[seq]

    def sequence_bytes(self, seq):
        return 1 + self.copies[seq]


@contextlib.contextmanager
def running(model, **kw):
    limits = kw.pop("limits", None) or Limits()
    server = Server(model, "127.0.0.1", 0, model_id=kw.pop("model_id", "test-model"), limits=limits, **kw).start()
    try:
        yield server
    finally:
        server.stop()


def http(server, method: str, path: str, body=None, *, headers=None, timeout: float = 60.0):
    """One request on a fresh connection: (status, headers dict, body text)."""
    import http.client

    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json"} if data is not None else {}
    hdrs.update(headers or {})
    conn.request(method, path, body=data, headers=hdrs)
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, text


def sse(text: str) -> list:
    """The ``data:`` payloads of an event stream (``[DONE]`` as a string), with their ``event:`` names."""
    out, name = [], None
    for line in text.splitlines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            payload = line[len("data: "):]
            out.append((name, payload if payload == "[DONE]" else json.loads(payload)))
            name = None
    return out


def raw_socket(server, timeout: float = 10.0) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=timeout)
