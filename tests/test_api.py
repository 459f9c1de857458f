"""The Engine contract beyond numbers: shapes, dtypes, properties, state, the GIL, loading
without copying the weights, and the equivalence of the production and reference CPU kernels
over a whole forward pass."""

from __future__ import annotations

import resource
import threading
import time

import numpy as np
import pytest


def test_shapes_and_properties(lily, ckpts):
    path = ckpts.path("real-s0-q4g64")
    eng = lily.Engine(path, backend="cpu", max_seq=300)
    vocab = ckpts.vocab_size("real-s0-q4g64")
    assert eng.backend == "cpu" and eng.max_seq == 300 and eng.vocab_size == vocab and eng.position == 0
    assert eng.config["model_type"] == "qwen3_5_moe"
    out = eng.prefill([1, 2, 3])
    assert out.shape == (vocab,) and out.dtype == np.float32
    allv = eng.prefill(np.array([4, 5], dtype=np.int64), all_logits=True)
    assert allv.shape == (2, vocab) and allv.dtype == np.float32
    assert eng.position == 5
    assert eng.decode(6).shape == (vocab,)
    assert eng.position == 6
    eng.reset()
    assert eng.position == 0
    assert "cpu" in repr(eng)


def test_auto_backend_is_cpu_on_linux(lily, tiny_hf):
    assert lily.Engine(tiny_hf).backend == "cpu"


def test_reset_gives_a_fresh_sequence(lily, tiny_hf):
    eng = lily.Engine(tiny_hf, backend="cpu")
    first = eng.prefill([5, 6, 7, 8])
    eng.decode(9)
    eng.reset()
    np.testing.assert_array_equal(eng.prefill([5, 6, 7, 8]), first)


def test_reference_kernels_agree_on_a_whole_forward(lily, ckpts):
    # The plain-loop twins through the same model code: catches a production kernel that
    # only goes wrong in context (strides, chunk boundaries, expert grouping). An f32 KV cache:
    # with bf16 rows, a K or V value on a rounding boundary rounds one way in one engine and the
    # other way in the other (1.8e-4 apart here), which says nothing about the kernels.
    path = ckpts.path("real-s0-q4g64")
    toks = list(np.random.default_rng(3).integers(0, ckpts.vocab_size("real-s0-q4g64"), 80))
    fast = lily.Engine(path, backend="cpu", kv_dtype="f32").prefill(toks, all_logits=True)
    ref = lily.Engine(path, backend="cpu-reference", kv_dtype="f32").prefill(toks, all_logits=True)
    assert np.abs(fast - ref).max() <= 1e-4


def test_gil_is_released_during_prefill(lily, ckpts):
    eng = lily.Engine(ckpts.path("real-s0"), backend="cpu")
    toks = list(range(1, 250))
    done = threading.Event()
    ticks = 0

    def run():
        eng.prefill(toks)
        done.set()

    worker = threading.Thread(target=run)
    start = time.perf_counter()
    worker.start()
    while not done.is_set():
        ticks += 1
        time.sleep(0.001)
    worker.join()
    elapsed = time.perf_counter() - start
    # The main thread kept running while the prefill computed (a held GIL would give ~1 tick).
    assert elapsed < 0.05 or ticks >= 5, f"{ticks} ticks in {elapsed:.3f}s"


def test_progress_callback_sees_every_layer(lily, tiny_hf, ckpts):
    seen = []
    lily.Engine(tiny_hf, backend="cpu", progress=lambda done, total: seen.append((done, total)))
    layers = ckpts.config("tiny-s0")["text_config"]["num_hidden_layers"]
    assert seen == [(i + 1, layers) for i in range(layers)]


def test_weights_are_mapped_not_copied(lily, ckpts):
    # Loading must not cost the checkpoint's size in private memory: quantized weights stay
    # in the (shared, evictable) file mapping. Measured as the growth of the peak RSS of this
    # process against the size of the weight files.
    path = ckpts.path("real-s0")
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    eng = lily.Engine(path, backend="cpu", max_seq=64)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert eng.position == 0
    if after - before > 0.5 * size:
        pytest.fail(f"loading grew peak RSS by {after - before} bytes for {size} bytes of weights")
