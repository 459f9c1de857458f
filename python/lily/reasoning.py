"""The thinking part of Qwen3.6 output: with thinking on, the prompt ends inside ``<think>`` and the model
writes its reasoning, ``</think>``, then the answer. ``split_reasoning`` splits a whole text;
``ThinkSplitter`` routes streamed text to either side as it arrives."""

from __future__ import annotations

from lily.stop import StopStrings

__all__ = ["ThinkSplitter", "split_reasoning"]


def split_reasoning(text: str, *, thinking: bool = True) -> tuple[str | None, str]:
    """Split generated text into ``(reasoning, content)``.

    With thinking on, the prompt ends inside ``<think>``, so everything before ``</think>`` is
    reasoning; output cut off before ``</think>`` is all reasoning. With thinking off the text is
    content (a stray ``</think>`` still splits). Whitespace around both parts is stripped, as the
    chat template strips it when the turn is rendered back.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if "</think>" in text:
        reasoning, _, content = text.partition("</think>")
        reasoning = reasoning.split("<think>")[-1]
        return reasoning.strip(), content.strip()
    if thinking:
        return text.split("<think>")[-1].strip(), ""
    return None, text.strip()


class ThinkSplitter:
    """Routes streamed text to the reasoning or the content side of ``</think>``."""

    def __init__(self, thinking: bool):
        self.in_reasoning = thinking
        self.stop = StopStrings(["</think>"])
        self.content_started = False

    def feed(self, delta: str) -> tuple[str, str]:
        """``(reasoning, content)`` text of ``delta``."""
        if not self.in_reasoning:
            return "", self._content(delta)
        text, hit = self.stop.feed(delta)
        if not hit:
            return text, ""
        self.in_reasoning = False
        return text, self._content(self.stop.rest)

    def _content(self, text: str) -> str:
        if not self.content_started:
            text = text.lstrip()
            self.content_started = bool(text)
        return text

    def flush(self) -> tuple[str, str]:
        tail = self.stop.flush()
        return (tail, "") if self.in_reasoning else ("", self._content(tail))
