//! `embed` on Metal (`shaders/metal/embed.metal`, one kernel per weight format): one thread per
//! output element, [`rows_grid`] (D, T).

use crate::backend::{
    metal::{args::bytes_of, rows_grid, Arg, Executor, Kernel, Metal, MetalBuf, MetalMatrix, WeightOp},
    params::EmbedParams,
};

pub fn embed<X: Executor>(
    m: &Metal<X>,
    tokens: usize,
    table: &MetalMatrix<X>,
    ids: &MetalBuf<X>,
    out: &mut MetalBuf<X>,
) {
    let d = table.desc.cols as usize;
    if !m.fits("embed", &[("ids", ids.len(), tokens), ("out", out.len(), tokens * d)]) {
        return;
    }
    let [w, s, b] = m.weights(table);
    let args = [
        Arg::Bytes(bytes_of(&EmbedParams { tokens: tokens as u32 })),
        Arg::Bytes(bytes_of(&table.desc)),
        w,
        s,
        b,
        ids.arg(),
        out.arg(),
    ];
    m.encode(
        Kernel::per_weight(WeightOp::Embed, table.weight),
        &args,
        rows_grid(d, tokens),
    );
}
