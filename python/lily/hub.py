"""Finding a checkpoint: a local folder, or a Hugging Face repo id fetched into the standard cache."""

from __future__ import annotations

import os
import re
from pathlib import Path

from lily._lily import ModelLoadError
from lily.progress import progress_bar

__all__ = ["resolve_model"]

# What a text checkpoint needs; skips the vision/audio extras and other formats (gguf, pytorch bins).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _cache_dir() -> str:
    try:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    except ImportError:  # pragma: no cover - depends on the environment
        return os.path.expanduser("~/.cache/huggingface/hub")


def resolve_model(model: str | os.PathLike[str], *, revision: str | None = None, progress: bool = True) -> Path:
    """The local folder of ``model``: the folder itself, or the cached snapshot of a Hub repo id
    (downloaded with a progress bar when it is not cached yet)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    name = os.fspath(model)
    if path.exists():
        raise ModelLoadError(f"{name}: not a folder (pass the checkpoint folder, not a file in it)")
    if not _REPO_ID.match(name) or name.startswith((".", "/", "~")):
        raise ModelLoadError(f"{name}: no such folder, and not a Hugging Face repo id (owner/name)")
    try:
        import huggingface_hub
        from huggingface_hub import errors as hf_errors
    except ImportError:
        raise ModelLoadError(
            f"{name}: no such folder; to download it from the Hugging Face Hub, install huggingface_hub "
            "(pip install huggingface_hub)"
        ) from None
    if not progress:
        huggingface_hub.utils.disable_progress_bars()
    try:
        return Path(huggingface_hub.snapshot_download(name, revision=revision, allow_patterns=ALLOW_PATTERNS))
    # The messages say what to do; the chained httpx / huggingface_hub tracebacks would only bury them.
    except hf_errors.RepositoryNotFoundError:
        raise ModelLoadError(
            f"{name}: no such repository on the Hugging Face Hub (or it is private or gated: run `hf auth login`)"
        ) from None
    except hf_errors.RevisionNotFoundError:
        raise ModelLoadError(f"{name}: revision {revision!r} not found on the Hugging Face Hub") from None
    except (hf_errors.LocalEntryNotFoundError, hf_errors.OfflineModeIsEnabled):
        raise ModelLoadError(
            f"{name}: not in the Hugging Face cache ({_cache_dir()}) and the Hub cannot be reached. "
            f"On a machine with network, run `hf download {name}` (it fills that cache; set HF_HOME or "
            "HF_HUB_CACHE to use another one), or pass the path of a local checkpoint folder."
        ) from None
    except (OSError, huggingface_hub.errors.HfHubHTTPError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"{name}: download failed: {first_line}") from None


def warm_page_cache(folder: Path, *, progress: bool = True, min_bytes: int = 1 << 30) -> None:
    """Read the weight files once with a progress bar, so that the engine's memory-mapped load of a
    large checkpoint finds them in the page cache instead of stalling silently. Skipped for small
    checkpoints and when the weights would not fit in memory."""
    files = sorted(folder.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    if not progress or total < min_bytes:
        return
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 0
    if ram and total > 0.8 * ram:
        return
    chunk = 64 << 20
    buf = bytearray(chunk)
    with progress_bar(total, desc="Reading weights", unit="B", unit_scale=True, leave=False) as bar:
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while True:
                    n = fh.readinto(buf)
                    if not n:
                        break
                    bar.update(n)
