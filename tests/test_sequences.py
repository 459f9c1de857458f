"""Many sequences in one engine: forks continue like the original, sequences do not disturb each
other, and a batched decode step gives each sequence the logits it gets when decoded alone."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="module")
def engine(lily, ckpts):
    # f32 KV rows: a batched step and a lone step then see bit-identical caches.
    return lily.Engine(ckpts.path("real-s0-q4g64"), backend="cpu", max_seq=512, kv_dtype="f32")


@pytest.fixture(scope="module")
def fast_engine(lily, ckpts):
    # The fast precision: one int8 plane of x, so batched steps run the one-plane batched row kernels.
    return lily.Engine(ckpts.path("real-s0-q4g64"), backend="cpu", max_seq=512, kv_dtype="f32", precision="fast")


def toks(seed, n, vocab=512):
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def test_fork_continues_like_the_original_and_independently(engine):
    engine.reset()
    engine.prefill(toks(1, 50))
    child = engine.fork()
    assert engine.sequence_position(child) == 50
    assert engine.sequence_tokens(child) == engine.sequence_tokens(0)
    nxt = toks(2, 9)
    a = engine.prefill(nxt, all_logits=True)
    b = engine.prefill(nxt, all_logits=True, seq=child)
    assert np.abs(a - b).max() <= 1e-6
    # The child goes its own way; the parent is not disturbed by it.
    engine.prefill(toks(3, 20), seq=child)
    assert engine.position == 59 and engine.sequence_position(child) == 79
    expected = engine.decode(11)
    engine.reset()
    engine.prefill(toks(1, 50) + nxt)
    assert np.abs(engine.decode(11) - expected).max() <= 1e-5
    engine.drop_sequence(child)
    assert child not in engine.sequences


def test_copy_sequence_resumes_a_kept_prefix(engine):
    keep = engine.new_sequence()
    engine.prefill(toks(4, 70), seq=keep)
    work = engine.new_sequence()
    engine.prefill(toks(5, 300), seq=work)  # longer: its extra segments must go
    engine.copy_sequence(keep, work)
    assert engine.sequence_position(work) == 70
    resumed = engine.prefill(toks(6, 12), all_logits=True, seq=work)
    cold = engine.new_sequence()
    fresh = engine.prefill(toks(4, 70) + toks(6, 12), all_logits=True, seq=cold)[70:]
    assert np.abs(resumed - fresh).max() <= 1e-5
    for s in (keep, work, cold):
        engine.drop_sequence(s)


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("n", [1, 3, 5])
def test_batched_decode_equals_each_sequence_alone(request, precision, n):
    engine = request.getfixturevalue("engine" if precision == "exact" else "fast_engine")
    assert engine.precision == precision
    seqs = [engine.new_sequence() for _ in range(n)]
    twins = []
    for i, s in enumerate(seqs):
        engine.prefill(toks(10 + i, 5 + 17 * i), seq=s)  # each at its own position
        twins.append(engine.fork(s))
    for step in range(4):
        batch = [(s, (7 * i + step) % 500) for i, s in enumerate(seqs)]
        got = engine.decode_batch(batch)
        assert got.shape == (n, engine.vocab_size)
        for i, (t, (_, token)) in enumerate(zip(twins, batch)):
            alone = engine.decode(token, seq=t)
            assert np.abs(got[i] - alone).max() <= 1e-4, (step, i)
    for s in seqs:
        assert engine.sequence_position(s) == engine.sequence_position(twins[seqs.index(s)])
    for s in seqs + twins:
        engine.drop_sequence(s)


@pytest.mark.parametrize("n", [1, 5, 17])
def test_batched_greedy_decode_picks_each_sequence_argmax(engine, n):
    # 17 sequences: more than the engine's 16 rows of logits at a time.
    seqs = [engine.new_sequence() for _ in range(n)]
    for i, s in enumerate(seqs):
        engine.prefill(toks(40 + i, 3 + 5 * i), seq=s)
    twins = [engine.fork(s) for s in seqs]
    tokens = [(3 * i + 1) % 500 for i in range(n)]
    for step in range(2):
        got = engine.decode_batch_greedy(list(zip(seqs, tokens)))
        want = engine.decode_batch(list(zip(twins, tokens)))
        assert got == [int(t) for t in np.argmax(want, axis=1)], step
        tokens = got
    assert [engine.sequence_position(s) for s in seqs] == [engine.sequence_position(t) for t in twins]
    with pytest.raises(ValueError, match="twice"):
        engine.decode_batch_greedy([(seqs[0], 1), (seqs[0], 2)])
    assert engine.sequence_position(seqs[0]) == engine.sequence_position(twins[0])
    for s in seqs + twins:
        engine.drop_sequence(s)


def test_bad_sequence_calls_raise_and_change_nothing(engine):
    s = engine.new_sequence()
    engine.prefill(toks(20, 10), seq=s)
    with pytest.raises(ValueError, match="no sequence"):
        engine.decode(1, seq=10_000)
    with pytest.raises(ValueError, match="no sequence"):
        engine.prefill([1], seq=-1)
    with pytest.raises(ValueError, match="twice"):
        engine.decode_batch([(s, 1), (s, 2)])
    with pytest.raises(ValueError, match="out of range"):
        engine.decode_batch([(s, 1), (0, 10**9)])
    with pytest.raises(ValueError, match="no sequences"):
        engine.decode_batch([])
    with pytest.raises(ValueError, match="default sequence"):
        engine.drop_sequence(0)
    assert engine.sequence_position(s) == 10
    engine.drop_sequence(s)
    with pytest.raises(ValueError, match="no sequence"):
        engine.drop_sequence(s)
    with pytest.raises(ValueError, match="no sequence"):
        engine.sequence_bytes(s)
