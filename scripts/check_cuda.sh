#!/usr/bin/env bash
# CUDA checks that run without a GPU (needs clang-19 and NVRTC; scripts/test.sh installs both):
#  1. every shaders/cuda/*.cu compiles with NVRTC (the pinned nvidia-cuda-nvrtc wheel) for sm_80,
#     sm_89 and sm_90 through the backend's own compile path, with no error and no warning;
#  2. every kernel runs on the CPU simulator (tools/cuda-sim) against its reference twin,
#     bounds-checked, then the per-kernel tests again with the threads of each block in reverse
#     order (a missing barrier or a race shows as a difference; the end-to-end model tests, which
#     only chain the same kernels, and the planted-bug checks, which set their own order, run once);
#     the simulator's planted-bug checks;
#  3. the host encoding layer against the null executor: warm prefill chunks and decode steps
#     encode without allocating, repeated decode steps replay one captured graph;
#  4. the tiny-model oracle end to end through backend="cuda-sim" (needs the Python package built
#     and the test requirements; skip with --no-python).
# Usage: scripts/check_cuda.sh [--no-python]
set -euo pipefail
cd "$(dirname "$0")/.."
export LILY_REQUIRE_CUDA_SIM=1 LILY_REQUIRE_NVRTC=1
if [ -z "${LILY_NVRTC:-}" ]; then
    LILY_NVRTC="$(python3 -c 'from lily._nvrtc import wheel_nvrtc; print(wheel_nvrtc() or "")')"
    export LILY_NVRTC
fi
[ -n "$LILY_NVRTC" ] || { echo "NVRTC not found: pip install nvidia-cuda-nvrtc (or set LILY_NVRTC)"; exit 1; }

echo "== NVRTC ($LILY_NVRTC): every kernel for sm_80, sm_89, sm_90, no warnings; the sm_90 resource report"
cargo test -p lily-core --release --locked --test cuda_nvrtc -- --nocapture

echo "== kernels vs CPU reference (simulator, bounds-checked: the cuda_sim tests of tests/ops_<family>.rs), argmax, the tiny model, planted bugs"
cargo test -p lily-core --release --locked --test 'ops_*' -- cuda_sim::
cargo test -p lily-core --release --locked --test cuda_sim

echo "== the per-kernel tests with reversed thread order (CUDA_SIM_SCHED=reverse)"
CUDA_SIM_SCHED=reverse cargo test -p lily-core --release --locked --test 'ops_*' -- cuda_sim::
CUDA_SIM_SCHED=reverse cargo test -p lily-core --release --locked --test cuda_sim -- --skip forward_ --skip sim_

echo "== host layer: warm encoding allocates nothing, decode replays one graph (null executor)"
cargo test -p lily-core --release --locked --test cuda_alloc

if [ "${1:-}" != "--no-python" ]; then
  echo "== tiny-model oracle end to end through backend=\"cuda-sim\""
  python3 -m pytest tests/test_cuda_sim.py -q
fi
