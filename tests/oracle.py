"""Teacher-forced reference logits from MLX-LM (CPU), run so that it is an fp32 oracle.

``mlx_logits(folder, tokens) -> np.ndarray [T, vocab] float32`` works for both checkpoint kinds:

* Hugging Face layout, bf16 (conv1d [C, 1, K], zero-centred norms): every tensor is upcast to fp32
  *before* mlx-lm's ``sanitize`` runs, so the ``1 + w`` of the zero-centred norms happens in fp32
  (oracle.md trap 4) and the MoE runs on the CPU at all (trap 1).
* MLX affine-quantized (``quantization`` in config.json): the packed uint32 codes stay as they are and
  scales, biases, norms, conv, A_log, dt_bias are upcast to fp32, so mlx computes the quantized matmuls
  with fp32 activations (trap 2; its bf16 CPU quantized matmul is off by several %).

``mlx_logits_dequantized(folder, tokens)`` is the independent cross-check for quantized folders: it unpacks
the codes itself with numpy (``w = scale * q + bias`` in float64, rounded to fp32), loads them into an
*unquantized* fp32 mlx model and runs that. ``test_oracle.py`` asserts both paths agree to ~1e-5.

``mlx_decode_logits(folder, tokens)`` runs the same model step by step with mlx-lm's cache (one token at a
time), a further self-check of the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from fixtures import read_checkpoint_tensors
from lily.mlx_reference import load_mlx_model, model_classes, upcast_to_float32


def _mx():
    import mlx.core as mx

    return mx


def load_fp32_model(folder):
    """mlx-lm model for ``folder`` with every floating parameter in fp32 (quantized codes untouched)."""
    return load_mlx_model(folder, "float32")


def _run(model, tokens) -> np.ndarray:
    mx = _mx()
    toks = np.asarray(tokens, dtype=np.int64)
    if toks.ndim != 1 or toks.size == 0:
        raise ValueError("tokens must be a non-empty 1-D sequence")
    logits = model(mx.array(toks.astype(np.int32))[None])
    logits = logits.astype(mx.float32)
    mx.eval(logits)
    return np.array(logits[0], dtype=np.float32)


def mlx_logits(folder, tokens) -> np.ndarray:
    """Teacher-forced logits [T, vocab] (fp32) of MLX-LM for ``tokens`` (full-sequence forward)."""
    model, _ = load_fp32_model(folder)
    return _run(model, tokens)


def mlx_decode_logits(folder, tokens) -> np.ndarray:
    """Like ``mlx_logits`` but one token per forward call through mlx-lm's prompt cache."""
    mx = _mx()
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load_fp32_model(folder)
    cache = make_prompt_cache(model)
    rows = []
    for t in np.asarray(tokens, dtype=np.int32):
        out = model(mx.array([[int(t)]]), cache=cache).astype(mx.float32)
        mx.eval(out)
        rows.append(np.array(out[0, -1]))
    return np.stack(rows).astype(np.float32)


# --------------------------------------------------------------------------------------------------
# independent dequantization


