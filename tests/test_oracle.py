"""Lily's CPU backend (fp32 activations) against MLX-LM teacher-forced logits, plus self-checks of the oracle.

Tolerances (oracle.md, "How loud is a bug"): fp32 engine vs fp32 oracle max |Δlogit| <= 1e-3 with 100 %
top-1 agreement; the same engine's prefill vs decode / split prefill <= 1e-4. Every architecture bug
moves logits by >= 0.5, fp32 noise is ~1e-5.
"""

from __future__ import annotations

import json

import fixtures
import numpy as np
import pytest
from conftest import ALL_CHECKPOINTS, HF_CHECKPOINTS, MLX_CHECKPOINTS, SEQ_LEN, make_tokens, require_mlx

ORACLE_TOL = 1e-3  # engine (fp32) vs MLX-LM fp32
SELF_TOL = 1e-4  # engine vs itself (prefill / decode / split prefill)
ORACLE_SELF_TOL = 1e-5  # oracle path vs oracle path
MAX_SEQ = 256

# A representative subset for the (slower, per-token) consistency tests: both presets, HF and MLX, 4- and 8-bit.
CONSISTENCY = ["tiny-s0", "real-s1-theta1e4", "real-s0-q4g64", "tiny-s1-q8g32"]


def token_seed(name: str) -> int:
    return ALL_CHECKPOINTS.index(name)


def tokens_for(ckpts, name: str, n: int = SEQ_LEN) -> np.ndarray:
    return make_tokens(token_seed(name), n, ckpts.vocab_size(name))


def compare(got: np.ndarray, ref: np.ndarray, tol: float, what: str, *, top1: bool = True) -> str:
    """Assert |got - ref| <= tol everywhere and (optionally) identical argmax; return a summary line."""
    got = np.asarray(got)
    ref = np.asarray(ref)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != reference {ref.shape}"
    assert got.dtype == np.float32, f"{what}: dtype {got.dtype}, expected float32"
    assert np.isfinite(got).all(), f"{what}: {np.size(got) - np.isfinite(got).sum()} non-finite logits"
    g2 = got.reshape(-1, got.shape[-1]).astype(np.float64)
    r2 = ref.reshape(-1, ref.shape[-1]).astype(np.float64)
    err = np.abs(g2 - r2)
    per_pos = err.max(axis=1)
    worst = int(per_pos.argmax())
    summary = (f"{what}: max|Δ|={per_pos.max():.3e} (position {worst}, first position over tol: "
               f"{int(np.argmax(per_pos > tol)) if (per_pos > tol).any() else None}), mean|Δ|={err.mean():.3e}, "
               f"|ref|max={np.abs(r2).max():.2f}, positions over tol: {int((per_pos > tol).sum())}/{len(per_pos)}")
    if top1:
        a_got, a_ref = g2.argmax(1), r2.argmax(1)
        srt = np.sort(r2, axis=1)
        margin = srt[:, -1] - srt[:, -2]
        # An argmax can legitimately flip only where the reference's top-2 margin is below 2 * tol.
        decisive = margin > 2 * tol
        bad = np.nonzero((a_got != a_ref) & decisive)[0]
        agree = float((a_got == a_ref).mean())
        summary += f", top-1 agreement {agree:.2%} ({int((~decisive).sum())} near-tie positions)"
        assert bad.size == 0, f"{summary}; argmax differs at decisive positions {bad[:10].tolist()}"
    assert per_pos.max() <= tol, summary
    return summary


# --------------------------------------------------------------------------------------------------
# self-checks of the fixtures and the oracle (no engine needed)


