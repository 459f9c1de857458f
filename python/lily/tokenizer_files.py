"""Tokenizer files for checkpoints Lily writes (``lily synth``, the test checkpoints).

Two kinds, both with Qwen3.6's chat template, so that generation, chat and the server work with them:

- the real Qwen3.6 tokenizer, shipped with the package (``lily/data/qwen3.6``), for checkpoints with the
  real vocabulary (``vocab_size`` >= 248077);
- a byte-level tokenizer with Qwen's pre-tokenizer and the chat special tokens (``<|im_start|>``,
  ``<|im_end|>``, ``<think>``, ``<tool_call>``, ...) right after the 256 byte tokens, for small
  vocabularies: any text encodes, and a chat turn renders and ends on ``<|im_end|>`` as with the real one.
"""

from __future__ import annotations

import gzip
import json
import shutil
from importlib import resources
from pathlib import Path

from lily.tokenizer import BYTE_TO_UNICODE

__all__ = ["QWEN_VOCAB", "TOKENIZER_FILES", "copy_tokenizer", "qwen_chat_template", "qwen_generation_config",
           "write_byte_tokenizer", "write_qwen_tokenizer"]

QWEN_VOCAB = 248077  # ids 0..248076 are the real tokenizer's; larger ids are padding rows of the embedding
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# Qwen3.5/3.6's pre-tokenizer split (digits one by one, combining marks joined to letters).
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# The byte-level tokenizer's added tokens (content, special), ids 256... in this order.
BYTE_TOKENIZER_ADDED = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)


def _data(name: str):
    return resources.files("lily").joinpath("data").joinpath("qwen3.6").joinpath(name)


def qwen_chat_template() -> str:
    """Qwen3.6's chat template (the published ``chat_template.jinja``)."""
    return _data("chat_template.jinja").read_text(encoding="utf-8")


def qwen_generation_config() -> dict:
    """Qwen3.6's ``generation_config.json`` (sampling defaults, stop ids)."""
    return json.loads(_data("generation_config.json").read_text(encoding="utf-8"))


def write_qwen_tokenizer(folder: Path) -> None:
    """Write the real Qwen3.6 tokenizer files (``TOKENIZER_FILES``) into ``folder``."""
    folder = Path(folder)
    with gzip.open(_data("tokenizer.json.gz").open("rb")) as src, open(folder / "tokenizer.json", "wb") as dst:
        shutil.copyfileobj(src, dst)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        (folder / name).write_bytes(_data(name).read_bytes())


def copy_tokenizer(source: Path, folder: Path) -> dict | None:
    """Copy the tokenizer files found in ``source`` into ``folder``; returns its generation config, if any."""
    source, folder = Path(source), Path(folder)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, folder / name)
    gen = source / "generation_config.json"
    return json.loads(gen.read_text(encoding="utf-8")) if gen.is_file() else None


def write_byte_tokenizer(folder: Path) -> dict[str, int]:
    """Write the byte-level tokenizer (see the module docstring) into ``folder``; returns the ids of its added
    tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    folder = Path(folder)
    tok = Tokenizer(models.BPE(vocab={BYTE_TO_UNICODE[b]: b for b in range(256)}, merges=[], ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    ids = {}
    for content, special in BYTE_TOKENIZER_ADDED:
        token = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
        ids[content] = tok.token_to_id(content)
    tok.save(str(folder / "tokenizer.json"))
    template = qwen_chat_template()
    (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    added = {str(ids[c]): {"content": c, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                           "special": s} for c, s in BYTE_TOKENIZER_ADDED}
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return ids
