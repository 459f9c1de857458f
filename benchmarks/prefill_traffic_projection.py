"""Project a measured prefill chunk's device-memory traffic (``python -m lily.bench.traffic``) to a longer
chunk, and the 4-layer checkpoint's chunk to the full layer count.

A prefill chunk of T tokens in the simulator at the real widths costs ~10^8 multiply-adds per token and
layer, executed per GPU thread on the CPU: a 4096-token chunk is out of reach on a small machine, a
256-token one is not. Per kernel family the counted bytes are a constant plus a part proportional to T:

* constant: the weights a family reads (every expert of every layer is picked at least once in a long
  chunk: read once, counted once per page), the lm_head GEMV (the last token's logits), and the DeltaNet
  recurrent state that ``delta_net_chunk`` reads and writes;
* proportional to T: everything else (activations in and out, the embedding rows, K/V rows written and read
  by the causal attention, the DeltaNet chunk scratch, the MoE sort's buffers).

So x_f(T) = c_f + T / T0 * (x_f(T0) - c_f) from one measured chunk of T0 tokens. Checked at the real widths
(``lily synth --layers 4``, chunks of 256, 512 and 1024 tokens measured: the longer ones predicted from 256
tokens within 0.05 % in total, 2 % for the smallest family) and on ``real-s0`` (``tests/fixtures.py``
``real_heads``, 256 -> 1024 tokens, 0.5 %; docs/2026-12-01-metal-on-a-mac.md, 2026-12-06). Layers: the
embedding, the final norm and the lm_head run once per chunk, everything else once per layer; a checkpoint of
4 layers (3 DeltaNet + 1 attention, one period of Qwen3.6's layout) projects to L layers as
once + L / 4 * (x - once).

    python benchmarks/prefill_traffic_projection.py REPORT CHECKPOINT --to 4096 [--layers 40]

REPORT: the saved output of ``python -m lily.bench.traffic CHECKPOINT --prefill T0 ...``.
"""

from __future__ import annotations

import argparse
import json
import re
import struct
from pathlib import Path

from lily.bench.accounting import decode_bytes_model, read_config, text_config

ONCE = ("embed", "matmul_gemv", "rms_norm")  # once per chunk (the lm_head is the only GEMV of a prefill)


def weight_family(name: str) -> str | None:
    """The kernel family of a prefill chunk that reads tensor ``name`` (None: not read by a prefill)."""
    if name.startswith("mtp.") or ".mtp." in name:
        return None
    if "shared_expert" not in name and ("switch_mlp" in name or ".experts." in name):
        return "moe_gemm_down" if "down" in name else "moe_gemm_gate_up"
    if "lm_head" in name:
        return "matmul_gemv"
    if "embed_tokens" in name or "conv1d" in name or "norm" in name or "A_log" in name or "dt_bias" in name:
        return None  # rows picked per token (proportional to T), or a few KiB
    return "matmul_mma"  # projections, router, shared expert and its gate


def weights_by_family(ckpt: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        for name, t in header.items():
            fam = None if name == "__metadata__" else weight_family(name)
            if fam is not None:
                out[fam] = out.get(fam, 0) + t["data_offsets"][1] - t["data_offsets"][0]
    return out


def parse_prefill(report: str) -> tuple[int, dict[str, list[float]]]:
    """(T0, {family: [dispatches, MiB read, MiB written]}) of the report's prefill chunk."""
    m = re.search(r"## prefill (\d+) tokens \(one chunk\).*?\n\n\|.*?\n\|.*?\n((?:\|.*\n)+)", report)
    if m is None:
        raise SystemExit("no prefill chunk in the report")
    fams = {}
    for line in m.group(2).strip().splitlines():
        f, n, r, w = (c.strip().replace(",", "") for c in line.strip("|").split("|"))
        fams[f] = [float(n), float(r), float(w)]
    return int(m.group(1)), fams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report")
    ap.add_argument("checkpoint")
    ap.add_argument("--to", type=int, required=True, help="the chunk length to project to")
    ap.add_argument("--layers", type=int, default=None, help="the layer count to project to (4-layer checkpoint)")
    a = ap.parse_args()
    t0, fams = parse_prefill(Path(a.report).read_text())
    ckpt = Path(a.checkpoint)
    mib = 2.0**20
    const_read = {f: b / mib for f, b in weights_by_family(ckpt).items()}
    # The recurrent state, read and written once per chunk (decode_bytes_model: recurrent + conv, both ways).
    state = decode_bytes_model(ckpt, kv_bytes=2)["state"] / mib / 2
    const_read["delta_net_chunk"] = state
    const_written = {"delta_net_chunk": state}
    # The lm_head GEMV reads its weights and the last token's row and writes one row of logits: all constant.
    const_read["matmul_gemv"] = const_written["matmul_gemv"] = float("inf")
    k = a.to / t0
    proj = {}
    for f, (n, r, w) in fams.items():
        cr, cw = min(const_read.get(f, 0.0), r), min(const_written.get(f, 0.0), w)
        proj[f] = [n, cr + k * (r - cr), cw + k * (w - cw)]
    measured_layers = int(text_config(read_config(ckpt))["num_hidden_layers"])
    layers = a.layers or measured_layers
    scale = layers / measured_layers
    proj = {f: (v if f in ONCE else [x * scale for x in v]) for f, v in proj.items()}
    print(f"prefill chunk of {a.to} tokens, {layers} layers, projected from {t0} tokens measured on {ckpt} "
          f"(bytes counted per 4 KiB page as in the report)")
    print()
    print("| kernel family | dispatches | MiB read | MiB written |")
    print("|---|---:|---:|---:|")
    for f, (n, r, w) in sorted(proj.items(), key=lambda kv: -(kv[1][1] + kv[1][2])):
        print(f"| {f} | {n:,.0f} | {r:,.2f} | {w:,.2f} |")
    n, r, w = (sum(v[i] for v in proj.values()) for i in range(3))
    print(f"| total | {n:,.0f} | {r:,.2f} | {w:,.2f} |")
    per_layer = sum(const_read.get(f, 0.0) for f in ("matmul_mma", "moe_gemm_gate_up", "moe_gemm_down"))
    weights = weights_by_family(ckpt).get("matmul_gemv", 0) / mib + per_layer * scale
    print()
    print(f"weights read once: {weights:,.2f} MiB; per token: {(r + w) / a.to:,.3f} MiB moved")


if __name__ == "__main__":
    main()
