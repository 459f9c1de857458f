"""``lily.load``: a checkpoint folder or Hugging Face repo id in, a ready ``Model`` out."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from lily import _lily
from lily._lily import Engine, ModelLoadError
from lily.arguments import flag, integer
from lily.checkpoint import load_tokenizer, read_json
from lily.hub import resolve_model, warm_page_cache
from lily.model import Model
from lily.progress import progress_bar
from lily.sampling import SamplingDefaults
from lily.template import ChatTemplate

__all__ = ["BACKENDS", "KV_DTYPES", "PRECISIONS", "load"]

BACKENDS = ("auto", "cpu", "metal", "cuda", "cpu-reference", "metal-sim", "cuda-sim")
KV_DTYPES = ("bf16", "f16", "f32")
PRECISIONS = ("exact", "fast")


def load(
    model: str | os.PathLike[str],
    *,
    backend: str = "auto",
    max_seq: int | None = None,
    prefill_chunk: int | None = None,
    kv_dtype: str = "bf16",
    precision: str = "exact",
    revision: str | None = None,
    progress: bool = True,
    prefix_cache_bytes: int | None = None,
    prefix_cache_dir: str | os.PathLike[str] | None = None,
    prefix_cache_dir_bytes: int | None = None,
    prefix_cache_snapshot_every: int | None = None,
) -> Model:
    """Load a checkpoint: a local folder or a Hugging Face repo id (downloaded into the standard cache).

    ``backend`` is "auto", "cpu", "metal" or "cuda" (or "cpu-reference", "metal-sim", "cuda-sim"); ``max_seq`` caps
    the context (default: the engine's); ``prefill_chunk`` the tokens per prefill step (default: the
    backend's; smaller saves memory); ``kv_dtype`` the element type of the stored keys and values
    ("bf16", "f16" or "f32"); ``precision`` how the CPU's 4-bit matmuls round the activations ("exact", the
    default, fp32-exact; "fast": one int8 plane per weight group, faster, a little below bf16 accuracy; GPUs
    ignore it);
    ``prefix_cache_bytes`` bounds the copies of earlier prompts' states that
    new prompts resume from (default: a quarter of the free memory; 0 keeps none); ``prefix_cache_dir`` keeps
them also as files in that folder, so a later process resumes from them (``prefix_cache_dir_bytes`` bounds
the folder; default a quarter of the disk's free space); ``prefix_cache_snapshot_every`` is the number of tokens
between the copies kept inside a long prefill (default 4096; 0 keeps none; written to ``prefix_cache_dir`` too, so a
prompt that shares only part of a long earlier one, or one whose prefill was interrupted, resumes from the deepest).
Raises
    ``ModelLoadError`` with what to do when the model cannot be found or read.
    """
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a folder or a Hugging Face repo id (a str), got {type(model).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    if max_seq is not None:
        integer("max_seq", max_seq, low=1)
    if prefill_chunk is not None:
        integer("prefill_chunk", prefill_chunk, low=1)
    if prefix_cache_bytes is not None:
        integer("prefix_cache_bytes", prefix_cache_bytes, low=0)
    if prefix_cache_dir_bytes is not None:
        integer("prefix_cache_dir_bytes", prefix_cache_dir_bytes, low=0)
    if prefix_cache_snapshot_every is not None:
        integer("prefix_cache_snapshot_every", prefix_cache_snapshot_every, low=0)
    if prefix_cache_dir is not None and not isinstance(prefix_cache_dir, (str, os.PathLike)):
        raise TypeError(f"prefix_cache_dir must be a folder path, got {type(prefix_cache_dir).__name__}")
    if revision is not None and not isinstance(revision, str):
        raise TypeError(f"revision must be a str, got {type(revision).__name__}")
    progress = flag("progress", progress)
    folder = resolve_model(model, revision=revision, progress=progress)
    generation_config = read_json(folder / "generation_config.json")
    try:
        SamplingDefaults.from_generation_config(generation_config)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{folder / 'generation_config.json'}: {e}") from None
    tokenizer = load_tokenizer(folder, generation_config)
    template = ChatTemplate.from_dir(folder)
    warm_page_cache(folder, progress=progress)
    if backend == "auto":
        _warn_on_fallback()
    engine = _open_engine(folder, backend, max_seq, prefill_chunk, kv_dtype, progress, precision)
    return Model(engine, tokenizer, template, generation_config, folder, prefix_cache_bytes, prefix_cache_dir,
                 prefix_cache_dir_bytes, prefix_cache_snapshot_every=prefix_cache_snapshot_every)


_warned_fallback = False


def _warn_on_fallback() -> None:
    """Say once per process when ``"auto"`` picks the CPU on a machine with a GPU backend (a Mac with Apple
    silicon whose Metal GPU was not found), with the reason: never a silent slow path."""
    global _warned_fallback
    auto = _lily.system_info()["auto"]
    if auto["fallback"] and not _warned_fallback:
        _warned_fallback = True
        warnings.warn(f"lily: backend \"auto\" runs on the CPU: {auto['reason']} (see `lily info`)",
                      RuntimeWarning, stacklevel=3)


def _open_engine(folder: Path, backend: str, max_seq: int | None, prefill_chunk: int | None, kv_dtype: str,
                 progress: bool, precision: str = "exact") -> Engine:
    """The engine, with a per-layer progress bar on stderr for large (>= 1 GiB) checkpoints."""
    kw = {"backend": backend, "max_seq": max_seq, "prefill_chunk": prefill_chunk, "kv_dtype": kv_dtype,
          "precision": precision}
    if not progress or sum(f.stat().st_size for f in folder.glob("*.safetensors")) < 1 << 30:
        return Engine(str(folder), **kw)
    bar = None

    def report(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = progress_bar(total, desc="Loading layers", unit="layer", leave=False)
        bar.update(done - bar.n)

    try:
        return Engine(str(folder), **kw, progress=report)
    finally:
        if bar is not None:
            bar.close()
