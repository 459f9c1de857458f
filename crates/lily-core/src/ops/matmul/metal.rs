//! `matmul` on Metal (`shaders/metal/matmul.metal`): the kernel by token count and GPU-family
//! variant (`Metal::variants`).

use crate::backend::{
    metal::{
        args::bytes_of, ceil_div, stream::Work, Arg, Executor, GemmOp, GemvOp, Grid, Kernel, Metal, MetalBuf,
        MetalMatrix, WeightOp,
    },
    params::{MatmulParams, MMA_TILE},
};

pub fn matmul<X: Executor>(m: &Metal<X>, p: &MatmulParams, w: &MetalMatrix<X>, x: &MetalBuf<X>, out: &mut MetalBuf<X>) {
    let (n, k, t) = (w.desc.rows as usize, w.desc.cols as usize, p.tokens as usize);
    if !m.fits(
        "matmul",
        &[("x", x.len(), (p.x_row0 as usize + t) * k), ("out", out.len(), t * n)],
    ) {
        return;
    }
    let [wb, s, b] = m.weights(w);
    let args = [
        Arg::Bytes(bytes_of(p)),
        Arg::Bytes(bytes_of(&w.desc)),
        wb,
        s,
        b,
        x.arg(),
        out.arg(),
    ];
    // Prefill past 8 tokens: the simdgroup-matrix GEMM, output tiles of 32 tokens x TN rows
    // staged through threadgroup memory (matmul.metal; TN by GPU family). One token: the
    // GEMV, R rows per simdgroup (by GPU family). 2..8 tokens: one simdgroup per output row.
    let v = m.variants;
    if t > 8 {
        let tn = v.gemm.rows();
        let grid = Grid::Groups {
            count: [ceil_div(n, tn), ceil_div(t, MMA_TILE), 1],
            size: [128, 1, 1],
        };
        let tg_mem = [MMA_TILE * MMA_TILE * 4, tn * MMA_TILE * 4];
        let work = Work::flops(2.0 * (t * n * k) as f64);
        return m.encode_work(v.gemm_kernel(GemmOp::MatmulMma, w.weight), &args, grid, &tg_mem, work);
    }
    if t == 1 {
        let grid = Grid::Groups {
            count: [ceil_div(n, 4 * v.gemv.rows()), 1, 1],
            size: [128, 1, 1],
        };
        return m.encode(v.gemv_kernel(GemvOp::MatmulGemv, w.weight), &args, grid);
    }
    let grid = Grid::Groups {
        count: [ceil_div(n, 4), ceil_div(t, 8), 1],
        size: [128, 1, 1],
    };
    m.encode(Kernel::per_weight(WeightOp::MatmulGemm, w.weight), &args, grid);
}
