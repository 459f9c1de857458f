//! The elementwise family (add, swiglu, sigmoid_gate_add): the CPU kernels and the GPU kernels
//! (Metal and CUDA, simulators and devices: `gpu_tests!`) against the reference twins; copy_rows.

mod common;
#[macro_use]
mod gpu_common;

use common::{assert_close, rand_vec};
use gpu_common::{read_all, TOL};
use lily_core::backend::{cpu::Cpu, params::RowsParams, Backend, StreamKind};

mod cpu {
    use super::*;

    #[test]
    fn elementwise_matches_reference() {
        let (fast, refr) = (Cpu::new(), Cpu::reference());
        let (rows, dim) = (7, 96);
        let x = rand_vec(rows * dim, 1, -3.0, 3.0);
        let z = rand_vec(rows * dim, 2, -3.0, 3.0);
        let rp = RowsParams {
            tokens: rows as u32,
            dim: dim as u32,
        };
        let (mut a, mut b) = (vec![0f32; rows * dim], vec![0f32; rows * dim]);
        fast.swiglu(&rp, &x, &z, &mut a);
        refr.swiglu(&rp, &x, &z, &mut b);
        assert_close(&a, &b, 1e-6, "swiglu");
        let gate = rand_vec(rows, 9, -2.0, 2.0);
        let (mut a, mut b) = (x.clone(), x.clone());
        fast.sigmoid_gate_add(&rp, &z, &gate, &mut a);
        refr.sigmoid_gate_add(&rp, &z, &gate, &mut b);
        assert_close(&a, &b, 1e-6, "sigmoid_gate_add");
        fast.add(&rp, &mut a, &z);
        refr.add(&rp, &mut b, &z);
        assert_close(&a, &b, 1e-6, "add");
    }
}

gpu_tests!(elementwise_matches_reference, copy_rows_moves_rows_in_the_stream);

/// add, swiglu, sigmoid_gate_add on a row narrower than a threadgroup (block) and one wider.
fn elementwise_matches_reference<B: Backend>(dev: &mut B, tolx: f32) {
    for (t, d) in [(3, 70), (3, 300)] {
        let x = rand_vec(t * d, 6, -1.0, 1.0);
        let y = rand_vec(t * d, 7, -1.0, 1.0);
        let g = rand_vec(t, 8, -2.0, 2.0);
        let p = RowsParams {
            tokens: t as u32,
            dim: d as u32,
        };
        both!(dev, tolx * TOL, format!("add/swiglu/sigmoid_gate_add {t}x{d}"), b => {
            let (mut xb, yb, gb) = (b.upload(&x).unwrap(), b.upload(&y).unwrap(), b.upload(&g).unwrap());
            let mut s = b.alloc(t * d).unwrap();
            b.swiglu(&p, &xb, &yb, &mut s);
            b.add(&p, &mut xb, &yb);
            b.sigmoid_gate_add(&p, &yb, &gb, &mut xb);
            b.finish().unwrap();
            vec![read_all(b, &s, t * d), read_all(b, &xb, t * d)]
        });
    }
}

/// copy_rows: a row into the middle of another buffer and back out, between kernels of one stream
/// (the second copy reads what the first wrote); out-of-bounds copies are errors.
fn copy_rows_moves_rows_in_the_stream<B: Backend>(dev: &mut B, tolx: f32) {
    let _ = tolx; // exact: copies
    for w in [70, 300] {
        let rows = 4;
        let src = rand_vec(rows * w, 9, -1.0, 1.0);
        both!(dev, 0.0, format!("copy_rows w={w}"), b => {
            let s = b.upload(&src).unwrap();
            let mut one = b.alloc(w).unwrap();
            let mut back = b.alloc(rows * w).unwrap();
            b.fill_zero(&mut back).unwrap();
            b.begin(StreamKind::Other).unwrap();
            b.copy_rows(&s, 2 * w, &mut one, 0, w).unwrap();
            b.copy_rows(&one, 0, &mut back, w, w).unwrap();
            b.copy_rows(&s, 3 * w + 5, &mut back, 3 * w, w - 5).unwrap();
            assert!(b.copy_rows(&s, 3 * w + 1, &mut one, 0, w).is_err(), "past the source");
            assert!(b.copy_rows(&s, 0, &mut one, 1, w).is_err(), "past the destination");
            b.finish().unwrap();
            vec![read_all(b, &back, rows * w)]
        });
    }
}
