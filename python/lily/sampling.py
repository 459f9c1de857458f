"""Sampling policy: ``Sampler`` holds the settings; the native ``lily._lily.Sampler`` does the work.

Order (transformers' ``generate``): logit bias, repetition penalty (prompt + generated tokens),
presence / frequency penalties (generated tokens), temperature, top-k, top-p, min-p, then a seeded
draw. ``temperature=0`` is greedy. Ids ``>= vocab_limit`` (the padding rows past the tokenizer, ids
248077... for Qwen3.6) are never sampled. The same seed gives the same tokens for the same logits.

``benchmarks/sampling_overhead.py`` measures the whole per-token overhead outside the forward pass.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lily import _lily
from lily.arguments import flag, integer, mapping, number, token_ids

__all__ = ["Sampler", "SamplingDefaults"]


@dataclasses.dataclass(frozen=True)
class SamplingDefaults:
    """The checkpoint's defaults (``generation_config.json``); ``do_sample=False`` means greedy."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    do_sample: bool = True

    @classmethod
    def from_generation_config(cls, config: Mapping[str, Any]) -> SamplingDefaults:
        """The defaults in ``config``; a value of the wrong type is a ``TypeError`` naming its key."""

        def get(key, default, check):
            value = config.get(key)
            return default if value is None else check(key, value)

        return cls(
            temperature=get("temperature", 1.0, number),
            top_k=get("top_k", 0, integer),
            top_p=get("top_p", 1.0, number),
            min_p=get("min_p", 0.0, number),
            repetition_penalty=get("repetition_penalty", 1.0, number),
            do_sample=get("do_sample", True, flag),
        )


def _row(logits: np.ndarray) -> np.ndarray:
    """``logits`` as a contiguous 1-D float32 array (the array itself when it already is one)."""
    if not (isinstance(logits, np.ndarray) and logits.dtype == np.float32 and logits.ndim == 1):
        try:
            logits = np.ascontiguousarray(logits, dtype=np.float32)
        except (TypeError, ValueError) as e:
            raise TypeError(f"logits must be a 1-D array of numbers: {e}") from None
        if logits.ndim != 1:
            raise ValueError(f"logits must be 1-D, got shape {logits.shape}")
    elif not logits.flags.c_contiguous:
        logits = np.ascontiguousarray(logits)
    return logits


class Sampler:
    """A sampling policy over float32 logits rows.

    ``sampler(logits)`` returns a token id; ``sampler.sample(logits, logprob=True)`` returns
    ``(token, logprob)``. Call ``reset(prompt)`` at the start of each generation: it re-seeds (so a
    fixed ``seed`` repeats its tokens) and records the prompt for the repetition penalty.
    """

    def __init__(
        self,
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: Mapping[int, float] | None = None,
        seed: int | None = None,
        vocab_limit: int | None = None,
    ):
        self.vocab_limit = None if vocab_limit is None else integer("vocab_limit", vocab_limit, low=1)
        bias: dict[int, float] = {}
        high = 2**32 - 1 if self.vocab_limit is None else self.vocab_limit - 1  # a bias on no token would do nothing
        for k, v in mapping("logit_bias", {} if logit_bias is None else logit_bias).items():
            bias[integer("logit_bias key", k, low=0, high=high)] = number(f"logit_bias[{k}]", v)
        self.temperature = number("temperature", temperature)
        self.top_k = integer("top_k", top_k, low=0)
        self.top_p = number("top_p", top_p)
        self.min_p = number("min_p", min_p)
        self.repetition_penalty = number("repetition_penalty", repetition_penalty)
        self.presence_penalty = number("presence_penalty", presence_penalty)
        self.frequency_penalty = number("frequency_penalty", frequency_penalty)
        self.logit_bias = bias
        self.seed = None if seed is None else integer("seed", seed, low=0, high=2**64 - 1)
        # Validates every value (ValueError naming the parameter).
        self._native = _lily.Sampler(
            temperature=self.temperature,
            top_k=min(self.top_k, 2**32),  # past any vocabulary: every id kept, as 0 does
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=bias or None,
            vocab_limit=vocab_limit,
            seed=self._next_seed(),
        )

    def _next_seed(self) -> int:
        return self.seed if self.seed is not None else int.from_bytes(os.urandom(8), "little")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def reset(self, prompt: Sequence[int] = ()) -> None:
        """Start a new sequence: re-seed and count ``prompt`` for the repetition penalty."""
        self._native.reset(token_ids("prompt", prompt, 2**32), self._next_seed())

    def accept(self, token: int) -> None:
        """Record a token chosen outside ``sample`` (for the penalties)."""
        self._native.accept(integer("token", token, low=0, high=2**32 - 1))

    def sample(
        self, logits: np.ndarray, *, logprob: bool = False, constraint: _lily.Constraint | None = None
    ) -> tuple[int, float | None]:
        """Draw a token from a 1-D float32 row; the row is read in place when it is contiguous float32.
        With a ``constraint`` (structured output), only ids its grammar allows are drawn."""
        return self._native.sample(_row(logits), logprob, constraint)

    def top_logprobs(self, logits: np.ndarray, k: int) -> list[tuple[int, float]]:
        """The ``k`` most likely ids of the model's own distribution (raw logits) with their logprobs."""
        return self._native.top_logprobs(_row(logits), integer("k", k, low=0))

    def __call__(self, logits: np.ndarray) -> int:
        return self.sample(logits)[0]

    def replace(self, **changes: Any) -> Sampler:
        """A copy with some settings changed."""
        settings = self.settings()
        settings.update(changes)
        return Sampler(**settings)

    def settings(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logit_bias": dict(self.logit_bias),
            "seed": self.seed,
            "vocab_limit": self.vocab_limit,
        }

    def __repr__(self) -> str:
        shown = {k: v for k, v in self.settings().items() if v not in (None, {})}
        return "Sampler(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"