def unpack_codes(packed: np.ndarray, bits: int, in_dim: int) -> np.ndarray:
    """MLX affine packing: little-endian bit stream per row in uint32 words (element 0 = lowest bits)."""
    if bits not in (2, 4, 8):
        raise ValueError(f"unsupported bits {bits}")
    per_word = 32 // bits
    w = np.asarray(packed, dtype=np.uint32)
    if w.shape[-1] * per_word != in_dim:
        raise ValueError(f"packed width {w.shape[-1]} x {per_word} != in_dim {in_dim}")
    shifts = (np.arange(per_word, dtype=np.uint32) * bits).astype(np.uint32)
    codes = (w[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return codes.reshape(*w.shape[:-1], in_dim)


def dequantize(packed, scales, biases, bits: int, group_size: int) -> np.ndarray:
    """w = scale * q + bias, per group of ``group_size`` along the last axis; float64 math, fp32 result."""
    scales = np.asarray(scales, dtype=np.float64)
    biases = np.asarray(biases, dtype=np.float64)
    in_dim = scales.shape[-1] * group_size
    q = unpack_codes(packed, bits, in_dim).astype(np.float64)
    q = q.reshape(*q.shape[:-1], scales.shape[-1], group_size)
    w = q * scales[..., None] + biases[..., None]
    return w.reshape(*w.shape[:-2], in_dim).astype(np.float32)


def _as_f32(dtype: str, arr: np.ndarray) -> np.ndarray:
    from fixtures import bf16_bits_to_f32

    if dtype == "BF16":
        return bf16_bits_to_f32(arr)
    return arr.astype(np.float32)


def dequantized_weights(folder) -> dict:
    """All tensors of an MLX quantized folder as fp32 numpy arrays, quantized modules dequantized by hand.

    Returns ``{name: np.ndarray}`` where each quantized module ``X`` appears as ``X.weight`` only."""
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    quant = cfg.get("quantization")
    if not quant:
        raise ValueError(f"{folder} has no quantization block in config.json")
    tensors = read_checkpoint_tensors(folder)
    out = {}
    modules = [k[: -len(".scales")] for k in tensors if k.endswith(".scales")]
    for mod in modules:
        spec = quant.get(mod, quant)
        if not isinstance(spec, dict) or spec.get("mode", "affine") != "affine":
            raise ValueError(f"{mod}: unsupported quantization spec {spec}")
        bits, gs = int(spec["bits"]), int(spec["group_size"])
        wd, w = tensors[mod + ".weight"]
        sd, s = tensors[mod + ".scales"]
        bd, b = tensors[mod + ".biases"]
        if wd != "U32":
            raise ValueError(f"{mod}.weight has dtype {wd}, expected U32")
        in_dim = s.shape[-1] * gs
        if w.shape[-1] * 32 != in_dim * bits:
            raise ValueError(f"{mod}: weight {w.shape} / scales {s.shape} do not match bits={bits} group={gs}")
        out[mod + ".weight"] = dequantize(w, _as_f32(sd, s), _as_f32(bd, b), bits, gs)
    done = {m + sfx for m in modules for sfx in (".weight", ".scales", ".biases")}
    for name, (dt, arr) in tensors.items():
        if name not in done:
            out[name] = _as_f32(dt, arr)
    return out


def mlx_logits_dequantized(folder, tokens) -> np.ndarray:
    """Reference for a quantized folder: hand-dequantized fp32 weights in an unquantized mlx-lm model."""
    mx = _mx()
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("quantization", None)
    cfg.pop("quantization_config", None)
    model_class, args_class = model_classes(cfg, float32=True)
    model = model_class(args_class.from_dict(cfg))
    weights = {k: mx.array(v) for k, v in dequantized_weights(folder).items()}
    weights = model.sanitize(weights)
    model.load_weights(list(weights.items()), strict=True)
    upcast_to_float32(model)
    return _run(model, tokens)


# --------------------------------------------------------------------------------------------------
# an independent float64 numpy implementation (written from spec/architecture.md, shares no code with mlx-lm)


def _numpy_weights(folder) -> tuple[dict, dict, bool]:
    """(text_config, {HF-style name relative to the language model: float64 array}, norms_already_shifted)."""
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    tc = cfg.get("text_config", cfg)
    if cfg.get("quantization"):
        raw = dequantized_weights(folder)
        w = {}
        for name, arr in raw.items():
            if name.startswith("language_model.model."):
                w[name[len("language_model.model."):]] = arr.astype(np.float64)
            elif name == "language_model.lm_head.weight":
                w["lm_head.weight"] = arr.astype(np.float64)
        for i in range(tc["num_hidden_layers"]):
            p = f"layers.{i}.mlp."
            g, u = w.pop(p + "switch_mlp.gate_proj.weight"), w.pop(p + "switch_mlp.up_proj.weight")
            w[p + "experts.gate_up_proj"] = np.concatenate([g, u], axis=1)
            w[p + "experts.down_proj"] = w.pop(p + "switch_mlp.down_proj.weight")
            c = f"layers.{i}.linear_attn.conv1d.weight"
            if c in w:
                w[c] = w[c][:, :, 0]  # [C, K, 1] -> [C, K]
        return tc, w, True
    raw = read_checkpoint_tensors(folder)
    w = {}
    for name, (dt, arr) in raw.items():
        if name.startswith("model.language_model."):
            w[name[len("model.language_model."):]] = _as_f32(dt, arr).astype(np.float64)
        elif name == "lm_head.weight":
            w[name] = _as_f32(dt, arr).astype(np.float64)
    for k in list(w):
        if k.endswith("conv1d.weight"):
            w[k] = w[k][:, 0, :]  # [C, 1, K] -> [C, K]
    return tc, w, False


def numpy_reference_logits(folder, tokens) -> np.ndarray:
    """Teacher-forced logits [T, vocab] from a float64 numpy forward pass (step recurrence, no chunking)."""
    tc, W, shifted = _numpy_weights(folder)
    toks = np.asarray(tokens, dtype=np.int64)
    T = len(toks)
    eps = tc["rms_norm_eps"]
    H, Hkv, hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    Hk, Hv, Dk, Dv = (tc["linear_num_key_heads"], tc["linear_num_value_heads"], tc["linear_key_head_dim"],
                      tc["linear_value_head_dim"])
    K = tc["linear_conv_kernel_dim"]
    topk = tc["num_experts_per_tok"]
    rope = tc.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", tc.get("rope_theta", 10000.0)))
    rd = int(round(hd * float(rope.get("partial_rotary_factor", tc.get("partial_rotary_factor", 1.0)))))

    def rms(x):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)

    def norm1p(x, name):
        wt = W[name]
        return rms(x) * (wt if shifted else 1.0 + wt)

    def silu(x):
        return x / (1.0 + np.exp(-x))

    def sigmoid(x):
        return 1.0 / (1.0 + np.exp(-x))

    x = W["embed_tokens.weight"][toks]
    pos = np.arange(T, dtype=np.float64)
    inv_freq = theta ** (-np.arange(0, rd, 2, dtype=np.float64) / rd)
    ang = pos[:, None] * inv_freq[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def apply_rope(t):  # [T, heads, hd], rotate-half on the first rd dims
        half = rd // 2
        a, b = t[..., :half], t[..., half:rd]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin, t[..., rd:]], axis=-1)

    layer_types = tc.get("layer_types") or [
        "full_attention" if (i + 1) % tc["full_attention_interval"] == 0 else "linear_attention"
        for i in range(tc["num_hidden_layers"])]
    for i, kind in enumerate(layer_types):
        p = f"layers.{i}."
        h = norm1p(x, p + "input_layernorm.weight")
        if kind == "linear_attention":
            a_ = p + "linear_attn."
            mixed = h @ W[a_ + "in_proj_qkv.weight"].T
            z = (h @ W[a_ + "in_proj_z.weight"].T).reshape(T, Hv, Dv)
            b = h @ W[a_ + "in_proj_b.weight"].T
            a = h @ W[a_ + "in_proj_a.weight"].T
            cw = W[a_ + "conv1d.weight"]  # [C, K]; tap K-1 multiplies the current token
            xp = np.concatenate([np.zeros((K - 1, mixed.shape[1])), mixed])
            y = silu(sum(cw[:, j][None, :] * xp[j : j + T] for j in range(K)))
            kd = Hk * Dk
            q = y[:, :kd].reshape(T, Hk, Dk)
            k = y[:, kd : 2 * kd].reshape(T, Hk, Dk)
            v = y[:, 2 * kd :].reshape(T, Hv, Dv)
            q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + 1e-6) * Dk**-0.5
            k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6)
            rep = Hv // Hk
            q, k = np.repeat(q, rep, axis=1), np.repeat(k, rep, axis=1)  # value head j -> key head j // rep
            beta = sigmoid(b)
            sp = np.logaddexp(0.0, a + W[a_ + "dt_bias"])
            alpha = np.exp(-np.exp(W[a_ + "A_log"]) * sp)
            S = np.zeros((Hv, Dk, Dv))
            o = np.zeros((T, Hv, Dv))
            for t in range(T):
                S = alpha[t][:, None, None] * S
                pred = np.einsum("hdv,hd->hv", S, k[t])
                delta = beta[t][:, None] * (v[t] - pred)
                S = S + k[t][:, :, None] * delta[:, None, :]
                o[t] = np.einsum("hdv,hd->hv", S, q[t])
            o = rms(o) * W[a_ + "norm.weight"] * silu(z)
            out = o.reshape(T, -1) @ W[a_ + "out_proj.weight"].T
        else:
            a_ = p + "self_attn."
            qg = (h @ W[a_ + "q_proj.weight"].T).reshape(T, H, 2 * hd)
            q, gate = qg[..., :hd], qg[..., hd:].reshape(T, H * hd)
            k = (h @ W[a_ + "k_proj.weight"].T).reshape(T, Hkv, hd)
            v = (h @ W[a_ + "v_proj.weight"].T).reshape(T, Hkv, hd)
            q = apply_rope(norm1p(q, a_ + "q_norm.weight"))
            k = apply_rope(norm1p(k, a_ + "k_norm.weight"))
            mask = np.triu(np.full((T, T), -np.inf), 1)
            att = np.zeros((T, H, hd))
            for hh in range(H):
                kv = hh // (H // Hkv)
                s = q[:, hh] @ k[:, kv].T * hd**-0.5 + mask
                s = np.exp(s - s.max(-1, keepdims=True))
                att[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, kv]
            out = (att.reshape(T, -1) * sigmoid(gate)) @ W[a_ + "o_proj.weight"].T
        x = x + out
        h = norm1p(x, p + "post_attention_layernorm.weight")
        m = p + "mlp."
        logits = h @ W[m + "gate.weight"].T
        pr = np.exp(logits - logits.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        top = np.argsort(-pr, axis=-1, kind="stable")[:, :topk]
        wsel = np.take_along_axis(pr, top, -1)
        wsel /= wsel.sum(-1, keepdims=True)
        gu, dn = W[m + "experts.gate_up_proj"], W[m + "experts.down_proj"]
        Im = gu.shape[1] // 2
        routed = np.zeros_like(x)
        for e in range(gu.shape[0]):
            rows, slot = np.nonzero(top == e)
            if rows.size == 0:
                continue
            u = h[rows] @ gu[e].T
            routed[rows] += wsel[rows, slot][:, None] * ((silu(u[:, :Im]) * u[:, Im:]) @ dn[e].T)
        se = m + "shared_expert."
        shared = (silu(h @ W[se + "gate_proj.weight"].T) * (h @ W[se + "up_proj.weight"].T)) @ W[
            se + "down_proj.weight"].T
        x = x + routed + sigmoid(h @ W[m + "shared_expert_gate.weight"].T) * shared
    x = norm1p(x, "norm.weight")
    return (x @ W["lm_head.weight"].T).astype(np.float32)
