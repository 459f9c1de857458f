"""Tiny random Qwen3.6 (``qwen3_5_moe``) checkpoints for tests, in the *released* Hugging Face layout.

The public entry points:

``write_hf_checkpoint(path, preset="tiny", seed=0, vocab_size=None, real_tokenizer=False, *,
num_layers=None, rope_theta=None, shards=1, max_position_embeddings=8192) -> Path``
    Writes a random bf16 checkpoint into the folder ``path`` (created; must be empty or absent) and
    returns it. The folder has ``config.json`` (``model_type: qwen3_5_moe`` with a nested
    ``text_config`` of ``model_type: qwen3_5_moe_text``), ``generation_config.json``, safetensors
    weights named exactly like ``Qwen/Qwen3.6-35B-A3B`` (``model.language_model.*``, top-level
    ``lm_head.weight``, fused experts ``mlp.experts.gate_up_proj`` [E, 2I, D] with the gate rows first and
    ``mlp.experts.down_proj`` [E, D, I], conv1d [C, 1, K], zero-centred norms, ``A_log`` in F32, everything
    else BF16), a few ``model.visual.*`` and ``mtp.*`` tensors that a text engine must skip, and a
    tokenizer (``tokenizer.json`` + ``tokenizer_config.json`` + ``chat_template.jinja``).

    * ``preset``: ``"tiny"`` (D=64, 4 layers lin/lin/lin/full, 4 query heads on 2 KV heads of dim 32,
      DeltaNet 2 key heads / 4 value heads of dim 16, 8 experts top-2, I=64) or ``"real_heads"`` (the real
      per-head shapes: attention head_dim 256 with 8 query heads per KV head (16 on 2), DeltaNet
      Dk=Dv=128 with 2 value heads per key head (2 key / 4 value heads), 16 experts top-8; D=256, I=128,
      so every projection quantizes at group 32, 64 and 128).
    * ``seed``: the weights are a deterministic function of (preset, seed, sizes).
    * ``vocab_size``: rows of ``embed_tokens``/``lm_head`` (defaults: 512 tiny, 1024 real_heads; with
      ``real_tokenizer=True`` 248320 like the real model). Rows past the tokenizer are padding, as in the
      real model.
    * ``real_tokenizer``: write the real Qwen3.6 tokenizer files (shipped with lily) instead of lily's
      byte-level tokenizer (``lily.tokenizer_files``; both come with Qwen3.6's chat template);
      special-token ids in the config are then the real ones (``<|endoftext|>`` 248044,
      ``<|im_end|>`` 248046).
    * ``num_layers``: override the layer count (layer i is full attention iff (i+1) % 4 == 0).
    * ``rope_theta``: default 1e7 like the real model; a small value (e.g. 1e3) makes RoPE bugs loud.
    * ``shards``: > 1 writes ``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``.

    The weights follow oracle.md trap 5 (damped residual branches, N(0, 1/fan_in) linears, A = exp(A_log)
    log-uniform in [0.005, 2], random dt_bias, nonzero random norms, lm_head logit std about 3), so the
    random network behaves like a trained one numerically instead of being chaotic.

``convert_mlx(hf_dir, out_dir, bits=4, group_size=64) -> Path``
    Runs ``mlx_lm.convert`` (affine quantization) on an HF-layout folder, checks that the routers and
    shared-expert gates got their 8-bit overrides, and returns ``out_dir``.

``read_safetensors`` / ``write_safetensors``: a dependency-free reader/writer (numpy, BF16 as uint16
bit patterns) used here and by the error tests to corrupt files on purpose.
"""

from __future__ import annotations

import atexit
import copy
import json
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
from lily.synth import DEFAULT_PRESET
from lily.synth import PRESETS as PRESETS_SYNTH
from lily.tokenizer_files import qwen_generation_config, write_byte_tokenizer, write_qwen_tokenizer

REAL_VOCAB_SIZE = 248320

PRESETS = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        vocab_size=512,
    ),
    "real_heads": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=16,
        num_experts_per_tok=8,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        vocab_size=1024,
    ),
}

# --------------------------------------------------------------------------------------------------
# safetensors I/O (BF16 handled as raw uint16 bit patterns, no ml_dtypes / torch needed)

