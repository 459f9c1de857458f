"""The KV cache (issue 13): 16-bit storage checked against MLX-LM past 8K tokens of context, memory that grows
in segments with the sequence and is given back on reset, snapshots across segment boundaries, and
prefill / decode consistency over several segments.

Tolerances (oracle.md): a 16-bit cache rounds every stored key and value, so it is judged as a bf16 path is:
mean KL(reference || engine) <= 2e-3 and top-1 agreement >= 98 %. Against MLX-LM running with the same
rounding of its own cache the agreement is much closer, which shows the error is the cache's and nothing else.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_tokens, require_mlx

LONG = "tiny-s3-long"
N_LONG = 9000  # past 8K, as the issue asks
TAIL = 512  # positions compared (the last ones: the longest contexts)


def kl_and_top1(got: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """Mean KL(softmax(ref) || softmax(got)) over positions and top-1 agreement."""
    g = got.astype(np.float64)
    r = ref.astype(np.float64)
    lg = g - g.max(1, keepdims=True)
    lg -= np.log(np.exp(lg).sum(1, keepdims=True))
    lr = r - r.max(1, keepdims=True)
    lr -= np.log(np.exp(lr).sum(1, keepdims=True))
    kl = float((np.exp(lr) * (lr - lg)).sum(1).mean())
    return kl, float((g.argmax(1) == r.argmax(1)).mean())


def mlx_tail_logits(folder, tokens: np.ndarray, kv: str | None) -> np.ndarray:
    """MLX-LM (fp32 weights and activations) teacher-forced logits of the last TAIL positions; with ``kv`` its
    attention caches store keys and values in that 16-bit dtype (rounded as stored, widened as read)."""
    import mlx.core as mx
    from lily.mlx_reference import load_mlx_model
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    model, _ = load_mlx_model(folder, "float32")
    cache = make_prompt_cache(model)
    if kv is not None:
        dt = {"bf16": mx.bfloat16, "f16": mx.float16}[kv]

        class Rounded(KVCache):
            def update_and_fetch(self, keys, values):
                k, v = super().update_and_fetch(keys.astype(dt), values.astype(dt))
                return k.astype(mx.float32), v.astype(mx.float32)

        cache = [Rounded() if isinstance(c, KVCache) else c for c in cache]
    out = model(mx.array(tokens.astype(np.int32))[None], cache=cache)[0, -TAIL:].astype(mx.float32)
    mx.eval(out)
    return np.array(out)


@pytest.fixture(scope="module")
def long_case(ckpts):
    require_mlx()
    folder = ckpts.path(LONG)
    toks = make_tokens(77, N_LONG, ckpts.vocab_size(LONG))
    return folder, toks, {kv: mlx_tail_logits(folder, toks, kv) for kv in (None, "bf16", "f16")}


@pytest.mark.parametrize("kv_dtype", ["bf16", "f16"])
def test_16bit_cache_matches_mlx_past_8k(lily, long_case, kv_dtype):
    folder, toks, ref = long_case
    eng = lily.Engine(str(folder), backend="cpu", kv_dtype=kv_dtype)
    assert eng.kv_dtype == kv_dtype
    got = eng.prefill(toks.tolist(), all_logits=True)[-TAIL:]
    kl, top1 = kl_and_top1(got, ref[None])
    print(f"{kv_dtype} KV vs MLX-LM fp32, {N_LONG} tokens: mean KL {kl:.2e}, top-1 {top1:.2%}")
    assert kl <= 2e-3 and top1 >= 0.98, (kl, top1)
    kl16, top16 = kl_and_top1(got, ref[kv_dtype])
    print(f"{kv_dtype} KV vs MLX-LM with a {kv_dtype} cache: mean KL {kl16:.2e}, top-1 {top16:.2%}")
    assert kl16 <= 2e-3 and top16 >= 0.98, (kl16, top16)
    # The 16-bit cache really rounds: the fp32 cache is closer to the fp32 oracle.
    f32 = lily.Engine(str(folder), backend="cpu", kv_dtype="f32").prefill(toks.tolist(), all_logits=True)[-TAIL:]
    assert np.abs(f32 - ref[None]).max() < np.abs(got - ref[None]).max()


def test_bf16_cache_decode_matches_mlx_past_8k(lily, long_case):
    """Decode attention (one token a step: split over the keys; the widening kernels by default, the vdpbf16ps
    kernels with q and the softmax weights split into bf16 hi + lo under LILY_CPU_ISA=avx512bf16, which the op
    tests check against the reference) over the last positions of the long case,
    against MLX-LM: the prefill test above never runs the decode kernels. Against MLX-LM with the same bf16
    cache only summation order and the split (2^-16 relative) differ: ~1e-12 KL, held to 1e-6 (this tiny model
    stays within the bf16-path tolerance even with every second V row dropped: 3.9e-4 KL, top-1 98.4 %)."""
    folder, toks, ref = long_case
    eng = lily.Engine(str(folder), backend="cpu", kv_dtype="bf16")
    eng.prefill(toks[:-TAIL].tolist())
    got = np.stack([eng.decode(int(t)) for t in toks[-TAIL:]])
    for name in (None, "bf16"):
        kl, top1 = kl_and_top1(got, ref[name])
        print(f"bf16 KV, decode, vs MLX-LM with a {name or 'fp32'} cache: mean KL {kl:.2e}, top-1 {top1:.2%}")
        assert kl <= 2e-3 and top1 >= 0.98, (name, kl, top1)
    assert kl <= 1e-6 and top1 >= 0.99, (kl, top1)  # against the bf16 cache (the loop's last)


def test_cache_grows_in_segments_and_reset_gives_memory_back(lily, ckpts):
    folder = ckpts.path(LONG)
    cfg = ckpts.config(LONG)["text_config"]
    row = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2  # K + V, bf16, per attention layer
    layers = sum(1 for i in range(cfg["num_hidden_layers"]) if (i + 1) % cfg["full_attention_interval"] == 0)
    eng = lily.Engine(str(folder), backend="cpu")
    assert eng.max_seq == cfg["max_position_embeddings"]  # the model's context: nothing allocated for it
    first = eng.kv_bytes
    assert 0 < first <= 4096 * row * layers, first  # one segment from the start
    toks = make_tokens(5, 3000, ckpts.vocab_size(LONG)).tolist()
    eng.prefill(toks)
    grown = eng.kv_bytes
    assert 3000 * row * layers <= grown <= (3000 + 1024) * row * layers, grown
    eng.reset()
    assert eng.kv_bytes == first
    f32 = lily.Engine(str(folder), backend="cpu", kv_dtype="f32")
    f32.prefill(toks)
    assert f32.kv_bytes == 2 * grown


def test_prefill_and_decode_agree_across_segments(lily, ckpts):
    """Prefill of a context spanning several 1024-row segments, then decode across the next boundary, equals
    one prefill of everything (same engine path, 16-bit cache: within the self-consistency tolerance)."""
    folder = ckpts.path(LONG)
    toks = make_tokens(11, 2060, ckpts.vocab_size(LONG)).tolist()
    whole = lily.Engine(str(folder), backend="cpu").prefill(toks, all_logits=True)
    eng = lily.Engine(str(folder), backend="cpu", prefill_chunk=700)
    got = [eng.prefill(toks[:2040], all_logits=True)[-1]]
    for t in toks[2040:-1]:
        got.append(eng.decode(t))  # rows 2040..2058: cross row 2048
    err = np.abs(np.stack(got) - whole[2039:-1]).max()
    assert err <= 1e-4, err


def test_decode_greedy_crosses_a_segment_boundary(lily, ckpts):
    """decode_greedy makes room in the cache as decode does: greedy steps across row 2048 pick the argmax of
    decode's logits."""
    folder = ckpts.path(LONG)
    toks = make_tokens(12, 2046, ckpts.vocab_size(LONG)).tolist()
    greedy, plain = (lily.Engine(str(folder), backend="cpu") for _ in range(2))
    tok = want = int(np.argmax(greedy.prefill(toks)))
    plain.prefill(toks)
    for _ in range(4):  # rows 2046..2049
        tok, want = greedy.decode_greedy(tok), int(np.argmax(plain.decode(want)))
        assert tok == want
    assert greedy.position == plain.position == 2050


