#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what the tests need, builds the package,
# checks formatting and lints, then runs the Rust and Python tests. `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

step() { printf '\n=== %s (%s)\n' "$1" "$(date +%H:%M:%S)"; }

step "install test dependencies"
python3 -m pip install -q "maturin>=1.7,<2" -r tests/requirements.txt
rustup component add rustfmt clippy >/dev/null 2>&1 || true
# clang-19 type-checks the Metal shaders and compiles them for the Metal simulator.
if ! command -v clang++-19 >/dev/null; then
    sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq && $sudo apt-get install -y -qq clang-19 >/dev/null
fi
# qemu + a cross linker run the CPU kernels' arm64 (NEON / sdot) paths on this x86_64 machine.
if ! command -v qemu-aarch64 >/dev/null || ! command -v aarch64-linux-gnu-gcc >/dev/null; then
    sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq && $sudo apt-get install -y -qq qemu-user gcc-aarch64-linux-gnu >/dev/null
fi
rustup target add aarch64-unknown-linux-gnu >/dev/null
export LILY_REQUIRE_METAL_SIM=1  # a missing simulator fails the Metal tests instead of skipping them
export LILY_REQUIRE_CUDA_SIM=1   # likewise for the CUDA simulator
# NVRTC (pinned: the CUDA 13.0 compiler of the H200 machine) compiles every CUDA kernel in CI.
python3 -m pip install -q "nvidia-cuda-nvrtc==13.0.88"

step "build and install the package (editable, release)"
python3 -m pip install -q --no-build-isolation -e .

step "rust: fmt, clippy, tests"
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
LILY_EXPECT_DOTS="$(grep -q avx512_vnni /proc/cpuinfo && echo Vnni512,Maddubs512,Maddubs256)" \
    cargo test -p lily-core --release --locked

step "rust: CPU kernels and pool on arm64 (qemu): every NEON path against its twin"
# The op families' CPU tests (tests/ops_*.rs); their Metal- and CUDA-simulator tests run above
# (the simulators load x86_64 kernel libraries, which an arm64 process under qemu cannot).
CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu" \
LILY_EXPECT_DOTS=NeonSdot \
    cargo test -p lily-core --release --locked --target aarch64-unknown-linux-gnu \
    --test cpu_int8 --test cpu_simd --test cpu_pool --test 'ops_*' -- --skip metal_sim --skip cuda_sim

step "fuzz: safetensors header, config.json, matrix descriptors (20 s each; scripts/fuzz.sh N for longer)"
bash scripts/fuzz.sh

step "python: ruff, stub check"
python3 -m ruff check python tests
python3 -m mypy.stubtest lily._lily --allowlist tests/stubtest-allowlist.txt

step "metal: shader type-checks, kernels in the simulator (also in reversed thread order)"
bash scripts/check_metal.sh --no-python

step "cuda: NVRTC compile of every kernel (sm_80/89/90), kernels in the simulator (also reversed), host layer"
bash scripts/check_cuda.sh --no-python

step "apple: type-check the macOS Metal host layer for aarch64-apple-darwin"
bash scripts/check_apple.sh

step "python: pytest"
python3 -m pytest -q tests
