"""Stop strings in streamed text: a string may arrive split over several tokens, so the tail of the text that
could be the start of one is held back until the next token settles it.

Generation stops where the first occurrence of any stop string ends, as it would with one character per
token; the text is cut before that occurrence (of two ending at the same place, before the longer one). So the
result does not depend on how the text was split into tokens."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopStrings"]


class StopStrings:
    """Finds user stop strings in streamed text, holding back a tail that may be the start of one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.rest = ""  # the text after the stop string that was hit

    def feed(self, delta: str) -> tuple[str, bool]:
        """Text safe to emit, and whether a stop string was hit (the text ends before it)."""
        if not self.stops:
            return delta, False
        buf = self.pending + delta
        # (end, -length, start) of each stop string's first occurrence: the one that ends first wins.
        hits = [(i + len(s), -len(s), i) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            end, _, at = min(hits)
            self.pending = ""
            self.rest = buf[end:]
            return buf[:at], True
        keep = 0
        for k in range(min(self.hold, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                keep = k
                break
        self.pending = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