_NP_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U32": np.uint32, "I32": np.int32,
              "I64": np.int64, "U8": np.uint8, "F64": np.float64}


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 (round to nearest even); returns the uint16 bit patterns."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = u + 0x7FFF + ((u >> 16) & 1)
    return (u >> 16).astype(np.uint16)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def write_safetensors(path, tensors: dict, metadata: dict | None = None) -> None:
    """Write ``{name: (dtype_str, np.ndarray)}``; BF16 arrays must be uint16 bit patterns."""
    header: dict = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    blobs = []
    for name, (dtype, arr) in tensors.items():
        arr = np.ascontiguousarray(arr, dtype=_NP_DTYPES[dtype])
        data = arr.tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for data in blobs:
            f.write(data)


def read_safetensors(path) -> tuple[dict, dict]:
    """Read a safetensors file into ``({name: (dtype_str, np.ndarray)}, metadata)``."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__", {}) or {}
    out = {}
    base = 8 + n
    for name, info in header.items():
        a, b = info["data_offsets"]
        arr = np.frombuffer(raw[base + a : base + b], dtype=_NP_DTYPES[info["dtype"]]).reshape(info["shape"])
        out[name] = (info["dtype"], arr.copy())
    return out, meta


def read_checkpoint_tensors(folder) -> dict:
    """All tensors of a (possibly sharded) checkpoint folder: ``{name: (dtype_str, np.ndarray)}``."""
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(read_safetensors(f)[0])
    return out


# --------------------------------------------------------------------------------------------------
# config


def make_config(preset: str = "tiny", *, vocab_size=None, num_layers=None, rope_theta=None,
                max_position_embeddings=8192, bos_id=None, eos_id=None) -> dict:
    """The released Qwen3.6-35B-A3B config.json (``lily synth``'s preset) at the sizes of ``preset``: its
    dims, layer pattern, special ids, context, RoPE base and a small vision tower."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    p = dict(PRESETS[preset])
    if vocab_size is not None:
        p["vocab_size"] = int(vocab_size)
    if num_layers is not None:
        p["num_hidden_layers"] = int(num_layers)
    config = copy.deepcopy(PRESETS_SYNTH[DEFAULT_PRESET])
    text = config["text_config"]
    text.update(p)
    text.update(
        bos_token_id=bos_id,
        eos_token_id=bos_id if eos_id is None else eos_id,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                     for i in range(p["num_hidden_layers"])],
        max_position_embeddings=max_position_embeddings,
    )
    text["rope_parameters"]["rope_theta"] = 10_000_000 if rope_theta is None else rope_theta
    config["vision_config"].update(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                   num_position_embeddings=16, out_hidden_size=p["hidden_size"], patch_size=4)
    return config


# --------------------------------------------------------------------------------------------------
# weights


