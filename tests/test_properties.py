"""Property tests (hypothesis) of the two streaming pieces every generated token goes through.

- The stop-string matcher (``lily.stop.StopStrings``) finds exactly what a search of the whole text finds
  (generation stops where the first occurrence of any stop string ends; the text is cut before it), however
  the text is split into chunks.
- The streaming detokenizer (``Tokenizer.detokenizer()``) emits, for any token sequence, chunks whose
  concatenation is ``Tokenizer.decode`` of the sequence, never part of a character (every prefix of the
  output is a prefix of the full decode), holding at most 3 bytes between tokens (constant work per token).

Bounded in CI by the "ci" profile of conftest.py; ``HYPOTHESIS_PROFILE=long`` runs 100 times more examples.
"""

from __future__ import annotations

import fixtures
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lily.stop import StopStrings
from lily.tokenizer import Tokenizer
from lily.tokenizer_files import write_byte_tokenizer

# ---- stop strings

ALPHABET = "ab<>é🙂"  # few letters, so that stop strings, overlaps and near misses occur often
CHEAP = settings(max_examples=5 * settings.default.max_examples)  # these run in microseconds: more examples


def naive(text: str, stops: list[str]) -> tuple[str, bool]:
    """The text before the stop-string occurrence that ends first (the longer one when two end together)."""
    hits = [(i + len(s), -len(s), i) for s in stops if s and (i := text.find(s)) >= 0]
    if not hits:
        return text, False
    return text[: min(hits)[2]], True


def chunked(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


@CHEAP
@given(text=st.text(ALPHABET, max_size=40), stops=st.lists(st.text(ALPHABET, max_size=5), max_size=4),
       cuts=st.lists(st.integers(0, 40), max_size=12))
def test_stop_strings_match_a_search_of_the_whole_text(text, stops, cuts):
    matcher = StopStrings(stops)
    out, hit = [], False
    for chunk in chunked(text, cuts):
        emitted, hit = matcher.feed(chunk)
        out.append(emitted)
        if hit:
            break
    if not hit:
        out.append(matcher.flush())
    assert ("".join(out), hit) == naive(text, stops)


@CHEAP
@given(text=st.text(ALPHABET, max_size=40),
       stops=st.lists(st.text(ALPHABET, min_size=1, max_size=5), min_size=1, max_size=4),
       cuts=st.lists(st.integers(0, 40), max_size=12))
def test_stop_strings_hold_back_only_a_possible_start(text, stops, cuts):
    """What is held back after each chunk is shorter than the longest stop string and could start one."""
    matcher = StopStrings(stops)
    for chunk in chunked(text, cuts):
        _, hit = matcher.feed(chunk)
        if hit:
            break
        held = matcher.pending
        assert len(held) < max(map(len, stops)) and (not held or any(s.startswith(held) for s in stops))


# ---- streaming detokenizer


@pytest.fixture(scope="module", params=["byte-level", "qwen3.6"])
def tokenizer(request, tmp_path_factory):
    if request.param == "qwen3.6":
        return Tokenizer.from_file(fixtures.qwen_tokenizer_dir() / "tokenizer.json")
    folder = tmp_path_factory.mktemp("byte-tokenizer")
    write_byte_tokenizer(folder)
    return Tokenizer.from_file(folder / "tokenizer.json")


def token_ids(tok: Tokenizer):
    """Any ids, weighted towards ids that stand for part of a character (the hard case) and added tokens."""
    n = len(tok)
    partial = [i for i in range(n) if _is_partial(tok.token_bytes(i))][:4000]
    added = sorted(tok.added_tokens)
    return st.lists(st.one_of(st.integers(0, n - 1), st.sampled_from(partial), st.sampled_from(added)), max_size=60)


def _is_partial(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


@pytest.mark.parametrize("skip_special", [True, False])
def test_streaming_detokenizer_equals_decode(tokenizer, skip_special):
    @given(ids=token_ids(tokenizer))
    def check(ids):
        detok = tokenizer.detokenizer(skip_special_tokens=skip_special)
        full = tokenizer.decode(ids, skip_special_tokens=skip_special)
        text = ""
        for i in ids:
            text += detok.add(i)
            assert full.startswith(text)  # nothing emitted early: no split character, no premature U+FFFD
            assert len(detok._decoder.getstate()[0]) <= 3  # at most one unfinished character held
        text += detok.flush()
        assert text == full == detok.text

    check()
