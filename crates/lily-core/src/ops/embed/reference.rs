//! The reference twin of `embed`: each row dequantized by `Matrix::dequant_row` (quant.rs).

use crate::quant::Matrix;

pub fn embed(tokens: usize, table: &Matrix, ids: &[u32], out: &mut [f32]) {
    let d = table.cols;
    for t in 0..tokens {
        table.dequant_row(0, ids[t] as usize, &mut out[t * d..(t + 1) * d]);
    }
}
