"""What runs inside a benchmark's worker process: one engine (Lily or MLX-LM) loaded once, then each prompt
length timed after a warm-up at the same shape; one ``RESULT_TAG`` line of JSON per length on stdout."""

from __future__ import annotations

import contextlib
import json
import time

import numpy as np

from lily.bench.machine import peak_rss_bytes
from lily.command import CommandError
from lily.mlx_reference import load_mlx_model

__all__ = ["RESULT_TAG", "LilyRunner", "MlxLmRunner", "make_prompt", "run_worker"]

RESULT_TAG = "LILY_BENCH_RESULT "


class LilyRunner:
    name = "lily"

    def __init__(self, model, backend="auto", max_seq=None, kv_dtype="bf16", precision="exact"):
        import lily

        kw = {"backend": backend, "kv_dtype": kv_dtype, "precision": precision}
        if max_seq:
            kw["max_seq"] = int(max_seq)
        self.eng = lily.Engine(str(model), **kw)
        self.backend = str(getattr(self.eng, "backend", backend))
        self.kv_dtype = str(getattr(self.eng, "kv_dtype", kv_dtype))
        self.max_seq = getattr(self.eng, "max_seq", max_seq)
        # A GPU backend: its memory bandwidth, measured here on the device (None on the CPU).
        measure = getattr(self.eng, "measure_device_bandwidth", None)
        self.device_bandwidth_gbps = measure() if measure else None

    def run(self, prompt: np.ndarray, steps: int) -> tuple[float, float]:
        eng = self.eng
        eng.reset()
        t0 = time.perf_counter()
        logits = eng.prefill(prompt.tolist())
        tok = int(np.argmax(logits))
        t1 = time.perf_counter()
        # Greedy: the engine picks the next token where the logits are (on a GPU only the id comes back).
        for _ in range(steps):
            tok = eng.decode_greedy(tok)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    def run_batch(self, prompts: list[np.ndarray], steps: int) -> float:
        """Prefill one sequence per prompt, then time ``steps`` batched decode steps of all of them."""
        eng = self.eng
        eng.reset()
        for s in eng.sequences:
            if s:
                eng.drop_sequence(s)
        seqs = [0] + [eng.new_sequence() for _ in prompts[1:]]
        toks = [int(np.argmax(eng.prefill(p.tolist(), seq=s))) for s, p in zip(seqs, prompts)]
        t0 = time.perf_counter()
        # Greedy where the logits are, as ``run``'s decode_greedy: no [B, vocab] block copied out per step.
        for _ in range(steps):
            toks = eng.decode_batch_greedy(list(zip(seqs, toks)))
        return time.perf_counter() - t0

    def peak_memory(self) -> int:
        """Peak device memory on a GPU backend (the engine's allocations), else the process's peak RSS."""
        dev = getattr(self.eng, "device_peak_bytes", None)
        return int(dev) if dev else peak_rss_bytes()


class MlxLmRunner:
    name = "mlx-lm"

    def __init__(self, model, dtype="native"):
        import mlx.core as mx

        self.mx = mx
        self.model, _ = load_mlx_model(model, dtype)
        self.backend = f"mlx {mx.default_device()}" + (" fp32" if dtype == "float32" else "")
        self.max_seq = None

    def run(self, prompt: np.ndarray, steps: int) -> tuple[float, float]:
        mx = self.mx
        from mlx_lm.generate import generate_step

        try:
            from mlx_lm.generate import generation_stream, wired_limit

            ctx = wired_limit(self.model, [generation_stream])
        except ImportError:
            ctx = contextlib.nullcontext()
        with ctx:
            t0 = time.perf_counter()
            t1 = None
            n = 0
            gen = generate_step(mx.array(prompt.astype(np.int32)), self.model, max_tokens=steps + 1)
            for _tok, _ in gen:
                n += 1
                if t1 is None:
                    t1 = time.perf_counter()
                if n == steps + 1:
                    break
            t2 = time.perf_counter()
        mx.clear_cache()
        return t1 - t0, t2 - t1

    def peak_memory(self) -> int:
        try:
            return max(peak_rss_bytes(), int(self.mx.get_peak_memory()))
        except AttributeError:
            return peak_rss_bytes()


def make_prompt(length: int, vocab: int, seed: int) -> np.ndarray:
    hi = min(vocab, 248044)  # stay below the special tokens of the real tokenizer
    return np.random.default_rng(seed).integers(0, hi, size=length, dtype=np.int64)


def run_worker(spec: dict, emit=print) -> None:
    """Load one engine and measure spec["lengths"] in order; emits one JSON record per length."""
    t0 = time.perf_counter()
    if spec["engine"] == "lily":
        runner = LilyRunner(spec["model"], spec.get("backend", "auto"), spec.get("max_seq"),
                            spec.get("kv_dtype", "bf16"), spec.get("precision", "exact"))
    elif spec["engine"] == "mlx-lm":
        runner = MlxLmRunner(spec["model"], spec.get("mlx_dtype", "native"))
    else:
        raise CommandError(f"unknown engine {spec['engine']!r}")
    load_s = time.perf_counter() - t0
    vocab = int(spec["vocab"])
    steps = int(spec["decode_steps"])
    if spec.get("concurrency"):
        _run_concurrency(runner, spec, vocab, steps, load_s, emit)
        return
    for length in spec["lengths"]:
        warm = make_prompt(length, vocab, spec["seed"] + 1000 + length)
        runner.run(warm, int(spec.get("warmup_steps", 2)))
        prompt = make_prompt(length, vocab, spec["seed"] + length)
        pre_s, dec_s = runner.run(prompt, steps)
        emit(RESULT_TAG + json.dumps({
            "engine": runner.name, "backend": runner.backend, "prompt_tokens": length, "decode_steps": steps,
            "prefill_s": pre_s, "decode_s": dec_s, "prefill_tok_s": length / pre_s,
            "decode_tok_s": steps / dec_s if dec_s > 0 else float("nan"),
            "peak_memory_bytes": runner.peak_memory(), "load_s": load_s, "max_seq": runner.max_seq,
            "kv_dtype": getattr(runner, "kv_dtype", None),
            "device_bandwidth_gbps": getattr(runner, "device_bandwidth_gbps", None)}), flush=True)


def _run_concurrency(runner: LilyRunner, spec: dict, vocab: int, steps: int, load_s: float, emit) -> None:
    """Batched decode of ``spec["concurrency"]`` sequences, each after a prompt of each length."""
    n = int(spec["concurrency"])
    for length in spec["lengths"]:
        warm = [make_prompt(length, vocab, spec["seed"] + 1000 + length + i) for i in range(n)]
        runner.run_batch(warm, int(spec.get("warmup_steps", 2)))
        prompts = [make_prompt(length, vocab, spec["seed"] + length + 7919 * i) for i in range(n)]
        dec_s = runner.run_batch(prompts, steps)
        emit(RESULT_TAG + json.dumps({
            "engine": runner.name, "backend": runner.backend, "prompt_tokens": length, "decode_steps": steps,
            "concurrency": n, "decode_s": dec_s,
            "aggregate_decode_tok_s": n * steps / dec_s if dec_s > 0 else float("nan"),
            "decode_tok_s": steps / dec_s if dec_s > 0 else float("nan"),
            "peak_memory_bytes": runner.peak_memory(), "load_s": load_s, "max_seq": runner.max_seq,
            "kv_dtype": runner.kv_dtype}), flush=True)