def test_snapshot_restore_across_segment_boundaries(lily, ckpts):
    folder = ckpts.path(LONG)
    vocab = ckpts.vocab_size(LONG)
    prefix = make_tokens(21, 1500, vocab).tolist()
    a, b = make_tokens(22, 700, vocab).tolist(), make_tokens(23, 40, vocab).tolist()
    eng = lily.Engine(str(folder), backend="cpu")
    eng.prefill(prefix)
    snap = eng.snapshot()  # inside the second segment
    eng.prefill(a)  # into the third
    eng.restore(snap)
    assert eng.position == len(prefix)
    got = eng.prefill(b)
    want = lily.Engine(str(folder), backend="cpu").prefill(prefix + b)
    assert np.abs(got - want).max() <= 1e-4
    eng.reset()  # back to one segment: the snapshot's rows are gone, so it must be refused
    eng.prefill(prefix[:10])
    with pytest.raises(ValueError):
        eng.restore(snap)


def test_bad_kv_dtype(lily, ckpts):
    with pytest.raises(ValueError, match="kv_dtype"):
        lily.Engine(str(ckpts.path("tiny-s0")), backend="cpu", kv_dtype="int8")


_PEAK = r"""
import resource, sys
import lily
import numpy as np
folder, n = sys.argv[1], int(sys.argv[2])
eng = lily.Engine(folder, backend="cpu", prefill_chunk=256)
toks = np.random.default_rng(0).integers(0, eng.vocab_size, n).tolist()
eng.prefill(toks[:8])  # warm: the pool, the first chunk's scratch
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
eng.prefill(toks[8:])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(base * 1024, peak * 1024, eng.kv_bytes)
"""


