"""Prefix reuse: snapshots of the DeltaNet states + the KV rows still in the cache give the same
logits as recomputing the prefix, and a snapshot whose tokens were overwritten is refused."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="module")
def engine(lily, ckpts):
    return lily.Engine(ckpts.path("real-s0-q4g64"), backend="cpu", max_seq=512)


def toks(seed, n, vocab=512):
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def test_restore_continues_like_a_recompute(lily, engine):
    system, turn1, turn2 = toks(1, 70), toks(2, 30), toks(3, 20)
    engine.reset()
    engine.prefill(system)
    snap = engine.snapshot()
    assert snap.position == 70 and snap.tokens == system
    engine.prefill(turn1)
    engine.decode(5)
    engine.restore(snap)
    assert engine.position == 70
    reused = engine.prefill(turn2, all_logits=True)
    engine.reset()
    fresh = engine.prefill(system + turn2, all_logits=True)[70:]
    # turn2's attention runs in other key blocks and chunks than in the recompute: equal up to fp32
    # rounding (oracle.md, same engine, other order: 1e-4; seen 1.05e-5 with the register-tiled P.V).
    assert np.abs(reused - fresh).max() <= 1e-4


def test_restore_forward_to_a_later_snapshot(engine):
    a, b = toks(4, 40), toks(5, 25)
    engine.reset()
    engine.prefill(a)
    early = engine.snapshot()
    engine.prefill(b)
    late = engine.snapshot()
    expected = engine.decode(7)
    engine.restore(early)
    engine.restore(late)  # rows of `b` are still cached: nothing was written over them
    assert engine.position == 65
    assert np.abs(engine.decode(7) - expected).max() <= 1e-6
    assert engine.cached_prefix(a + b + [7, 9]) == 66


def test_overwritten_snapshot_is_refused_and_changes_nothing(engine):
    a, b, c = toks(6, 30), toks(7, 10), toks(8, 10)
    engine.reset()
    engine.prefill(a)
    early = engine.snapshot()
    engine.prefill(b)
    late = engine.snapshot()
    engine.restore(early)
    engine.prefill(c)  # writes over b's rows
    before = engine.position
    with pytest.raises(ValueError, match="snapshot"):
        engine.restore(late)
    assert engine.position == before
    engine.restore(early)  # a is still there
    assert engine.position == 30


def test_snapshot_of_another_engine_is_refused(lily, ckpts, engine):
    other = lily.Engine(ckpts.path("real-s0-q4g64"), backend="cpu", max_seq=64)
    other.prefill([1, 2, 3])
    snap = other.snapshot()
    engine.reset()
    engine.prefill([1, 2, 3])
    with pytest.raises(ValueError):
        engine.restore(snap)


def test_reset_invalidates_nothing_it_should_not(engine):
    # After reset, the same tokens rewrite the same rows: an old snapshot of them is valid again.
    a = toks(9, 12)
    engine.reset()
    engine.prefill(a)
    snap = engine.snapshot()
    expected = engine.decode(3)
    engine.reset()
    engine.prefill(a[:5])
    with pytest.raises(ValueError):
        engine.restore(snap)
    engine.prefill(a[5:])
    engine.restore(snap)
    # The KV rows were recomputed in other chunks: equal up to fp32 rounding (oracle.md: 1e-4).
    assert np.abs(engine.decode(3) - expected).max() <= 1e-4
