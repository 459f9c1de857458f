//! The norm family (rms_norm, rms_norm_gated, the fused add_rms_norm / add_gated_rms_norm):
//! the CPU kernels and the GPU kernels (Metal and CUDA, simulators and devices: `gpu_tests!`)
//! against the reference twins.

mod common;
#[macro_use]
mod gpu_common;

use common::{assert_close, norm_params, rand_vec};
use gpu_common::{read_all, TOL};
use lily_core::backend::{cpu::Cpu, Backend, GatedAdd, StreamKind};

mod cpu {
    use super::*;

    #[test]
    fn norms_match_reference() {
        let (fast, refr) = (Cpu::new(), Cpu::reference());
        let (rows, dim) = (7, 96);
        let x = rand_vec(rows * dim, 1, -3.0, 3.0);
        let z = rand_vec(rows * dim, 2, -3.0, 3.0);
        let w = rand_vec(dim, 3, 0.5, 1.5);
        let p = norm_params(rows, dim);
        let (mut a, mut b) = (vec![0f32; rows * dim], vec![0f32; rows * dim]);
        fast.rms_norm(&p, &x, &w, &mut a);
        refr.rms_norm(&p, &x, &w, &mut b);
        assert_close(&a, &b, 1e-6, "rms_norm");
        fast.rms_norm_gated(&p, &x, &z, &w, &mut a);
        refr.rms_norm_gated(&p, &x, &z, &w, &mut b);
        assert_close(&a, &b, 1e-6, "rms_norm_gated");
    }
}

gpu_tests!(rms_norm_matches_reference, add_rms_norm_matches_reference);

/// rms_norm and rms_norm_gated on rows narrower than a warp, a partial block, wider than one, and
/// at and past the widest row a CUDA block holds in registers (2048).
fn rms_norm_matches_reference<B: Backend>(dev: &mut B, tolx: f32) {
    for (rows, dim) in [(3, 100), (2, 300), (4, 16), (5, 48), (1, 2048), (2, 2050)] {
        let x = rand_vec(rows * dim, 1, -2.0, 2.0);
        let z = rand_vec(rows * dim, 4, -3.0, 3.0);
        let w = rand_vec(dim, 2, 0.5, 1.5);
        let p = norm_params(rows, dim);
        both!(dev, tolx * TOL, format!("rms_norm(_gated) {rows}x{dim}"), b => {
            let (xb, zb, wb) = (b.upload(&x).unwrap(), b.upload(&z).unwrap(), b.upload(&w).unwrap());
            let (mut out, mut gated) = (b.alloc(rows * dim).unwrap(), b.alloc(rows * dim).unwrap());
            b.begin(StreamKind::Other).unwrap();
            b.rms_norm(&p, &xb, &wb, &mut out);
            b.rms_norm_gated(&p, &xb, &zb, &wb, &mut gated);
            b.finish().unwrap();
            vec![read_all(b, &out, rows * dim), read_all(b, &gated, rows * dim)]
        });
    }
}
/// The fused residual add + norm kernels against the reference's unfused add, sigmoid_gate_add
/// and rms_norm: both outputs (the new residual x and the norm), at widths below, at and above
/// one threadgroup's (block's) 256 threads.
fn add_rms_norm_matches_reference<B: Backend>(dev: &mut B, tolx: f32) {
    for (rows, dim) in [(3, 100), (2, 300), (1, 2048), (2, 2049)] {
        let n = rows * dim;
        let x = rand_vec(n, 11, -2.0, 2.0);
        let y = rand_vec(n, 12, -2.0, 2.0);
        let shared = rand_vec(n, 13, -2.0, 2.0);
        let gate = rand_vec(rows, 14, -4.0, 4.0);
        let w = rand_vec(dim, 15, 0.5, 1.5);
        let p = norm_params(rows, dim);
        both!(dev, tolx * TOL, format!("add_rms_norm {rows}x{dim}"), b => {
            let (yb, sb, gb, wb) = (
                b.upload(&y).unwrap(),
                b.upload(&shared).unwrap(),
                b.upload(&gate).unwrap(),
                b.upload(&w).unwrap(),
            );
            let (mut x1, mut x2) = (b.upload(&x).unwrap(), b.upload(&x).unwrap());
            let (mut out1, mut out2) = (b.alloc(n).unwrap(), b.alloc(n).unwrap());
            b.begin(StreamKind::Other).unwrap();
            b.add_rms_norm(&p, &mut x1, &yb, &wb, &mut out1);
            let add = GatedAdd { y: &yb, shared: &sb, gate: &gb };
            b.add_gated_rms_norm(&p, &mut x2, &add, &wb, &mut out2);
            b.finish().unwrap();
            vec![
                read_all(b, &x1, n),
                read_all(b, &out1, n),
                read_all(b, &x2, n),
                read_all(b, &out2, n),
            ]
        });
    }
}
