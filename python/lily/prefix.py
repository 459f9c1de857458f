"""Prefix reuse: a new prompt that shares a prefix with what the engine already holds (the next turn of a
chat, an agent resending its history) only prefills what is new.

The DeltaNet state cannot be cut back like a KV cache, so going back means restoring a snapshot of the
whole engine state (about 63 MB for Qwen3.6-35B-A3B). Snapshots are taken at the start of the last
message of each prompt (the last ``<|im_start|>``), a point the next turn's prompt shares; a prompt that
extends the engine's current sequence simply continues it. A prefill stopped part-way (Ctrl-C) leaves the
engine holding the chunks it completed, which the next prompt with the same start continues from.

The engine holds one sequence, so one generation owns it at a time: ``prefill`` gives the sequence to a new
generation, and an older one that tries to go on (``decode``) raises ``SequenceEvictedError``. ``turn`` is
held by a generation step (and by a whole non-streaming generation) so that threads sharing a model take
turns instead of evicting each other.
"""

from __future__ import annotations

import threading
from typing import Any

from lily._lily import Engine, SequenceEvictedError

__all__ = ["PrefixReuse"]


class PrefixReuse:
    """Prefills an engine, reusing the longest saved prefix of the prompt; keeps the ``max_snapshots``
    newest snapshots. Knows which generation owns the engine's sequence."""

    def __init__(self, engine: Engine, boundary_id: int | None, max_snapshots: int = 4):
        self.engine = engine
        self.boundary_id = boundary_id  # the token a message starts with: where snapshots are taken
        self.max_snapshots = max_snapshots
        self._snapshots: list[Any] = []  # newest last
        self.turn = threading.RLock()
        self._owner: object | None = None  # the ticket of the generation that owns the sequence
        self._position = 0  # the engine's position after this object's last call on it

    def reset(self) -> None:
        """Empty the engine's sequence and forget the saved prefixes (a running generation is evicted)."""
        with self.turn:
            self._owner = None
            self.engine.reset()
            self._snapshots.clear()

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
        eng = self.engine
        # Reuse at most len - 1 tokens: the last one must run to give the logits.
        cached = min(eng.cached_prefix(tokens), len(tokens) - 1)
        if 0 < eng.position <= cached:
            start = eng.position
        else:
            start = self._restore(cached)
        # Snapshot at the last message boundary, so the next turn can come back to it.
        cut = None
        if self.boundary_id is not None:
            cut = next((i for i in range(len(tokens) - 1, start, -1) if tokens[i] == self.boundary_id), None)
        if cut is not None:
            eng.prefill(tokens[start:cut])
            self._remember(eng.snapshot())
            return eng.prefill(tokens[cut:]), start
        return eng.prefill(tokens[start:]), start

    def _restore(self, cached: int) -> int:
        """Go back to the longest snapshot within the first ``cached`` tokens (or to empty); its position."""
        best = max((s for s in self._snapshots if s.position <= cached), key=lambda s: s.position, default=None)
        if best is not None:
            try:
                self.engine.restore(best)
                return best.position
            except ValueError:  # its rows were overwritten since
                self._snapshots.remove(best)
        self.engine.reset()
        return 0

    def _remember(self, snap: Any) -> None:
        self._snapshots = [s for s in self._snapshots if s.position != snap.position]
        self._snapshots.append(snap)
        del self._snapshots[: -self.max_snapshots]
