//! `embed` on the CPU.

use crate::{
    backend::cpu::{isa::Isa, pool, simd},
    quant::Matrix,
};

/// out[t, :] = dequant(table row ids[t]). Threads: one task per token row.
pub fn embed(tokens: usize, table: &Matrix, ids: &[u32], out: &mut [f32]) {
    let (isa, d) = (Isa::get(), table.cols);
    pool::for_chunks(&mut out[..tokens * d], d, |t, o| {
        simd::dequant_row(isa, table, table.stored_row(0, ids[t] as usize), o)
    });
}
