"""What the simulated-GPU test files (test_metal_sim.py, test_cuda_sim.py) share: the clang-19 requirement,
opening an engine, the decode check against the CPU backend and MLX-LM, and the errors every engine raises."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from test_oracle import ORACLE_TOL, SELF_TOL, compare, tokens_for


def require_clang(gpu: str) -> None:
    """Skip (with the reason) where clang++-19 is absent, unless ``LILY_REQUIRE_<GPU>_SIM=1`` (CI): then fail.
    ``gpu``: "metal" or "cuda"; ``LILY_<GPU>_SIM_CXX`` names another compiler."""
    key = gpu.upper()
    if shutil.which(os.environ.get(f"LILY_{key}_SIM_CXX", "clang++-19")) is not None:
        return
    why = f"clang++-19 is required for the {gpu.title()} simulator tests (apt-get install -y clang-19)"
    if os.environ.get(f"LILY_REQUIRE_{key}_SIM") == "1":
        pytest.fail(why)
    pytest.skip(why)


def engine(lily, ckpts, name: str, backend: str, max_seq: int, kv_dtype: str = "f32"):
    """An engine on ``backend`` for checkpoint ``name``; an f32 KV cache unless asked (the fp32 tolerances are
    checked against it)."""
    eng = lily.Engine(str(ckpts.path(name)), backend=backend, max_seq=max_seq, kv_dtype=kv_dtype)
    assert eng.backend == backend
    return eng


def check_decode(lily, ckpts, oracle_cache, backend: str, name: str, n_prefill: int, n_tokens: int, max_seq: int):
    """Prefill ``n_prefill`` tokens, then decode the rest of the first ``n_tokens`` teacher-forced, on ``backend``
    and on the CPU backend: each step's logits within SELF_TOL of the CPU's and ORACLE_TOL of MLX-LM's."""
    eng = engine(lily, ckpts, name, backend, max_seq)
    cpu = engine(lily, ckpts, name, "cpu", max_seq)
    toks = tokens_for(ckpts, name)[:n_tokens]
    steps = [eng.prefill(toks[:n_prefill].tolist())] + [eng.decode(t) for t in toks[n_prefill:].tolist()]
    got = np.stack(steps[:-1])
    cpu_first = cpu.prefill(toks[:n_prefill].tolist())
    want = np.stack([cpu_first] + [cpu.decode(t) for t in toks[n_prefill:-1].tolist()])
    ref = oracle_cache.logits(name, tokens_for(ckpts, name))[n_prefill - 1 : n_tokens - 1]
    print(compare(got, want, SELF_TOL, f"{name} {eng.backend} decode vs cpu decode"))
    print(compare(got, ref, ORACLE_TOL, f"{name} {eng.backend} decode vs MLX-LM"))
    assert eng.position == n_tokens


def check_errors(lily, eng, max_seq: int) -> None:
    """A token id past the vocabulary is a ValueError, a prompt of ``max_seq`` tokens a ContextFullError."""
    with pytest.raises(ValueError):
        eng.decode(10**6)
    with pytest.raises(lily.ContextFullError):
        eng.prefill(list(range(max_seq)))
