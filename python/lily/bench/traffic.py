"""Device-memory traffic of the Metal command stream, measured in the simulator (issue 12, item 9).

``python -m lily.bench.traffic CHECKPOINT`` runs the engine on the simulated Metal device with
``LILY_METAL_SIM_TRAFFIC`` set, so that every dispatch's bytes read and written are counted (page
protection, first touches: crates/lily-core/src/backend/metal/traffic.rs), and prints, for a decode step
at each ``--contexts`` length and for one ``--prefill`` chunk: bytes per kernel family, the total against
the minimum (active weights + DeltaNet state read and written + the KV rows the step needs, from
``accounting.decode_bytes_model``), the dispatch count, and the decode tok/s the traffic implies at the
memory bandwidth of each Apple chip at ``--efficiency`` of it.

With ``--project-with CKPT2 --project-to N`` (CKPT2: the same model with more layers, e.g. ``lily synth
--layers 4`` and ``--layers 8``) both are measured and every count (per family: dispatches, bytes read and
written; the minimum) is projected linearly in the layer count to N layers: the real model's step from two
short checkpoints at its real widths (a 40-layer one would not fit the simulator's time here).

Nothing here is timed: the simulator's speed says nothing about a Mac's. Bytes inside a binding are
counted per 4 KiB page (a page a kernel touches counts the bytes of it the binding covers).
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from lily.bench.accounting import decode_bytes_model, read_config, text_config

__all__ = ["BANDWIDTH_GBS", "Step", "Totals", "decode_minimum", "family", "main", "measure", "project"]

# Unified-memory bandwidth of Apple-silicon chips, GB/s (10^9 bytes/s), Apple's published figures for
# the full (unbinned) chip; binned Max parts are lower (M3 Max 300, M4 Max 410).
BANDWIDTH_GBS: dict[str, float] = {
    "M1": 68.25, "M1 Pro": 200, "M1 Max": 400, "M1 Ultra": 800,
    "M2": 100, "M2 Pro": 200, "M2 Max": 400, "M2 Ultra": 800,
    "M3": 100, "M3 Pro": 150, "M3 Max": 400, "M3 Ultra": 819,
    "M4": 120, "M4 Pro": 273, "M4 Max": 546,
    "M5": 153, "M5 Max": 614,
}
# Figures not checked against an Apple page when this table was written (marked in the output).
UNVERIFIED = {"M5 Max"}

# Suffixes naming a weight / activation format or a variant (rows per simdgroup, tile height).
_FORMAT = re.compile(r"_(bf16|f16|f32|u32|q\d|n\d+|r\d+)$")


def family(kernel: str) -> str:
    """The kernel family: the name without its format / variant suffixes
    (``matmul_gemv_q4_bf16_r4`` -> ``matmul_gemv``)."""
    name = kernel
    while True:
        stripped = _FORMAT.sub("", name)
        if stripped == name or not stripped:
            return name
        name = stripped


@dataclass
class Step:
    """The dispatches of one engine call: (stream label, kernel, bytes read, bytes written) each."""
    what: str
    dispatches: list[tuple[str, str, int, int]] = field(default_factory=list)

    @property
    def read(self) -> int:
        return sum(d[2] for d in self.dispatches)

    @property
    def written(self) -> int:
        return sum(d[3] for d in self.dispatches)

    @property
    def total(self) -> int:
        return self.read + self.written

    def by_family(self) -> dict[str, list[int]]:
        """{family: [dispatches, bytes read, bytes written]}, largest traffic first."""
        out: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        for _, k, r, w in self.dispatches:
            f = out[family(k)]
            f[0] += 1
            f[1] += r
            f[2] += w
        return dict(sorted(out.items(), key=lambda kv: -(kv[1][1] + kv[1][2])))

    def totals(self, model: str | Path, kv_dtype: str = "bf16") -> Totals:
        """By family, with the minimum of a decode step (``decode_minimum``)."""
        m = re.match(r"decode at context (\d+)", self.what)
        fams = {f: [float(x) for x in v] for f, v in self.by_family().items()}
        if m is None:
            return Totals(self.what, fams)
        ctx = int(m.group(1))
        return Totals(self.what, fams, ctx, {k: float(v) for k, v in decode_minimum(model, ctx, kv_dtype).items()})


@dataclass
class Totals:
    """One engine call's traffic by kernel family ({family: [dispatches, bytes read, bytes written]}) and, for
    a decode step, its context and minimum (``decode_minimum``): measured (``Step.totals``) or projected to
    another layer count (``project``)."""
    what: str
    families: dict[str, list[float]]
    context: int | None = None
    minimum: dict[str, float] | None = None
    projected: bool = False

    @property
    def dispatches(self) -> float:
        return sum(f[0] for f in self.families.values())

    @property
    def read(self) -> float:
        return sum(f[1] for f in self.families.values())

    @property
    def written(self) -> float:
        return sum(f[2] for f in self.families.values())

    @property
    def total(self) -> float:
        return self.read + self.written


def project(small: Totals, large: Totals, layers: tuple[int, int], to: int) -> Totals:
    """``small`` and ``large`` (the same call on checkpoints of ``layers`` = (a, b) layers, a < b) projected
    linearly to ``to`` layers: x(to) = x(a) + (to - a) / (b - a) * (x(b) - x(a)) for every count. Exact where
    each layer of the period adds the same (the checkpoints' layer counts multiples of the attention
    interval); the once-per-step kernels (embedding, lm_head) are in x(a) and cancel in the difference."""
    a, b = layers
    if not a < b or small.what != large.what:
        raise ValueError(f"project needs one call on a and b > a layers, got {small.what!r} at {a}, "
                         f"{large.what!r} at {b}")
    k = (to - a) / (b - a)

    def lerp(x: list[float], y: list[float]) -> list[float]:
        return [u + k * (v - u) for u, v in zip(x, y)]

    zero = [0.0, 0.0, 0.0]
    names = sorted(set(small.families) | set(large.families))
    fams = {f: lerp(small.families.get(f, zero), large.families.get(f, zero)) for f in names}
    fams = dict(sorted(((f, v) for f, v in fams.items() if any(v)), key=lambda kv: -(kv[1][1] + kv[1][2])))
    minimum = None
    if small.minimum is not None and large.minimum is not None:
        minimum = {key: small.minimum[key] + k * (large.minimum[key] - small.minimum[key]) for key in small.minimum}
    return Totals(f"{small.what}, projected to {to} layers", fams, small.context, minimum, projected=True)


def _read_new(path: Path, offset: int) -> tuple[list[tuple[str, str, int, int]], int]:
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    rows = []
    for line in data.decode().splitlines():
        label, kernel, r, w = line.split("\t")
        rows.append((label, kernel, int(r), int(w)))
    return rows, offset + len(data)


def measure(model: str | Path, contexts: list[int], prefill: int, kv_dtype: str = "bf16") -> list[Step]:
    """Run the simulated Metal engine on ``model``: a decode step at each context length (the context
    filled with synthetic K/V rows first, ``Engine.fill_context``, not reported) and one prefill of
    ``prefill`` tokens in one chunk from an empty cache; the counted dispatches of each."""
    import lily

    log = Path(tempfile.mkstemp(prefix="lily-traffic-", suffix=".tsv")[1])
    old = os.environ.get("LILY_METAL_SIM_TRAFFIC")
    os.environ["LILY_METAL_SIM_TRAFFIC"] = str(log)
    try:
        longest = max([*contexts, prefill]) + 2
        chunk = prefill or None  # None: the engine's default chunk
        eng = lily.Engine(str(model), backend="metal-sim", max_seq=longest, prefill_chunk=chunk, kv_dtype=kv_dtype)
        vocab = eng.vocab_size
        steps = []
        offset = 0
        if prefill:
            eng.reset()
            _, offset = _read_new(log, offset)
            eng.prefill([(7 * i + 3) % vocab for i in range(prefill)])
            rows, offset = _read_new(log, offset)
            steps.append(Step(f"prefill {prefill} tokens (one chunk)", rows))
        for ctx in contexts:
            eng.reset()
            # Synthetic context (random K/V rows): a decode step at that depth reads and computes
            # what it would after a real prompt, without the prefill's cost in the simulator.
            eng.fill_context(ctx)
            _, offset = _read_new(log, offset)
            eng.decode(5 % vocab)
            rows, offset = _read_new(log, offset)
            steps.append(Step(f"decode at context {ctx}", rows))
        return steps
    finally:
        if old is None:
            os.environ.pop("LILY_METAL_SIM_TRAFFIC", None)
        else:
            os.environ["LILY_METAL_SIM_TRAFFIC"] = old
        log.unlink(missing_ok=True)


def decode_minimum(model: str | Path, context: int, kv_dtype: str = "bf16") -> dict[str, int]:
    """The bytes a decode step at ``context`` cannot avoid: active weights (embedding row, dense weights,
    top-k experts, lm_head), DeltaNet state read and written, and the K/V rows of the context plus the
    new row."""
    kv_bytes = {"bf16": 2, "f16": 2, "f32": 4}[kv_dtype]
    bm = decode_bytes_model(Path(model), kv_bytes=kv_bytes)
    kv = bm["kv_per_context_token"] * (context + 1)
    return {"weights": bm["weights"], "state": bm["state"], "kv": kv, "total": bm["weights"] + bm["state"] + kv}


def _mib(b: float) -> str:
    return f"{b / 2**20:,.2f}"


def report(model: str | Path, steps: list[Step] | list[Totals], kv_dtype: str, efficiency: float,
           speeds: bool = True) -> str:
    """The tables of ``steps`` (measured ``Step``s of ``model``, or ``Totals``), and with ``speeds`` the decode
    tok/s each chip's bandwidth implies at ``efficiency``."""
    totals = [s.totals(model, kv_dtype) if isinstance(s, Step) else s for s in steps]
    out = [f"Metal traffic of {model} (simulated command stream, bytes counted per 4 KiB page inside each "
           f"binding; KV {kv_dtype})", ""]
    decodes = []
    for s in totals:
        out.append(f"## {s.what}: {s.dispatches:,.0f} dispatches, {_mib(s.read)} MiB read, "
                   f"{_mib(s.written)} MiB written")
        out.append("")
        out.append("| kernel family | dispatches | MiB read | MiB written |")
        out.append("|---|---:|---:|---:|")
        for f, (n, r, w) in s.families.items():
            out.append(f"| {f} | {n:,.0f} | {_mib(r)} | {_mib(w)} |")
        out.append("")
        if s.minimum is not None:
            mn = s.minimum
            over = s.total / mn["total"] - 1
            out.append(f"minimum {_mib(mn['total'])} MiB (weights {_mib(mn['weights'])}, DeltaNet state "
                       f"{_mib(mn['state'])}, KV {_mib(mn['kv'])}); {'projected' if s.projected else 'measured'} "
                       f"{_mib(s.total)} MiB: "
                       f"{over:+.1%} over the minimum")
            out.append("")
            decodes.append((s.context, s.total, mn["total"]))
    if decodes and speeds:
        counted = "projected" if any(s.projected for s in totals) else "measured"
        out.append(f"Decode tok/s implied at {efficiency:.0%} of each chip's memory bandwidth "
                   f"({counted} traffic / minimum traffic):")
        out.append("")
        out.append("| chip | GB/s | " + " | ".join(f"ctx {c}" for c, _, _ in decodes) + " |")
        out.append("|---|---:|" + "---:|" * len(decodes))
        for chip, gbs in BANDWIDTH_GBS.items():
            bw = gbs * 1e9 * efficiency
            cells = " | ".join(f"{bw / t:,.0f} / {bw / m:,.0f}" for _, t, m in decodes)
            mark = " (unverified)" if chip in UNVERIFIED else ""
            out.append(f"| {chip}{mark} | {gbs:g} | {cells} |")
        out.append("")
    return "\n".join(out)


