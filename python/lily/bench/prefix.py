"""Time to first token of a returning conversation: cold, resumed from the prefix cache in memory, and
resumed from its disk tier in a new process.

``python -m lily.bench.prefix CHECKPOINT --tokens 8192`` builds a conversation of ``--tokens`` random token
ids and a new message of ``--new`` tokens (starting with ``<|im_start|>``), then times the prefill that gives
the first token's logits of conversation + message:

- cold: an empty sequence, no cache;
- memory: after the conversation was prefilled once through the prefix cache and another prompt ran in
  between (so the sequence itself no longer holds it);
- disk: a new process (``--prefix-cache-dir`` of a temporary folder written by the memory run) that loads
  the model and sends the conversation with another new message; the time excludes loading the model.

Each figure is one run (the first touches cold caches: run it twice and take the second on a quiet machine).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

import numpy as np

from lily import command
from lily.command import ArgParser
from lily.loading import BACKENDS, KV_DTYPES, load

__all__ = ["main"]

TAG = "LILY_PREFIX_RESULT "


def _prompt(model, seed: int, n: int) -> list[int]:
    vocab = model.engine.vocab_size
    high = min(vocab, 150_000)  # ordinary text ids of the Qwen vocabulary (specials sit above)
    return [int(t) for t in np.random.default_rng(seed).integers(0, high, n)]


def _message(model, seed: int, n: int) -> list[int]:
    start = model.tokenizer.token_to_id("<|im_start|>")
    return [start] + _prompt(model, seed, n - 1)


def _timed_prefill(model, ids: list[int]) -> tuple[float, int]:
    t = time.perf_counter()
    _, reused = model.prefix.prefill(ids)
    return time.perf_counter() - t, reused


def _disk_worker(args) -> int:
    model = load(args.checkpoint, backend=args.backend, kv_dtype=args.kv_dtype, progress=False,
                 prefix_cache_dir=args.worker_dir)
    ids = _prompt(model, 1, args.tokens) + _message(model, 3, args.new)
    seconds, reused = _timed_prefill(model, ids)
    info = model.cache_info()
    print(TAG + json.dumps({"seconds": seconds, "reused": reused, "disk_hits": info.disk_hits}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = ArgParser(prog="python -m lily.bench.prefix", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--backend", choices=BACKENDS, default="auto")
    ap.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16")
    ap.add_argument("--tokens", type=command.integer(1), default=8192, help="tokens of the earlier conversation")
    ap.add_argument("--new", type=command.integer(2), default=64, help="tokens of the new message")
    ap.add_argument("--worker-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    return command.run("lily.bench.prefix", lambda: _run(args))


def _run(args) -> int:
    if args.worker_dir is not None:
        return _disk_worker(args)
    with tempfile.TemporaryDirectory(prefix="lily-prefix-bench-") as cache_dir:
        model = load(args.checkpoint, backend=args.backend, kv_dtype=args.kv_dtype, progress=False,
                     prefix_cache_dir=cache_dir)
        conversation = _prompt(model, 1, args.tokens)
        returning = conversation + _message(model, 2, args.new)
        eng = model.engine
        eng.reset()
        t = time.perf_counter()
        eng.prefill(returning)
        cold = time.perf_counter() - t
        eng.reset()
        first, _ = _timed_prefill(model, conversation)  # fills the cache (memory and disk)
        eng.prefill(_prompt(model, 9, 16))  # another prompt: the sequence moves on
        memory, reused = _timed_prefill(model, returning)
        assert reused == args.tokens, (reused, args.tokens)
        info = model.cache_info()
        if (tier := model.prefix.cache.disk) is not None:  # the new process reads the files: all written first
            tier.flush()
        cmd = [sys.executable, "-m", "lily.bench.prefix", str(args.checkpoint), "--backend", args.backend,
               "--kv-dtype", args.kv_dtype, "--tokens", str(args.tokens), "--new", str(args.new),
               "--worker-dir", cache_dir]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith(TAG)]
        if out.returncode != 0 or not lines:
            raise command.CommandError(f"disk worker failed: {out.stderr.strip()[-2000:]}")
        disk = json.loads(lines[-1][len(TAG):])
        if disk["reused"] != args.tokens or disk["disk_hits"] != 1:
            raise command.CommandError(f"the new process did not resume from disk: {disk}")
    print(f"backend {eng.backend}, kv {args.kv_dtype}, conversation {args.tokens} tokens + new message {args.new}")
    print(f"prefix cache: {info.entries} entries, {info.bytes / 1e6:.1f} MB in memory "
          f"({info.logical_bytes / 1e6:.1f} MB as private copies: entries share whole KV segments), "
          f"{info.disk_entries} files, {info.disk_bytes / 1e6:.1f} MB on disk")
    print(f"first prefill of the conversation (writes the cache): {first:.2f} s")
    print("| returning conversation | time to first token (s) | vs cold |")
    print("|---|---:|---:|")
    for name, s in (("cold", cold), ("from memory", memory), ("from disk (new process)", disk["seconds"])):
        print(f"| {name} | {s:.3f} | {cold / s:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
