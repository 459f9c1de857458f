"""The measurement protocol: which prompt lengths fit, rounds in alternating order, each measurement in a fresh
worker process (``lily.bench.workers``), the records gathered for the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from lily.bench.accounting import decode_bytes_model, prefill_flops_per_token, read_config, text_config
from lily.bench.machine import available_memory_bytes, machine_info, measure_bandwidth, measure_peak_flops
from lily.bench.report import format_table, summarize, write_plot
from lily.bench.workers import RESULT_TAG
from lily.command import CommandError

__all__ = ["DEFAULT_LENGTHS", "fits", "parse_lengths", "run_bench", "run_subprocess"]

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


def _worker_cmd(spec: dict) -> list[str]:
    return [sys.executable, "-m", "lily.bench", "--worker", json.dumps(spec)]


def run_subprocess(spec: dict, timeout: float | None = None) -> list[dict]:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])  # the folder lily is imported from
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        proc = subprocess.run(_worker_cmd(spec), capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise CommandError(f"{spec['engine']} worker timed out after {timeout:.0f} s") from None
    recs = [json.loads(line[len(RESULT_TAG):]) for line in proc.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if proc.returncode != 0 or len(recs) != len(spec["lengths"]):
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise CommandError(f"{spec['engine']} worker failed (exit {proc.returncode}): {tail}")
    return recs


def fits(length: int, steps: int, max_seq: int | None, bm: dict, avail: int, weights_total: int) -> str | None:
    if max_seq and length + steps + 1 > max_seq:
        return f"{length} + {steps + 1} tokens exceed max_seq {max_seq}"
    need = weights_total + bm["kv_per_context_token"] * (length + steps + 1) + 64 * 2048 * length + (512 << 20)
    if avail and need > avail:
        return f"needs ~{need / 1e9:.1f} GB, {avail / 1e9:.1f} GB available"
    return None


def run_bench(args) -> int:
    model = Path(args.model)
    cfg = read_config(model)
    t = text_config(cfg)
    vocab = int(t["vocab_size"])
    bm = decode_bytes_model(model, cfg)
    steps = args.decode_steps
    lengths = parse_lengths(args.lengths) if args.lengths else list(DEFAULT_LENGTHS)
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
    engines = [args.engine] + ([args.compare] if args.compare else [])
    method = args.bandwidth_method
    if method == "auto":
        method = "mlx" if args.backend == "metal" else "numpy"
    bw = measure_bandwidth(int(args.bandwidth_mib) << 20, method=method)
    peak = measure_peak_flops(method)
    if not args.quiet:
        print(f"lily bench: memory bandwidth {bw['read_bandwidth_gbps']:.1f} GB/s read, "
              f"{bw['memory_bandwidth_gbps']:.1f} GB/s copy ({bw['bandwidth_method']}); f32 matmul peak "
              f"{peak['peak_gflops']:,.0f} GFLOP/s ({peak['peak_method']})", file=sys.stderr)

    from lily.synth import Progress

    per_proc = not args.same_process
    n_jobs = len(engines) * args.rounds * (len(keep) if per_proc else 1)
    prog = Progress(n_jobs, label="bench", enabled=not args.quiet)
    prog.update(0, force=True)
    raw: dict = {}
    backend_seen = None
    for rnd in range(args.rounds):
        order = keep if rnd % 2 == 0 else keep[::-1]
        engs = engines if rnd % 2 == 0 else engines[::-1]
        groups = [[x] for x in order] if per_proc else [order]
        for group in groups:
            for eng in engs:
                spec = {"engine": eng, "model": str(model), "backend": args.backend, "max_seq": args.max_seq,
                        "lengths": group, "decode_steps": steps, "warmup_steps": args.warmup_steps,
                        "seed": args.seed, "vocab": vocab, "mlx_dtype": args.mlx_dtype}
                try:
                    recs = run_subprocess(spec, args.timeout)
                except CommandError as e:
                    print(f"\nlily bench: {e}", file=sys.stderr)
                    recs = [{"prompt_tokens": x, "error": str(e)} for x in group]
                for r in recs:
                    raw.setdefault((eng, r["prompt_tokens"]), []).append(r)
                    if eng == args.engine and "backend" in r:
                        backend_seen = r["backend"]
                prog.update(1, note=f"round {rnd + 1} {eng} {','.join(map(str, group))[:30]}")
    prog.close()
    flops = {x: prefill_flops_per_token(cfg, x)["total"] for x in keep}
    records = summarize(raw, keep, bm, bw, steps, engines, flops, peak)
    meta = {"model": str(model.resolve()), "engine": args.engine, "backend": backend_seen or args.backend,
            "machine": machine_info(), "decode_steps": steps, "warmup_steps": args.warmup_steps,
            "rounds": args.rounds, "fresh_process_per_measurement": per_proc,
            "compare": args.compare, "mlx_dtype": args.mlx_dtype if args.compare or args.engine == "mlx-lm" else None,
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
