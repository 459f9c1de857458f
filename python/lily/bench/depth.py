"""Long-context benchmark: decode speed and memory at depths up to the model's context length.

``python -m lily.bench.depth CHECKPOINT --depths 4K,32K,128K,256K`` measures, for each depth in a fresh
process (so that peak memory belongs to that depth alone):

- how the depth was reached: a real prefill of random tokens up to ``--prefill-upto`` (its tok/s is
  reported), beyond that ``Engine.fill_context`` (random K/V rows written without the prefill's cost:
  decode reads and computes exactly what it would after a real prompt of that length);
- decode tok/s at that depth, the bytes one decoded token reads (active weights + DeltaNet state + the
  KV rows of every attention layer), the read bandwidth that implies, and its fraction of the read
  bandwidth measured in the same run;
- peak resident memory against weights + state + KV + one prefill chunk's activations.

With ``--llama-bench PATH --gguf FILE`` (a GGUF of the same synthetic weights) llama.cpp's ``llama-bench -d``
runs at the depths Lily prefilled, with the same thread count, and the ratios are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from lily import command
from lily.bench.accounting import decode_bytes_model, read_config, text_config
from lily.bench.llamacpp import llama_bench
from lily.bench.machine import machine_info, measure_bandwidth, peak_rss_bytes, usable_cpus
from lily.bench.protocol import parse_lengths
from lily.bench.workers import make_prompt
from lily.command import ArgParser, CommandError
from lily.loading import BACKENDS, KV_DTYPES

__all__ = ["main", "measure_depth"]

TAG = "LILY_DEPTH_RESULT "


def measure_depth(model: str, depth: int, *, backend: str, kv_dtype: str, steps: int, prefill_upto: int,
                  seed: int) -> dict:
    """Reach ``depth`` (prefill or fill), then time ``steps`` greedy decode steps; one record."""
    import numpy as np

    import lily

    eng = lily.Engine(model, backend=backend, kv_dtype=kv_dtype, max_seq=depth + steps + 2)
    vocab = eng.vocab_size
    rec: dict = {"depth": depth, "backend": eng.backend, "kv_dtype": eng.kv_dtype,
                 "prefill_chunk": eng.prefill_chunk}
    if depth <= prefill_upto:
        prompt = make_prompt(depth, vocab, seed).tolist()
        t0 = time.perf_counter()
        logits = eng.prefill(prompt)
        rec["prefill_s"] = time.perf_counter() - t0
        rec["prefill_tok_s"] = depth / rec["prefill_s"]
        rec["reached_by"] = "prefill"
    else:
        eng.fill_context(depth - 1, seed=seed)
        logits = eng.prefill(make_prompt(1, vocab, seed).tolist())
        rec["reached_by"] = "fill"
    tok = int(np.argmax(logits))
    tok = int(np.argmax(eng.decode(tok)))  # one untimed step: any segment growth and warm caches
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = int(np.argmax(eng.decode(tok)))
    dt = time.perf_counter() - t0
    rec.update(decode_steps=steps, decode_s=dt, decode_tok_s=steps / dt, kv_bytes=eng.kv_bytes,
               peak_rss_bytes=peak_rss_bytes())
    return rec


def _worker(spec: str) -> int:
    s = json.loads(spec)
    rec = measure_depth(s["model"], s["depth"], backend=s["backend"], kv_dtype=s["kv_dtype"], steps=s["steps"],
                        prefill_upto=s["prefill_upto"], seed=s["seed"])
    print(TAG + json.dumps(rec), flush=True)
    return 0


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def run(args: argparse.Namespace) -> int:
    model = Path(args.model)
    cfg = read_config(model)
    t = text_config(cfg)
    kvb = 4 if args.kv_dtype == "f32" else 2
    bm = decode_bytes_model(model, cfg, kv_bytes=kvb)
    limit = int(t.get("max_position_embeddings", 0)) or None
    depths = args.depths
    for d in depths:
        if limit and d + args.decode_steps + 2 > limit:
            raise CommandError(f"depth {d} + {args.decode_steps + 2} decoded tokens exceed the model's context "
                               f"length {limit}")
    bw = measure_bandwidth(int(args.bandwidth_mib) << 20)["read_bandwidth_gbps"] * 1e9
    threads = int(os.environ.get("LILY_THREADS") or usable_cpus())
    print(f"lily depth: read bandwidth {bw / 1e9:.1f} GB/s, {threads} threads, {machine_info()['cpu']}",
          file=sys.stderr)
    recs = []
    for d in depths:
        spec = {"model": str(model), "depth": d, "backend": args.backend, "kv_dtype": args.kv_dtype,
                "steps": args.decode_steps, "prefill_upto": args.prefill_upto, "seed": args.seed}
        res = subprocess.run([sys.executable, "-m", "lily.bench.depth", "--worker", json.dumps(spec)],
                             capture_output=True, text=True, timeout=args.timeout, env=command.worker_env())
        lines = [x for x in res.stdout.splitlines() if x.startswith(TAG)]
        if res.returncode != 0 or not lines:
            raise CommandError(f"depth {d}: the worker failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
        r = json.loads(lines[0][len(TAG):])
        ctx = d + 2 + args.decode_steps // 2  # mean context over the timed steps
        r["bytes_per_token"] = bm["weights"] + bm["state"] + bm["kv_per_context_token"] * ctx
        r["read_gbps"] = r["bytes_per_token"] * r["decode_tok_s"] / 1e9
        r["bandwidth_fraction"] = r["read_gbps"] * 1e9 / bw
        chunk_act = 64 * int(t["hidden_size"]) * 4 * r["prefill_chunk"]  # generous bound on one chunk's scratch
        r["expected_bytes"] = bm["weights_total"] + bm["state"] + r["kv_bytes"] + chunk_act
        r["peak_over_expected"] = r["peak_rss_bytes"] / r["expected_bytes"]
        recs.append(r)
        print(f"lily depth: {d} done ({r['reached_by']})", file=sys.stderr)
    llama = {}
    if args.llama_bench:
        if not args.gguf:
            raise CommandError("--llama-bench needs --gguf (a GGUF of the same weights)")
        prefilled = [r["depth"] for r in recs if r["reached_by"] == "prefill"]
        if prefilled:
            llama = llama_bench(Path(args.llama_bench), Path(args.gguf), prefilled, args.decode_steps, threads,
                                reps=args.llama_reps)
    print(f"\n{model} · {recs[0]['backend']} · KV {recs[0]['kv_dtype']} · {threads} threads · read bandwidth "
          f"{bw / 1e9:.1f} GB/s · {args.decode_steps} decode steps")
    head = ("| depth | reached by | prefill tok/s | decode tok/s | MB read / token | of bandwidth | KV GB | "
            "peak GB | peak / (weights+state+KV+chunk) |")
    if llama:
        head += " llama.cpp prefill | decode | Lily/llama prefill | decode |"
    print(head)
    print("|" + "|".join(["---:"] * (head.count("|") - 1)) + "|")
    for r in recs:
        pre = f"{r['prefill_tok_s']:,.0f}" if "prefill_tok_s" in r else "–"
        row = (f"| {r['depth']:,} | {r['reached_by']} | {pre} | {r['decode_tok_s']:,.1f} | "
               f"{r['bytes_per_token'] / 1e6:,.0f} | {r['bandwidth_fraction']:.0%} | {_gb(r['kv_bytes'])} | "
               f"{_gb(r['peak_rss_bytes'])} | {r['peak_over_expected']:.2f} |")
        if llama:
            lr = llama.get(r["depth"], {})
            lp, ld = lr.get("prefill_tok_s"), lr.get("decode_tok_s")
            cells = [f"{lp:,.0f}" if lp else "–", f"{ld:,.1f}" if ld else "–",
                     f"{r['prefill_tok_s'] / lp:.2f}" if lp and "prefill_tok_s" in r else "–",
                     f"{r['decode_tok_s'] / ld:.2f}" if ld else "–"]
            row += " " + " | ".join(cells) + " |"
        print(row)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_info(), "read_bandwidth_bytes_s": bw,
                                               "threads": threads, "bytes_model": bm, "records": recs,
                                               "llama_cpp": llama}, indent=2) + "\n")
    return 0


def _depths(text: str) -> list[int]:
    try:
        return parse_lengths(text)
    except CommandError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    ap = ArgParser(prog="python -m lily.bench.depth", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="checkpoint folder (e.g. from lily synth --layers 4)")
    ap.add_argument("--depths", type=_depths, default=[4096, 32768],
                    help="comma-separated context depths, K suffix allowed (default 4K,32K)")
    ap.add_argument("--backend", default="auto", choices=BACKENDS)
    ap.add_argument("--kv-dtype", default="bf16", choices=KV_DTYPES)
    ap.add_argument("--decode-steps", type=command.integer(1), default=32, help="timed decode steps (32)")
    ap.add_argument("--prefill-upto", type=_depths, default=[32768],
                    help="depths up to this are reached by a real prefill (timed), deeper ones by fill_context "
                         "(default 32K)")
    ap.add_argument("--seed", type=command.integer(0), default=0)
    ap.add_argument("--timeout", type=command.number(1), default=3600, help="seconds per depth (3600)")
    ap.add_argument("--bandwidth-mib", type=command.integer(64), default=1024)
    ap.add_argument("--llama-bench", metavar="PATH", help="a llama-bench binary to run beside Lily")
    ap.add_argument("--gguf", metavar="FILE", help="GGUF of the same synthetic weights (for --llama-bench)")
    ap.add_argument("--llama-reps", type=command.integer(1), default=2,
                    help="llama-bench repetitions per measurement (2; each decode-at-depth one prefills the depth)")
    ap.add_argument("--json", metavar="PATH", help="write the records as JSON")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return _worker(args.worker)

    def body() -> int:
        if not args.model or not Path(args.model).is_dir():
            raise CommandError(f"{args.model}: not a checkpoint folder")
        args.prefill_upto = max(args.prefill_upto)
        return run(args)

    return command.run("lily depth", body)


if __name__ == "__main__":
    sys.exit(main())
