"""``lily synth``: write a random-weight Qwen3.5/3.6-MoE checkpoint with a real configuration.

The default is the exact Qwen3.6-35B-A3B configuration (built-in preset) in the layout ``mlx_lm.convert``
writes for it (MLX affine 4-bit, group 64, 8-bit routers and shared-expert gates, ``language_model.*`` names,
split ``switch_mlp`` experts, conv1d ``[C, K, 1]``, norms stored as ``1 + w``), or, with ``--format hf``, the
released Hugging Face bf16 layout. ``--layers N`` keeps the full width but only the first N layers.

Nothing is quantized: the packed 4-bit codes are uniform random bits and the bf16 scales/biases are drawn
directly (random sign, magnitude chosen so that ``w = scale * q + bias`` has the intended standard
deviation), so the full 19.5 GB checkpoint is written at disk speed. Tensors are streamed: every shard's
header is written first from the known shapes, then the bytes are generated chunk by chunk on worker
threads and appended. Initialisation follows docs' oracle trap 5 (N(0, 1/fan_in) linears, output
projections x0.25, A = exp(A_log) log-uniform in [0.005, 2], lm_head logit std about 3), so activations
stay finite and logits look like a real model's through all 40 layers.

Python API: ``synthesize(out_dir, config=None, layers=None, fmt="mlx", ...) -> dict``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lily import command
from lily.command import ArgParser, CommandError
from lily.progress import progress_bar
from lily.tokenizer import Tokenizer
from lily.tokenizer_files import (
    QWEN_VOCAB,
    copy_tokenizer,
    qwen_generation_config,
    write_byte_tokenizer,
    write_qwen_tokenizer,
)

# The published config.json of Qwen/Qwen3.6-35B-A3B (docs/spec architecture.md §1).
_LAYER_TYPES_40 = (["linear_attention"] * 3 + ["full_attention"]) * 10
PRESETS: dict[str, dict] = {
    "qwen3.6-35b-a3b": {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "image_token_id": 248056,
        "model_type": "qwen3_5_moe",
        "text_config": {
            "attention_bias": False,
            "attention_dropout": 0.0,
            "attn_output_gate": True,
            "bos_token_id": 248044,
            "dtype": "bfloat16",
            "eos_token_id": 248044,
            "full_attention_interval": 4,
            "head_dim": 256,
            "hidden_act": "silu",
            "hidden_size": 2048,
            "initializer_range": 0.02,
            "layer_types": _LAYER_TYPES_40,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_value_head_dim": 128,
            "mamba_ssm_dtype": "float32",
            "max_position_embeddings": 262144,
            "model_type": "qwen3_5_moe_text",
            "moe_intermediate_size": 512,
            "mtp_num_hidden_layers": 1,
            "mtp_use_dedicated_embeddings": False,
            "num_attention_heads": 16,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 40,
            "num_key_value_heads": 2,
            "output_router_logits": False,
            "pad_token_id": None,
            "partial_rotary_factor": 0.25,
            "rms_norm_eps": 1e-06,
            "rope_parameters": {
                "mrope_interleaved": True,
                "mrope_section": [11, 11, 10],
                "partial_rotary_factor": 0.25,
                "rope_theta": 10000000,
                "rope_type": "default",
            },
            "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": 512,
            "tie_word_embeddings": False,
            "use_cache": True,
            "vocab_size": 248320,
        },
        "tie_word_embeddings": False,
        "transformers_version": "4.57.1",
        "video_token_id": 248057,
        "vision_config": {
            "deepstack_visual_indexes": [],
            "depth": 27,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 1152,
            "in_channels": 3,
            "initializer_range": 0.02,
            "intermediate_size": 4304,
            "model_type": "qwen3_5_moe",
            "num_heads": 16,
            "num_position_embeddings": 2304,
            "out_hidden_size": 2048,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        "vision_end_token_id": 248054,
        "vision_start_token_id": 248053,
    }
}
DEFAULT_PRESET = "qwen3.6-35b-a3b"
DTYPE_SIZE = {"U32": 4, "BF16": 2, "F32": 4}
SHARD_BYTES = 5 << 30  # mlx_lm.utils.make_shards: 5 GiB
CHUNK_BYTES = 32 << 20
EMBED_STD = 1.0
OUT_PROJ_DAMP = 0.25
NORM_STD = 0.1


# --------------------------------------------------------------------------------------------------
# configuration


def load_config(config) -> dict:
    """A full (nested) config dict from a preset name, a config.json path / folder, or a dict."""
    if config is None:
        config = DEFAULT_PRESET
    if isinstance(config, dict):
        cfg = copy.deepcopy(config)
    elif isinstance(config, str) and config in PRESETS:
        cfg = copy.deepcopy(PRESETS[config])
    else:
        p = Path(config)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise CommandError(f"config {config!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file")
        try:
            cfg = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise CommandError(f"cannot read {p}: {e}") from None
    if "text_config" not in cfg:  # a bare qwen3_5_moe_text config: wrap it like the released file
        text = cfg
        cfg = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
               "text_config": text, "tie_word_embeddings": text.get("tie_word_embeddings", False)}
    if "quantization" in cfg or "quantization_config" in cfg:
        cfg.pop("quantization", None)
        cfg.pop("quantization_config", None)
    return cfg


def _parse_value(s: str):
    try:
        return json.loads(s)
    except ValueError:
        return s


def apply_overrides(cfg: dict, layers: int | None = None, sets: list[str] | None = None) -> dict:
    text = cfg["text_config"]
    for item in sets or []:
        if "=" not in item:
            raise CommandError(f"--set expects KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        text[k.strip()] = _parse_value(v.strip())
    n_full = int(text.get("num_hidden_layers", 0))
    if layers is not None:
        if layers < 1:
            raise CommandError(f"--layers must be >= 1, got {layers}")
        if n_full and layers > n_full:
            raise CommandError(f"--layers {layers} exceeds the config's num_hidden_layers {n_full}")
        text["num_hidden_layers"] = layers
    n = int(text["num_hidden_layers"])
    interval = int(text.get("full_attention_interval", 4))
    lt = text.get("layer_types")
    if not lt or len(lt) < n or (sets and any(s.startswith("full_attention_interval=") for s in sets)):
        lt = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    text["layer_types"] = list(lt[:n])
    return cfg


@dataclass(frozen=True)
class Dims:
    D: int
    L: int
    V: int
    H: int
    Hkv: int
    hd: int
    Hk: int
    Hv: int
    Dk: int
    Dv: int
    K: int
    E: int
    topk: int
    I: int  # noqa: E741
    Is: int
    layer_types: tuple
    tie: bool

    @staticmethod
    def of(cfg: dict) -> Dims:
        t = cfg["text_config"]

        def size(key: str, default: int | None = None) -> int:
            value = t.get(key)
            if value is None:
                value = default
            if value is None:
                raise CommandError(f"config.json text_config lacks {key!r}")
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CommandError(f"config.json text_config {key} must be a positive integer, got {value!r}")
            return value

        D, H = size("hidden_size"), size("num_attention_heads")
        return Dims(D=D, L=size("num_hidden_layers"), V=size("vocab_size"), H=H, Hkv=size("num_key_value_heads"),
                    hd=size("head_dim", D // H), Hk=size("linear_num_key_heads"),
                    Hv=size("linear_num_value_heads"), Dk=size("linear_key_head_dim"),
                    Dv=size("linear_value_head_dim"), K=size("linear_conv_kernel_dim", 4), E=size("num_experts"),
                    topk=size("num_experts_per_tok"), I=size("moe_intermediate_size"),
                    Is=size("shared_expert_intermediate_size"), layer_types=tuple(t["layer_types"]),
                    tie=bool(t.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))))

    def is_linear(self, i: int) -> bool:
        return self.layer_types[i] == "linear_attention"


# --------------------------------------------------------------------------------------------------
# tensor plan


@dataclass
class Tensor:
    name: str
    shape: tuple
    dtype: str  # "U32" | "BF16" | "F32"
    init: tuple  # generator spec, see _generate
    seed_key: str  # tensors with the same seed_key draw the same random stream (scales/biases pairs)
    role: str = ""  # "expert" for routed-expert tensors, "embed" for the embedding (bench byte counts)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * DTYPE_SIZE[self.dtype]


def _linear_specs(D: Dims):
    """(module, out, in, std, experts, role) of every Linear-like module in HF-equivalent terms (mlx names)."""
    mods = []
    for i in range(D.L):
        p = f"language_model.model.layers.{i}."
        if D.is_linear(i):
            kd, vd = D.Hk * D.Dk, D.Hv * D.Dv
            mods += [(p + "linear_attn.in_proj_qkv", 2 * kd + vd, D.D, 1.0, 0),
                     (p + "linear_attn.in_proj_z", vd, D.D, 1.0, 0),
                     (p + "linear_attn.in_proj_b", D.Hv, D.D, 1.0, 0),
                     (p + "linear_attn.in_proj_a", D.Hv, D.D, 1.0, 0),
                     (p + "linear_attn.out_proj", D.D, vd, OUT_PROJ_DAMP, 0)]
        else:
            mods += [(p + "self_attn.q_proj", D.H * D.hd * 2, D.D, 1.0, 0),
                     (p + "self_attn.k_proj", D.Hkv * D.hd, D.D, 1.0, 0),
                     (p + "self_attn.v_proj", D.Hkv * D.hd, D.D, 1.0, 0),
                     (p + "self_attn.o_proj", D.D, D.H * D.hd, OUT_PROJ_DAMP, 0)]
        mods += [(p + "mlp.gate", D.E, D.D, 1.0, 0),
                 (p + "mlp.switch_mlp.gate_proj", D.I, D.D, 1.0, D.E),
                 (p + "mlp.switch_mlp.up_proj", D.I, D.D, 1.0, D.E),
                 (p + "mlp.switch_mlp.down_proj", D.D, D.I, OUT_PROJ_DAMP, D.E),
                 (p + "mlp.shared_expert.gate_proj", D.Is, D.D, 1.0, 0),
                 (p + "mlp.shared_expert.up_proj", D.Is, D.D, 1.0, 0),
                 (p + "mlp.shared_expert.down_proj", D.D, D.Is, OUT_PROJ_DAMP, 0),
                 (p + "mlp.shared_expert_gate", 1, D.D, 1.0, 0)]
    return mods


def _small_specs(D: Dims, fmt: str):
    """(name, shape, dtype, init) of the unquantized tensors, mlx names, values already in the target convention."""
    out = []
    mlx = fmt == "mlx"
    norm_init = ("normal", NORM_STD, 1.0) if mlx else ("normal", NORM_STD, 0.0)  # mlx stores 1 + w
    for i in range(D.L):
        p = f"language_model.model.layers.{i}."
        out += [(p + "input_layernorm.weight", (D.D,), "BF16", norm_init),
                (p + "post_attention_layernorm.weight", (D.D,), "BF16", norm_init)]
        if D.is_linear(i):
            C = 2 * D.Hk * D.Dk + D.Hv * D.Dv
            out += [(p + "linear_attn.conv1d.weight", (C, D.K, 1) if mlx else (C, 1, D.K), "BF16",
                     ("normal", 1.0 / math.sqrt(D.K), 0.0)),
                    (p + "linear_attn.dt_bias", (D.Hv,), "BF16", ("uniform", -1.0, 1.0)),
                    (p + "linear_attn.A_log", (D.Hv,), "F32", ("uniform", math.log(0.005), math.log(2.0))),
                    (p + "linear_attn.norm.weight", (D.Dv,), "BF16", ("normal", NORM_STD, 1.0))]
        else:
            out += [(p + "self_attn.q_norm.weight", (D.hd,), "BF16", norm_init),
                    (p + "self_attn.k_norm.weight", (D.hd,), "BF16", norm_init)]
    out.append(("language_model.model.norm.weight", (D.D,), "BF16", norm_init))
    return out


def quant_spec_for(module: str, bits: int, group_size: int) -> tuple[int, int]:
    """mlx-lm's quant_predicate for MoE Qwen3.5: routers and shared-expert gates at 8 bits."""
    if module.endswith("mlp.gate") or module.endswith("shared_expert_gate"):
        return 8, 64
    return bits, group_size


