"""The CUDA backend end to end through the CUDA simulator (``backend="cuda-sim"``): the engine's real CUDA
command stream (kernels, arguments, grids) executed on the CPU by tools/cuda-sim, against MLX-LM
teacher-forced logits and against the CPU backend.

Two precisions (oracle.md): with every matmul on the f32 GEMV (``LILY_CUDA_GEMV_TOKENS`` raised) the
fp32 tolerances hold (max |Δlogit| <= 1e-3 vs the fp32 oracle with top-1 agreement, <= 1e-4 vs the CPU
backend); with the default plan the prefill matmuls run on the bf16 tensor cores, judged by the bf16 rows
(mean KL <= 2e-3, argmax agreement >= 98 %). Decode steps (GEMVs, f32) are checked at fp32 tolerances. The
simulator is slow, so sequences are short. Needs clang-19 (``apt-get install -y clang-19``); skipped with
a message where it is absent unless ``LILY_REQUIRE_CUDA_SIM=1``.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_sim import check_decode, check_errors, engine, require_clang
from test_oracle import ORACLE_TOL, compare, tokens_for

N_TOKENS = 40
MAX_SEQ = 64
BF16_KL = 2e-3
BF16_TOP1 = 0.98


@pytest.fixture(scope="module", autouse=True)
def _need_clang():
    require_clang("cuda")


def _engine(lily, ckpts, name, backend="cuda-sim", kv_dtype="f32"):
    return engine(lily, ckpts, name, backend, MAX_SEQ, kv_dtype)


def compare_bf16(got: np.ndarray, ref: np.ndarray, what: str) -> str:
    """The bf16 rows of oracle.md: mean KL(ref || got) <= 2e-3 and argmax agreement >= 98 %."""
    g = got.astype(np.float64)
    r = ref.astype(np.float64)
    assert np.isfinite(g).all(), f"{what}: non-finite logits"
    lp = r - r.max(1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(1, keepdims=True))
    lq = g - g.max(1, keepdims=True)
    lq -= np.log(np.exp(lq).sum(1, keepdims=True))
    kl = (np.exp(lp) * (lp - lq)).sum(1)
    top1 = float((g.argmax(1) == r.argmax(1)).mean())
    summary = f"{what}: mean KL {kl.mean():.2e} (max {kl.max():.2e}), top-1 agreement {top1:.2%}"
    assert kl.mean() <= BF16_KL and top1 >= BF16_TOP1, summary
    return summary


# Two checkpoints (the simulator is slow; every weight format is checked per kernel in cuda_sim.rs): 4-bit
# at tiny shapes over 40 tokens, and the real head shapes.
@pytest.mark.parametrize("name", ["tiny-s0-q4g64", "real-s0-q4g64"])
def test_cuda_sim_prefill_f32_matches_mlx(lily, ckpts, oracle_cache, monkeypatch, name):
    monkeypatch.setenv("LILY_CUDA_GEMV_TOKENS", "100000")  # every matmul on the f32 GEMV
    n = 12 if name.startswith("real") else N_TOKENS
    toks = tokens_for(ckpts, name)
    ref = oracle_cache.logits(name, toks)[:n]
    got = _engine(lily, ckpts, name).prefill(toks[:n].tolist(), all_logits=True).reshape(n, -1)
    print(compare(got, ref, ORACLE_TOL, f"{name} cuda-sim f32 prefill vs MLX-LM"))


@pytest.mark.parametrize("name", ["real-s0-q4g64"])
def test_cuda_sim_prefill_tensor_cores_match_mlx_at_bf16_tolerance(lily, ckpts, oracle_cache, name):
    n = 12
    toks = tokens_for(ckpts, name)
    ref = oracle_cache.logits(name, toks)[:n]
    got = _engine(lily, ckpts, name, kv_dtype="bf16").prefill(toks[:n].tolist(), all_logits=True).reshape(n, -1)
    print(compare_bf16(got, ref, f"{name} cuda-sim prefill (bf16 tensor-core GEMMs, bf16 KV cache) vs MLX-LM"))


def test_cuda_sim_decode_matches_cpu_and_mlx(lily, ckpts, oracle_cache, monkeypatch):
    # A short prefill (T <= 8: the f32 GEMVs), then decode steps: split attention, step recurrence,
    # per-token MoE, and from the third step on the same command list every step.
    name, n_prefill = "tiny-s1-theta1e3", 6
    check_decode(lily, ckpts, oracle_cache, "cuda-sim", name, n_prefill, N_TOKENS, MAX_SEQ)


def test_cuda_sim_reset_snapshot_and_errors(lily, ckpts):
    eng = _engine(lily, ckpts, "tiny-s0")
    a = eng.prefill([1, 2, 3])
    snap = eng.snapshot()
    b = eng.decode(4)
    eng.restore(snap)
    np.testing.assert_array_equal(eng.decode(4), b)
    eng.reset()
    np.testing.assert_array_equal(eng.prefill([1, 2, 3]), a)
    check_errors(lily, eng, MAX_SEQ)


def test_missing_compiler_is_a_device_error(lily, ckpts, monkeypatch, tmp_path):
    monkeypatch.setenv("LILY_CUDA_SIM_CXX", "/nonexistent/clang++-19")
    monkeypatch.setenv("LILY_CUDA_SIM_CACHE", str(tmp_path))  # an empty cache: the compiler is needed
    with pytest.raises(lily.DeviceError, match="clang"):
        lily.Engine(str(ckpts.path("tiny-s0")), backend="cuda-sim", max_seq=MAX_SEQ)


def test_cuda_sim_decode_greedy_picks_the_argmax(lily, ckpts):
    eng = _engine(lily, ckpts, "tiny-s0")
    cpu = _engine(lily, ckpts, "tiny-s0", backend="cpu")
    tok = int(np.argmax(eng.prefill([5, 6, 7])))
    want = int(np.argmax(cpu.prefill([5, 6, 7])))
    assert tok == want
    for _ in range(4):
        tok, want = eng.decode_greedy(tok), int(np.argmax(cpu.decode(want)))
        assert tok == want
    assert eng.position == cpu.position == 7
