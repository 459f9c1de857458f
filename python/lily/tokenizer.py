"""The checkpoint's tokenizer (``tokenizer.json`` through ``tokenizers``) and a streaming detokenizer.

The streaming detokenizer turns token ids into text one id at a time without ever emitting broken
UTF-8: a character whose bytes are split over several tokens comes out whole once its last byte
arrives (mlx-lm's ``BPEStreamingDetokenizer`` idea, done with a byte table and Python's incremental
UTF-8 decoder). The concatenated output equals ``Tokenizer.decode`` of the same ids.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Iterable, Sequence

import tokenizers
import tokenizers.decoders

from lily.arguments import integer, token_ids
from lily.arguments import text as _text

__all__ = ["BYTE_TO_UNICODE", "StreamingDetokenizer", "Tokenizer"]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


#: byte -> the character that stands for it in a byte-level BPE vocabulary (GPT-2's table)
BYTE_TO_UNICODE = _bytes_to_unicode()
# character of the byte-level alphabet -> the latin-1 character of its byte, for str.translate
_BYTE_LEVEL_TO_LATIN1 = {ord(c): b for b, c in BYTE_TO_UNICODE.items()}


class Tokenizer:
    """Text <-> token ids for one checkpoint.

    ``encode(text)`` and ``decode(ids)`` match ``transformers``' tokenizer for the same files
    (``encode(text, add_special_tokens=False)`` and ``decode(ids)``). Added tokens written in the text
    (``<|im_start|>``, ``<think>``, ...) are encoded as their single ids.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, eos_ids: Iterable[int] = ()):
        self._tok = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        self.added_tokens: dict[int, str] = {i: t.content for i, t in added.items()}
        #: ids of the added tokens flagged special (dropped by ``decode(..., skip_special_tokens=True)``)
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self.eos_ids: frozenset[int] = frozenset(eos_ids)
        self._size = max([tokenizer.get_vocab_size(with_added_tokens=True), *(i + 1 for i in added)])
        self._table: list[bytes] | None = None

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, eos_ids: Iterable[int] = ()) -> Tokenizer:
        return cls(tokenizers.Tokenizer.from_file(str(path)), eos_ids=eos_ids)

    def __len__(self) -> int:
        """Number of ids the tokenizer knows (regular + added); larger ids are padding rows."""
        return self._size

    def __repr__(self) -> str:
        return f"Tokenizer(len={len(self)}, eos_ids={sorted(self.eos_ids)})"

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` (a str that is valid Unicode: a lone surrogate is a ``ValueError``).
        ``add_special_tokens`` applies the post-processor (none for Qwen)."""
        return self._tok.encode(_text("text", text), add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; ids past ``len(self)`` raise ``ValueError``."""
        return self._tok.decode(token_ids("ids", ids, self._size), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes that ``token_id`` stands for (possibly part of a character)."""
        table = self._byte_table()
        if not 0 <= integer("token_id", token_id) < len(table):
            raise ValueError(f"token id {token_id} out of range: the tokenizer has {self._size} ids")
        return table[token_id]

    def detokenizer(self, *, skip_special_tokens: bool = True) -> StreamingDetokenizer:
        """A fresh streaming detokenizer (special tokens dropped by default, as in generated text)."""
        return StreamingDetokenizer(self._byte_table(), self.special_ids if skip_special_tokens else frozenset())

    def _byte_table(self) -> list[bytes]:
        """id -> bytes for every id, built once (about 0.2 s for 248k ids)."""
        if self._table is not None:
            return self._table
        byte_level = isinstance(self._tok.decoder, tokenizers.decoders.ByteLevel)
        table: list[bytes] = [b""] * self._size
        for token, i in self._tok.get_vocab(with_added_tokens=False).items():
            if byte_level:
                try:
                    table[i] = token.translate(_BYTE_LEVEL_TO_LATIN1).encode("latin-1")
                    continue
                except UnicodeEncodeError:
                    pass
            table[i] = self._tok.decode([i], skip_special_tokens=False).encode("utf-8")
        for i, content in self.added_tokens.items():
            table[i] = content.encode("utf-8")
        self._table = table
        return table


class StreamingDetokenizer:
    """Token ids in, text deltas out; holds back the bytes of an unfinished UTF-8 character.

    ``add(token)`` returns the new text (possibly ``""``); ``flush()`` returns what is left (an
    unfinished character becomes U+FFFD, as in ``decode``). ``text`` is everything emitted so far.
    """

    __slots__ = ("_table", "_skip", "_decoder", "_parts", "tokens")

    def __init__(self, table: list[bytes], skip: frozenset[int] = frozenset()):
        self._table = table
        self._skip = skip
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._parts: list[str] = []
        self.tokens: list[int] = []

    def add(self, token: int) -> str:
        if type(token) is not int:
            token = integer("token", token)
        if not 0 <= token < len(self._table):
            raise ValueError(f"token id {token} out of range: the tokenizer has {len(self._table)} ids")
        self.tokens.append(token)
        if token in self._skip:
            return ""
        delta = self._decoder.decode(self._table[token])
        if delta:
            self._parts.append(delta)
        return delta

    def flush(self) -> str:
        delta = self._decoder.decode(b"", final=True)
        if delta:
            self._parts.append(delta)
        return delta

    @property
    def text(self) -> str:
        return "".join(self._parts)

