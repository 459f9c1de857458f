"""Checks of the arguments of public functions: a value of the wrong type is a ``TypeError`` and a value out of
range a ``ValueError``, each naming the argument, before anything runs (rather than an ``AttributeError`` or a
comparison error from inside the library, or a silently truncated float)."""

from __future__ import annotations

import numbers
import operator
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

__all__ = ["flag", "integer", "mapping", "number", "strings", "text", "token_ids", "unicode_paths"]


def _what(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def integer(name: str, value: Any, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int (ints and NumPy integers, not bools or floats), within ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {_what(value)}")
    value = operator.index(value)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"<= {high}" if low is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bounds}, got {value}")
    return value


def number(name: str, value: Any) -> float:
    """``value`` as a float (ints, floats and NumPy numbers, not bools or strings); ranges are the caller's."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {_what(value)}")
    return float(value)


def flag(name: str, value: Any) -> bool:
    """``value`` as a bool (``True`` / ``False``, NumPy's included; not a string such as ``"no"``)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {_what(value)}")


def mapping(name: str, value: Any) -> Mapping:
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a mapping (a dict), got {_what(value)}")
    return value


def text(name: str, value: Any) -> str:
    """``value``, a str that is valid Unicode (a lone surrogate such as ``"\\ud800"`` has no UTF-8 form)."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {_what(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode text: a lone surrogate {value[e.start]!r} at index "
                         f"{e.start}") from None
    return value


def strings(name: str, value: Any) -> list[str]:
    """One str or an iterable of them (``None``: none) as a list."""
    if value is None:
        return []
    if isinstance(value, str):
        return [text(name, value)]
    if isinstance(value, (bytes, bytearray, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a str or a list of str, got {_what(value)}")
    return [text(f"{name}[{i}]", s) for i, s in enumerate(value)]


def token_ids(name: str, value: Any, vocab: int | None = None) -> list[int]:
    """A sequence of token ids (ints or NumPy integers) as a list, each in ``[0, vocab)``."""
    if isinstance(value, (str, bytes, bytearray, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a list of token ids, got {_what(value)}")
    ids = value.tolist() if isinstance(value, np.ndarray) else list(value)
    if not all(type(t) is int for t in ids):  # the per-item check only when needed (long prompts)
        ids = [integer(f"{name}[{i}]", t) for i, t in enumerate(ids)]
    if ids and min(ids) >= 0 and (vocab is None or max(ids) < vocab):
        return ids
    for i, t in enumerate(ids):
        if t < 0 or (vocab is not None and t >= vocab):
            limit = f"[0, {vocab})" if vocab is not None else ">= 0"
            raise ValueError(f"{name}[{i}]: token id {t} out of range: must be {limit}")
    return ids


def unicode_paths(name: str, value: Any, depth: int = 0) -> None:
    """Raise ``ValueError`` naming the place (``messages[0]['content']``) of a str in a nest of dicts and lists
    that is not valid Unicode (a lone surrogate), which no tokenizer can encode."""
    if isinstance(value, str):
        text(name, value)
    elif depth < 64 and isinstance(value, Mapping):
        for k, v in value.items():
            unicode_paths(f"{name}[{k!r}]", v, depth + 1)
    elif depth < 64 and isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            unicode_paths(f"{name}[{i}]", v, depth + 1)
