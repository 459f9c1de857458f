"""What a checkpoint folder says besides its weights: the generation defaults (``generation_config.json``)
and the tokenizer with its end-of-sequence ids, gathered from every file that names one."""

from __future__ import annotations

import json
from pathlib import Path

from lily._lily import ModelLoadError
from lily.tokenizer import Tokenizer

__all__ = ["eos_ids", "load_tokenizer", "read_json"]


def read_json(path: Path) -> dict:
    """The JSON object in ``path``; ``{}`` when the file is absent. A file that cannot be read or holds
    something else is a ``ModelLoadError`` naming it."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def eos_ids(folder: Path, generation_config: dict, tokenizer: Tokenizer) -> set[int]:
    """Generation stops on any of: ``generation_config.json``'s ``eos_token_id`` (else ``config.json``'s),
    plus the ``eos_token`` of ``tokenizer_config.json``."""
    ids: set[int] = set()

    def add(value, where="config.json"):
        if isinstance(value, int) and not isinstance(value, bool):
            ids.add(value)
        elif isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            ids.update(value)
        elif value is not None:
            raise ModelLoadError(f"{folder / where}: eos_token_id must be a token id or a list of them, got {value!r}")

    add(generation_config.get("eos_token_id"), "generation_config.json")
    if not ids:
        config = read_json(folder / "config.json")
        add(config.get("eos_token_id"))
        add((config.get("text_config") or {}).get("eos_token_id"))
    eos = read_json(folder / "tokenizer_config.json").get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if isinstance(eos, str) and tokenizer.token_to_id(eos) is not None:
        ids.add(tokenizer.token_to_id(eos))
    return ids


def load_tokenizer(folder: Path, generation_config: dict) -> Tokenizer:
    """The folder's ``tokenizer.json`` with its eos ids, its byte table built now rather than during the
    first generation."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: no tokenizer.json in the checkpoint folder")
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception on a bad file
        raise ModelLoadError(f"{path}: {e}") from None
    tokenizer = Tokenizer(tokenizer.backend, eos_ids=eos_ids(folder, generation_config, tokenizer))
    tokenizer.detokenizer()
    return tokenizer
