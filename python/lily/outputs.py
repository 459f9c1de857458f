"""What generation returns: per-token ``Chunk``s, the collected ``Completion``, chat's ``ChatChunk`` and
``AssistantMessage``, and the ``GenerationStats`` they carry.

``Completion`` is a ``str`` and ``AssistantMessage`` a ``dict`` (so they print, compare and append to a
conversation like the plain values), with their extra data in attributes. Pickling keeps everything;
``json.dumps`` sees only the plain value (the text, the chat message), so ``to_dict()`` gives all of it
as JSON types and ``from_dict()`` rebuilds the object.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["AssistantMessage", "ChatChunk", "Chunk", "Completion", "GenerationStats"]


@dataclasses.dataclass
class GenerationStats:
    """Timing of one generation. Prefill covers the prompt tokens not already in the engine."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    time_to_first_token_s: float = 0.0

    @property
    def prompt_tps(self) -> float:
        computed = self.prompt_tokens - self.cached_prompt_tokens
        return computed / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        # the first token comes from the prefill logits; each later one costs one decode
        steps = self.generated_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0

    def __str__(self) -> str:
        return (
            f"prompt {self.prompt_tokens} tok @ {self.prompt_tps:.1f} tok/s | "
            f"decode {self.generated_tokens} tok @ {self.decode_tps:.1f} tok/s | "
            f"ttft {self.time_to_first_token_s:.3f} s"
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GenerationStats:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


def _require(data: Any, *keys: str) -> None:
    if not isinstance(data, Mapping):
        raise TypeError(f"data must be a dict (from to_dict()), got {type(data).__name__}")
    missing = [k for k in keys if k not in data]
    if missing:
        raise ValueError(f"data has no {', '.join(map(repr, missing))}: not from to_dict()")


def _stats(data: Any) -> GenerationStats | None:
    return GenerationStats.from_dict(data) if isinstance(data, Mapping) else data


@dataclasses.dataclass
class Chunk:
    """One step of ``Model.stream``: the text it adds (may be empty while a character is incomplete),
    the sampled token, its logprob when asked for (and the ``top_logprobs`` most likely ids with
    theirs), and ``finish_reason`` ("stop" or "length") on the last chunk, which also carries ``stats``."""

    text: str
    token: int | None
    logprob: float | None = None
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class Completion(str):
    """The text ``Model.generate`` returns, with ``tokens``, ``logprobs``, ``finish_reason`` and ``stats``."""

    tokens: list[int]
    logprobs: list[float] | None
    finish_reason: str | None
    stats: GenerationStats

    def __new__(cls, text: str, tokens, logprobs, finish_reason, stats):
        self = super().__new__(cls, text)
        self.tokens = tokens
        self.logprobs = logprobs
        self.finish_reason = finish_reason
        self.stats = stats
        return self

    @property
    def text(self) -> str:
        return str.__str__(self)

    def __reduce__(self):
        return (type(self), (self.text, self.tokens, self.logprobs, self.finish_reason, self.stats))

    def to_dict(self) -> dict[str, Any]:
        """Everything as JSON types: ``text``, ``tokens``, ``logprobs``, ``finish_reason``, ``stats``."""
        return {"text": self.text, "tokens": list(self.tokens), "logprobs": self.logprobs,
                "finish_reason": self.finish_reason, "stats": self.stats.to_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Completion:
        _require(data, "text", "tokens")
        return cls(data["text"], list(data["tokens"]), data.get("logprobs"), data.get("finish_reason"),
                   _stats(data.get("stats")) or GenerationStats())


class AssistantMessage(dict):
    """An assistant message as a dict (``role``, ``content``, ``reasoning_content``, ``tool_calls``),
    ready to append to the conversation; also ``.content`` etc., ``.finish_reason`` and ``.stats``."""

    def __init__(self, content: str, reasoning_content: str | None, tool_calls: list, finish_reason, stats):
        super().__init__(role="assistant", content=content, reasoning_content=reasoning_content, tool_calls=tool_calls)
        self.finish_reason = finish_reason
        self.stats = stats

    @property
    def content(self) -> str:
        return self["content"]

    @property
    def reasoning_content(self) -> str | None:
        return self["reasoning_content"]

    @property
    def tool_calls(self) -> list:
        return self["tool_calls"]

    def to_dict(self) -> dict[str, Any]:
        """The message's keys plus ``finish_reason`` and ``stats``, as JSON types."""
        stats = self.stats.to_dict() if self.stats is not None else None
        return {**self, "finish_reason": self.finish_reason, "stats": stats}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AssistantMessage:
        _require(data)
        message = cls(data.get("content") or "", data.get("reasoning_content"), list(data.get("tool_calls") or []),
                      data.get("finish_reason"), _stats(data.get("stats")))
        message.update({k: v for k, v in data.items() if k not in ("finish_reason", "stats")})
        return message


@dataclasses.dataclass
class ChatChunk:
    """One step of ``Model.chat(..., stream=True)``: new thinking text and/or new answer text. The last
    chunk has ``finish_reason`` and ``message``, the complete parsed ``AssistantMessage``."""

    reasoning: str
    content: str
    token: int | None
    logprob: float | None = None
    finish_reason: str | None = None
    message: AssistantMessage | None = None