def test_prefill_memory_is_bounded_by_kv_growth(ckpts):
    """A long prefill's peak memory grows with the KV rows it writes and nothing else: the activations are one
    chunk's whatever the prompt length (measured as peak RSS in a fresh process, 2K vs 16K tokens)."""
    import subprocess
    import sys

    folder = str(ckpts.path(LONG))
    runs = {}
    for n in (2048, 16384):
        out = subprocess.run([sys.executable, "-c", _PEAK, folder, str(n)], capture_output=True, text=True, check=True)
        base, peak, kv = map(int, out.stdout.split())
        runs[n] = (peak - base, kv)
    (grow_s, kv_s), (grow_l, kv_l) = runs[2048], runs[16384]
    # Past the KV the long prefill may not take more than a few MiB beyond the short one (allocator noise).
    assert grow_l - grow_s <= (kv_l - kv_s) + (8 << 20), runs


def test_fill_context_reaches_depth_without_prefill(lily, ckpts):
    """``fill_context`` (what the long-context benchmark uses past a real prefill) writes rows that attention reads,
    grows the cache like a prefill of that length, matches no token, and refuses to pass max_seq."""
    folder = str(ckpts.path(LONG))
    cfg = ckpts.config(LONG)["text_config"]
    row = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    layers = sum(1 for i in range(cfg["num_hidden_layers"]) if (i + 1) % cfg["full_attention_interval"] == 0)
    eng = lily.Engine(folder, backend="cpu", max_seq=4096)
    eng.fill_context(3000, seed=1)
    assert eng.position == 3000
    assert 3000 * row * layers <= eng.kv_bytes <= (3000 + 1024) * row * layers
    assert eng.cached_prefix([0, 1, 2]) == 0
    got = eng.decode(5)
    assert np.isfinite(got).all()
    other = lily.Engine(folder, backend="cpu", max_seq=4096)
    other.fill_context(3000, seed=2)
    assert np.abs(other.decode(5) - got).max() > 1e-3  # different rows, different attention output
    same = lily.Engine(folder, backend="cpu", max_seq=4096)
    same.fill_context(1000, seed=1)  # the rows depend on the seed and the position only, not the call's size
    same.fill_context(2000, seed=1)
    assert same.position == 3000
    assert np.array_equal(same.decode(5), got)
    with pytest.raises(lily.ContextFullError):
        eng.fill_context(2000)
    assert eng.position == 3001
    with pytest.raises(ValueError):
        eng.fill_context(0)
