//! The CUDA-only tests shared by the simulator (`tests/cuda_sim.rs`) and the real GPU
//! (`tests/cuda_device.rs`): argmax on the device, and the tiny checkpoint end to end (all f32
//! GEMVs; the bf16 tensor-core prefill) against the reference backend. Every op kernel is tested
//! against its reference twin in tests/ops_<family>.rs, one generic body for every GPU backend
//! (`gpu_tests!`). Each test is a function of the backend under test and a tolerance factor (1
//! for the simulator; the GPU's reduction order gets a little more room); `all_cuda_tests!` turns
//! the list into `#[test]`s.

#![allow(dead_code)] // each test binary uses the subset it needs

// A test crate that uses this module declares `mod common; mod gpu_common; mod metal_common;` too.
use crate::common::{assert_close, rand_vec};
pub use crate::metal_common::TinyCheckpoint;

use lily_core::backend::{
    cpu::Cpu,
    cuda::{Cuda, Executor},
    Backend,
};

/// A `#[test]` per case of this module on the device `$dev()` returns, with tolerance factor
/// `$tolx`.
#[macro_export]
macro_rules! all_cuda_tests {
    ($dev:path, $tolx:expr) => {
        gpu_module!(kernels, $dev, $tolx;
            argmax_matches_cpu
            forward_f32_matches_cpu
            forward_matches_cpu_at_bf16_tolerance
        );
    };
}

/// `argmax` on the device against the host's: random rows, ties (the lowest index wins), the
/// maximum in the last element, a NaN (never wins), a prefix of the buffer.
pub fn argmax_matches_cpu<X: Executor>(dev: &mut Cuda<X>, tolx: f32) {
    let _ = tolx;
    let mut cases: Vec<(Vec<f32>, usize)> = vec![
        (rand_vec(248_320, 7, -8.0, 8.0), 248_320),
        (rand_vec(5000, 8, -1.0, 1.0), 3000),
    ];
    let mut tie = rand_vec(3000, 9, -1.0, 1.0);
    tie[100] = 5.0;
    tie[2900] = 5.0;
    tie[50] = f32::NAN;
    cases.push((tie, 3000));
    let mut last = vec![0.0f32; 1025];
    last[1024] = 1.0;
    cases.push((last, 1025));
    for (v, n) in cases {
        let want = Cpu::reference().argmax(&v, n).unwrap();
        let b = dev.upload(&v).unwrap();
        assert_eq!(dev.argmax(&b, n).unwrap(), want, "argmax of {n}");
    }
}

/// The tiny checkpoint end to end with every matmul on the f32 GEMV: logits of a 40-token
/// prefill (every position) and 3 decode steps within 1e-4 of the reference backend.
pub fn forward_f32_matches_cpu<X: Executor>(dev: &mut Cuda<X>, tolx: f32) {
    let ckpt = TinyCheckpoint::write();
    let want = ckpt.logits(&Cpu::reference());
    let saved = dev.gemv_tokens;
    dev.gemv_tokens = usize::MAX;
    let got = ckpt.logits(&*dev);
    dev.gemv_tokens = saved;
    let worst = crate::metal_common::assert_logits_close(&got, &want, tolx, "tiny model, f32 GEMV");
    eprintln!("tiny model, f32: max |Δlogit| / max(1, max |logit|) = {worst:.2e}");
}

/// The same with the prefill matmuls on the bf16 tensor cores: every logit within 5e-2 of the
/// largest (bf16 inputs keep 8 bits), and the argmax of every position the reference's wherever
/// the reference's top two differ by more than that.
pub fn forward_matches_cpu_at_bf16_tolerance<X: Executor>(dev: &mut Cuda<X>, tolx: f32) {
    let ckpt = TinyCheckpoint::write();
    let want = ckpt.logits(&Cpu::reference());
    let got = ckpt.logits(&*dev);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_close(
            g,
            w,
            tolx * 5e-2,
            &format!("tiny model (bf16 prefill GEMMs) position {i}"),
        );
        let argmax = |v: &[f32]| (0..v.len()).max_by(|&a, &b| v[a].total_cmp(&v[b])).unwrap();
        let mut sorted = w.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let scale = w.iter().fold(1f32, |m, v| m.max(v.abs()));
        if sorted[0] - sorted[1] > 5e-2 * scale {
            assert_eq!(argmax(g), argmax(w), "position {i}: argmax");
        }
    }
}
