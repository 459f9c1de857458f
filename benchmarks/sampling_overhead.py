"""Per-token overhead outside the forward pass: sampling + detokenizing + stop checks, at the real vocabulary.

Runs ``Model.stream`` with an engine whose ``decode`` returns one of 8 precomputed float32 logits rows
of 248,320 entries (no compute: the time per token is what Lily adds around the forward pass). The 8
rows (8 MB) stay cache-resident, as the row the engine has just written is; cycling through 64 MB of
rows instead would time DRAM reads that a real generation loop does not make. Also times the native
sampler alone. The budget is 0.5 ms per token.

    python benchmarks/sampling_overhead.py [--tokens 2000] [--tokenizer CHECKPOINT_DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from lily.model import Model
from lily.sampling import Sampler
from lily.tokenizer import Tokenizer
from lily.tokenizer_files import write_qwen_tokenizer

VOCAB = 248_320
TOKENIZER_LEN = 248_077
BUDGET_MS = 0.5


def lm_like_rows(n_rows: int, seed: int = 0) -> list[np.ndarray]:
    """Logits shaped like a trained LM's: a broad normal bulk plus a few strong candidates; padding rows
    get large values so that a missing mask would show."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n_rows):
        row = rng.normal(0.0, 2.5, VOCAB).astype(np.float32)
        top = rng.choice(TOKENIZER_LEN, 8, replace=False)
        row[top] += rng.uniform(8.0, 14.0, 8).astype(np.float32)
        row[TOKENIZER_LEN:] = 100.0
        rows.append(row)
    return rows


class ReplayEngine:
    """Returns precomputed rows; ``decode`` costs nothing, so the loop's own overhead is what is timed."""

    def __init__(self, rows):
        self.rows, self.i = rows, 0
        self.backend, self.config, self.max_seq = "replay", {}, 1 << 30
        self.position = 0

    def _next(self):
        self.i += 1
        return self.rows[self.i % len(self.rows)]

    def prefill(self, tokens, *, all_logits=False):
        return self._next()

    def decode(self, token):
        return self._next()

    def reset(self):
        self.position = 0

    def cached_prefix(self, tokens):
        return 0  # nothing to reuse: every prompt is prefilled in full


SETTINGS = {
    "greedy": dict(temperature=0.0),
    "default (T=1, top_k=20, top_p=0.95)": dict(),
    "default + logprobs": dict(logprobs=True),
    "default + penalties (rep 1.1, presence 1.5)": dict(repetition_penalty=1.1, presence_penalty=1.5),
    "full softmax (top_k=0, top_p=1)": dict(top_k=0, top_p=1.0),
    "nucleus only (top_k=0, top_p=0.95)": dict(top_k=0, top_p=0.95),
    "min_p=0.05, top_k=0": dict(top_k=0, top_p=1.0, min_p=0.05),
}


def bench_loop(model: Model, tokens: int, settings: dict) -> float:
    """Median over 3 runs of the mean time per generated token, in ms."""
    settings = dict(settings)
    logprobs = settings.pop("logprobs", False)
    times = []
    for trial in range(3):
        t0 = time.perf_counter()
        n = 0
        for chunk in model.stream([1, 2, 3], max_tokens=tokens, stop=["<|stop|>", "\n\nUser:"], logprobs=logprobs,
                                  seed=trial, **settings):
            n += 1
            if chunk.finish_reason:
                break
        times.append((time.perf_counter() - t0) / n * 1e3)
    return statistics.median(times)


def bench_sampler(rows, settings: dict, iters: int) -> float:
    settings = {k: v for k, v in settings.items() if k != "logprobs"}
    s = Sampler(seed=0, vocab_limit=TOKENIZER_LEN, **{"top_k": 20, "top_p": 0.95, **settings})
    s.reset([1, 2, 3])
    for r in rows[:5]:
        s(r)
    t0 = time.perf_counter()
    for i in range(iters):
        s(rows[i % len(rows)])
    return (time.perf_counter() - t0) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1000, help="tokens generated per run")
    ap.add_argument("--tokenizer", default=None, metavar="DIR",
                    help="folder with a tokenizer.json (default: the Qwen3.6 tokenizer shipped with lily)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.tokenizer) if args.tokenizer else Path(tmp)
        if not args.tokenizer:
            write_qwen_tokenizer(folder)
        tok = Tokenizer.from_file(folder / "tokenizer.json", eos_ids=[])  # no eos: every run goes to max_tokens
    tok.detokenizer()
    rows = lm_like_rows(8)
    gen_config = {"do_sample": True, "temperature": 1.0, "top_k": 20, "top_p": 0.95}
    model = Model(ReplayEngine(rows), tok, None, gen_config)
    print(f"vocab {VOCAB} (tokenizer {len(tok)}), {os.cpu_count()} CPUs, {args.tokens} tokens per run, "
          f"budget {BUDGET_MS} ms/token")
    print(f"{'setting':46} {'sampler only':>13} {'whole loop':>11}")
    worst = 0.0
    for name, settings in SETTINGS.items():
        alone = bench_sampler(rows, settings, 300)
        loop = bench_loop(model, args.tokens, settings)
        worst = max(worst, loop)
        flag = "" if loop < BUDGET_MS else "  OVER BUDGET"
        print(f"{name:46} {alone:10.3f} ms {loop:8.3f} ms{flag}")
    print(f"worst whole-loop overhead: {worst:.3f} ms/token ({'within' if worst < BUDGET_MS else 'over'} budget)")


if __name__ == "__main__":
    main()