def make_weights(config: dict, seed: int = 0) -> dict:
    """Random weights in the released HF layout: ``{name: (dtype_str, np.ndarray)}`` (BF16 as uint16 bits).

    All values are drawn in float32 and rounded once to bf16 (A_log stays F32)."""
    c = config["text_config"]
    rng = np.random.default_rng(seed)
    D = c["hidden_size"]
    V = c["vocab_size"]
    H, Hkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    Hk, Hv, Dk, Dv = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                      c["linear_value_head_dim"])
    K = c["linear_conv_kernel_dim"]
    E, Im, Is = c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    key_dim, value_dim = Hk * Dk, Hv * Dv
    conv_dim = 2 * key_dim + value_dim
    damp = 0.25  # residual-branch output projections (oracle.md trap 5)

    def lin(out_dim, in_dim, scale=1.0):
        return rng.standard_normal((out_dim, in_dim), dtype=np.float32) * np.float32(scale / np.sqrt(in_dim))

    def znorm(n):  # zero-centred norm weight (the model uses 1 + w)
        return rng.normal(0.0, 0.1, size=n).astype(np.float32)

    t: dict = {}

    def bf(name, arr):
        t[name] = ("BF16", f32_to_bf16_bits(arr))

    pre = "model.language_model."
    bf(pre + "embed_tokens.weight", rng.standard_normal((V, D), dtype=np.float32))
    for i, kind in enumerate(c["layer_types"]):
        lp = f"{pre}layers.{i}."
        bf(lp + "input_layernorm.weight", znorm(D))
        bf(lp + "post_attention_layernorm.weight", znorm(D))
        if kind == "linear_attention":
            a = lp + "linear_attn."
            bf(a + "in_proj_qkv.weight", lin(conv_dim, D))
            bf(a + "in_proj_z.weight", lin(value_dim, D))
            bf(a + "in_proj_b.weight", lin(Hv, D))
            bf(a + "in_proj_a.weight", lin(Hv, D))
            bf(a + "conv1d.weight", rng.normal(0.0, 0.5, size=(conv_dim, 1, K)).astype(np.float32))
            A = np.exp(rng.uniform(np.log(0.005), np.log(2.0), size=Hv))
            t[a + "A_log"] = ("F32", np.log(A).astype(np.float32))
            bf(a + "dt_bias", rng.uniform(-1.0, 1.0, size=Hv).astype(np.float32))
            bf(a + "norm.weight", (1.0 + rng.normal(0.0, 0.1, size=Dv)).astype(np.float32))
            bf(a + "out_proj.weight", lin(D, value_dim, damp))
        else:
            a = lp + "self_attn."
            bf(a + "q_proj.weight", lin(H * hd * 2, D))
            bf(a + "k_proj.weight", lin(Hkv * hd, D))
            bf(a + "v_proj.weight", lin(Hkv * hd, D))
            bf(a + "o_proj.weight", lin(D, H * hd, damp))
            bf(a + "q_norm.weight", znorm(hd))
            bf(a + "k_norm.weight", znorm(hd))
        m = lp + "mlp."
        bf(m + "gate.weight", lin(E, D, 2.0))
        gate_up = np.stack([lin(2 * Im, D) for _ in range(E)])  # [E, 2I, D], gate rows first
        bf(m + "experts.gate_up_proj", gate_up)
        bf(m + "experts.down_proj", np.stack([lin(D, Im, damp) for _ in range(E)]))  # [E, D, I]
        bf(m + "shared_expert.gate_proj.weight", lin(Is, D))
        bf(m + "shared_expert.up_proj.weight", lin(Is, D))
        bf(m + "shared_expert.down_proj.weight", lin(D, Is, damp))
        bf(m + "shared_expert_gate.weight", lin(1, D))
    bf(pre + "norm.weight", znorm(D))
    bf("lm_head.weight", lin(V, D, 3.0))

    # Tensors a text-only engine must skip: a sliver of the vision tower and of the MTP head.
    vc = config["vision_config"]
    vh = vc["hidden_size"]
    bf("model.visual.patch_embed.proj.weight",
       rng.standard_normal((vh, 3, 2, vc["patch_size"], vc["patch_size"]), dtype=np.float32))
    bf("model.visual.pos_embed.weight", rng.standard_normal((vc["num_position_embeddings"], vh), dtype=np.float32))
    bf("model.visual.blocks.0.attn.qkv.weight", lin(3 * vh, vh))
    bf("model.visual.blocks.0.attn.qkv.bias", np.zeros(3 * vh, np.float32))
    bf("model.visual.blocks.0.norm1.weight", np.ones(vh, np.float32))
    bf("model.visual.merger.linear_fc2.weight", lin(D, 4 * vh))
    bf("mtp.fc.weight", lin(D, 2 * D))
    bf("mtp.pre_fc_norm_embedding.weight", znorm(D))
    bf("mtp.pre_fc_norm_hidden.weight", znorm(D))
    bf("mtp.norm.weight", znorm(D))
    bf("mtp.layers.0.input_layernorm.weight", znorm(D))
    bf("mtp.layers.0.self_attn.q_proj.weight", lin(H * hd * 2, D))
    bf("mtp.layers.0.self_attn.k_norm.weight", znorm(hd))
    bf("mtp.layers.0.mlp.gate.weight", lin(E, D))
    bf("mtp.layers.0.mlp.experts.gate_up_proj", np.stack([lin(2 * Im, D) for _ in range(E)]))
    bf("mtp.layers.0.mlp.experts.down_proj", np.stack([lin(D, Im, damp) for _ in range(E)]))
    return t


def write_weights(folder: Path, tensors: dict, shards: int = 1) -> None:
    folder = Path(folder)
    meta = {"format": "pt"}
    if shards <= 1:
        write_safetensors(folder / "model.safetensors", tensors, meta)
        return
    names = list(tensors)
    sizes = [tensors[n][1].nbytes for n in names]
    total = sum(sizes)
    target = total / shards
    groups: list[list[str]] = [[] for _ in range(shards)]
    acc, k = 0, 0
    for n, s in zip(names, sizes):
        if acc >= target * (k + 1) and k < shards - 1 and groups[k]:
            k += 1
        groups[k].append(n)
        acc += s
    groups = [g for g in groups if g]
    n_files = len(groups)
    weight_map = {}
    for idx, g in enumerate(groups):
        fname = f"model-{idx + 1:05d}-of-{n_files:05d}.safetensors"
        write_safetensors(folder / fname, {n: tensors[n] for n in g}, meta)
        for n in g:
            weight_map[n] = fname
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# --------------------------------------------------------------------------------------------------
# tokenizer


