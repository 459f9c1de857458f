"""Generated text as it streams, split into what the APIs report separately: reasoning (before
``</think>``), answer text, and tool calls (Qwen's XML, parsed when the generation ends).

Answer text streams until a ``<tool_call>`` starts; from there the text is held and parsed at the end:
well-formed calls become tool calls, anything malformed is sent as text, so no output is lost. Leading
and trailing whitespace of each part is dropped (the chat template strips it when the turn is rendered
back), and tags are never split across two deltas.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from lily.tools import parse_tool_calls

__all__ = ["Delta", "OutputParser"]

_THINK_END = "</think>"
_CALL_START = "<tool_call>"


class Delta(NamedTuple):
    kind: str  # "reasoning" or "text"
    text: str


class _Part:
    """One stream of text with its leading whitespace dropped and its trailing whitespace held back."""

    def __init__(self):
        self.started = False
        self.pending = ""  # trailing whitespace not sent yet

    def add(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        if not text:
            return ""
        stripped = text.rstrip()
        if not stripped:
            self.pending += text
            return ""
        out = self.pending + stripped
        self.pending = text[len(stripped) :]
        return out


def _held_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class OutputParser:
    """``feed(text)`` returns the deltas to send; ``finish()`` the last ones and the tool calls."""

    def __init__(self, *, thinking: bool, tools: Sequence[Mapping[str, Any]] | None):
        self.in_reasoning = thinking
        self.tools = tools
        self.buffer = ""  # text that may be the start of a tag
        self.held = ""  # from `<tool_call>` on: parsed at the end
        self.reasoning, self.answer = _Part(), _Part()
        self.reasoning_text: list[str] = []
        self.answer_text: list[str] = []

    def _emit(self, kind: str, text: str, out: list[Delta]) -> None:
        part = self.reasoning if kind == "reasoning" else self.answer
        text = part.add(text)
        if text:
            (self.reasoning_text if kind == "reasoning" else self.answer_text).append(text)
            out.append(Delta(kind, text))

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        if self.held:
            self.held += text
            return out
        buf = self.buffer + text
        self.buffer = ""
        while buf:
            if self.in_reasoning:
                at = buf.find(_THINK_END)
                if at < 0:
                    keep = _held_suffix(buf, _THINK_END)
                    self._emit("reasoning", buf[: len(buf) - keep], out)
                    self.buffer = buf[len(buf) - keep :]
                    return out
                self._emit("reasoning", buf[:at], out)
                self.in_reasoning = False
                buf = buf[at + len(_THINK_END) :]
                continue
            if self.tools:
                at = buf.find(_CALL_START)
                if at >= 0:
                    self._emit("text", buf[:at], out)
                    self.held = buf[at:]
                    return out
                keep = _held_suffix(buf, _CALL_START)
            else:
                keep = 0
            self._emit("text", buf[: len(buf) - keep], out)
            self.buffer = buf[len(buf) - keep :]
            return out
        return out

    def finish(self) -> tuple[list[Delta], list[dict[str, Any]]]:
        """The deltas still held back and the parsed tool calls."""
        out: list[Delta] = []
        tail, self.buffer = self.buffer, ""
        if tail:
            self._emit("reasoning" if self.in_reasoning else "text", tail, out)
        calls: list[dict[str, Any]] = []
        if self.held:
            rest, calls = parse_tool_calls(self.held, self.tools)
            if rest:  # malformed calls: sent as text rather than lost
                self._emit("text", rest, out)
        return out, calls

    @property
    def reasoning_content(self) -> str:
        return "".join(self.reasoning_text)

    @property
    def content(self) -> str:
        return "".join(self.answer_text)
