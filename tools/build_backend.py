"""The package's PEP 517 build backend: maturin's, after a check that Rust (cargo) and a C compiler are there.

Without cargo, maturin would quietly download a temporary Rust toolchain (about 690 MB) and show nothing for
minutes; without a C compiler, the build would fail at the final link after compiling everything. This stops
at once with what to install instead. ``LILY_BUILD_DOWNLOAD_RUST=1`` lets maturin download its temporary
toolchain as it would on its own.
"""

from __future__ import annotations

import os
import shutil
import sys

import maturin
from maturin import get_requires_for_build_sdist  # noqa: F401 - a hook pip calls; needs no toolchain

RUST = "Rust (cargo) is not on PATH: install it from https://rustup.rs (`curl https://sh.rustup.rs -sSf | sh`, then \
open a new shell), or set LILY_BUILD_DOWNLOAD_RUST=1 to let maturin download a temporary toolchain (about 690 MB)."
C_COMPILER = "no C compiler (cc) on PATH: Rust links with it. Install one: `sudo apt-get install build-essential` \
(Debian, Ubuntu), `xcode-select --install` (macOS)."


def _check() -> None:
    problems = []
    if not shutil.which("cargo") and not os.environ.get("LILY_BUILD_DOWNLOAD_RUST"):
        problems.append(RUST)
    if not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")):
        problems.append(C_COMPILER)
    if problems:
        sys.stderr.write("".join(f"\nlily: cannot build: {p}\n" for p in problems) + "\n")
        raise SystemExit(1)


def get_requires_for_build_wheel(config_settings=None):
    _check()
    return maturin.get_requires_for_build_wheel(config_settings)


def get_requires_for_build_editable(config_settings=None):
    _check()
    return maturin.get_requires_for_build_editable(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    _check()
    return maturin.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    _check()
    return maturin.prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _check()
    return maturin.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _check()
    return maturin.build_editable(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    _check()
    return maturin.build_sdist(sdist_directory, config_settings)