@pytest.mark.parametrize("name", list(HF_CHECKPOINTS))
def test_fixture_is_released_hf_layout(ckpts, name):
    folder = ckpts.path(name)
    cfg = json.loads((folder / "config.json").read_text())
    tc = cfg["text_config"]
    assert cfg["model_type"] == "qwen3_5_moe" and tc["model_type"] == "qwen3_5_moe_text"
    assert len(tc["layer_types"]) == tc["num_hidden_layers"] and tc["full_attention_interval"] == 4
    assert tc["rope_parameters"]["rope_type"] == "default"
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (folder / f).exists(), f
    t = fixtures.read_checkpoint_tensors(folder)
    D, E, Im = tc["hidden_size"], tc["num_experts"], tc["moe_intermediate_size"]
    C = 2 * tc["linear_num_key_heads"] * tc["linear_key_head_dim"] + (
        tc["linear_num_value_heads"] * tc["linear_value_head_dim"])
    pre = "model.language_model.layers.0."
    assert t[pre + "mlp.experts.gate_up_proj"][1].shape == (E, 2 * Im, D)
    assert t[pre + "mlp.experts.down_proj"][1].shape == (E, D, Im)
    assert t[pre + "linear_attn.conv1d.weight"][1].shape == (C, 1, tc["linear_conv_kernel_dim"])
    assert t[pre + "linear_attn.A_log"][0] == "F32"
    assert t["lm_head.weight"][1].shape == (tc["vocab_size"], D)
    assert {dt for n, (dt, _) in t.items() if not n.endswith("A_log")} == {"BF16"}
    assert any(n.startswith("model.visual.") for n in t) and any(n.startswith("mtp.") for n in t)
    shards = HF_CHECKPOINTS[name].get("shards", 1)
    if shards > 1:
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        assert len(files) == shards and set(index["weight_map"].values()) == set(files)
        assert set(index["weight_map"]) == set(t)
        assert index["metadata"]["total_size"] == sum(a.nbytes for _, a in t.values())


def test_fixture_is_deterministic(tmp_path):
    a = fixtures.write_hf_checkpoint(tmp_path / "a", "tiny", seed=5, vocab_size=300)
    b = fixtures.write_hf_checkpoint(tmp_path / "b", "tiny", seed=5, vocab_size=300)
    c = fixtures.write_hf_checkpoint(tmp_path / "c", "tiny", seed=6, vocab_size=300)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


@pytest.mark.parametrize("name", list(MLX_CHECKPOINTS))
def test_mlx_conversion_layout(ckpts, name):
    _, bits, gs = MLX_CHECKPOINTS[name]
    cfg = ckpts.config(name)
    q = cfg["quantization"]
    assert (q["bits"], q["group_size"]) == (bits, gs)
    t = fixtures.read_checkpoint_tensors(ckpts.path(name))
    router = "language_model.model.layers.0.mlp.gate"
    assert q[router] == {"group_size": 64, "bits": 8}
    D = cfg["text_config"]["hidden_size"]
    assert t[router + ".weight"][1].shape[-1] * 32 == D * 8 and t[router + ".scales"][1].shape[-1] == D // 64
    emb = "language_model.model.embed_tokens"
    assert t[emb + ".weight"][1].shape[-1] * 32 == D * bits and t[emb + ".scales"][1].shape[-1] == D // gs
    assert t["language_model.model.layers.0.linear_attn.conv1d.weight"][1].shape[-1] == 1
    assert not any(n.startswith(("mtp.", "model.visual", "vision_tower")) for n in t)


@pytest.mark.parametrize("bits,group_size", [(4, 64), (8, 32), (4, 128), (8, 64), (4, 32)])
def test_oracle_unpacking_matches_mx_dequantize(bits, group_size):
    require_mlx()
    import mlx.core as mx
    import oracle

    rng = np.random.default_rng(bits * 1000 + group_size)
    w = mx.array(rng.standard_normal((3, 24, 4 * group_size)).astype(np.float32))
    wq, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    ref = np.array(mx.dequantize(wq, s, b, group_size=group_size, bits=bits))
    mine = oracle.dequantize(np.array(wq), np.array(s), np.array(b), bits, group_size)
    np.testing.assert_allclose(mine, ref, rtol=0, atol=1e-6 * np.abs(ref).max())
    # and the quantization is not a no-op (the check would be vacuous otherwise)
    assert np.abs(mine - np.array(w)).max() > 1e-3


@pytest.mark.parametrize("name", list(MLX_CHECKPOINTS))
def test_oracle_quantized_path_is_exact(ckpts, oracle_cache, name):
    """The fp32-activation quantized MLX run equals fp32 math on weights we dequantized ourselves."""
    toks = tokens_for(ckpts, name)
    ref = oracle_cache.dequantized_logits(name, toks)
    got = oracle_cache.logits(name, toks)
    print(compare(got, ref, ORACLE_SELF_TOL, f"{name} oracle quantized vs hand-dequantized"))


