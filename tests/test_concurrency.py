"""Generation state shared by generators and threads.

A ``Model`` holds one sequence: a stream resumed after another generation started on the same model raises
``SequenceEvictedError`` (it used to continue on the other's state and return garbage). An ``Engine`` shared
by threads serializes their calls (it used to raise ``RuntimeError: Already borrowed``); ``Model.generate``
from several threads gives what the same calls give one after the other.
"""

from __future__ import annotations

import signal
import threading

import lily
import numpy as np
import pytest

MAX_SEQ = 512


@pytest.fixture(scope="module")
def model(tiny_hf):
    return lily.load(tiny_hf, backend="cpu", max_seq=MAX_SEQ, progress=False)


PROMPT_A = [5, 6, 7, 8, 9]
PROMPT_B = [40, 41, 42]


def _solo(model, prompt, n=6):
    model.reset()
    return [c.token for c in model.stream(prompt, max_tokens=n, temperature=0)]


def test_interleaved_streams_evict_the_older_one(model):
    want_a, want_b = _solo(model, PROMPT_A), _solo(model, PROMPT_B)
    model.reset()
    a = model.stream(PROMPT_A, max_tokens=6, temperature=0)
    b = model.stream(PROMPT_B, max_tokens=6, temperature=0)
    first_a = next(a)
    assert first_a.token == want_a[0]  # computed before b started: right
    got_b = [next(b).token]
    with pytest.raises(lily.SequenceEvictedError, match="taken over by a later generation"):
        next(a)
    got_b += [c.token for c in b]  # the newer stream is not disturbed
    assert got_b == want_b
    with pytest.raises(StopIteration):  # an evicted stream is finished
        next(a)


def test_a_finished_stream_is_not_evicted(model):
    want_a, want_b = _solo(model, PROMPT_A), _solo(model, PROMPT_B)
    a = list(model.stream(PROMPT_A, max_tokens=6, temperature=0))
    b = list(model.stream(PROMPT_B, max_tokens=6, temperature=0))
    assert [c.token for c in a] == want_a and [c.token for c in b] == want_b


def test_generate_inside_a_stream_evicts_it(model):
    """The same in one thread with a non-streaming call in between: the stream raises, the call is right."""
    want_b = model.generate(PROMPT_B, max_tokens=6, temperature=0)
    a = model.stream(PROMPT_A, max_tokens=6, temperature=0)
    next(a)
    assert model.generate(PROMPT_B, max_tokens=6, temperature=0).tokens == want_b.tokens
    with pytest.raises(lily.SequenceEvictedError):
        next(a)


def test_reset_evicts_a_stream(model):
    a = model.stream(PROMPT_A, max_tokens=6, temperature=0)
    next(a)
    model.reset()
    with pytest.raises(lily.SequenceEvictedError):
        next(a)


def test_direct_engine_use_under_a_stream_is_noticed(model):
    a = model.stream(PROMPT_A, max_tokens=6, temperature=0)
    next(a)
    model.engine.decode(3)
    with pytest.raises(lily.SequenceEvictedError, match="used directly"):
        next(a)


def test_chat_streams_are_evicted_too(model):
    messages = [{"role": "user", "content": "hi"}]
    a = model.chat(messages, stream=True, max_tokens=6, temperature=0)
    next(a)
    model.chat(messages, max_tokens=2, temperature=0)
    with pytest.raises(lily.SequenceEvictedError):
        list(a)


def test_threads_sharing_an_engine_take_turns(tiny_hf):
    """Four threads decode and prefill on one engine at once. No call fails, and every call's logits equal
    those of the same calls replayed one after the other in the order the engine ran them (the final
    sequence shows that order: each call appends tokens no other call uses)."""
    eng = lily.Engine(tiny_hf, backend="cpu", max_seq=MAX_SEQ)
    eng.prefill([1, 2, 3])
    calls = {}  # first token -> (tokens, logits)
    errors = []

    def work(t):
        try:
            for i in range(12):
                base = 10 + 100 * t + 8 * i
                toks = [base] if t % 2 else [base, base + 1, base + 2]
                logits = eng.decode(toks[0]) if len(toks) == 1 else eng.prefill(toks)
                calls[base] = (toks, logits)
                assert eng.position <= 3 + 4 * 12 * 2  # another thread's getter call while busy is fine
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    order = eng.snapshot().tokens[3:]
    replay = lily.Engine(tiny_hf, backend="cpu", max_seq=MAX_SEQ)
    replay.prefill([1, 2, 3])
    i = 0
    while i < len(order):
        toks, logits = calls.pop(order[i])
        assert order[i : i + len(toks)] == toks  # each call ran whole
        want = replay.decode(toks[0]) if len(toks) == 1 else replay.prefill(toks)
        np.testing.assert_allclose(logits, want, rtol=0, atol=1e-5)
        i += len(toks)
    assert not calls


def test_threads_sharing_a_model_get_sequential_results(model):
    prompts = {t: [20 + t, 30 + t, 40 + t, 50 + t] for t in range(3)}
    want = {t: model.generate(p, max_tokens=5, seed=t).tokens for t, p in prompts.items()}
    got: dict = {t: [] for t in prompts}
    errors = []

    def work(t):
        try:
            for _ in range(4):
                got[t].append(model.generate(prompts[t], max_tokens=5, seed=t).tokens)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in prompts]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert got == {t: [want[t]] * 4 for t in prompts}


def test_engine_called_from_a_signal_handler_during_a_call_is_an_error(tiny_hf):
    """A signal handler runs between prefill chunks, inside the prefill: if it calls the same engine, that is a
    RuntimeError (raised out of the prefill, which stops there), not a deadlock."""
    eng = lily.Engine(tiny_hf, backend="cpu", max_seq=8192, prefill_chunk=8)
    seen = []

    def handler(signum, frame):
        seen.append(signum)
        eng.position  # noqa: B018 - the call under test

    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(RuntimeError, match="reentrant call"):
            eng.prefill([(i % 500) + 1 for i in range(8000)])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert seen and 0 < eng.position < 8000 and eng.position % 8 == 0
