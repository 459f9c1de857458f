"""The measurement protocol: which prompt lengths fit, rounds in alternating order, each measurement in a fresh
worker process (``lily.bench.workers``), the records gathered for the report."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from lily.bench.accounting import (
    bytes_per_batched_step,
    decode_bytes_model,
    prefill_flops_per_token,
    read_config,
    text_config,
)
from lily.bench.llamacpp import GgufFile, find_llama_bench, llama_bench_records
from lily.bench.machine import available_memory_bytes, machine_info, measure_bandwidth, measure_peak_flops, usable_cpus
from lily.bench.report import format_table, summarize, write_plot
from lily.bench.workers import RESULT_TAG
from lily.command import CommandError, worker_env
from lily.progress import progress_bar

__all__ = ["DEFAULT_LENGTHS", "Status", "fits", "parse_concurrency", "parse_lengths", "run_bench", "run_subprocess"]

DEFAULT_LENGTHS = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]


def parse_lengths(s: str) -> list[int]:
    out = []
    for part in s.split(","):
        p = part.strip().lower()
        if not p:
            continue
        mult = 1
        if p.endswith("k"):
            mult, p = 1024, p[:-1]
        elif p.endswith("m"):
            mult, p = 1024 * 1024, p[:-1]
        try:
            v = int(float(p) * mult)
        except ValueError:
            raise CommandError(f"bad prompt length {part!r} (e.g. 256,1K,4096)") from None
        if v < 1:
            raise CommandError(f"prompt length must be >= 1, got {part!r}")
        out.append(v)
    if not out:
        raise CommandError("no prompt lengths given")
    return out


def parse_concurrency(s: str) -> list[int]:
    try:
        out = [int(p) for p in s.split(",") if p.strip()]
    except ValueError:
        raise CommandError(f"bad concurrency list {s!r} (e.g. 1,2,4,8)") from None
    if not out or min(out) < 1:
        raise CommandError(f"concurrency levels must be >= 1, got {s!r}")
    return out


def _worker_cmd(spec: dict) -> list[str]:
    return [sys.executable, "-m", "lily.bench", "--worker", json.dumps(spec)]


def run_subprocess(spec: dict, timeout: float | None = None, tick=None, env: dict | None = None) -> list[dict]:
    """Run one worker process for ``spec``; its records. ``tick(seconds)`` is called about once a second while
    it runs."""
    t0 = time.perf_counter()
    with subprocess.Popen(_worker_cmd(spec), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**worker_env(), **(env or {})}) as proc:
        while True:
            try:
                out, err = proc.communicate(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                elapsed = time.perf_counter() - t0
                if timeout is not None and elapsed > timeout:
                    proc.kill()
                    proc.communicate()
                    raise CommandError(f"{spec['engine']} worker timed out after {timeout:.0f} s") from None
                if tick is not None:
                    tick(elapsed)
    recs = [json.loads(line[len(RESULT_TAG):]) for line in out.splitlines() if line.startswith(RESULT_TAG)]
    if proc.returncode != 0 or len(recs) != len(spec["lengths"]):
        tail = (err.strip().splitlines() or ["(no output)"])[-1]
        raise CommandError(f"{spec['engine']} worker failed (exit {proc.returncode}): {tail}")
    return recs


class Status:
    """The progress line of a benchmark: runs done, the running one and how long it has run, and the time left.

    The estimate is honest about what it knows: nothing until every engine has finished a run (MLX-LM can be
    a hundred times slower than Lily); then, per engine, its seconds per unit of work so far times its work
    left, where a run's work is the tokens it prefills and decodes (warm-up included) plus its process start.
    """

    START_WORK = 2048  # a process start and model load, in tokens: a rough weight, refined by nothing

    def __init__(self, runs: list[tuple[str, list[int]]], steps: int, warmup: int, enabled: bool):
        self.steps, self.warmup = steps, warmup
        self.work_left: dict[str, float] = {}
        for engine, lengths in runs:
            self.work_left[engine] = self.work_left.get(engine, 0.0) + self.work(lengths)
        self.seconds = dict.fromkeys(self.work_left, 0.0)
        self.work_done = dict.fromkeys(self.work_left, 0.0)
        self.bar = progress_bar(len(runs), desc="lily bench", unit="run", disable=not enabled,
                                bar_format="{desc}: {n}/{total} runs, {elapsed}{postfix}")

    def work(self, lengths: list[int]) -> float:
        return self.START_WORK + sum(2 * n + 4 * (self.steps + self.warmup) for n in lengths)

    def left(self, running: str, elapsed: float) -> str:
        if not all(self.work_done.values()):
            return "time left: unknown until each engine has finished a run"
        total = sum(self.seconds[e] / self.work_done[e] * self.work_left[e] for e in self.work_left) - elapsed
        return f"about {_duration(max(total, 0.0))} left"

    def running(self, engine: str, lengths: list[int], elapsed: float) -> None:
        what = ",".join(map(str, lengths))
        self.bar.set_postfix_str(f"{engine} {what[:30]} for {_duration(elapsed)}; {self.left(engine, elapsed)}")

    def finished(self, engine: str, lengths: list[int], seconds: float) -> None:
        work = self.work(lengths)
        self.seconds[engine] += seconds
        self.work_done[engine] += work
        self.work_left[engine] -= work
        self.bar.set_postfix_str(self.left(engine, 0.0), refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def fits(length: int, steps: int, max_seq: int | None, bm: dict, avail: int, weights_total: int) -> str | None:
    if max_seq and length + steps + 1 > max_seq:
        return f"{length} + {steps + 1} tokens exceed max_seq {max_seq}"
    need = weights_total + bm["kv_per_context_token"] * (length + steps + 1) + 64 * 2048 * length + (512 << 20)
    if avail and need > avail:
        return f"needs ~{need / 1e9:.1f} GB, {avail / 1e9:.1f} GB available"
    return None


def _mlx_dtype(choice: str) -> str:
    """MLX-LM's precision: "auto" is fp32 on a CPU, where its bf16 quantized matmul decodes at a fraction of a
    token per second at the real widths, and as saved on a GPU; an explicit bf16 CPU run is warned about."""
    from lily.mlx_reference import default_dtype

    best = default_dtype()
    if choice == "auto":
        return best
    if choice == "native" and best == "float32":
        print("lily bench: warning: MLX-LM runs on the CPU here; as saved (bf16) its quantized matmul is about 8x "
              "slower than with --mlx-dtype float32 (the default): one prompt length can take many minutes",
              file=sys.stderr)
    return choice


def run_bench(args) -> int:
    model = Path(args.model)
    cfg = read_config(model)
    t = text_config(cfg)
    vocab = int(t["vocab_size"])
    bm = decode_bytes_model(model, cfg, kv_bytes=4 if getattr(args, "kv_dtype", "bf16") == "f32" else 2)
    steps = args.decode_steps
    lengths = args.lengths or list(DEFAULT_LENGTHS)
    max_seq = args.max_seq or int(t.get("max_position_embeddings", 0)) or None
    avail = available_memory_bytes()
    keep = []
    for length in lengths:
        why = fits(length, steps, max_seq, bm, avail, bm["weights_total"])
        if why:
            print(f"lily bench: skipping {length}: {why}", file=sys.stderr)
        else:
            keep.append(length)
    if not keep:
        raise CommandError("no prompt length fits (see above); pass --lengths or --max-seq")
    if getattr(args, "concurrency", None):
        return _run_concurrency(args, model, vocab, bm, keep)
    engines = [args.engine] + ([args.compare] if args.compare else [])
    threads = getattr(args, "threads", None)
    llama = find_llama_bench(getattr(args, "llama_bench", None)) if "llama.cpp" in engines else None
    if llama is not None:
        threads = threads or usable_cpus()  # llama-bench's own default counts cores differently: say it
    mlx_dtype = _mlx_dtype(args.mlx_dtype) if "mlx-lm" in engines else None
    method = args.bandwidth_method
    if method == "auto":
        method = "mlx" if args.backend == "metal" else "numpy"
    bw = measure_bandwidth(int(args.bandwidth_mib) << 20, method=method)
    # On a CUDA GPU the f32 matmul peak of the host says nothing about the device: left out.
    peak = {} if args.backend == "cuda" else measure_peak_flops(method)
    if not args.quiet:
        print(f"lily bench: memory bandwidth {bw['read_bandwidth_gbps']:.1f} GB/s read, "
              f"{bw['memory_bandwidth_gbps']:.1f} GB/s copy ({bw['bandwidth_method']}); f32 matmul peak "
              f"{peak.get('peak_gflops', float('nan')):,.0f} GFLOP/s ({peak.get('peak_method')})", file=sys.stderr)

    per_proc = not args.same_process
    runs = []
    for rnd in range(args.rounds):
        order = keep if rnd % 2 == 0 else keep[::-1]
        engs = engines if rnd % 2 == 0 else engines[::-1]
        runs += [(eng, group) for group in ([[x] for x in order] if per_proc else [order]) for eng in engs]
    status = Status(runs, steps, args.warmup_steps, enabled=not args.quiet)
    gguf = GgufFile(cfg, getattr(args, "gguf", None), args.seed, say=None if args.quiet else status.bar.write) \
        if llama is not None else None
    try:
        raw, backend_seen = _measure(args, runs, status, model, steps, vocab, mlx_dtype, threads, llama, gguf)
    finally:
        if gguf is not None:
            gguf.close()
    status.close()
    device_bw = [r["device_bandwidth_gbps"] for rs in raw.values() for r in rs if r.get("device_bandwidth_gbps")]
    if device_bw:
        # A GPU backend measured its own memory in the worker: the fractions are of that.
        gbps = max(device_bw)
        bw = {"memory_bandwidth_gbps": gbps, "read_bandwidth_gbps": gbps, "host_bandwidth": bw,
              "bandwidth_method": "device-to-device copy on the GPU, 1024 MiB, (read + write) / time, best of 5 "
                                  "(read and copy columns both use it)"}
    flops = {x: prefill_flops_per_token(cfg, x)["total"] for x in keep}
    records = summarize(raw, keep, bm, bw, steps, engines, flops, peak)
    meta = {"model": str(model.resolve()), "engine": args.engine, "backend": backend_seen or args.backend,
            "machine": machine_info(), "decode_steps": steps, "warmup_steps": args.warmup_steps,
            "rounds": args.rounds, "fresh_process_per_measurement": per_proc,
            "compare": args.compare, "mlx_dtype": mlx_dtype, "threads": threads,
            "llama_bench": str(llama) if llama else None,
            "bytes_model": bm, "config": {k: t.get(k) for k in ("num_hidden_layers", "hidden_size", "num_experts",
                                                                 "num_experts_per_tok", "vocab_size")},
            "quantization": {k: v for k, v in (cfg.get("quantization") or {}).items() if not isinstance(v, dict)},
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **bw, **peak}
    print(format_table(records, meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "records": records}, indent=2) + "\n")
    if args.plot:
        write_plot(Path(args.plot), records, meta)
    if any("error" in r for r in records):
        return 1
    return 0


def _run_concurrency(args, model: Path, vocab: int, bm: dict, lengths: list[int]) -> int:
    """Batched decode: for each concurrency level (a fresh worker process each, rounds in alternating order),
    that many sequences prefilled with a prompt of each length, then decoded together; aggregate and
    per-sequence decode tok/s, and the estimated bytes one batched step touches."""
    if args.engine != "lily" or args.compare:
        raise CommandError("--concurrency measures Lily's batched decode alone (no --compare)")
    steps = args.decode_steps
    levels = args.concurrency
    runs = [c for rnd in range(args.rounds) for c in (levels if rnd % 2 == 0 else levels[::-1])]
    status = Status([("lily", lengths) for _ in runs], steps, args.warmup_steps, enabled=not args.quiet)
    raw: dict = {}
    backend_seen = args.backend
    for c in runs:
        spec = {"engine": "lily", "model": str(model), "backend": args.backend, "max_seq": args.max_seq,
                "kv_dtype": args.kv_dtype, "precision": getattr(args, "precision", "exact"),
                "lengths": lengths, "decode_steps": steps,
                "warmup_steps": args.warmup_steps, "seed": args.seed, "vocab": vocab, "concurrency": c}
        t0 = time.perf_counter()
        try:
            recs = run_subprocess(spec, args.timeout, tick=lambda s, g=lengths: status.running("lily", g, s))
        except CommandError as e:
            status.bar.write(f"lily bench: {e}", file=sys.stderr)
            recs = [{"prompt_tokens": x, "concurrency": c, "error": str(e)} for x in lengths]
        for r in recs:
            raw.setdefault((c, r["prompt_tokens"]), []).append(r)
            backend_seen = r.get("backend", backend_seen)
        status.finished("lily", lengths, time.perf_counter() - t0)
    status.close()
    records = []
    for length in lengths:
        base = None
        for c in levels:
            rs = raw.get((c, length), [])
            errors = [r["error"] for r in rs if "error" in r]
            if errors or not rs:
                records.append({"concurrency": c, "prompt_tokens": length, "error": errors[0] if errors else "no run"})
                continue
            agg = sorted(r["aggregate_decode_tok_s"] for r in rs)[len(rs) // 2]
            step_bytes = bytes_per_batched_step(bm, c, length, steps)
            if c == 1:
                base = agg
            records.append({
                "concurrency": c, "prompt_tokens": length, "decode_steps": steps,
                "aggregate_decode_tok_s": agg, "per_sequence_decode_tok_s": agg / c,
                "speedup_vs_1": agg / base if base else None,
                "drift": (max(r["aggregate_decode_tok_s"] for r in rs) / min(r["aggregate_decode_tok_s"] for r in rs)
                          - 1),
                "bytes_per_step": step_bytes, "effective_gbps": step_bytes * agg / c / 1e9,
                "peak_memory_bytes": max(r["peak_memory_bytes"] for r in rs), "backend": rs[0]["backend"],
                "kv_dtype": rs[0]["kv_dtype"]})
    meta = {"model": str(model.resolve()), "engine": "lily", "backend": backend_seen, "machine": machine_info(),
            "decode_steps": steps, "warmup_steps": args.warmup_steps, "rounds": args.rounds,
            "concurrency": levels, "bytes_model": bm, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    head = ["concurrency", "prompt", "aggregate tok/s", "per-seq tok/s", "x vs 1", "drift", "MB/step (est)",
            "eff GB/s", "peak mem"]
    rows = [head]
    for r in records:
        if "error" in r:
            rows.append([str(r["concurrency"]), str(r["prompt_tokens"]), "error: " + r["error"]] + [""] * 6)
            continue
        speed = r["speedup_vs_1"]
        rows.append([str(r["concurrency"]), str(r["prompt_tokens"]), f"{r['aggregate_decode_tok_s']:,.2f}",
                     f"{r['per_sequence_decode_tok_s']:,.2f}", "-" if speed is None else f"{speed:.2f}x",
                     f"{100 * r['drift']:.1f}%", f"{r['bytes_per_step'] / 1e6:,.0f}", f"{r['effective_gbps']:.2f}",
                     f"{r['peak_memory_bytes'] / 1e9:.2f} GB"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    print(f"lily bench --concurrency: {meta['backend']}, {steps} batched decode steps after each prompt")
    for row in rows:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)).rstrip())
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "records": records}, indent=2) + "\n")
    return 1 if any("error" in r for r in records) else 0


def _measure(args, runs, status, model, steps, vocab, mlx_dtype, threads, llama, gguf):
    """Every (engine, lengths) run in order; the records by (engine, length) and the backend Lily reported."""
    raw: dict = {}
    backend_seen = None
    env = {"LILY_THREADS": str(threads)} if threads else None
    for eng, group in runs:
        spec = {"engine": eng, "model": str(model), "backend": args.backend, "max_seq": args.max_seq,
                "kv_dtype": getattr(args, "kv_dtype", "bf16"), "precision": getattr(args, "precision", "exact"),
                "lengths": group, "decode_steps": steps, "warmup_steps": args.warmup_steps,
                "seed": args.seed, "vocab": vocab, "mlx_dtype": mlx_dtype}
        t0 = time.perf_counter()
        status.running(eng, group, 0.0)
        try:
            if eng == "llama.cpp":
                recs = llama_bench_records(llama, gguf.path, group, steps, threads, args.timeout)
            else:
                recs = run_subprocess(spec, args.timeout, tick=lambda s, e=eng, g=group: status.running(e, g, s),
                                      env=env)
        except CommandError as e:
            status.bar.write(f"lily bench: {e}", file=sys.stderr)
            recs = [{"prompt_tokens": x, "error": str(e)} for x in group]
        for r in recs:
            raw.setdefault((eng, r["prompt_tokens"]), []).append(r)
            if eng == args.engine and "backend" in r:
                backend_seen = r["backend"]
        status.finished(eng, group, time.perf_counter() - t0)
    return raw, backend_seen
