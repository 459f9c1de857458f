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
    """Generates ``token`` forever, ``delay`` seconds per decode step (of any number of sequences); counts the
    tokens it decodes. Its sequences are positions (the logits never depend on the sequence)."""

    def __init__(self, token: int, delay: float = 0.002, max_seq: int = 1 << 20, prefill_chunk: int = 512):
        self.token, self.delay, self.max_seq, self.prefill_chunk = token, delay, max_seq, prefill_chunk
        self.decodes = 0
        self.positions = {0: 0}
        self.backend, self.config, self.vocab_size = "slow", {}, VOCAB

    @property
    def position(self):
        return self.positions[0]

    def _row(self):
        row = np.full(VOCAB, -30.0, dtype=np.float32)
        row[self.token] = 30.0
        return row

    def prefill(self, tokens, *, all_logits=False, seq=0):
        self.positions[seq] += len(tokens)
        return self._row()

    def decode(self, token, *, seq=0):
        return self.decode_batch([(seq, token)])[0]

    def decode_batch(self, batch):
        time.sleep(self.delay)
        for seq, _ in batch:
            self.decodes += 1
            self.positions[seq] += 1
        return np.stack([self._row() for _ in batch])

    def reset(self, seq=0):
        self.positions[seq] = 0

    def cached_prefix(self, tokens, seq=0):
        return 0

    def snapshot(self):
        return FakeSnapshot(self.position, [], 0)

    def restore(self, snap):
        raise ValueError("no snapshots")

    def new_sequence(self):
        n = self._next_seq = getattr(self, "_next_seq", 0) + 1
        self.positions[n] = 0
        return n

    def fork(self, seq=0):
        n = self.new_sequence()
        self.positions[n] = self.positions[seq]
        return n

    def copy_sequence(self, src, dst):
        self.positions[dst] = self.positions[src]

    def drop_sequence(self, seq):
        del self.positions[seq]

    @property
    def sequences(self):
        return list(self.positions)

    def sequence_bytes(self, seq):
        return 1 + self.positions[seq]

    def sequences_bytes(self, seqs):
        return sum(self.sequence_bytes(s) for s in set(seqs))


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
