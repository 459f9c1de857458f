"""The prefix cache: a prompt resumed from a cached prefix (ending mid-chunk, at a snapshot, past one,
the identical prompt) gives the logits of a cold run; entries are evicted least recently used under a
byte bound; the radix tree finds the longest prefix among diverging conversations."""

from __future__ import annotations

import numpy as np
import pytest
from lily.prefix import PrefixCache, PrefixReuse

BOUNDARY = 3  # stands for <|im_start|>: where the last message starts


@pytest.fixture(scope="module")
def engine(lily, ckpts):
    # A small prefill chunk (32) and snapshots every 48 tokens: prompts cross both.
    return lily.Engine(ckpts.path("real-s0-q4g64"), backend="cpu", max_seq=1024, kv_dtype="f32",
                       prefill_chunk=32)


@pytest.fixture(scope="module")
def cold(lily, ckpts):
    return lily.Engine(ckpts.path("real-s0-q4g64"), backend="cpu", max_seq=1024, kv_dtype="f32",
                       prefill_chunk=32)


def toks(seed, n, vocab=512):
    # No BOUNDARY inside, so the tests place message starts themselves.
    return [int(t) + 4 for t in np.random.default_rng(seed).integers(0, vocab - 4, n)]


def cold_logits(cold, tokens):
    cold.reset()
    return cold.prefill(tokens)


def reuse(engine, max_bytes=1 << 40):
    engine.reset()
    for s in engine.sequences:
        if s:
            engine.drop_sequence(s)
    return PrefixReuse(engine, BOUNDARY, PrefixCache(engine, max_bytes, snapshot_every=48))


@pytest.mark.parametrize("first_len, second_extra", [
    (40, 25),   # the second prompt resumes at the end of the first (mid-chunk, before any snapshot)
    (96, 7),    # resumes at the end of the first, which is itself a snapshot point (2 x 48)
    (130, 30),  # resumes past snapshots at 48 and 96
])
def test_resumed_prefix_equals_a_cold_run(engine, cold, first_len, second_extra):
    r = reuse(engine)
    first = toks(1, first_len)
    r.prefill(first)
    engine.prefill(toks(9, 5))  # the sequence moves on (a reply): resuming needs the cache
    second = first + [BOUNDARY] + toks(2, second_extra)
    logits, start = r.prefill(second)
    assert start == first_len
    assert np.abs(logits - cold_logits(cold, second)).max() <= 1e-4
    info = r.cache.info()
    assert info.hits == 1 and info.tokens_saved == first_len


def test_another_conversation_resumes_from_a_shared_snapshot(engine, cold):
    r = reuse(engine)
    system = toks(3, 100)
    r.prefill(system + [BOUNDARY] + toks(4, 20))  # copies at 48, 96, 100 (last message) and the end
    other = system + [BOUNDARY] + toks(5, 30)  # same system prompt, another question
    logits, start = r.prefill(other)
    assert start == 100  # the start of the last message of the first prompt
    assert np.abs(logits - cold_logits(cold, other)).max() <= 1e-4
    partial = system[:70] + toks(6, 10)  # diverges inside the system prompt: the snapshot at 48
    logits, start = r.prefill(partial)
    assert start == 48
    assert np.abs(logits - cold_logits(cold, partial)).max() <= 1e-4


def test_identical_prompt_restores_the_end_of_prompt_state(engine, cold):
    r = reuse(engine)
    prompt = toks(7, 60)
    first, _ = r.prefill(prompt)
    engine.decode(11)
    engine.decode(12)  # a reply that the regenerated one must not continue
    again, start = r.prefill(prompt)
    assert start == 60
    assert np.array_equal(first, again)
    assert engine.position == 60
    cold_logits(cold, prompt)
    assert np.abs(engine.decode(13) - cold.decode(13)).max() <= 1e-4


def test_eviction_under_a_small_byte_bound(engine):
    probe = reuse(engine)
    probe.prefill(toks(8, 30))
    one = probe.cache.info().bytes  # one entry of 30 tokens (KV in whole segments + DeltaNet states)
    r = reuse(engine, max_bytes=2 * one)
    prompts = [toks(20 + i, 30) for i in range(4)]
    for p in prompts:
        r.prefill(p)
    info = r.cache.info()
    assert info.entries == 2 and info.bytes <= 2 * one and info.evictions == 2
    assert len(engine.sequences) == 3  # the default sequence and the two kept copies
    _, start = r.prefill(prompts[0] + toks(30, 5))  # evicted: cold
    assert start == 0
    _, start = r.prefill(prompts[3] + toks(31, 5))  # the most recent is still there
    assert start == 30
    none = reuse(engine, max_bytes=0)
    none.prefill(toks(32, 30))
    assert none.cache.info().entries == 0 and engine.sequences == [0]


def test_model_uses_the_cache_transparently(lily, ckpts):
    model = lily.load(ckpts.path("real-s0-q4g64"), backend="cpu", max_seq=512, progress=False)
    ids = [int(t) for t in np.random.default_rng(40).integers(0, 500, 80)]
    a = model.generate(ids, max_tokens=4, temperature=0)
    model.generate([1, 2, 3], max_tokens=2, temperature=0)  # another conversation in between
    b = model.generate(ids, max_tokens=4, temperature=0)
    assert a.tokens == b.tokens and b.stats.cached_prompt_tokens == 80
    info = model.cache_info()
    assert info.hits >= 1 and info.tokens_saved >= 80 and info.entries >= 2 and info.bytes > 0


def test_copies_of_one_long_sequence_share_its_whole_segments(lily, ckpts):
    # 2148 positions: two whole KV segments of 1024 rows and part of a third. Every copy the cache keeps is a
    # fork sharing the two whole segments, so it holds one partial segment (and its DeltaNet states) of its
    # own, and the cache counts the shared ones once.
    eng = lily.Engine(ckpts.path("real-s0-q4g64"), backend="cpu", max_seq=4096, kv_dtype="f32")
    eng.fill_context(2 * 1024 + 100)
    kv, full = eng.kv_bytes, eng.sequence_bytes(0)
    cache = PrefixCache(eng, max_bytes=1 << 40)
    for i in range(4):
        cache.add([1, 2, 3 + i], 0)  # four copies of one state, under four keys
    seqs = [s for s in eng.sequences if s]
    own = eng.sequence_unique_bytes(seqs[0])
    shared = full - own
    assert shared == 2 * kv // 3
    info = cache.info()
    assert (info.entries, info.bytes, info.logical_bytes) == (4, shared + 4 * own, 4 * full)
    assert eng.sequences_bytes([0, *seqs]) == full + 4 * own
    # A bound with room for two copies as shared, not as four (nor two) private copies: two are kept.
    small = PrefixCache(eng, max_bytes=shared + 2 * own)
    cache.clear()
    for i in range(4):
        small.add([1, 2, 3 + i], 0)
    info = small.info()
    assert (info.entries, info.evictions, info.bytes) == (2, 2, shared + 2 * own)
    assert len(eng.sequences) == 3
    # The source going away leaves the copies whole: a copy resumed decodes like the source did.
    want = eng.decode(7)
    eng.reset()
    entry = small.longest([1, 2, 6, 9], 4)
    assert entry is not None and entry.length == 3
    small.resume(entry, 0)
    assert np.abs(eng.decode(7) - want).max() <= 1e-6
    small.clear()
    assert eng.sequences == [0]