@pytest.mark.parametrize("name", ["tiny-s0", "real-s1-theta1e4", "real-s0-q4g64"])
def test_oracle_decode_matches_full_forward(ckpts, oracle_cache, name):
    toks = tokens_for(ckpts, name, 80)
    print(compare(oracle_cache.decode_logits(name, toks), oracle_cache.logits(name, toks), ORACLE_SELF_TOL,
                  f"{name} oracle step decode vs full forward"))


@pytest.mark.parametrize("name", ["tiny-s0", "tiny-s1-theta1e3", "real-s1-theta1e4", "real-s2-2shards",
                                  "real-s0-q4g64", "tiny-s1-q8g32", "real-s1-q4g128"])
def test_oracle_matches_independent_numpy_float64(ckpts, oracle_cache, name):
    """MLX-LM (fp32) against a float64 numpy implementation written from spec/architecture.md: this pins the
    oracle (and the fixture layout) to the documented math; measured max |Δ| ~1e-5."""
    toks = tokens_for(ckpts, name)
    print(compare(oracle_cache.logits(name, toks), oracle_cache.numpy_logits(name, toks), 1e-4,
                  f"{name} MLX-LM fp32 vs numpy float64"))


def test_oracle_hf_reference_is_fp32(ckpts, oracle_cache):
    """The HF oracle adds 1 to the norms in fp32: loading the same bf16 folder naively in mlx-lm (norm weights
    1+w rounded to bf16, oracle.md trap 4) must differ clearly, and quantization must differ more still."""
    require_mlx()
    from pathlib import Path

    import mlx.core as mx
    from lily.mlx_reference import upcast_to_float32
    from mlx_lm.utils import load_model

    name = "tiny-s0"
    toks = tokens_for(ckpts, name)
    ref = oracle_cache.logits(name, toks)
    model, _ = load_model(Path(ckpts.path(name)))  # sanitize in bf16, then run in fp32
    upcast_to_float32(model)
    naive = np.array(model(mx.array(toks.astype(np.int32))[None]).astype(mx.float32)[0])
    d = np.abs(naive - ref).max()
    assert 1e-3 < d < 2.0, f"bf16-sanitized vs fp32-sanitized max|Δ|={d:.3e} (expected ~0.1-0.5)"
    assert np.abs(ref).std() > 1.5, "logits too flat for a meaningful test"


# --------------------------------------------------------------------------------------------------
# the engine against the oracle


def _engine(lily, ckpts, name, max_seq=MAX_SEQ, **kw):
    # fp32 oracle tolerances need the fp32 KV cache (the 16-bit caches: tests/test_kv_cache.py).
    kw.setdefault("kv_dtype", "f32")
    eng = lily.Engine(str(ckpts.path(name)), backend="cpu", max_seq=max_seq, **kw)
    assert eng.backend == "cpu"
    return eng


@pytest.mark.parametrize("name", ALL_CHECKPOINTS)
def test_prefill_matches_mlx(lily, ckpts, oracle_cache, name):
    toks = tokens_for(ckpts, name)
    ref = oracle_cache.logits(name, toks)
    eng = _engine(lily, ckpts, name)
    got = eng.prefill(toks.tolist(), all_logits=True)
    assert eng.position == len(toks)
    print(compare(got, ref, ORACLE_TOL, f"{name} engine prefill vs MLX-LM"))


@pytest.mark.parametrize("name", CONSISTENCY)
def test_decode_matches_prefill_and_mlx(lily, ckpts, oracle_cache, name):
    toks = tokens_for(ckpts, name)
    eng = _engine(lily, ckpts, name)
    full = eng.prefill(toks.tolist(), all_logits=True)
    eng.reset()
    assert eng.position == 0
    steps = []
    for i, t in enumerate(toks.tolist()):
        steps.append(eng.decode(t))
        assert eng.position == i + 1
    steps = np.stack(steps)
    msgs = [compare(steps, full, SELF_TOL, f"{name} decode vs prefill")]
    msgs.append(compare(steps, oracle_cache.logits(name, toks), ORACLE_TOL, f"{name} decode vs MLX-LM"))
    print("\n".join(msgs))


