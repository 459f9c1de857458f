"""Prefix reuse across conversations: a byte-bounded cache of engine sequences keyed by their token
prefixes, so a new prompt that starts like any earlier one (the next turn of a chat, an agent resending
its history, a regenerated reply, another sub-task with the same system prompt and tools) only prefills
what is new.

The DeltaNet state cannot be cut back like a KV cache, so a prefix is resumed from a copy of the whole
sequence state taken at that position (KV rows + DeltaNet conv and recurrent states, about 63 MB plus
20 KiB per token for Qwen3.6-35B-A3B with a bf16 cache). Copies are taken at the end of every prompt (with
its last logits, so an identical prompt resends nothing), at the start of its last message (the last
``<|im_start|>``: the point the next turn, or a regenerated reply, shares) and every ``snapshot_every``
tokens of a long prefill. They are kept in a radix tree over token ids, as extra sequences of the engine,
and evicted least recently used past ``max_bytes``.

Why here and not in Rust: where to take a copy is a matter of the chat format (message boundaries) and the
policy may change with the server's scheduler; the engine gives the mechanisms (``fork``,
``copy_sequence``, ``drop_sequence``, ``sequence_bytes``), the cache is a few dozen lines of bookkeeping.

The working sequence is the engine's default sequence, so one generation owns it at a time: ``prefill``
gives it to a new generation, and an older one that tries to go on (``decode``) raises
``SequenceEvictedError``. ``turn`` is held by a generation step (and by a whole non-streaming generation)
so that threads sharing a model take turns instead of evicting each other.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from lily._lily import Engine, SequenceEvictedError

__all__ = ["CacheInfo", "PrefixCache", "PrefixReuse", "default_cache_bytes"]

#: Tokens between snapshots of a long prefill.
SNAPSHOT_EVERY = 4096


def default_cache_bytes() -> int:
    """A quarter of the memory available now (of physical memory where the system does not say)."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        try:
            free = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
        except (ValueError, OSError, AttributeError):
            free = 8 << 30
    return max(free // 4, 0)


@dataclass(frozen=True)
class CacheInfo:
    """What the prefix cache holds and what it saved."""

    entries: int
    bytes: int
    max_bytes: int
    hits: int
    misses: int
    tokens_saved: int
    evictions: int


class _Entry:
    __slots__ = ("seq", "length", "bytes", "logits", "node")

    def __init__(self, seq: int, length: int, nbytes: int, logits: Any, node: _Node):
        self.seq, self.length, self.bytes, self.logits, self.node = seq, length, nbytes, logits, node


class _Node:
    """A radix-tree node: ``edge`` is the token run from its parent; children by their edge's first token."""

    __slots__ = ("edge", "children", "parent", "entry")

    def __init__(self, edge: tuple[int, ...], parent: _Node | None):
        self.edge = edge
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.entry: _Entry | None = None


class PrefixCache:
    """Copies of an engine's sequences at known token prefixes, at most ``max_bytes`` of them
    (least recently used evicted first; one copy larger than the bound is not kept)."""

    def __init__(self, engine: Engine, max_bytes: int | None = None, snapshot_every: int = SNAPSHOT_EVERY):
        self.engine = engine
        self.max_bytes = default_cache_bytes() if max_bytes is None else max_bytes
        self.snapshot_every = snapshot_every
        self._root = _Node((), None)
        self._lru: OrderedDict[int, _Entry] = OrderedDict()  # by sequence id, least recent first
        self.bytes = 0
        self.hits = self.misses = self.tokens_saved = self.evictions = 0

    def info(self) -> CacheInfo:
        return CacheInfo(len(self._lru), self.bytes, self.max_bytes, self.hits, self.misses, self.tokens_saved,
                         self.evictions)

    def longest(self, tokens: list[int], limit: int) -> _Entry | None:
        """The entry with the longest prefix of ``tokens`` of at most ``limit`` tokens (one of exactly
        ``len(tokens)`` only if it kept its logits)."""
        node, i, best = self._root, 0, None
        while True:
            e = node.entry
            if e is not None and e.length <= limit and (e.length < len(tokens) or e.logits is not None):
                best = e
            if i >= len(tokens):
                break
            child = node.children.get(tokens[i])
            if child is None or tuple(tokens[i:i + len(child.edge)]) != child.edge:
                break
            node, i = child, i + len(child.edge)
        if best is not None:
            self._lru.move_to_end(best.seq)
        return best

    def record(self, reused: int) -> None:
        """Count a prompt that resumed ``reused`` tokens (0: a miss)."""
        if reused:
            self.hits += 1
            self.tokens_saved += reused
        else:
            self.misses += 1

    def cuts(self, tokens: list[int], start: int, boundary_id: int | None) -> list[int]:
        """Where a prefill of ``tokens`` from ``start`` keeps copies (before the end of the prompt, which is kept
        too): every ``snapshot_every`` tokens and the start of the last message (its ``boundary_id``)."""
        n, every = len(tokens), self.snapshot_every
        cuts = set(range((start // every + 1) * every, n, every)) if every > 0 else set()
        if boundary_id is not None:
            cut = next((i for i in range(n - 1, start, -1) if tokens[i] == boundary_id), None)
            if cut is not None:
                cuts.add(cut)
        return sorted(cuts)

    def holds(self, tokens: list[int]) -> bool:
        node = self._find(tokens)
        return node is not None and node.entry is not None

    def add(self, tokens: list[int], seq: int, logits: Any = None) -> None:
        """Keep a copy of sequence ``seq`` (whose tokens are ``tokens``) as a new entry."""
        node = self._insert(tokens)
        if node.entry is not None:  # the same prefix again: keep the newer logits, touch it
            if logits is not None:
                node.entry.logits = logits
            self._lru.move_to_end(node.entry.seq)
            return
        copy = self.engine.fork(seq)
        e = _Entry(copy, len(tokens), self.engine.sequence_bytes(copy), logits, node)
        node.entry = e
        self._lru[copy] = e
        self.bytes += e.bytes
        while self.bytes > self.max_bytes and self._lru:
            self._evict(next(iter(self._lru.values())))

    def resume(self, entry: _Entry, seq: int) -> None:
        """Sequence ``seq`` becomes the entry's copy."""
        self.engine.copy_sequence(entry.seq, seq)

    def clear(self) -> None:
        for e in list(self._lru.values()):
            self._evict(e, counted=False)

    def _evict(self, e: _Entry, counted: bool = True) -> None:
        del self._lru[e.seq]
        self.bytes -= e.bytes
        self.evictions += counted
        self.engine.drop_sequence(e.seq)
        node = e.node
        node.entry = None
        # Prune what no entry needs any more: empty leaves, then merge a lone child into its parent.
        while node.parent is not None and node.entry is None and not node.children:
            parent = node.parent
            del parent.children[node.edge[0]]
            node = parent
        if node.parent is not None and node.entry is None and len(node.children) == 1:
            (child,) = node.children.values()
            child.edge = node.edge + child.edge
            child.parent = node.parent
            node.parent.children[node.edge[0]] = child

    def _find(self, tokens: list[int]) -> _Node | None:
        node, i = self._root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None or tuple(tokens[i:i + len(child.edge)]) != child.edge:
                return None
            node, i = child, i + len(child.edge)
        return node if i == len(tokens) else None

    def _insert(self, tokens: list[int]) -> _Node:
        node, i = self._root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = _Node(tuple(tokens[i:]), node)
                node.children[tokens[i]] = leaf
                return leaf
            k = 0
            edge = child.edge
            while k < len(edge) and i + k < len(tokens) and edge[k] == tokens[i + k]:
                k += 1
            if k < len(edge):  # split the edge at k
                mid = _Node(edge[:k], node)
                node.children[tokens[i]] = mid
                child.edge, child.parent = edge[k:], mid
                mid.children[child.edge[0]] = child
                child = mid
            node, i = child, i + k
        return node


class PrefixReuse:
    """Prefills the engine's default sequence, resuming the longest cached prefix of the prompt (from the
    sequence itself when it already holds one, else from ``cache``). Knows which generation owns it."""

    def __init__(self, engine: Engine, boundary_id: int | None, cache: PrefixCache | None = None):
        self.engine = engine
        self.boundary_id = boundary_id  # the token a message starts with: where snapshots are taken
        self.cache = cache if cache is not None else PrefixCache(engine)
        self.turn = threading.RLock()
        self._owner: object | None = None  # the ticket of the generation that owns the sequence
        self._position = 0  # the engine's position after this object's last call on it

    def reset(self) -> None:
        """Empty the engine's sequence and forget the saved prefixes (a running generation is evicted)."""
        with self.turn:
            self._owner = None
            self.engine.reset()
            self.cache.clear()

    def prefill(self, tokens: list[int], ticket: object | None = None) -> tuple[Any, int]:
        """Logits after ``tokens``, and how many leading tokens were reused rather than computed. The sequence
        now belongs to ``ticket`` (the previous owner's next ``decode`` raises)."""
        with self.turn:
            self._owner = ticket
            try:
                return self._prefill(tokens)
            finally:
                self._position = self.engine.position

    def decode(self, ticket: object, token: int) -> Any:
        """The logits after ``token``, appended to the sequence of generation ``ticket``; raises
        ``SequenceEvictedError`` if the sequence is no longer that generation's."""
        with self.turn:
            if self._owner is not ticket:
                raise SequenceEvictedError(
                    "this generation's sequence was taken over by a later generation (or reset) on the same model: "
                    "a Model holds one sequence, so finish or close a stream before starting another on it, or "
                    "load a second Model")
            if self.engine.position != self._position:
                raise SequenceEvictedError(
                    f"the engine's sequence changed under this generation (position {self.engine.position}, expected "
                    f"{self._position}): model.engine was used directly while the generation was running")
            try:
                return self.engine.decode(token)
            finally:
                self._position = self.engine.position

    def _prefill(self, tokens: list[int]) -> tuple[Any, int]:
        eng, cache = self.engine, self.cache
        n = len(tokens)
        # The sequence itself continues when it holds a prefix (at most n - 1 tokens: the last one must run
        # to give the logits), unless the cache has a longer one.
        own = eng.position if 0 < eng.position <= min(eng.cached_prefix(tokens), n - 1) else 0
        entry = cache.longest(tokens, n)
        if entry is not None and entry.length > own:
            cache.resume(entry, 0)
            start = entry.length
        elif own:
            start = own
        else:
            eng.reset()
            start = 0
        cache.record(start)
        if start == n:  # the identical prompt again: its end-of-prompt state and logits
            assert entry is not None
            return entry.logits.copy(), start
        pos = start
        for cut in cache.cuts(tokens, start, self.boundary_id):
            eng.prefill(tokens[pos:cut])
            pos = cut
            if not cache.holds(tokens[:cut]):
                cache.add(tokens[:cut], 0)
        logits = eng.prefill(tokens[pos:])
        cache.add(list(tokens), 0, logits.copy())
        return logits, start
