"""What a checkpoint folder says besides its weights: the generation defaults (``generation_config.json``)
and the tokenizer with its end-of-sequence ids, gathered from every file that names one."""

from __future__ import annotations

import json
from pathlib import Path

from lily._lily import ModelLoadError
from lily.tokenizer import Tokenizer

__all__ = ["eos_ids", "load_tokenizer", "read_json"]


def read_json(path: Path) -> dict:
    """The JSON object in ``path``; ``{}`` when the file is absent or holds no object."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: {e}") from None
    return data if isinstance(data, dict) else {}


def eos_ids(folder: Path, generation_config: dict, tokenizer: Tokenizer) -> set[int]:
    """Generation stops on any of: ``generation_config.json``'s ``eos_token_id`` (else ``config.json``'s),
    plus the ``eos_token`` of ``tokenizer_config.json``."""
    ids: set[int] = set()

    def add(value):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))

    add(generation_config.get("eos_token_id"))
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