def _hf_name(name: str) -> str:
    if name.startswith("language_model.model."):
        return "model.language_model." + name[len("language_model.model."):]
    if name.startswith("language_model.lm_head"):
        return "lm_head" + name[len("language_model.lm_head"):]
    return name


def plan(cfg: dict, fmt: str = "mlx", bits: int = 4, group_size: int = 64) -> tuple[list[Tensor], dict]:
    """The tensors of the checkpoint (in write order) and the quantization block (mlx) or {} (hf)."""
    D = Dims.of(cfg)
    if fmt not in ("mlx", "hf"):
        raise CommandError(f"unknown format {fmt!r} (mlx or hf)")
    if bits not in (2, 3, 4, 5, 6, 8):
        raise CommandError(f"--bits must be one of 2, 3, 4, 5, 6, 8, got {bits}")
    if group_size not in (32, 64, 128):
        raise CommandError(f"--group-size must be 32, 64 or 128, got {group_size}")
    tensors: list[Tensor] = []
    quant: dict = {}

    def add_linear(module, out_dim, in_dim, std, experts=0, role=""):
        lead = (experts,) if experts else ()
        if fmt == "hf":
            tensors.append(Tensor(_hf_name(module) + ".weight", lead + (out_dim, in_dim), "BF16",
                                  ("normal", std, 0.0), module, role))
            return
        b, gs = quant_spec_for(module, bits, group_size)
        if in_dim % gs != 0 or (in_dim * b) % 32 != 0:  # mlx leaves such modules unquantized
            tensors.append(Tensor(module + ".weight", lead + (out_dim, in_dim), "BF16", ("normal", std, 0.0),
                                  module, role))
            return
        if (b, gs) != (bits, group_size):
            quant[module] = {"group_size": gs, "bits": b}
        tensors.append(Tensor(module + ".weight", lead + (out_dim, in_dim * b // 32), "U32", ("codes",), module, role))
        for part in ("scales", "biases"):
            tensors.append(Tensor(f"{module}.{part}", lead + (out_dim, in_dim // gs), "BF16", (part, std, b),
                                  module + ".sb", role))

    add_linear("language_model.model.embed_tokens", D.V, D.D, EMBED_STD, role="embed")
    small = {name: (shape, dt, init) for name, shape, dt, init in _small_specs(D, fmt)}
    for i in range(D.L):
        p = f"language_model.model.layers.{i}."
        for name in [n for n in small if n.startswith(p)]:
            shape, dt, init = small.pop(name)
            tensors.append(Tensor(_hf_name(name) if fmt == "hf" else name, shape, dt, init, name))
        mods = [m for m in _linear_specs(D) if m[0].startswith(p)]
        if fmt == "hf":  # fused experts, no .weight suffix
            mods = [m for m in mods if ".switch_mlp." not in m[0]]
            tensors.append(Tensor(_hf_name(p) + "mlp.experts.gate_up_proj", (D.E, 2 * D.I, D.D), "BF16",
                                  ("normal", 1.0 / math.sqrt(D.D), 0.0), p + "experts.gate_up", "expert"))
            tensors.append(Tensor(_hf_name(p) + "mlp.experts.down_proj", (D.E, D.D, D.I), "BF16",
                                  ("normal", OUT_PROJ_DAMP / math.sqrt(D.I), 0.0), p + "experts.down", "expert"))
        for module, out_dim, in_dim, gain, experts in mods:
            add_linear(module, out_dim, in_dim, gain / math.sqrt(in_dim), experts, "expert" if experts else "")
    for name, (shape, dt, init) in small.items():
        tensors.append(Tensor(_hf_name(name) if fmt == "hf" else name, shape, dt, init, name))
    if not D.tie:
        add_linear("language_model.lm_head", D.V, D.D, 3.0 / math.sqrt(D.D))
    qblock = {}
    if fmt == "mlx":
        qblock = {"group_size": group_size, "bits": bits, "mode": "affine", **quant}
    return tensors, qblock


# --------------------------------------------------------------------------------------------------
# random generation


def _f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


_GAUSS_CACHE: dict = {}


def _gauss_table() -> np.ndarray:
    """65536 equiprobable standard-normal values (sorted samples, exactly unit variance)."""
    if "t" not in _GAUSS_CACHE:
        g = np.sort(np.random.default_rng(12345).standard_normal(65536))
        g = (g - g.mean()) / g.std()
        _GAUSS_CACHE["t"] = g
    return _GAUSS_CACHE["t"]


def _bf16_table(std: float, mean: float) -> np.ndarray:
    key = ("bf16", std, mean)
    if key not in _GAUSS_CACHE:
        _GAUSS_CACHE[key] = _f32_to_bf16_bits(mean + std * _gauss_table())
    return _GAUSS_CACHE[key]


def _scale_bias_bases(std: float, bits: int) -> tuple[int, int]:
    """bf16 bit patterns (sign clear) of the nominal scale and bias magnitudes.

    Codes q are uniform on [0, 2^bits - 1] (mean m, std sq). A scale is +-base*(1 + j/128), j uniform in 0..15
    (random low 4 mantissa bits, mean factor ~1.059), and the bias is -m * nominal scale with the scale's sign,
    so w = s*q + b has mean ~0 and standard deviation ~std."""
    n = (1 << bits) - 1
    m, sq = n / 2.0, math.sqrt(((n + 1) ** 2 - 1) / 12.0)
    target = std / sq / 1.059
    sbits = int(_f32_to_bf16_bits(np.array([target]))[0]) & 0x7FF0
    s_nominal = float(np.array([sbits << 16], dtype=np.uint32).view(np.float32)[0]) * 1.059
    bbits = int(_f32_to_bf16_bits(np.array([m * s_nominal]))[0]) & 0x7FFF
    return sbits, bbits


def _rng(seed: int, key: str, chunk: int) -> np.random.Generator:
    return np.random.Generator(np.random.SFC64([seed, zlib.crc32(key.encode()), chunk]))


def _generate(t: Tensor, start: int, count: int, chunk: int, seed: int) -> bytes:
    """Bytes of elements [start, start + count) of tensor t (flat order)."""
    g = _rng(seed, t.seed_key, chunk)
    kind = t.init[0]
    if kind == "codes":
        words = g.bit_generator.random_raw((count + 1) // 2).view(np.uint32)[:count]
        return words.tobytes()
    if kind in ("scales", "biases"):
        _, std, bits = t.init
        sbits, bbits = _scale_bias_bases(std, bits)
        r = g.bit_generator.random_raw((count + 3) // 4).view(np.uint16)[:count]
        if kind == "scales":
            out = (r & np.uint16(0x800F)) | np.uint16(sbits)
        else:
            out = ((r & np.uint16(0x8000)) ^ np.uint16(0x8000)) | np.uint16(bbits)
        return out.tobytes()
    if kind == "normal":
        _, std, mean = t.init
        if t.dtype == "BF16":
            idx = g.bit_generator.random_raw((count + 3) // 4).view(np.uint16)[:count]
            return _bf16_table(std, mean)[idx].tobytes()
        return (mean + std * g.standard_normal(count)).astype(np.float32).tobytes()
    if kind == "uniform":
        _, lo, hi = t.init
        x = g.uniform(lo, hi, count).astype(np.float32)
        return _f32_to_bf16_bits(x).tobytes() if t.dtype == "BF16" else x.tobytes()
    raise AssertionError(kind)


def _chunks(t: Tensor):
    """(start_element, count, chunk_index) covering t in pieces of <= CHUNK_BYTES."""
    n = int(np.prod(t.shape, dtype=np.int64))
    per = max(1, CHUNK_BYTES // DTYPE_SIZE[t.dtype])
    per -= per % 4
    return [(s, min(per, n - s), k) for k, s in enumerate(range(0, n, per))]


# --------------------------------------------------------------------------------------------------
# writing


def _header_bytes(tensors: list[Tensor], metadata: dict) -> bytes:
    header: dict = {"__metadata__": metadata}
    off = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def make_shards(tensors: list[Tensor], max_bytes: int) -> list[list[Tensor]]:
    shards: list[list[Tensor]] = []
    size = 0
    for t in tensors:
        if not shards or size + t.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def write_tensors(out: Path, tensors: list[Tensor], *, seed: int, shard_bytes: int, metadata: dict,
                  progress, workers: int) -> dict:
    """Write the shards; ``progress`` (a tqdm bar or None) advances by the bytes written."""
    shards = make_shards(tensors, shard_bytes)
    n = len(shards)
    fmt = "model-{:05d}-of-{:05d}.safetensors" if n > 1 else "model.safetensors"
    weight_map = {}
    jobs = [(t, s, c, k) for t in tensors for (s, c, k) in _chunks(t)]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: list = []
        it = iter(jobs)

        def refill():
            while len(pending) < 2 * workers + 2:
                try:
                    t, s, c, k = next(it)
                except StopIteration:
                    return
                pending.append((t, pool.submit(_generate, t, s, c, k, seed)))

        refill()
        for i, shard in enumerate(shards):
            name = fmt.format(i + 1, n)
            with open(out / name, "wb") as f:
                f.write(_header_bytes(shard, metadata))
                for t in shard:
                    weight_map[t.name] = name
                    remaining = t.nbytes
                    while remaining > 0:
                        t2, fut = pending.pop(0)
                        assert t2 is t
                        data = fut.result()
                        refill()
                        f.write(data)
                        remaining -= len(data)
                        if progress:
                            progress.update(len(data))
                    assert remaining == 0, t.name
    return weight_map


def _write_tokenizer(out: Path, source, vocab_size: int) -> tuple[dict, str]:
    """Tokenizer files for a checkpoint of ``vocab_size`` rows: copied from ``source`` when given, else the
    real Qwen3.6 tokenizer when the vocabulary holds it, else a byte-level one. Returns the generation config
    and which tokenizer it is."""
    if source is not None:
        src = Path(source)
        if not (src / "tokenizer.json").is_file():
            raise CommandError(f"--tokenizer {source}: no tokenizer.json there")
        try:
            n_ids = len(Tokenizer.from_file(src / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            raise CommandError(f"--tokenizer {source}: cannot read tokenizer.json ({e})") from None
        if n_ids > vocab_size:
            raise CommandError(f"--tokenizer {source} has {n_ids} ids, more than the config's vocab_size {vocab_size}")
        gen = copy_tokenizer(src, out) or (qwen_generation_config() if n_ids == QWEN_VOCAB else {})
        return gen, f"copied from {src}"
    if vocab_size >= QWEN_VOCAB:
        write_qwen_tokenizer(out)
        return qwen_generation_config(), "Qwen3.6 (shipped with lily)"
    ids = write_byte_tokenizer(out)
    eot, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]
    if vocab_size <= max(ids.values()):
        raise CommandError(f"vocab_size {vocab_size} is too small for the byte-level tokenizer (needs > "
                         f"{max(ids.values())})")
    gen = {"bos_token_id": eot, "do_sample": True, "eos_token_id": [im_end, eot], "pad_token_id": eot,
           "temperature": 1.0, "top_k": 20, "top_p": 0.95}
    return gen, "byte-level"


def _mlx_config(cfg: dict, qblock: dict, gen: dict | None) -> dict:
    """config.json the way mlx_lm.convert saves it (vision_config dropped, keys sorted, quantization blocks)."""
    c = copy.deepcopy(cfg)
    c.pop("vision_config", None)
    c.pop("_name_or_path", None)
    rp = c["text_config"].get("rope_parameters")
    if isinstance(rp, dict) and "type" not in rp and "rope_type" in rp:  # mlx-lm's ModelArgs renames it in place
        rp["type"] = rp.pop("rope_type")
    if gen and "eos_token_id" in gen:  # mlx_lm.utils.load_config copies it from generation_config.json
        c["eos_token_id"] = gen["eos_token_id"]
    c["quantization"] = qblock
    c["quantization_config"] = copy.deepcopy(qblock)
    return dict(sorted(c.items()))


def _parse_size(s) -> int:
    if isinstance(s, (int, float)):
        return int(s)
    t = str(s).strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        if t and t[-1] in mult:
            return int(float(t[:-1]) * mult[t[-1]])
        return int(float(t))
    except ValueError:
        raise CommandError(f"bad size {s!r} (e.g. 5G, 512M)") from None


def _shard_size(text: str) -> int:
    try:
        size = _parse_size(text)
    except CommandError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"expected a size > 0 (e.g. 5G, 512M), got {text!r}")
    return size


def synthesize(out_dir, config=None, *, layers: int | None = None, fmt: str = "mlx", bits: int = 4,
               group_size: int = 64, seed: int = 0, tokenizer=None, shard_bytes: int = SHARD_BYTES,
               sets: list[str] | None = None, force: bool = False, progress: bool = True,
               workers: int | None = None) -> dict:
    """Write a random checkpoint to ``out_dir``; returns a summary dict (path, bytes, tensors, seconds)."""
    t0 = time.perf_counter()
    cfg = apply_overrides(load_config(config), layers, sets)
    tensors, qblock = plan(cfg, fmt, bits, group_size)
    total = sum(t.nbytes for t in tensors)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not force:
            raise CommandError(f"{out} exists and is not empty (use --force to overwrite a checkpoint folder)")
        if not out.is_dir() or not (out / "config.json").exists():
            raise CommandError(f"--force: {out} does not look like a checkpoint folder (no config.json); not touched")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    if free < total + (64 << 20):
        raise CommandError(f"not enough disk space in {out}: need {total / 1e9:.2f} GB, {free / 1e9:.2f} GB free")
    # Everything is written into a staging folder inside `out`, then renamed over the old files: an engine
    # that has the old checkpoint loaded keeps reading its files intact, and a failure or Ctrl-C part-way
    # leaves the old checkpoint as it was.
    stage = Path(tempfile.mkdtemp(prefix=".lily-synth-", dir=out))
    try:
        info = _write_checkpoint(stage, cfg, tensors, qblock, total, fmt=fmt, bits=bits, group_size=group_size,
                                 seed=seed, tokenizer=tokenizer, shard_bytes=shard_bytes, progress=progress,
                                 workers=workers, label=out.name)
        new = {p.name for p in stage.iterdir()}
        for p in sorted(stage.iterdir(), key=lambda p: p.suffix != ".safetensors"):  # weights before configs
            os.replace(p, out / p.name)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    stage.rmdir()
    for p in out.iterdir():  # what the old checkpoint had and the new one has not (other shard names)
        if p.name not in new and p.is_file() and (p.suffix in (".safetensors", ".json", ".jinja")
                                                  or p.name == "README.md"):
            p.unlink()
    return {"path": str(out), "format": fmt, "bytes": total, "tensors": len(tensors), **info,
            "seconds": time.perf_counter() - t0}


def _write_checkpoint(out: Path, cfg: dict, tensors: list[Tensor], qblock: dict, total: int, *, fmt: str, bits: int,
                      group_size: int, seed: int, tokenizer, shard_bytes: int, progress: bool, workers: int | None,
                      label: str) -> dict:
    """Write the checkpoint's files into the (empty) folder ``out``; the summary's parameters, layers, shards and
    tokenizer."""
    # tokenizer + generation config
    D = Dims.of(cfg)
    gen, tok_kind = _write_tokenizer(out, tokenizer, D.V)
    if tok_kind == "byte-level":  # keep the special ids inside the small vocabulary
        cfg["text_config"].update(bos_token_id=gen["bos_token_id"], eos_token_id=gen["bos_token_id"])
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

    if fmt == "mlx":
        out_cfg = _mlx_config(cfg, qblock, gen)
        metadata = {"format": "mlx"}
    else:
        out_cfg = cfg
        metadata = {"format": "pt"}
    (out / "config.json").write_text(json.dumps(out_cfg, indent=4) + "\n")

    with progress_bar(total, desc=f"synth {label}", unit="B", unit_scale=True, disable=not progress) as bar:
        weight_map = write_tensors(out, tensors, seed=seed, shard_bytes=shard_bytes, metadata=metadata,
                                   progress=bar, workers=workers or max(1, min(4, os.cpu_count() or 1)))
    n_params = sum(int(np.prod(t.shape)) * (32 // _bits_of(t, qblock) if t.dtype == "U32" else 1)
                   for t in tensors if not t.name.endswith((".scales", ".biases")))
    index = {"metadata": {"total_size": total, "total_parameters": n_params},
             "weight_map": {k: weight_map[k] for k in sorted(weight_map)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=4) + "\n")
    kind = f"MLX affine {bits}-bit group {group_size}" if fmt == "mlx" else "Hugging Face bf16"
    (out / "README.md").write_text(
        f"# Random-weight synthetic checkpoint ({kind})\n\nWritten by `lily synth` (seed {seed}): the "
        f"Qwen3.5/3.6-MoE architecture with {D.L} layers, hidden size {D.D}, {D.E} experts. The weights are random; "
        "use it for speed and consistency tests only.\n")
    return {"parameters": n_params, "layers": D.L, "shards": len(set(weight_map.values())), "tokenizer": tok_kind}


def _bits_of(t: Tensor, qblock: dict) -> int:
    mod = t.name[: -len(".weight")]
    spec = qblock.get(mod)
    return spec["bits"] if isinstance(spec, dict) else qblock.get("bits", 4)


# --------------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    ap = ArgParser(
        prog="lily synth",
        description="Write a random-weight Qwen3.6-35B-A3B-architecture checkpoint (MLX 4-bit or HF bf16 layout).")
    ap.add_argument("out", help="output folder (created; must be empty unless --force)")
    ap.add_argument("--config", default=None,
                    help=f"preset name ({', '.join(PRESETS)}; default) or a config.json / checkpoint folder")
    ap.add_argument("--layers", type=command.integer(1), default=None,
                    help="keep the full width but only the first N layers")
    ap.add_argument("--format", dest="fmt", choices=("mlx", "hf"), default="mlx",
                    help="mlx: what mlx_lm.convert writes (affine-quantized, default); hf: released bf16 layout")
    ap.add_argument("--bits", type=int, default=4, help="quantization bits (mlx format; default 4)")
    ap.add_argument("--group-size", type=int, default=64, help="quantization group size (mlx format; default 64)")
    ap.add_argument("--seed", type=command.integer(0), default=0,
                    help="seed of the random weights (same seed, same bytes)")
    ap.add_argument("--tokenizer", default=None, metavar="DIR",
                    help="copy the tokenizer files of this folder (default: the Qwen3.6 tokenizer shipped with "
                         "lily when vocab_size holds it, else a byte-level tokenizer with the same chat template)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="override a text_config field (JSON value), e.g. --set num_experts=16; repeatable")
    ap.add_argument("--shard-size", type=_shard_size, default="5G",
                    help="maximum shard size (default 5G, like mlx_lm)")
    ap.add_argument("--force", action="store_true", help="overwrite an existing checkpoint folder")
    ap.add_argument("--dry-run", action="store_true", help="print the size and tensor count, write nothing")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return command.run("lily synth", lambda: _synth(args))


def _synth(args) -> int:
    if args.dry_run:
        cfg = apply_overrides(load_config(args.config), args.layers, args.sets)
        tensors, _ = plan(cfg, args.fmt, args.bits, args.group_size)
        total = sum(t.nbytes for t in tensors)
        print(f"{len(tensors)} tensors, {total:,} bytes ({total / 1e9:.2f} GB), "
              f"{cfg['text_config']['num_hidden_layers']} layers")
        return 0
    info = synthesize(args.out, args.config, layers=args.layers, fmt=args.fmt, bits=args.bits,
                      group_size=args.group_size, seed=args.seed, tokenizer=args.tokenizer,
                      shard_bytes=args.shard_size, sets=args.sets, force=args.force,
                      progress=not args.quiet)
    gb = info["bytes"] / 1e9
    print(f"wrote {info['path']}: {info['tensors']} tensors, {info['parameters']:,} parameters, {gb:.2f} GB in "
          f"{info['shards']} shard(s), {info['seconds']:.1f} s ({gb / max(info['seconds'], 1e-9):.2f} GB/s); "
          f"tokenizer {info['tokenizer']}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
