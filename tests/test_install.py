"""`pip install .` on a machine without Rust or a C compiler stops at once with what to install (the build
backend's check, tools/build_backend.py), instead of maturin quietly downloading a Rust toolchain."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pip_install_with_path(tmp_path: Path, tools: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    """`pip install .` (metadata stage, nothing installed) with only ``tools`` on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in tools:
        (bin_dir / tool).symlink_to(shutil.which(tool))
    env = {k: v for k, v in os.environ.items() if k != "LILY_BUILD_DOWNLOAD_RUST"}
    env["PATH"] = str(bin_dir)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--dry-run",
                        str(ROOT)], env=env, capture_output=True, text=True, timeout=300)
    return r, time.perf_counter() - t0


def test_without_rust_and_c_compiler(tmp_path):
    r, seconds = pip_install_with_path(tmp_path, [])
    out = r.stdout + r.stderr
    assert r.returncode != 0 and seconds < 60, out
    assert "lily: cannot build: Rust (cargo) is not on PATH: install it from https://rustup.rs" in out
    assert "lily: cannot build: no C compiler (cc) on PATH" in out
    assert "installing into a temporary directory" not in out  # maturin's toolchain download never started


def test_without_c_compiler(tmp_path):
    r, _ = pip_install_with_path(tmp_path, ["cargo"])
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "no C compiler (cc) on PATH" in out and "Rust (cargo)" not in out, out
