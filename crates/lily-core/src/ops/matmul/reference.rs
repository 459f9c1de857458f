//! The reference twin of `matmul`: each weight row dequantized by `Matrix::dequant_row`
//! (quant.rs), then dotted with each token's x.

use crate::{backend::params::MatmulParams, quant::Matrix};

pub fn matmul(p: &MatmulParams, w: &Matrix, x: &[f32], out: &mut [f32]) {
    let (n, k) = (w.rows, w.cols);
    let mut row = vec![0f32; k];
    for r in 0..n {
        w.dequant_row(0, r, &mut row);
        for t in 0..p.tokens as usize {
            let xt = &x[(p.x_row0 as usize + t) * k..][..k];
            out[t * n + r] = row.iter().zip(xt).map(|(a, b)| a * b).sum();
        }
    }
}