_QWEN_DIR: list[Path] = []


def qwen_tokenizer_dir() -> Path:
    """A folder with the Qwen3.6 tokenizer files shipped with lily (``tokenizer.json``, ``tokenizer_config.json``,
    ``chat_template.jinja``, ``generation_config.json``) and the published ``config.json`` (transformers picks
    the tokenizer class by the model type), written once per test process."""
    if not _QWEN_DIR:
        folder = Path(tempfile.mkdtemp(prefix="lily-qwen3.6-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        write_qwen_tokenizer(folder)
        (folder / "generation_config.json").write_text(json.dumps(qwen_generation_config()))
        (folder / "config.json").write_text(json.dumps(PRESETS_SYNTH[DEFAULT_PRESET]))
        _QWEN_DIR.append(folder)
    return _QWEN_DIR[0]


# --------------------------------------------------------------------------------------------------
# public API


def write_hf_checkpoint(path, preset: str = "tiny", seed: int = 0, vocab_size: int | None = None,
                        real_tokenizer: bool = False, *, num_layers: int | None = None,
                        rope_theta: float | None = None, shards: int = 1,
                        max_position_embeddings: int = 8192) -> Path:
    """Write a random Qwen3.6-layout bf16 checkpoint into ``path`` and return it (see the module docstring)."""
    folder = Path(path)
    if folder.exists() and any(folder.iterdir()):
        raise FileExistsError(f"{folder} exists and is not empty")
    folder.mkdir(parents=True, exist_ok=True)

    if real_tokenizer:
        if vocab_size is None:
            vocab_size = REAL_VOCAB_SIZE
        if vocab_size < 248077:
            raise ValueError(f"vocab_size {vocab_size} is smaller than the real tokenizer (248077 ids)")
        write_qwen_tokenizer(folder)
        bos, eos_gen, pad = 248044, [248046, 248044], 248044
    else:
        specials = write_byte_tokenizer(folder)
        n_tok = max(specials.values()) + 1
        if vocab_size is None:
            vocab_size = max(PRESETS[preset]["vocab_size"], n_tok) if preset in PRESETS else None
        if vocab_size is not None and vocab_size < n_tok:
            raise ValueError(f"vocab_size {vocab_size} is smaller than the byte-level tokenizer ({n_tok} ids)")
        bos = specials["<|endoftext|>"]
        eos_gen, pad = [specials["<|im_end|>"], bos], bos

    config = make_config(preset, vocab_size=vocab_size, num_layers=num_layers, rope_theta=rope_theta,
                         max_position_embeddings=max_position_embeddings, bos_id=bos, eos_id=bos)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": bos, "do_sample": True, "eos_token_id": eos_gen, "pad_token_id": pad,
           "temperature": 1.0, "top_k": 20, "top_p": 0.95}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    write_weights(folder, make_weights(config, seed), shards=shards)
    return folder


def convert_mlx(hf_dir, out_dir, bits: int = 4, group_size: int = 64) -> Path:
    """Quantize an HF-layout folder with ``mlx_lm.convert`` (affine) into ``out_dir`` (must not exist)."""
    import contextlib
    import io

    from mlx_lm.convert import convert

    out_dir = Path(out_dir)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        convert(str(hf_dir), str(out_dir), quantize=True, q_bits=bits, q_group_size=group_size)
    cfg = json.loads((out_dir / "config.json").read_text())
    q = cfg.get("quantization")
    if not q or q.get("bits") != bits or q.get("group_size") != group_size:
        raise RuntimeError(f"mlx_lm.convert wrote an unexpected quantization block: {q}")
    n_layers = cfg["text_config"]["num_hidden_layers"]
    for i in range(n_layers):
        for mod in ("mlp.gate", "mlp.shared_expert_gate"):
            key = f"language_model.model.layers.{i}.{mod}"
            if q.get(key, {}).get("bits") != 8:
                raise RuntimeError(f"mlx_lm.convert did not keep {key} at 8 bits: {q.get(key)}")
    return out_dir
