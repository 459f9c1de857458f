"""Sequence state export / import (``Engine.export_sequence`` / ``import_sequence``): a state written
back into a fresh sequence, of this engine or of a new one, continues exactly like the original (the
next decode step's logits) on the CPU and through the simulated Metal backend; a state that does not
fit the engine is a typed error that changes nothing."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

BACKENDS = ["cpu", "metal-sim"]


def toks(seed, n, vocab=512):
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def _need(backend):
    if backend == "metal-sim" and shutil.which(os.environ.get("LILY_METAL_SIM_CXX", "clang++-19")) is None:
        if os.environ.get("LILY_REQUIRE_METAL_SIM") == "1":
            pytest.fail("clang++-19 is required for the Metal simulator tests (apt-get install -y clang-19)")
        pytest.skip("clang++-19 not found: the Metal simulator tests need it (apt-get install -y clang-19)")


def _engine(lily, ckpts, backend, kv_dtype, name="real-s0-q4g64"):
    _need(backend)
    return lily.Engine(ckpts.path(name), backend=backend, max_seq=128, kv_dtype=kv_dtype, prefill_chunk=16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_dtype", ["bf16", "f32"])
def test_round_trip_continues_like_the_original(lily, ckpts, backend, kv_dtype):
    # 37 tokens: two full prefill chunks and a partial one; the KV segment (LILY_KV_SEGMENT_ROWS
    # unset: the default) is only partly filled.
    n = 37 if backend == "cpu" else 21
    src = _engine(lily, ckpts, backend, kv_dtype)
    src.prefill(toks(1, n))
    tokens, dtype, tensors = src.export_sequence()
    assert tokens == toks(1, n) and dtype == kv_dtype
    kv = [k for k in tensors if k.endswith(".k")]
    assert kv and all(tensors[k].shape[0] == n for k in kv)
    assert tensors[kv[0]].dtype == (np.float32 if kv_dtype == "f32" else np.uint16)

    dst = _engine(lily, ckpts, backend, kv_dtype)  # a new engine: what a new process sees
    dst.prefill(toks(2, 60))  # held something else before: all of it must go
    dst.import_sequence(tokens, dtype, tensors)
    assert dst.position == n and dst.sequence_tokens(0) == tokens
    again = dst.export_sequence()
    assert again[0] == tokens
    for name, arr in tensors.items():
        assert np.array_equal(again[2][name], arr), name
    expected = src.decode(7)
    got = dst.decode(7)
    assert np.abs(got - expected).max() <= 1e-5
    # Into another sequence of the same engine, too.
    s = src.new_sequence()
    src.import_sequence(tokens, dtype, tensors, seq=s)
    assert np.abs(src.decode(7, seq=s) - expected).max() <= 1e-5
    # From a first row on (what the disk tier writes after a file it extends): those rows, the same states.
    first, _, part = dst.export_sequence(first_row=n - 5)
    whole = dst.export_sequence()[2]
    assert first == dst.sequence_tokens(0) and part.keys() == whole.keys()
    for name, arr in whole.items():
        assert np.array_equal(part[name], arr[n - 5:] if name.endswith((".k", ".v")) else arr), name


def test_bad_states_raise_and_change_nothing(lily, ckpts):
    eng = _engine(lily, ckpts, "cpu", "bf16")
    eng.prefill(toks(3, 20))
    tokens, dtype, tensors = eng.export_sequence()
    s = eng.new_sequence()
    eng.prefill(toks(4, 5), seq=s)
    before = eng.export_sequence(s)

    def refused(exc, match, **changes):
        t, d, ts = changes.pop("tokens", tokens), changes.pop("dtype", dtype), dict(changes.pop("tensors", tensors))
        with pytest.raises(exc, match=match):
            eng.import_sequence(t, d, ts, seq=s)
        after = eng.export_sequence(s)
        assert after[0] == before[0] and all(np.array_equal(after[2][k], v) for k, v in before[2].items())

    k = next(n for n in tensors if n.endswith(".k"))
    conv = next(n for n in tensors if n.endswith(".conv"))
    refused(ValueError, "cache is bf16", dtype="f16")
    refused(ValueError, "unknown kv_dtype", dtype="int4")
    refused(TypeError, "uint16", tensors={**tensors, k: tensors[k].astype(np.float32)})
    refused(ValueError, "shape", tensors={**tensors, k: tensors[k][:-1]})
    refused(ValueError, "bytes", tensors={**tensors, k: tensors[k][:, :-1]})
    refused(ValueError, "conv", tensors={**tensors, conv: tensors[conv][:-1]})
    refused(ValueError, "lacks tensor", tensors={n: v for n, v in tensors.items() if n != conv})
    refused(ValueError, "does not have", tensors={**tensors, "layers.99.k": tensors[k]})
    refused(ValueError, "out of range", tokens=[10**6] * len(tokens))
    refused(ValueError, "out of range", tokens=[-1] * len(tokens))
    long = toks(5, 129)
    refused(ValueError, "max_seq", tokens=long,
            tensors={n: (np.zeros((129, v.shape[1]), v.dtype) if v.ndim == 2 else v) for n, v in tensors.items()})
    with pytest.raises(ValueError, match="no sequence"):
        eng.import_sequence(tokens, dtype, tensors, seq=10_000)
    with pytest.raises(ValueError, match="no sequence"):
        eng.export_sequence(10_000)
    with pytest.raises(ValueError, match="first_row 21 is past"):
        eng.export_sequence(first_row=21)
    # Rows from a first row on are not a whole state: an import refuses them.
    _, _, part = eng.export_sequence(first_row=4)
    refused(ValueError, "shape", tensors=part)
