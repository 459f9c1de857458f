#!/usr/bin/env bash
# Metal checks that run without a Mac (needs clang-19: apt-get install -y clang-19):
#  1. type-check every shaders/metal/*.metal (with shaders/params.h) in both tools/metal-sim
#     modes (C++20 with address spaces, and clang's C++ for OpenCL 2021), as Metal Shading
#     Language 3.0 (macOS 13: -DMTL_NO_BFLOAT, no `bfloat` type), after checking that both modes
#     reject a kernel that uses `bfloat`;
#  2. run every kernel (every GPU-family variant) on the CPU simulator against its reference twin
#     (bounds-checked; the metal_sim tests of tests/ops_<family>.rs), one tiny-model forward pass
#     per GPU family (tests/metal_sim.rs), then again with the threads of each threadgroup in
#     reverse order for the kernels using threadgroup memory;
#  3. the host encoding layer: warm decode steps and prefill chunks of a tiny model encoded
#     through a null executor allocate nothing (tests/metal_alloc.rs, a counting allocator);
#  4. the tiny-model oracle test end to end through backend="metal-sim" (needs the Python package
#     built and the test requirements; skip with --no-python), also with the Apple7 variants
#     (LILY_METAL_FAMILY=7).
# Usage: scripts/check_metal.sh [--no-python]
set -euo pipefail
cd "$(dirname "$0")/.."
export LILY_REQUIRE_METAL_SIM=1

echo "== type-check shaders/metal (2 modes) as MSL 3.0 (macOS 13: no bfloat)"
# The MSL 3.0 mode must reject what MSL 3.0 lacks, or it would pass whatever the shaders use.
probe="$(mktemp -d)/uses_bfloat.metal"
printf '#include "common.h"\nkernel void k(device float* y [[buffer(0)]]) { bfloat b = bfloat(1.0f); y[0] = float(b); }\n' > "$probe"
for mode in check.sh check_clcpp.sh; do
  if tools/metal-sim/$mode "$probe" -Ishaders/metal -Ishaders -DMTL_NO_BFLOAT >/dev/null 2>&1; then
    echo "FAILED: $mode -DMTL_NO_BFLOAT accepts a kernel that uses bfloat"; exit 1
  fi
done
rm -rf "$(dirname "$probe")"
fail=0
for f in shaders/metal/*.metal; do
  for mode in check.sh check_clcpp.sh; do
    if ! tools/metal-sim/$mode "$f" -Ishaders/metal -Ishaders -DMTL_NO_BFLOAT; then
      echo "FAILED: $mode $f"; fail=1
    fi
  done
done
[ "$fail" = 0 ] || exit 1

echo "== kernels vs their reference twins (simulator, bounds-checked), the whole backend"
cargo test -p lily-core --release --test 'ops_*' -- metal_sim
cargo test -p lily-core --release --test metal_sim

echo "== threadgroup-memory kernels with reversed fiber order (MTL_SCHED=reverse)"
# (matmul and moe_experts_sorted run every GEMM tile variant; delta_net_chunked also has a
# reversed twin in the plain run, metal_sim_reversed::delta_net_chunked_matches_reference.)
MTL_SCHED=reverse cargo test -p lily-core --release --test 'ops_*' -- \
  metal_sim::rms_norm metal_sim::add_rms_norm metal_sim::qk_norm_rope metal_sim::attention metal_sim::moe_route metal_sim::moe_sort \
  metal_sim::moe_experts_sorted metal_sim::moe_experts_add_rms_norm metal_sim::matmul metal_sim::delta_net_chunked

echo "== warm forward passes encode without allocating (counting allocator, null executor)"
cargo test -p lily-core --release --test metal_alloc

if [ "${1:-}" != "--no-python" ]; then
  echo "== tiny-model oracle end to end through backend=\"metal-sim\""
  python -m pytest tests/test_metal_sim.py -q
fi
