"""Byte and FLOP accounting of a checkpoint: what one decoded token reads and what one prompt token costs,
from ``config.json`` and the safetensors headers alone (no weights are read)."""

from __future__ import annotations

import json
from pathlib import Path

from lily.command import CommandError

__all__ = ["bytes_per_decoded_token", "decode_bytes_model", "layer_kinds", "prefill_flops_per_token", "read_config",
           "read_headers", "text_config"]


def read_config(model: Path) -> dict:
    p = Path(model) / "config.json"
    if not p.is_file():
        raise CommandError(f"{model}: no config.json (not a checkpoint folder)")
    try:
        cfg = json.loads(p.read_text())
    except ValueError as e:
        raise CommandError(f"{p}: not valid JSON ({e})") from None
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
        raise CommandError(f"{model}: no *.safetensors files")
    out = {}
    for f in files:
        try:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                h = json.loads(fh.read(n))
        except (OSError, ValueError) as e:
            raise CommandError(f"{f}: not a readable safetensors file ({e})") from None
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


def decode_bytes_model(model: Path, cfg: dict | None = None, kv_bytes: int = 2) -> dict:
    """Bytes touched per decoded token: {"weights", "state", "kv_per_context_token", ...}; the KV cache
    holds ``kv_bytes`` per element (2 for bf16 / f16, 4 for f32)."""
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
    kv = n_full * 2 * int(t["num_key_value_heads"]) * hd * kv_bytes  # K and V per context token
    return {"weights": int(active), "weights_total": int(w_all), "state": int(state),
            "kv_per_context_token": int(kv), "full_attention_layers": n_full, "linear_layers": n_lin,
            "experts_total": int(w_expert), "experts_per_token_fraction": k / E}


def bytes_per_batched_step(bm: dict, batch: int, prompt: int, steps: int) -> float:
    """Bytes one decode step of ``batch`` sequences touches: the non-expert weights once, the experts that at
    least one row routes to (expected share 1 - (1 - k/E)^batch under uniform routing), and each sequence's
    state and KV rows."""
    f = bm["experts_per_token_fraction"]
    dense = bm["weights"] - bm["experts_total"] * f
    experts = bm["experts_total"] * (1 - (1 - f) ** batch)
    ctx = prompt + (steps + 1) / 2.0
    return dense + experts + batch * (bm["state"] + bm["kv_per_context_token"] * ctx)


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
