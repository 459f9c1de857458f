"""A random-weight ``qwen35moe`` GGUF of a checkpoint's shapes, so that ``lily bench --compare llama.cpp`` runs
llama.cpp on the same model at the same bytes per weight. A measurement tool, not a converter: the values are
random draws from the distributions ``lily synth`` uses, not the checkpoint's own weights (a 4-bit MLX group of
64 with scale and bias has no exact Q4_0 form at the same 4.5 bits per weight), and the vocabulary is
llama.cpp's dummy one (``tokenizer.ggml.model = "none"``), which is all ``llama-bench`` needs.

Formats follow what llama.cpp's ``convert_hf_to_gguf.py`` writes for this architecture, at MLX 4-bit's bytes:
every weight matrix Q4_0 (4.5 bits per weight, as 4-bit group 64 with 16-bit scale and bias), the MoE router and
the shared-expert gate Q8_0 (MLX keeps them at 8 bits), norms, ``ssm_a``, ``ssm_dt`` and ``ssm_conv1d`` F32.
Value scales: Q4_0 codes uniform, each block's f16 scale of random sign and magnitude std / 4.61 (the std of
a uniform nibble) so that d (q - 8) has the intended std; std = 1 / sqrt(fan_in), output projections x 0.25,
lm_head 3 / sqrt(D), embedding 1. Activations stay finite through 40 layers, as with ``lily synth``.

Adapted from the project's earlier stand-alone script that wrote the same file from a metadata template
extracted from a ``convert_hf_to_gguf.py`` output; here the keys and tensor list come from ``config.json``.
Needs the ``gguf`` package (PyPI; also ``gguf-py/`` inside llama.cpp's source tree).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from lily.command import CommandError
from lily.synth import Dims

__all__ = ["gguf_plan", "write_gguf"]

ARCH = "qwen35moe"
QK = 32  # elements per Q4_0 / Q8_0 block
BLOCK_BYTES = {"Q4_0": 18, "Q8_0": 34}  # f16 scale + 16 bytes of nibbles / 32 int8 codes
CODE_STD = {"Q4_0": math.sqrt((16 * 16 - 1) / 12.0), "Q8_0": math.sqrt((256 * 256 - 1) / 12.0)}
OUT_PROJ_DAMP = 0.25


def _gguf():
    try:
        import gguf
    except ImportError:
        raise CommandError("writing a GGUF needs the gguf package (pip install gguf)") from None
    return gguf


def gguf_plan(d: Dims) -> list[tuple[str, list[int], str, float | str]]:
    """(name, shape in numpy order [out, in], type, std of a matrix or the init of an F32 tensor) of every tensor,
    with llama.cpp's names for ``qwen35moe``."""
    damp = OUT_PROJ_DAMP
    plan: list[tuple[str, list[int], str, float | str]] = [
        ("token_embd.weight", [d.V, d.D], "Q4_0", 1.0),
        ("output_norm.weight", [d.D], "F32", "norm"),
        ("output.weight", [d.V, d.D], "Q4_0", 3.0 / math.sqrt(d.D)),
    ]

    def q4(name: str, out: int, inp: int, std_mult: float = 1.0, experts: int = 0) -> None:
        shape = ([experts] if experts else []) + [out, inp]
        plan.append((name, shape, "Q4_0", std_mult / math.sqrt(inp)))

    for i in range(d.L):
        p = f"blk.{i}."
        plan.append((p + "attn_norm.weight", [d.D], "F32", "norm"))
        if d.is_linear(i):
            conv = 2 * d.Hk * d.Dk + d.Hv * d.Dv
            q4(p + "attn_qkv.weight", conv, d.D)
            q4(p + "attn_gate.weight", d.Hv * d.Dv, d.D)
            q4(p + "ssm_beta.weight", d.Hv, d.D)
            q4(p + "ssm_alpha.weight", d.Hv, d.D)
            plan += [(p + "ssm_conv1d.weight", [conv, d.K], "F32", "conv"), (p + "ssm_a", [d.Hv], "F32", "a"),
                     (p + "ssm_dt.bias", [d.Hv], "F32", "dt"), (p + "ssm_norm.weight", [d.Dv], "F32", "norm")]
            q4(p + "ssm_out.weight", d.D, d.Hv * d.Dv, damp)
        else:
            q4(p + "attn_q.weight", 2 * d.H * d.hd, d.D)  # queries and their output gate, interleaved per head
            q4(p + "attn_k.weight", d.Hkv * d.hd, d.D)
            q4(p + "attn_v.weight", d.Hkv * d.hd, d.D)
            plan += [(p + "attn_q_norm.weight", [d.hd], "F32", "norm"),
                     (p + "attn_k_norm.weight", [d.hd], "F32", "norm")]
            q4(p + "attn_output.weight", d.D, d.H * d.hd, damp)
        plan.append((p + "post_attention_norm.weight", [d.D], "F32", "norm"))
        plan.append((p + "ffn_gate_inp.weight", [d.E, d.D], "Q8_0", 1.0 / math.sqrt(d.D)))
        q4(p + "ffn_gate_exps.weight", d.I, d.D, experts=d.E)
        q4(p + "ffn_up_exps.weight", d.I, d.D, experts=d.E)
        q4(p + "ffn_down_exps.weight", d.D, d.I, damp, experts=d.E)
        plan.append((p + "ffn_gate_inp_shexp.weight", [1, d.D], "Q8_0", 1.0 / math.sqrt(d.D)))
        q4(p + "ffn_gate_shexp.weight", d.Is, d.D)
        q4(p + "ffn_up_shexp.weight", d.Is, d.D)
        q4(p + "ffn_down_shexp.weight", d.D, d.Is, damp)
    for name, shape, qt, _ in plan:
        if qt != "F32" and shape[-1] % QK:
            raise CommandError(f"{name}: {shape[-1]} inputs per row is not a multiple of the GGUF block of {QK}")
    return plan


