"""The report of a benchmark: one record per prompt length (means over rounds, drift, bandwidth and FLOP
fractions, the comparison engine's numbers and ratios), as a table, JSON and a plot."""

from __future__ import annotations

import math
from pathlib import Path

from lily.bench.accounting import bytes_per_decoded_token
from lily.command import CommandError

__all__ = ["DRIFT_LIMIT", "engine_key", "format_table", "summarize", "write_plot"]

DRIFT_LIMIT = 0.03
COMPARED = ("mlx-lm", "llama.cpp")


def engine_key(engine: str) -> str:
    """The record key of a compared engine's numbers: "mlx-lm" -> "mlx_lm", "llama.cpp" -> "llama_cpp"."""
    return engine.replace("-", "_").replace(".", "_")


def _compared(records: list[dict]) -> str | None:
    return next((e for e in COMPARED if any(engine_key(e) in r for r in records)), None)


def _mean(xs):
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def _drift(xs):
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if len(xs) < 2:
        return 0.0
    m = sum(xs) / len(xs)
    return (max(xs) - min(xs)) / m if m else 0.0


def summarize(
    raw: dict,
    lengths: list[int],
    bm: dict,
    bw: dict,
    steps: int,
    engines: list[str],
    flops: dict | None = None,
    peak: dict | None = None,
) -> list[dict]:
    """One record per length; ``flops`` = {length: prefill FLOPs per token}, ``peak`` = measure_peak_flops()."""
    records = []
    for length in lengths:
        rec: dict = {"prompt_tokens": length}
        for eng in engines:
            rs = raw.get((eng, length), [])
            errs = [r["error"] for r in rs if "error" in r]
            ok = [r for r in rs if "error" not in r]
            pre = [r["prefill_tok_s"] for r in ok]
            dec = [r["decode_tok_s"] for r in ok]
            d = {"prefill_tok_s": _mean(pre), "decode_tok_s": _mean(dec), "prefill_tok_s_rounds": pre,
                 "decode_tok_s_rounds": dec, "prefill_drift": _drift(pre), "decode_drift": _drift(dec),
                 "peak_memory_bytes": max([r["peak_memory_bytes"] for r in ok if r.get("peak_memory_bytes")],
                                          default=None),
                 "backend": ok[0]["backend"] if ok else None}
            d["drift_ok"] = d["prefill_drift"] < DRIFT_LIMIT and d["decode_drift"] < DRIFT_LIMIT
            if errs:
                d["error"] = errs[0]
            bpt = bytes_per_decoded_token(bm, length, steps)
            d["decode_bytes_per_token"] = int(bpt)
            d["decode_effective_gbps"] = bpt * d["decode_tok_s"] / 1e9
            d["memory_bandwidth_gbps"] = bw["memory_bandwidth_gbps"]
            d["decode_bandwidth_fraction"] = d["decode_effective_gbps"] / bw["memory_bandwidth_gbps"]
            d["read_bandwidth_gbps"] = bw["read_bandwidth_gbps"]
            d["decode_read_bandwidth_fraction"] = d["decode_effective_gbps"] / bw["read_bandwidth_gbps"]
            if flops and length in flops:
                d["prefill_flops_per_token"] = flops[length]
                d["prefill_gflops"] = d["prefill_tok_s"] * flops[length] / 1e9
                if peak:
                    d["peak_gflops"] = peak["peak_gflops"]
                    d["prefill_peak_fraction"] = d["prefill_gflops"] / peak["peak_gflops"]
            if eng == engines[0]:
                rec.update(d)
                rec["engine"] = eng
            else:
                rec[engine_key(eng)] = d
                rec["prefill_ratio"] = rec["prefill_tok_s"] / d["prefill_tok_s"] if d["prefill_tok_s"] else None
                rec["decode_ratio"] = rec["decode_tok_s"] / d["decode_tok_s"] if d["decode_tok_s"] else None
        records.append(rec)
    return records


def _fmt(x, spec=",.1f"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def format_table(records: list[dict], meta: dict) -> str:
    cmp = _compared(records)
    cmp_key = engine_key(cmp) if cmp else None
    head = ["prompt", "prefill tok/s", "of peak", "decode tok/s", "drift", "MB/token", "eff GB/s", "of read BW",
            "of copy BW", "peak mem"]
    if cmp_key:
        head += [f"{cmp} prefill", f"{cmp} decode", "prefill x", "decode x"]
    rows = [head]
    for r in records:
        drift = max(r.get("prefill_drift", 0.0), r.get("decode_drift", 0.0))
        row = [str(r["prompt_tokens"]), _fmt(r.get("prefill_tok_s")),
               _fmt(100 * r.get("prefill_peak_fraction", float("nan")), ".0f") + "%",
               _fmt(r.get("decode_tok_s"), ",.2f"), f"{drift * 100:.1f}%" + ("" if r.get("drift_ok", True) else " !"),
               _fmt(r.get("decode_bytes_per_token", 0) / 1e6, ",.0f"), _fmt(r.get("decode_effective_gbps"), ".2f"),
               _fmt(100 * r.get("decode_read_bandwidth_fraction", float("nan")), ".0f") + "%",
               _fmt(100 * r.get("decode_bandwidth_fraction", float("nan")), ".0f") + "%",
               _fmt((r.get("peak_memory_bytes") or float("nan")) / 1e9, ".2f") + " GB"]
        if "error" in r:
            row[1] = "error"
        if cmp_key:
            c = r.get(cmp_key, {})
            row += [_fmt(c.get("prefill_tok_s")), _fmt(c.get("decode_tok_s"), ",.2f"),
                    _fmt(r.get("prefill_ratio"), ".2f"), _fmt(r.get("decode_ratio"), ".2f")]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    m = meta
    foot = (f"engine {m['engine']} backend {m.get('backend')}; {m['machine']['cpu']} ({m['machine']['cpu_count']} "
            f"cores); memory bandwidth {m.get('read_bandwidth_gbps', float('nan')):.1f} GB/s read (a decode step is "
            f"a read stream), {m['memory_bandwidth_gbps']:.1f} GB/s copy (read + write), by {m['bandwidth_method']}; "
            f"f32 matmul peak {m.get('peak_gflops', float('nan')):,.0f} GFLOP/s ({m.get('peak_method')}); "
            f"{m['decode_steps']} decode steps; drift = max spread of the {m['rounds']} rounds"
            + (" (! = 3 % or more)" if any(not r.get("drift_ok", True) for r in records) else "")
            + (f"; {m['threads']} threads" if m.get("threads") else "")
            + (f"; {cmp}: {m['llama_bench']} on a random-weight GGUF of the same shapes (Q4_0, 4.5 bits per weight)"
               if cmp == "llama.cpp" and m.get("llama_bench") else ""))
    return "\n".join(lines) + "\n" + foot


def write_plot(path: Path, records: list[dict], meta: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CommandError("--plot needs matplotlib (pip install matplotlib)") from None
    xs = [r["prompt_tokens"] for r in records]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "prefill_tok_s", "prefill"), (axes[1], "decode_tok_s", "decode")):
        ax.plot(xs, [r.get(key) for r in records], "o-", label=f"lily ({meta.get('backend')})")
        cmp = _compared(records)
        if cmp:
            ax.plot(xs, [r.get(engine_key(cmp), {}).get(key) for r in records], "s--", label=cmp)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens (context)")
        ax.set_ylabel("tokens / s")
        ax.set_title(f"{title} tok/s")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"{Path(meta['model']).name} - {meta['machine']['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