def _contexts(v: str) -> list[int]:
    try:
        out = [int(x) for x in v.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {v!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive token counts, got {v!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lily.bench.traffic", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="checkpoint folder")
    ap.add_argument("--contexts", type=_contexts, default=[256, 32768],
                    help="decode context lengths, comma-separated (default 256,32768)")
    ap.add_argument("--prefill", type=int, default=4096, help="prefill chunk measured (default 4096; 0: none)")
    ap.add_argument("--kv-dtype", default="bf16", choices=("bf16", "f16", "f32"))
    ap.add_argument("--efficiency", type=float, default=0.8,
                    help="fraction of the published bandwidth a decode step reaches (default 0.8)")
    ap.add_argument("--project-with", metavar="CKPT2", default=None,
                    help="the same model with more layers: measure it too and project to --project-to layers")
    ap.add_argument("--project-to", type=int, default=None, metavar="N",
                    help="the layer count to project to (with --project-with; Qwen3.6-35B-A3B: 40)")
    a = ap.parse_args(argv)
    if not 0 < a.efficiency <= 1:
        ap.error("--efficiency must be in (0, 1]")
    if a.prefill < 0:
        ap.error("--prefill must be >= 0")
    if (a.project_with is None) != (a.project_to is None):
        ap.error("--project-with and --project-to go together")
    if a.project_with is None:
        print(report(a.model, measure(a.model, a.contexts, a.prefill, a.kv_dtype), a.kv_dtype, a.efficiency))
        return 0
    layers = tuple(int(text_config(read_config(Path(m)))["num_hidden_layers"]) for m in (a.model, a.project_with))
    if not layers[0] < layers[1]:
        ap.error(f"--project-with needs more layers than {a.model} ({layers[0]}), has {layers[1]}")
    steps = measure(a.model, a.contexts, a.prefill, a.kv_dtype)
    more = measure(a.project_with, a.contexts, a.prefill, a.kv_dtype)
    small = [s.totals(a.model, a.kv_dtype) for s in steps]
    large = [s.totals(a.project_with, a.kv_dtype) for s in more]
    print(report(a.model, small, a.kv_dtype, a.efficiency, speeds=False))
    print(report(a.project_with, large, a.kv_dtype, a.efficiency, speeds=False))
    projected = [project(x, y, (layers[0], layers[1]), a.project_to) for x, y in zip(small, large)]
    print(report(f"{a.model} and {a.project_with} projected to {a.project_to} layers", projected, a.kv_dtype,
                 a.efficiency))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