def _metadata(cfg: dict, d: Dims) -> dict:
    """GGUF keys (without the ``qwen35moe.`` prefix where it applies) with their values."""
    t = cfg.get("text_config", cfg)
    rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
    partial = float(rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 1.0)))
    sections = list(rope.get("mrope_section", [])) + [0] * 4
    interval = int(t.get("full_attention_interval", 4))
    return {
        "context_length": int(t.get("max_position_embeddings", 4096)),
        "embedding_length": d.D,
        "block_count": d.L,
        "vocab_size": d.V,
        "attention.head_count": d.H,
        "attention.head_count_kv": d.Hkv,
        "attention.key_length": d.hd,
        "attention.value_length": d.hd,
        "attention.layer_norm_rms_epsilon": float(t.get("rms_norm_eps", 1e-6)),
        "rope.freq_base": float(rope.get("rope_theta", t.get("rope_theta", 1e7))),
        "rope.dimension_count": int(d.hd * partial),
        "rope.dimension_sections": [int(s) for s in sections[:4]],
        "expert_count": d.E,
        "expert_used_count": d.topk,
        "expert_feed_forward_length": d.I,
        "expert_shared_feed_forward_length": d.Is,
        "ssm.conv_kernel": d.K,
        "ssm.state_size": d.Dk,
        "ssm.group_count": d.Hk,
        "ssm.time_step_rank": d.Hv,
        "ssm.inner_size": d.Hv * d.Dv,
        "full_attention_interval": interval,
        "attention.recurrent_layers": [d.is_linear(i) for i in range(d.L)],
        "nextn_predict_layers": 0,  # no multi-token-prediction weights (Lily runs none either)
    }


def _f32_values(init: str, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    n = int(np.prod(shape))
    if init == "a":  # ssm_a = -exp(A_log)
        x = -np.exp(rng.uniform(math.log(0.005), math.log(2.0), n))
    elif init == "dt":
        x = rng.uniform(-1.0, 1.0, n)
    elif init == "conv":
        x = rng.normal(0.0, 1.0 / math.sqrt(shape[-1]), n)
    else:  # norms
        x = rng.normal(1.0, 0.02, n)
    return x.astype(np.float32).reshape(shape)


def _blocks(qt: str, shape: list[int], std: float, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_0 / Q8_0 blocks [.., rows, blocks * bytes] (uint8): uniform codes, an f16 scale of random sign
    and magnitude std / std(code) x (1 + U[0, 1/8))."""
    nb = int(np.prod(shape)) // QK
    bs = BLOCK_BYTES[qt]
    buf = np.frombuffer(rng.bytes(nb * bs), dtype=np.uint8).reshape(nb, bs).copy()
    base = np.array([std / CODE_STD[qt]], dtype=np.float16).view(np.uint16)[0] & np.uint16(0x7FF0)
    r = buf[:, 0:2].copy().view(np.uint16).reshape(nb)
    buf[:, 0:2] = ((r & np.uint16(0x800F)) | base).view(np.uint8).reshape(nb, 2)
    return buf.reshape(shape[:-1] + [shape[-1] // QK * bs])


def write_gguf(cfg: dict, out: Path, seed: int = 0) -> int:
    """Write the GGUF of config ``cfg`` (a checkpoint's config.json) to ``out``; its size in bytes. The file
    appears complete or not at all (written beside it, then renamed)."""
    gguf = _gguf()
    d = Dims.of(cfg if "text_config" in cfg else {"text_config": cfg})
    plan = gguf_plan(d)
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(tmp, ARCH)
    w.add_string("general.name", f"lily bench: random {ARCH} {d.L} layers")
    w.add_uint32("general.file_type", int(gguf.LlamaFileType.MOSTLY_Q4_0))
    w.add_uint32("general.quantization_version", 2)
    for key, val in _metadata(cfg, d).items():
        name = f"{ARCH}.{key}"
        if isinstance(val, list):
            w.add_array(name, val)  # element type from the values: bool or int32
        elif isinstance(val, float):
            w.add_float32(name, val)
        else:
            w.add_uint32(name, val)
    w.add_string("tokenizer.ggml.model", "none")  # d.V dummy tokens: llama-bench draws random ids
    total = 0
    for name, shape, qt, _ in plan:
        if qt == "F32":
            nbytes = int(np.prod(shape)) * 4
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes)
        else:
            nbytes = int(np.prod(shape)) // QK * BLOCK_BYTES[qt]
            w.add_tensor_info(name, shape[:-1] + [shape[-1] // QK * BLOCK_BYTES[qt]], np.dtype(np.uint8), nbytes,
                              raw_dtype=getattr(gguf.GGMLQuantizationType, qt))
        total += nbytes
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        rng = np.random.Generator(np.random.SFC64(seed))
        for _, shape, qt, init in plan:
            if qt == "F32":
                w.write_tensor_data(_f32_values(str(init), shape, rng))
            else:
                w.write_tensor_data(_blocks(qt, shape, float(init), rng))
        w.close()
        tmp.replace(out)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    return total
