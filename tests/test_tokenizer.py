"""Tokenizer and streaming detokenizer against transformers, with the real Qwen3.6 tokenizer."""

from __future__ import annotations

import random

import fixtures
import pytest
from lily.tokenizer import Tokenizer

QWEN = fixtures.qwen_tokenizer_dir()

TEXTS = [
    "Hello, world! It's a test; we'll see.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 斐波那契\n\n\n\tx = [1,2,3]\r\n",
    "用一句话介绍你自己。日本語のテキスト、한국어 텍스트",
    "emoji 🎉👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 keycap 1️⃣",
    "combining e\u0301 a\u0308 n\u0303 (NFD) vs é ä ñ; Zalgo Z\u0351\u0300\u0301a\u0489",
    "العربية עברית हिन्दी ไทย Ελληνικά Русский",
    "numbers 1234567890 3.14159 -42 1e10",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nHello<|im_end|>",
    "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
    "   leading and trailing spaces   ",
    "",
    "a" * 500,
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(QWEN / "tokenizer.json", eos_ids=[248046, 248044])


@pytest.fixture(scope="module")
def hf():
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(QWEN))


def test_sizes_and_special_tokens(tok):
    assert len(tok) == 248077
    assert tok.token_to_id("<|im_end|>") == 248046
    assert tok.token_to_id("<think>") == 248068 and tok.token_to_id("</think>") == 248069
    assert {248044, 248045, 248046} <= tok.special_ids
    assert not {248058, 248059, 248068, 248069} & tok.special_ids  # added but not special
    assert tok.eos_ids == {248046, 248044}
    assert tok.encode("<|im_start|>user\n") == [248045, 846, 198]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok, hf, text):
    ids = tok.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == hf.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_random_text_matches_transformers(tok, hf):
    rng = random.Random(0)
    alphabet = "ab \n\t.,'é中文🎉\u0301\u200d1'sllve" + "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(200))
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), repr(text)
        assert tok.decode(ids) == hf.decode(ids)


def test_decode_rejects_bad_ids(tok):
    with pytest.raises(ValueError):
        tok.decode([248077])
    with pytest.raises(ValueError):
        tok.decode([-1])


def _stream(tok, ids, skip):
    d = tok.detokenizer(skip_special_tokens=skip)
    deltas = [d.add(i) for i in ids]
    deltas.append(d.flush())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_equals_decode(tok, text):
    ids = tok.encode(text)
    for skip in (False, True):
        assert "".join(_stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)


def test_streaming_never_splits_a_character(tok):
    # each byte of a multi-byte character as its own byte-level token: nothing comes out until the last
    byte_token = {tok.token_bytes(i): i for i in range(248044) if len(tok.token_bytes(i)) == 1}
    for ch in "é中🎉👍🏽":
        ids = [byte_token[bytes([b])] for b in ch.encode("utf-8")]
        deltas = _stream(tok, ids, True)
        assert "".join(deltas) == ch
        assert all("\ufffd" not in d for d in deltas)
        assert deltas[: len(ch.encode()) - 1] == [""] * (len(ch.encode()) - 1) or len(ch) > 1


def test_streaming_random_ids_match_decode(tok):
    rng = random.Random(1)
    byte_ids = [i for i in range(248044) if len(tok.token_bytes(i)) == 1]
    specials = [248044, 248046, 248058, 248068, 248069]
    for _ in range(500):
        ids = [
            rng.choice(byte_ids) if r < 0.5 else rng.choice(specials) if r < 0.6 else rng.randrange(len(tok))
            for r in (rng.random() for _ in range(rng.randrange(1, 16)))
        ]
        for skip in (False, True):
            assert "".join(_stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip), ids


def test_streaming_keeps_added_tokens_and_drops_special(tok):
    ids = tok.encode("<think>\nx\n</think>\n\nok<|im_end|>")
    assert "".join(_stream(tok, ids, True)) == "<think>\nx\n</think>\n\nok"
    assert "".join(_stream(tok, ids, False)).endswith("ok<|im_end|>")
