//! The CUDA kernels run by the simulator (tools/cuda-sim: the real `.cu` sources compiled by
//! clang-19 as C++, bounds-checked, warp collectives and mma.sync emulated) against their
//! plain-loop twins `Cpu::reference()`: those of `cuda_common` (shared with the GPU) here, the
//! others in the `cuda_sim` module of each tests/ops_<family>.rs.
//! Skipped (with a message) where clang-19 is absent, unless LILY_REQUIRE_CUDA_SIM=1 (CI).
//! `CUDA_SIM_SCHED=reverse` reruns them with the threads of each block in reverse order.
//! Also here: the simulator's own checks, planted bugs it must catch.

#![cfg(unix)]

mod common;
#[macro_use]
mod gpu_common;
#[macro_use]
mod cuda_common;
mod metal_common;

use cuda_common::*;
use gpu_common::cuda_sim as sim;
use lily_core::backend::cuda::{sim::Sim, Args, Executor, Launch};

all_cuda_tests!(crate::gpu_common::cuda_sim, 1.0);

// ---- the simulator itself: planted bugs ---------------------------------------------------------

const MUTANTS: &str = include_str!("../../../tools/cuda-sim/mutants/mutants.cu");

fn mutants() -> Option<Sim> {
    sim()?;
    let so = lily_core::backend::cuda::sim::build_library(&[("mutants.cu", MUTANTS)]).unwrap();
    Some(Sim::from_library(&so).unwrap())
}

/// Run kernel `name` over `grid` blocks of `block` threads on `n`-float buffers (input 0..n,
/// output poisoned); the output, or the simulator's error.
fn run(s: &Sim, name: &str, grid: u32, block: u32, n: usize) -> Result<Vec<f32>, String> {
    let x = s.alloc(n * 4, "x").unwrap();
    let out = s.alloc(n * 4, "out").unwrap();
    let input: Vec<u8> = (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect();
    s.write(x, &input).unwrap();
    s.write(out, &vec![0xffu8; n * 4]).unwrap();
    let f = s.function(name).unwrap();
    let mut args = Args::new().ptr(x).ptr(out).push(n as u32);
    let shape = Launch {
        grid: [grid, 1, 1],
        block: [block, 1, 1],
        shared: 0,
    };
    let r = s.launch(&f, name, shape, &mut args).map_err(|e| e.to_string());
    let mut bytes = vec![0u8; n * 4];
    s.read(out, &mut bytes).unwrap();
    s.free(x);
    s.free(out);
    r.map(|_| {
        bytes
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    })
}

/// Block sums of 0..n (64-thread blocks): what every reduction mutant should compute.
fn block_sums(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i / 64 * 64)..((i / 64 + 1) * 64).min(n)).map(|j| j as f32).sum())
        .collect()
}

#[test]
fn sim_runs_the_correct_reduction_in_both_orders() {
    let Some(s) = mutants() else { return };
    for reverse in [false, true] {
        s.set_reverse(Some(reverse));
        assert_eq!(
            run(&s, "block_sum_ok", 2, 64, 128).unwrap(),
            block_sums(128),
            "reverse={reverse}"
        );
    }
}

#[test]
fn sim_catches_a_missing_syncthreads() {
    let Some(s) = mutants() else { return };
    let want = block_sums(128);
    // Forward order happens to work; the reversed order reads shared memory before it is written.
    s.set_reverse(Some(true));
    let got = run(&s, "block_sum_no_barrier", 2, 64, 128).unwrap();
    assert_ne!(got, want, "a missing __syncthreads went unnoticed");
}

#[test]
fn sim_catches_a_wrong_shuffle() {
    let Some(s) = mutants() else { return };
    // A butterfly with a wrong lane mask sums the wrong lanes.
    let got = run(&s, "warp_sum_wrong_xor", 1, 32, 32).unwrap();
    assert_ne!(got[0], (0..32).sum::<i32>() as f32);
    // A shuffle whose mask leaves out lanes that call it is an error, not a silent result.
    let e = run(&s, "warp_sum_partial_mask", 1, 32, 32).unwrap_err();
    assert!(e.contains("__shfl_xor_sync") && e.contains("mask 0x0000ffff"), "{e}");
    // Lanes that returned before a full-mask collective.
    let e = run(&s, "shuffle_after_return", 1, 32, 32).unwrap_err();
    assert!(e.contains("returned"), "{e}");
}

#[test]
fn sim_catches_an_out_of_bounds_write() {
    let Some(s) = mutants() else { return };
    let e = run(&s, "write_past_end", 1, 64, 40).unwrap_err();
    assert!(
        e.contains("out-of-bounds") && e.contains("'out'") && e.contains("argument 1"),
        "{e}"
    );
}

#[test]
fn sim_catches_a_wrong_mma_fragment_index() {
    let Some(s) = mutants() else { return };
    // x holds 0..256 as a 16 x 16 A (row-major) and B (16 x 8 from its first 128 values): the
    // correct kernel matches a plain product, the mutant (fragment registers 1 and 2 swapped)
    // does not.
    let a: Vec<f32> = (0..256).map(|i| i as f32).collect();
    let want: Vec<f32> = (0..128)
        .map(|o| {
            let (r, c) = (o / 8, o % 8);
            (0..16).map(|k| a[r * 16 + k] * a[k * 8 + c]).sum()
        })
        .collect();
    let got = run(&s, "mma_ok", 1, 32, 256).unwrap();
    assert_eq!(&got[..128], &want[..], "the emulated mma.sync");
    let bad = run(&s, "mma_wrong_fragment", 1, 32, 256).unwrap();
    assert_ne!(&bad[..128], &want[..], "a wrong fragment index went unnoticed");
}
