"""``lily eval MODEL --reference mlx-lm``: teacher-forced next-token comparison of Lily against MLX-LM.

The same token sequence (synthetic ids, or ``--text FILE`` tokenized with the checkpoint's tokenizer) goes
through both engines; the next-token logits at N positions (default 192) are compared: top-1 agreement,
mean / max KL(reference || lily), max |delta logit| and the perplexity of the sequence under each (delta in %).
The reference may also be a saved ``.npz`` (``--save-reference`` writes one), so a run on a machine without
MLX, or a later run, compares against the same numbers.

Each engine runs in its own process, one after the other, so the two never hold the weights at the same time.
MLX-LM on the CPU runs with every float tensor upcast to fp32 (its bf16 CPU quantized matmul is off by
several %, docs/spec oracle.md trap 2; its bf16 MoE does not run at all, trap 1); on a GPU it runs as saved.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from lily import command
from lily.bench.machine import package_version
from lily.command import ArgParser, CommandError
from lily.loading import BACKENDS

REAL_VOCAB = 248077  # rows >= this are padding in the Qwen3.6 vocabulary


# --------------------------------------------------------------------------------------------------
# logits (run inside worker processes)


def lily_logits(model: str, tokens: list[int], mode: str, backend: str = "auto", max_seq=None) -> np.ndarray:
    import lily

    kw = {"backend": backend}
    if max_seq:
        kw["max_seq"] = int(max_seq)
    eng = lily.Engine(str(model), **kw)
    eng.reset()
    if mode == "prefill":
        out = np.asarray(eng.prefill(list(tokens), all_logits=True), dtype=np.float32)
        return out.reshape(len(tokens), -1)
    rows = []
    split = 1 if mode == "decode" else max(1, len(tokens) // 2)
    first = np.asarray(eng.prefill(list(tokens[:split]), all_logits=True), dtype=np.float32)
    rows.extend(first.reshape(split, -1))
    for t in tokens[split:]:
        rows.append(np.asarray(eng.decode(int(t)), dtype=np.float32))
    return np.stack(rows)


def mlx_logits(model: str, tokens: list[int], mode: str, dtype: str = "auto") -> tuple[np.ndarray, str]:
    import mlx.core as mx

    from lily.mlx_reference import default_dtype, load_mlx_model

    if dtype == "auto":
        dtype = default_dtype()
    m, _ = load_mlx_model(Path(model), dtype)
    toks = np.asarray(tokens, dtype=np.int32)
    if mode == "prefill":
        out = m(mx.array(toks)[None]).astype(mx.float32)
        mx.eval(out)
        return np.array(out[0]), dtype
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(m)
    split = 1 if mode == "decode" else max(1, len(toks) // 2)
    out = m(mx.array(toks[:split])[None], cache=cache).astype(mx.float32)
    mx.eval(out)
    rows = list(np.array(out[0]))
    for t in toks[split:]:
        o = m(mx.array([[int(t)]]), cache=cache).astype(mx.float32)
        mx.eval(o)
        rows.append(np.array(o[0, -1]))
    return np.stack(rows), dtype


def run_worker(spec: dict) -> None:
    t0 = time.perf_counter()
    info = {"engine": spec["engine"], "mode": spec["mode"]}
    if spec["engine"] == "lily":
        logits = lily_logits(spec["model"], spec["tokens"], spec["mode"], spec.get("backend", "auto"),
                             spec.get("max_seq"))
    else:
        logits, dt = mlx_logits(spec["model"], spec["tokens"], spec["mode"], spec.get("mlx_dtype", "auto"))
        info["dtype"] = dt
    info["seconds"] = time.perf_counter() - t0
    np.savez(spec["out"], logits=logits.astype(np.float32), tokens=np.asarray(spec["tokens_full"], np.int32),
             meta=np.array(json.dumps(info)))


def compute_logits(spec: dict, timeout=None) -> tuple[np.ndarray, dict]:
    with tempfile.TemporaryDirectory(prefix="lily-eval-") as td:
        spec = dict(spec, out=str(Path(td) / "logits.npz"))
        with open(Path(td) / "spec.json", "w") as f:
            json.dump(spec, f)
        try:
            proc = subprocess.run([sys.executable, "-m", "lily.eval", "--worker", str(Path(td) / "spec.json")],
                                  capture_output=True, text=True, timeout=timeout, env=command.worker_env())
        except subprocess.TimeoutExpired:
            raise CommandError(f"{spec['engine']} timed out after {timeout} s") from None
        if proc.returncode != 0 or not Path(spec["out"]).exists():
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise CommandError(f"{spec['engine']} failed (exit {proc.returncode}): {tail}")
        z = np.load(spec["out"])
        return z["logits"], json.loads(str(z["meta"]))


# --------------------------------------------------------------------------------------------------
# metrics


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def compare(ref: np.ndarray, cand: np.ndarray, targets: np.ndarray | None, vocab_limit: int | None = None) -> dict:
    """Metrics of ``cand`` against ``ref`` ([N, V] logits); ``targets[i]`` is the token after position i."""
    if ref.shape != cand.shape:
        raise CommandError(f"logit shapes differ: reference {ref.shape}, lily {cand.shape}")
    V = ref.shape[1] if not vocab_limit else min(vocab_limit, ref.shape[1])
    kls, top1, maxd, nll_r, nll_c, meand = [], 0, 0.0, [], [], 0.0
    for i in range(ref.shape[0]):
        r, c = ref[i, :V], cand[i, :V]
        if not (np.isfinite(r).all() and np.isfinite(c).all()):
            who = "reference" if not np.isfinite(r).all() else "lily"
            raise CommandError(f"non-finite logits at position {i} ({who})")
        lr, lc = _log_softmax(r), _log_softmax(c)
        kls.append(float(np.sum(np.exp(lr) * (lr - lc))))
        top1 += int(np.argmax(r) == np.argmax(c))
        d = np.abs(r.astype(np.float64) - c)
        maxd = max(maxd, float(d.max()))
        meand += float(d.mean())
        if targets is not None and i < len(targets) and targets[i] < V:
            nll_r.append(-lr[targets[i]])
            nll_c.append(-lc[targets[i]])
    n = ref.shape[0]
    out = {"positions": n, "top1_agreement": top1 / n, "kl_mean": float(np.mean(kls)), "kl_max": float(np.max(kls)),
           "max_abs_logit_diff": maxd, "mean_abs_logit_diff": meand / n}
    if nll_r:
        pr, pc = math.exp(float(np.mean(nll_r))), math.exp(float(np.mean(nll_c)))
        out.update(perplexity_reference=pr, perplexity_lily=pc, perplexity_delta_pct=100.0 * (pc / pr - 1.0))
    return out


# --------------------------------------------------------------------------------------------------
# CLI


def _vocab_of(model: Path) -> int:
    cfg = json.loads((model / "config.json").read_text())
    return int(cfg.get("text_config", cfg)["vocab_size"])


def make_tokens(model: Path, n_positions: int, text: str | None, seed: int) -> tuple[list[int], str]:
    V = _vocab_of(model)
    if text is not None:
        tj = model / "tokenizer.json"
        if not tj.is_file():
            raise CommandError(f"--text needs a tokenizer: {tj} not found")
        from tokenizers import Tokenizer

        try:
            data = Path(text).read_text(encoding="utf-8")
        except OSError as e:
            raise CommandError(f"--text {text}: {e.strerror}") from None
        ids = Tokenizer.from_file(str(tj)).encode(data, add_special_tokens=False).ids
        if len(ids) < 2:
            raise CommandError(f"--text {text}: fewer than 2 tokens")
        if max(ids) >= V:
            raise CommandError(f"the tokenizer produced id {max(ids)} >= vocab_size {V}")
        if len(ids) < n_positions + 1:
            print(f"lily eval: {text} has {len(ids)} tokens; comparing {len(ids) - 1} positions", file=sys.stderr)
        return ids[: n_positions + 1], f"text {Path(text).name}"
    hi = min(V, 248044)
    return np.random.default_rng(seed).integers(0, hi, size=n_positions + 1).tolist(), f"random ids (seed {seed})"


def format_report(m: dict, meta: dict) -> str:
    lines = [f"lily eval: {meta['model']}  ({meta['tokens']}, {m['positions']} positions, mode {meta['mode']})",
             f"  reference           {meta['reference']}",
             f"  top-1 agreement     {100 * m['top1_agreement']:.2f} %",
             f"  KL(ref || lily)     mean {m['kl_mean']:.3e}   max {m['kl_max']:.3e}",
             f"  |delta logit|       max {m['max_abs_logit_diff']:.4f}   mean {m['mean_abs_logit_diff']:.4f}"]
    if "perplexity_reference" in m:
        lines.append(f"  perplexity          reference {m['perplexity_reference']:.4f}   lily "
                     f"{m['perplexity_lily']:.4f}   delta {m['perplexity_delta_pct']:+.3f} %")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = ArgParser(prog="lily eval", description="Teacher-forced logit comparison against MLX-LM.")
    ap.add_argument("model", help="checkpoint folder")
    ap.add_argument("--reference", default="mlx-lm", help="mlx-lm (run it now) or a .npz of saved reference logits")
    ap.add_argument("--positions", type=command.integer(1), default=192, help="number of next-token positions (192)")
    ap.add_argument("--text", default=None, metavar="FILE", help="tokenize this text instead of random ids")
    ap.add_argument("--seed", type=command.integer(0), default=0, help="seed of the random ids")
    ap.add_argument("--mode", choices=("prefill", "decode", "mixed"), default="prefill",
                    help="how the sequence goes through both engines: one prefill with all logits (default), "
                         "token-by-token decode, or prefill of the first half then decode")
    ap.add_argument("--backend", default="auto", choices=BACKENDS, help="Lily's compute backend")
    ap.add_argument("--max-seq", type=command.MAX_SEQ, default=None,
                    help="Lily's context length (default: the engine's)")
    ap.add_argument("--mlx-dtype", choices=("auto", "native", "float32"), default="auto",
                    help="MLX-LM precision: auto = fp32 on the CPU, as saved on a GPU")
    ap.add_argument("--save-reference", default=None, metavar="NPZ", help="save the reference logits and tokens")
    ap.add_argument("--vocab-limit", type=command.integer(1), default=None,
                    help="compare only the first N vocabulary rows (default: 248077 for the real vocabulary)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the metrics as JSON")
    ap.add_argument("--min-top1", type=command.number(0, 100), default=None, metavar="PERCENT",
                    help="exit 1 if the top-1 agreement is below this percentage (0-100, as printed)")
    ap.add_argument("--max-kl", type=command.number(0), default=None, help="exit 1 if the mean KL is above this")
    ap.add_argument("--engine", choices=("lily", "mlx-lm"), default="lily", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=command.number(0), default=None, help="seconds per engine process")
    return ap


def run(args) -> int:
    model = Path(args.model)
    if not (model / "config.json").is_file():
        raise CommandError(f"{model}: not a checkpoint folder (no config.json)")
    V = _vocab_of(model)
    ref_meta: dict
    if args.reference == "mlx-lm":
        tokens, tok_desc = make_tokens(model, args.positions, args.text, args.seed)
        spec = {"engine": "mlx-lm", "model": str(model), "tokens": tokens[:-1], "tokens_full": tokens,
                "mode": args.mode, "mlx_dtype": args.mlx_dtype}
        print(f"lily eval: reference: MLX-LM on {len(tokens) - 1} positions ...", file=sys.stderr)
        ref, ref_meta = compute_logits(spec, args.timeout)
        ref_desc = (f"mlx-lm {package_version('mlx-lm') or '?'} ({ref_meta.get('dtype')}, {args.mode}, "
                    f"{ref_meta['seconds']:.1f} s)")
        if args.save_reference:
            np.savez(args.save_reference, logits=ref, tokens=np.asarray(tokens, np.int32),
                     meta=np.array(json.dumps(dict(ref_meta, model=str(model), tokens_desc=tok_desc))))
    else:
        p = Path(args.reference)
        if not p.is_file():
            raise CommandError(f"--reference {args.reference}: neither 'mlx-lm' nor an existing .npz file")
        try:
            z = np.load(p)
            ref, tokens = z["logits"], z["tokens"].tolist()
            ref_meta = json.loads(str(z["meta"])) if "meta" in z else {}
        except (OSError, ValueError, KeyError) as e:
            raise CommandError(f"--reference {p}: not a reference .npz with logits and tokens ({e})") from None
        if ref.ndim != 2 or ref.shape[0] != len(tokens) - 1:
            raise CommandError(f"--reference {p}: logits {ref.shape} do not match {len(tokens)} tokens")
        tok_desc = ref_meta.get("tokens_desc", "tokens from the .npz")
        ref_desc = f"{p} ({ref_meta.get('engine', '?')} {ref_meta.get('dtype', '')})"
    if ref.shape[1] != V:
        raise CommandError(f"reference has {ref.shape[1]} logits per position, the checkpoint's vocab_size is {V}")
    print(f"lily eval: {args.engine} on {len(tokens) - 1} positions ...", file=sys.stderr)
    spec = {"engine": args.engine, "model": str(model), "tokens": tokens[:-1], "tokens_full": tokens,
            "mode": args.mode, "backend": args.backend, "max_seq": args.max_seq, "mlx_dtype": args.mlx_dtype}
    cand, cand_meta = compute_logits(spec, args.timeout)
    limit = args.vocab_limit or (REAL_VOCAB if V > REAL_VOCAB else None)
    metrics = compare(ref, cand, np.asarray(tokens[1:]), limit)
    meta = {"model": str(model), "tokens": tok_desc, "mode": args.mode, "reference": ref_desc,
            "candidate": cand_meta, "vocab_limit": limit}
    print(format_report(metrics, meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "metrics": metrics}, indent=2) + "\n")
    bad = []
    if args.min_top1 is not None and 100 * metrics["top1_agreement"] < args.min_top1:
        bad.append(f"top-1 agreement {100 * metrics['top1_agreement']:.3f} % < {args.min_top1:g} %")
    if args.max_kl is not None and metrics["kl_mean"] > args.max_kl:
        bad.append(f"mean KL {metrics['kl_mean']:.3e} > {args.max_kl}")
    if bad:
        print("lily eval: FAIL: " + "; ".join(bad), file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        run_worker(json.loads(Path(argv[1]).read_text()))
        return 0
    args = build_parser().parse_args(argv)
    return command.run("lily eval", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