def test_small_prefill_chunks_match_one_chunk(lily, ckpts, oracle_cache):
    # Chunks of 7 and 64 tokens: the state carried across chunk boundaries inside one prefill call.
    name = CONSISTENCY[0]
    toks = tokens_for(ckpts, name)
    full = _engine(lily, ckpts, name).prefill(toks.tolist(), all_logits=True)
    for chunk in (7, 64):
        eng = _engine(lily, ckpts, name, prefill_chunk=chunk)
        assert eng.prefill_chunk == chunk
        got = eng.prefill(toks.tolist(), all_logits=True)
        print(compare(got, full, SELF_TOL, f"{name} prefill in chunks of {chunk} vs one chunk"))
        print(compare(got, oracle_cache.logits(name, toks), ORACLE_TOL, f"{name} chunks of {chunk} vs MLX-LM"))


@pytest.mark.parametrize("splits", [(1, 37, 64, 65, 150), (2, 3, 63, 128, 129, 191), (100,)],
                         ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("name", CONSISTENCY)
def test_split_prefill_matches_single_prefill(lily, ckpts, oracle_cache, name, splits):
    toks = tokens_for(ckpts, name)
    eng = _engine(lily, ckpts, name)
    full = eng.prefill(toks.tolist(), all_logits=True)
    eng.reset()
    parts = []
    bounds = [0, *splits, len(toks)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        parts.append(eng.prefill(toks[a:b].tolist(), all_logits=True).reshape(b - a, -1))
        assert eng.position == b
    got = np.concatenate(parts)
    msgs = [compare(got, full, SELF_TOL, f"{name} prefill split at {splits} vs one prefill")]
    msgs.append(compare(got, oracle_cache.logits(name, toks), ORACLE_TOL, f"{name} split prefill vs MLX-LM"))
    print("\n".join(msgs))


@pytest.mark.parametrize("name", CONSISTENCY)
def test_last_logits_match_all_logits(lily, ckpts, name):
    toks = tokens_for(ckpts, name)
    eng = _engine(lily, ckpts, name)
    all_rows = eng.prefill(toks.tolist(), all_logits=True)
    vocab = ckpts.vocab_size(name)
    assert all_rows.shape == (len(toks), vocab) and all_rows.dtype == np.float32
    eng.reset()
    first = eng.prefill(toks[:70].tolist())  # default: last position only
    assert first.shape == (vocab,) and first.dtype == np.float32
    second = eng.prefill(toks[70:].tolist(), all_logits=False)
    assert second.shape == (vocab,)
    eng.reset()
    one = eng.prefill(toks[:1].tolist(), all_logits=True)
    assert one.shape == (1, vocab), f"all_logits=True for one token must be [1, vocab], got {one.shape}"
    msgs = [compare(first, all_rows[69], SELF_TOL, f"{name} last-only (position 69) vs all_logits"),
            compare(second, all_rows[-1], SELF_TOL, f"{name} last-only (after a split) vs all_logits"),
            compare(one[0], all_rows[0], SELF_TOL, f"{name} one-token prefill vs all_logits")]
    print("\n".join(msgs))


# --------------------------------------------------------------------------------------------------
# precision="fast": the CPU's 4-bit matmuls with x as one int8 plane per group

Q4_CHECKPOINTS = [n for n, (_, bits, _) in MLX_CHECKPOINTS.items() if bits == 4]
# The fast precision's stated tolerance (docs/2026-12-01-cpu-prefill.md): it does NOT meet oracle.md's bf16 row
# (mean KL <= 2e-3, top-1 >= 98 %) on the tiny checkpoints (decode, where every 4-bit matmul including the lm_head
# rounds x, measured mean KL 1.9e-3 to 4.6e-3 and top-1 94.3 % to 97.4 %), which is why the default stays "exact";
# this bound holds the measured figures and catches a broken fast kernel (those move logits by >= 0.5).
FAST_KL = 1e-2
FAST_TOP1 = 0.93


@pytest.mark.parametrize("name", Q4_CHECKPOINTS)
def test_fast_precision_against_mlx(lily, ckpts, oracle_cache, name):
    """Mean KL(oracle || engine) and top-1 agreement of precision="fast" within its stated tolerance, for the
    prefill, for step-by-step decode (the int8 GEMV) and for batched decode (equal to decode alone); and the fast
    path is taken (its logits are not the exact path's) in decode and in a short prefill. A long prefill may equal
    the exact one: an expert routed more than `rows_tokens_max` tokens (64 for fast) runs the dequantized f32 tile
    in both precisions, faster there and exact."""
    from test_kv_cache import kl_and_top1

    toks = tokens_for(ckpts, name)
    ref = oracle_cache.logits(name, toks)
    fast = _engine(lily, ckpts, name, precision="fast")
    assert fast.precision == "fast"
    pre = fast.prefill(toks.tolist(), all_logits=True)
    fast.reset()
    dec = np.stack([fast.decode(t) for t in toks.tolist()])
    exact = _engine(lily, ckpts, name).prefill(toks.tolist(), all_logits=True)
    msgs, ok = [], True
    for got, what in ((pre, "prefill"), (dec, "decode")):
        kl, top1 = kl_and_top1(got, ref)
        d = np.abs(got - ref).max()
        msgs.append(f"{name} fast {what} vs MLX-LM: mean KL {kl:.2e}, top-1 {top1:.2%}, max|Δ| {d:.3e}")
        ok &= bool(np.isfinite(got).all() and kl <= FAST_KL and top1 >= FAST_TOP1)
    kl_e, top1_e = kl_and_top1(exact, ref)
    msgs.append(f"{name} exact prefill vs MLX-LM: mean KL {kl_e:.2e}, top-1 {top1_e:.2%}")
    print("\n".join(msgs))
    assert ok, "\n".join(msgs)
    assert np.abs(dec - exact).max() > ORACLE_TOL, "fast decode equals the exact prefill: the fast path was not taken"
    # Batched decode (issue 16: the one-plane batched row kernels): three sequences fed the same tokens, started
    # LAG steps apart, so each step's batch (1-3 rows) mixes positions, tokens and experts. Each sequence's logits
    # must meet the same tolerance against MLX-LM, and be the lone decode's within fp32 tolerance (the batched
    # kernels give each token the row kernel's numbers bit for bit; only the MoE's sum over experts may reorder).
    lag, n = 5, len(toks)
    fast.reset()
    seqs = [0, fast.new_sequence(), fast.new_sequence()]
    rows: list[list[np.ndarray]] = [[] for _ in seqs]
    for step in range(n + lag * (len(seqs) - 1)):
        live = [(i, step - lag * i) for i in range(len(seqs)) if 0 <= step - lag * i < n]
        got = fast.decode_batch([(seqs[i], int(toks[p])) for i, p in live])
        for (i, _), row in zip(live, got):
            rows[i].append(row)
    for i, r in enumerate(rows):
        got = np.stack(r)
        kl, top1 = kl_and_top1(got, ref)
        d = np.abs(got - dec).max()
        print(f"{name} fast batched decode, sequence {i} vs MLX-LM: mean KL {kl:.2e}, top-1 {top1:.2%}; "
              f"vs decode alone max|Δ| {d:.2e}")
        assert np.isfinite(got).all() and kl <= FAST_KL and top1 >= FAST_TOP1, (i, kl, top1)
        assert d <= 1e-4, (i, d)
    for s in seqs[1:]:
        fast.drop_sequence(s)
    # 16 tokens: past the batched-decode sizes (<= 8), so the prefill path, with at most 16 pairs per expert, all
    # on the int8 row kernel in fast.
    short = toks[:16].tolist()
    fast.reset()
    pre16 = fast.prefill(short, all_logits=True)
    exact16 = _engine(lily, ckpts, name).prefill(short, all_logits=True)
    assert np.abs(pre16 - exact16).max() > ORACLE_TOL, "fast prefill equals the exact one: the fast path was not taken"


def test_precision_is_checked(lily, ckpts):
    with pytest.raises(ValueError, match="precision"):
        _engine(lily, ckpts, "tiny-s0-q4g64", precision="int8")
    assert _engine(lily, ckpts, "tiny-s0-q4g64").precision == "exact"
