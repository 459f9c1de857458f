"""``lily bench MODEL``: prefill and decode speed at batch 1, the way the reference numbers were measured.

For every prompt length (default 256, 512, ..., 131072, cut to what fits ``max_seq`` and memory): synthetic
prompt ids; a warm-up at the exact shape (same prompt length, a few decode steps); then prefill tok/s = prompt
tokens / time to first token and decode tok/s over the next 64 steps (greedy). Two rounds, the second in the
reverse order; the drift between rounds is reported (>= 3 % marks the row). Each measurement runs in a fresh
process (``--same-process`` runs a whole round in one) so that peak memory is per measurement.

Next to the speed: bytes read per decoded token (weights actually touched: every tensor except the routed
experts, of which top-k of E, plus one embedding row; DeltaNet state read + write; KV cache read at the mean
context of the decode window), the effective bandwidth that implies, and the machine's memory bandwidth
measured in the same run (multi-threaded numpy copy; an MLX GPU copy for the Metal backend).

Next to prefill: the FLOPs one prompt token costs (from config.json's dims: every weight matrix the token passes
through, top-k of the routed experts, the lm_head once per prompt; causal attention at the mean context; the
DeltaNet recurrence and its conv), the GFLOP/s that implies, and the fraction of the machine's f32 matmul peak,
measured in the same run (numpy matmul; an MLX matmul for the Metal backend).

``--compare mlx-lm`` runs MLX-LM's own generation path (``mlx_lm.generate.generate_step``) on the same
checkpoint in a separate process with the same protocol and prints the ratio per length.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from lily.loading import BACKENDS

DEFAULT_LENGTHS = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
RESULT_TAG = "LILY_BENCH_RESULT "
DRIFT_LIMIT = 0.03


class BenchError(Exception):
    pass


# --------------------------------------------------------------------------------------------------
# checkpoint inspection


def read_config(model: Path) -> dict:
    p = Path(model) / "config.json"
    if not p.is_file():
        raise BenchError(f"{model}: no config.json (not a checkpoint folder)")
    try:
        cfg = json.loads(p.read_text())
    except ValueError as e:
        raise BenchError(f"{p}: not valid JSON ({e})") from None
    return cfg


def text_config(cfg: dict) -> dict:
    return cfg.get("text_config", cfg)


def read_headers(model: Path) -> dict:
    """{tensor name: (dtype, shape, nbytes)} from the safetensors headers of the checkpoint."""
    model = Path(model)
    files = sorted(model.glob("*.safetensors"))
    idx = model / "model.safetensors.index.json"
    if idx.is_file():
        try:
            wm = json.loads(idx.read_text()).get("weight_map", {})
            files = sorted({model / f for f in wm.values()})
        except ValueError:
            pass
    if not files:
        raise BenchError(f"{model}: no *.safetensors files")
    out = {}
    for f in files:
        try:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                h = json.loads(fh.read(n))
        except (OSError, ValueError) as e:
            raise BenchError(f"{f}: not a readable safetensors file ({e})") from None
        for k, v in h.items():
            if k == "__metadata__":
                continue
            b, e = v["data_offsets"]
            out[k] = (v["dtype"], tuple(v["shape"]), e - b)
    return out


def layer_kinds(t: dict) -> list[str]:
    """Layer kinds ("full_attention" / "linear_attention") of the text config: ``layer_types`` if present, else
    every ``full_attention_interval``-th layer is full attention."""
    L = int(t["num_hidden_layers"])
    interval = int(t.get("full_attention_interval", 4))
    kinds = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(L)]
    return list((t.get("layer_types") or kinds)[:L])


def decode_bytes_model(model: Path, cfg: dict | None = None) -> dict:
    """Bytes touched per decoded token: {"weights", "state", "kv_per_context_token", ...}."""
    cfg = cfg or read_config(model)
    t = text_config(cfg)
    heads = read_headers(model)
    E, k = int(t["num_experts"]), int(t["num_experts_per_tok"])
    V = int(t["vocab_size"])
    L = int(t["num_hidden_layers"])
    lt = layer_kinds(t)
    n_full = sum(1 for x in lt if x == "full_attention")
    n_lin = L - n_full
    w_all = w_dense = w_expert = w_embed = 0
    for name, (_, _, nb) in heads.items():
        if name.startswith(("model.visual.", "vision_tower.", "mtp.")) or ".mtp." in name:
            continue
        w_all += nb
        if ".switch_mlp." in name or ".mlp.experts." in name:
            w_expert += nb
        elif "embed_tokens" in name:
            w_embed += nb
        else:
            w_dense += nb
    tie = bool(t.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)))
    active = w_dense + w_expert * k / E + w_embed / V + (w_embed if tie else 0)
    Hv, Dk, Dv = int(t["linear_num_value_heads"]), int(t["linear_key_head_dim"]), int(t["linear_value_head_dim"])
    C = 2 * int(t["linear_num_key_heads"]) * Dk + Hv * Dv
    K = int(t.get("linear_conv_kernel_dim", 4))
    state = n_lin * (2 * Hv * Dk * Dv * 4 + 2 * (K - 1) * C * 2)  # fp32 recurrent + bf16 conv, read + write
    hd = int(t.get("head_dim") or int(t["hidden_size"]) // int(t["num_attention_heads"]))
    kv = n_full * 2 * int(t["num_key_value_heads"]) * hd * 2  # bf16 K and V per context token
    return {"weights": int(active), "weights_total": int(w_all), "state": int(state),
            "kv_per_context_token": int(kv), "full_attention_layers": n_full, "linear_layers": n_lin}


def bytes_per_decoded_token(bm: dict, prompt: int, steps: int) -> float:
    ctx = prompt + (steps + 1) / 2.0  # mean context length seen by the decode window
    return bm["weights"] + bm["state"] + bm["kv_per_context_token"] * ctx


def prefill_flops_per_token(cfg: dict, prompt: int) -> dict:
    """FLOPs one prompt token costs in a prefill of ``prompt`` tokens from an empty cache (architecture.md
    §5-§8, §13), from the config's dims. A multiply-add is 2 FLOPs. Not counted: norms, RoPE, activations,
    softmaxes, the router's top-k (O(hidden) per token, well under 1 %).

    - ``matmul``: every weight matrix a token passes through: per DeltaNet layer in_proj_qkv/z/b/a and out_proj;
      per full-attention layer q_proj (query + output gate), k_proj, v_proj, o_proj; per layer the router, top-k
      routed experts (gate, up, down), the shared expert and its gate; the lm_head once per prompt (prefill
      returns the last token's logits), i.e. hidden * vocab * 2 / prompt per token.
    - ``attention``: causal scores q.k and weighted values p.v of the full-attention layers at the mean
      context (prompt + 1) / 2.
    - ``delta_net``: the recurrence of the DeltaNet layers, counted in its recurrent (step) form: per value head
      decay (Dk*Dv), read S^T k (2*Dk*Dv), rank-1 write (2*Dk*Dv), output read S^T q (2*Dk*Dv) = 7*Dk*Dv.
      A chunked prefill does other arithmetic (matmuls over chunks of tokens) for the same result.
    - ``conv``: the DeltaNet depthwise causal conv1d (kernel taps per channel of in_proj_qkv's output).
    The ``matmul_*`` entries are the per-layer terms (``matmul_lm_head`` per token at this prompt length)."""
    t = text_config(cfg)
    prompt = max(1, int(prompt))
    D, V = int(t["hidden_size"]), int(t["vocab_size"])
    lt = layer_kinds(t)
    n_full = sum(1 for x in lt if x == "full_attention")
    n_lin = len(lt) - n_full
    # Gated DeltaNet (§6): Hk q/k heads of Dk, Hv value heads of Dv
    Hk, Hv = int(t["linear_num_key_heads"]), int(t["linear_num_value_heads"])
    Dk, Dv = int(t["linear_key_head_dim"]), int(t["linear_value_head_dim"])
    C = 2 * Hk * Dk + Hv * Dv  # in_proj_qkv out = conv channels
    lin = 2 * (D * C + D * Hv * Dv + 2 * D * Hv + Hv * Dv * D)  # qkv, z, b + a, out_proj
    conv = 2 * int(t.get("linear_conv_kernel_dim", 4)) * C
    rec = 7 * Hv * Dk * Dv
    # gated full attention (§5): q_proj carries the query and its output gate
    H, Hkv = int(t["num_attention_heads"]), int(t["num_key_value_heads"])
    hd = int(t.get("head_dim") or D // H)
    q_out = H * hd * (2 if t.get("attn_output_gate", True) else 1)
    full = 2 * (D * q_out + 2 * D * Hkv * hd + H * hd * D)  # q, k + v, o_proj
    ctx = (prompt + 1) / 2.0  # token i of the prompt attends to i + 1 positions
    attn = 4 * H * hd * ctx  # q.k and p.v, 2 FLOPs per multiply-add each
    # MoE (§7), every layer
    E, k, Im = int(t["num_experts"]), int(t["num_experts_per_tok"]), int(t["moe_intermediate_size"])
    Is = int(t.get("shared_expert_intermediate_size") or 0)
    moe = 2 * (D * E + k * 3 * D * Im)  # router; gate + up + down of top-k experts
    if Is:
        moe += 2 * (3 * D * Is + D)  # shared expert gate + up + down; shared_expert_gate [hidden -> 1]
    head = 2 * D * V / prompt
    matmul = n_lin * lin + n_full * full + len(lt) * moe + head
    out = {
        "matmul": matmul,
        "attention": n_full * attn,
        "delta_net": n_lin * rec,
        "conv": n_lin * conv,
        "matmul_linear_layer": lin,
        "matmul_full_attention_layer": full,
        "matmul_moe_layer": moe,
        "matmul_lm_head": head,
        "linear_layers": n_lin,
        "full_attention_layers": n_full,
    }
    out["total"] = out["matmul"] + out["attention"] + out["delta_net"] + out["conv"]
    return out


# --------------------------------------------------------------------------------------------------
# machine


def total_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(total_memory_bytes() * 0.75)


def cpu_name() -> str:
    try:
        if sys.platform == "darwin":
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=5).stdout.strip()
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine()


def _version(pkg: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(pkg)
    except Exception:  # noqa: BLE001
        return None


def machine_info() -> dict:
    return {"platform": platform.platform(), "machine": platform.machine(), "cpu": cpu_name(),
            "cpu_count": usable_cpus(), "memory_bytes": total_memory_bytes(), "python": platform.python_version(),
            "numpy": np.__version__, "lily": _version("lily"), "mlx": _version("mlx"), "mlx_lm": _version("mlx-lm")}


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. under taskset), not the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS has no sched_getaffinity
        return max(1, os.cpu_count() or 1)


def measure_bandwidth(size_bytes: int = 1 << 30, repeats: int = 5, method: str = "numpy") -> dict:
    """Memory bandwidth in GB/s, best of ``repeats``: as a copy ((bytes read + bytes written) / time,
    the usual figure) and as a read (bytes read / time: what a decode step does, streaming weights)."""
    if method == "mlx":
        import mlx.core as mx

        n = size_bytes // 4
        a = mx.ones((n,), dtype=mx.float32)
        mx.eval(a)
        best, best_read = math.inf, math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            b = a + 1.0
            mx.eval(b)
            best = min(best, time.perf_counter() - t0)
            del b
            t0 = time.perf_counter()
            mx.eval(mx.max(a))
            best_read = min(best_read, time.perf_counter() - t0)
        return {"memory_bandwidth_gbps": 2 * n * 4 / best / 1e9, "read_bandwidth_gbps": n * 4 / best_read / 1e9,
                "bandwidth_method": f"mlx GPU copy / max {size_bytes >> 20} MiB"}
    from concurrent.futures import ThreadPoolExecutor

    n = size_bytes // 8
    src = np.ones(n, dtype=np.float64)
    dst = np.empty_like(src)
    raw = src.view(np.uint8)
    threads = usable_cpus()
    parts = [(i * n // threads, (i + 1) * n // threads) for i in range(threads)]

    def copy(p):
        np.copyto(dst[p[0]:p[1]], src[p[0]:p[1]])

    def read(p):  # a SIMD max over bytes: nothing but the stream of loads (numpy releases the GIL)
        return raw[8 * p[0]:8 * p[1]].max()

    def best_of(f) -> float:
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(f, parts))
            best = min(best, time.perf_counter() - t0)
        return best

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(copy, parts))  # first touch
        t_copy, t_read = best_of(copy), best_of(read)
    return {"memory_bandwidth_gbps": 2 * n * 8 / t_copy / 1e9, "read_bandwidth_gbps": n * 8 / t_read / 1e9,
            "bandwidth_method": f"numpy copy / byte max {size_bytes >> 20} MiB, {threads} threads"}


def measure_peak_flops(method: str = "numpy", repeats: int = 5, n: int = 2048) -> dict:
    """The machine's f32 matmul rate in GFLOP/s (2 n^3 FLOPs per n x n product), best of ``repeats`` after a
    warm-up: numpy's BLAS with its own threads, or (method "mlx") an MLX matmul on its default device."""
    if method == "mlx":
        import mlx.core as mx

        a = mx.random.normal((n, n), dtype=mx.float32)
        b = mx.random.normal((n, n), dtype=mx.float32)
        mx.eval(a, b)
        mx.eval(a @ b)  # warm-up (kernel build, allocation)
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            mx.eval(a @ b)
            best = min(best, time.perf_counter() - t0)
        where = "gpu" if mx.default_device() == mx.gpu else "cpu"
    else:
        rng = np.random.default_rng(0)
        a = rng.standard_normal((n, n), dtype=np.float32)
        b = rng.standard_normal((n, n), dtype=np.float32)
        c = np.empty((n, n), dtype=np.float32)
        np.matmul(a, b, out=c)  # warm-up (BLAS threads)
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            np.matmul(a, b, out=c)
            best = min(best, time.perf_counter() - t0)
        where = f"{usable_cpus()} cpus"
    return {"peak_gflops": 2 * n**3 / best / 1e9, "peak_method": f"{method} f32 matmul {n}^2, {where}"}


def peak_rss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


# --------------------------------------------------------------------------------------------------
# engines (run inside worker processes)


def load_mlx_model(model: Path, dtype: str = "native"):
    """mlx-lm model for the folder; dtype "float32" upcasts every float tensor (before sanitize) to fp32."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import _get_classes, load_model

    get_classes = _get_classes
    if dtype == "float32":
        def get_classes(config):
            model_class, args_class = _get_classes(config=config)

            class Fp32Model(model_class):
                def sanitize(self, weights):
                    weights = {k: (v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v)
                               for k, v in weights.items()}
                    return super().sanitize(weights)

            return Fp32Model, args_class

    m, config = load_model(Path(model), lazy=False, strict=True, get_model_classes=get_classes)
    if dtype == "float32":
        m.update(tree_map(lambda p: p.astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p,
                          m.parameters()))
        mx.eval(m.parameters())
    # mlx-lm indexes the cache of layer full_attention_interval - 1 even when the model is shorter
    # (e.g. `lily synth --layers 2`); without full-attention layers there is no mask to build.
    tm = m.language_model.model if hasattr(m, "language_model") else getattr(m, "model", None)
    if tm is not None and getattr(tm, "fa_idx", None) is not None and tm.fa_idx >= len(tm.layers):
        tm.fa_idx = None
    return m, config


class LilyRunner:
    name = "lily"

    def __init__(self, model, backend="auto", max_seq=None):
        import lily

        kw = {"backend": backend}
        if max_seq:
            kw["max_seq"] = int(max_seq)
        self.eng = lily.Engine(str(model), **kw)
        self.backend = str(getattr(self.eng, "backend", backend))
        self.max_seq = getattr(self.eng, "max_seq", max_seq)

    def run(self, prompt: np.ndarray, steps: int) -> tuple[float, float]:
        eng = self.eng
        eng.reset()
        t0 = time.perf_counter()
        logits = eng.prefill(prompt.tolist())
        tok = int(np.argmax(logits))
        t1 = time.perf_counter()
        for _ in range(steps):
            tok = int(np.argmax(eng.decode(tok)))
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    def peak_memory(self) -> int:
        return peak_rss_bytes()


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
        runner = LilyRunner(spec["model"], spec.get("backend", "auto"), spec.get("max_seq"))
    elif spec["engine"] == "mlx-lm":
        runner = MlxLmRunner(spec["model"], spec.get("mlx_dtype", "native"))
    else:
        raise BenchError(f"unknown engine {spec['engine']!r}")
    load_s = time.perf_counter() - t0
    vocab = int(spec["vocab"])
    steps = int(spec["decode_steps"])
    for length in spec["lengths"]:
        warm = make_prompt(length, vocab, spec["seed"] + 1000 + length)
        runner.run(warm, int(spec.get("warmup_steps", 2)))
        prompt = make_prompt(length, vocab, spec["seed"] + length)
        pre_s, dec_s = runner.run(prompt, steps)
        emit(RESULT_TAG + json.dumps({
            "engine": runner.name, "backend": runner.backend, "prompt_tokens": length, "decode_steps": steps,
            "prefill_s": pre_s, "decode_s": dec_s, "prefill_tok_s": length / pre_s,
            "decode_tok_s": steps / dec_s if dec_s > 0 else float("nan"),
            "peak_memory_bytes": runner.peak_memory(), "load_s": load_s, "max_seq": runner.max_seq}), flush=True)


# --------------------------------------------------------------------------------------------------
# orchestration


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
            raise BenchError(f"bad prompt length {part!r} (e.g. 256,1K,4096)") from None
        if v < 1:
            raise BenchError(f"prompt length must be >= 1, got {part!r}")
        out.append(v)
    if not out:
        raise BenchError("no prompt lengths given")
    return out


def _worker_cmd(spec: dict) -> list[str]:
    return [sys.executable, "-m", "lily.bench", "--worker", json.dumps(spec)]


def run_subprocess(spec: dict, timeout: float | None = None) -> list[dict]:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        proc = subprocess.run(_worker_cmd(spec), capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{spec['engine']} worker timed out after {timeout:.0f} s") from None
    recs = [json.loads(line[len(RESULT_TAG):]) for line in proc.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if proc.returncode != 0 or len(recs) != len(spec["lengths"]):
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise BenchError(f"{spec['engine']} worker failed (exit {proc.returncode}): {tail}")
    return recs


def fits(length: int, steps: int, max_seq: int | None, bm: dict, avail: int, weights_total: int) -> str | None:
    if max_seq and length + steps + 1 > max_seq:
        return f"{length} + {steps + 1} tokens exceed max_seq {max_seq}"
    need = weights_total + bm["kv_per_context_token"] * (length + steps + 1) + 64 * 2048 * length + (512 << 20)
    if avail and need > avail:
        return f"needs ~{need / 1e9:.1f} GB, {avail / 1e9:.1f} GB available"
    return None


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
                 "peak_memory_bytes": max([r["peak_memory_bytes"] for r in ok], default=None),
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
                rec[eng.replace("-", "_")] = d
                rec["prefill_ratio"] = rec["prefill_tok_s"] / d["prefill_tok_s"] if d["prefill_tok_s"] else None
                rec["decode_ratio"] = rec["decode_tok_s"] / d["decode_tok_s"] if d["decode_tok_s"] else None
        records.append(rec)
    return records


def _fmt(x, spec=",.1f"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def format_table(records: list[dict], meta: dict) -> str:
    cmp_key = "mlx_lm" if any("mlx_lm" in r for r in records) else None
    head = ["prompt", "prefill tok/s", "of peak", "decode tok/s", "drift", "MB/token", "eff GB/s", "of read BW",
            "of copy BW", "peak mem"]
    if cmp_key:
        head += ["mlx-lm prefill", "mlx-lm decode", "prefill x", "decode x"]
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
            + (" (! = 3 % or more)" if any(not r.get("drift_ok", True) for r in records) else ""))
    return "\n".join(lines) + "\n" + foot


def write_plot(path: Path, records: list[dict], meta: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--plot needs matplotlib (pip install matplotlib)") from None
    xs = [r["prompt_tokens"] for r in records]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "prefill_tok_s", "prefill"), (axes[1], "decode_tok_s", "decode")):
        ax.plot(xs, [r.get(key) for r in records], "o-", label=f"lily ({meta.get('backend')})")
        if any("mlx_lm" in r for r in records):
            ax.plot(xs, [r.get("mlx_lm", {}).get(key) for r in records], "s--", label="mlx-lm")
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


def bench(args) -> int:
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
        raise BenchError("no prompt length fits (see above); pass --lengths or --max-seq")
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
                except BenchError as e:
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


def build_parser() -> argparse.ArgumentParser:
    from lily.synth import ArgParser

    ap = ArgParser(prog="lily bench", description="Prefill / decode speed of a checkpoint, batch 1.")
    ap.add_argument("model", help="checkpoint folder (MLX 4-bit or HF bf16)")
    ap.add_argument("--lengths", default=None,
                    help="comma-separated prompt lengths, K suffix allowed (default 256,512,...,128K, cut to "
                         "what fits max_seq and memory)")
    ap.add_argument("--backend", default="auto", choices=BACKENDS)
    ap.add_argument("--max-seq", type=int, default=None, help="engine max_seq (default: the config's)")
    ap.add_argument("--decode-steps", type=int, default=64, help="decode steps timed after the first token (64)")
    ap.add_argument("--warmup-steps", type=int, default=2, help="decode steps of the warm-up run (2)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, alternating order (2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, metavar="PATH", help="write the records as JSON")
    ap.add_argument("--plot", nargs="?", const="bench.png", default=None, metavar="PNG",
                    help="write a PNG of tok/s against context length (default bench.png; needs matplotlib)")
    ap.add_argument("--compare", choices=("mlx-lm",), default=None,
                    help="also run MLX-LM's own generation path on the same checkpoint and print the ratio")
    ap.add_argument("--mlx-dtype", choices=("native", "float32"), default="native",
                    help="MLX-LM run as saved (native) or with every float tensor upcast to fp32")
    ap.add_argument("--engine", choices=("lily", "mlx-lm"), default="lily", help=argparse.SUPPRESS)
    ap.add_argument("--same-process", action="store_true",
                    help="one process per round instead of a fresh process per measurement")
    ap.add_argument("--bandwidth-mib", type=int, default=1024, help="buffer size of the bandwidth test (1024)")
    ap.add_argument("--bandwidth-method", choices=("auto", "numpy", "mlx"), default="auto")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per worker process")
    ap.add_argument("-q", "--quiet", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        run_worker(json.loads(argv[1]))
        return 0
    args = build_parser().parse_args(argv)
    try:
        if args.decode_steps < 1 or args.rounds < 1 or args.warmup_steps < 0:
            raise BenchError("--decode-steps and --rounds must be >= 1, --warmup-steps >= 0")
        if args.compare and args.compare == args.engine:
            raise BenchError("--compare names the engine being measured")
        if not Path(args.model).is_dir():
            raise BenchError(f"{args.model}: not a folder")
        return bench(args)
    except BenchError as e:
        print(f"lily bench: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nlily bench: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
