"""Where the CUDA backend finds NVRTC (the CUDA run-time compiler it builds its kernels with).

``pip install nvidia-cuda-nvrtc`` (or ``pip install lily[cuda]``) puts ``libnvrtc.so`` inside the
``nvidia`` namespace package, off the loader's search path; the Rust core loads the file named by
``LILY_NVRTC``. This sets that variable at import, unless the user set it, when the wheel is there.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path


def wheel_nvrtc() -> str | None:
    """The libnvrtc of an installed ``nvidia-cuda-nvrtc`` wheel (CUDA 13 or 12 layout), or None."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        for sub in ("cu13/lib", "cuda_nvrtc/lib", "cu12/lib"):
            for lib in sorted(Path(base, sub).glob("libnvrtc.so*")):
                if "builtins" not in lib.name and ".alt." not in lib.name:
                    return str(lib)
    return None


def configure() -> None:
    if not os.environ.get("LILY_NVRTC"):
        path = wheel_nvrtc()
        if path:
            os.environ["LILY_NVRTC"] = path
