//! `matmul` on CUDA (`shaders/cuda/matmul.cu`): the f32 GEMV up to `Cuda::gemv_tokens` tokens
//! (one launch for up to 4 matrices reading the same x: `matmuls`; K split across warps when rows
//! are too few to fill the GPU: `gemv_split`), above it the bf16 tensor-core GEMM.

use crate::backend::{
    cuda::{
        div, gemv_split,
        kernels::{Kernel, WeightOp},
        shape, Args, Cuda, CudaBuf, CudaMat, Executor, GemvMulti,
    },
    params::MatmulParams,
};

pub fn matmul<X: Executor>(c: &Cuda<X>, p: &MatmulParams, w: &CudaMat<X>, x: &CudaBuf<X>, out: &mut CudaBuf<X>) {
    let (t, n, k) = (p.tokens as usize, w.desc.rows as usize, w.desc.cols as usize);
    if !c.fits(
        "matmul",
        &[("x", x.len, (p.x_row0 as usize + t) * k), ("out", out.len, t * n)],
    ) || t == 0
    {
        return;
    }
    let [wp, s, b] = w.ptrs();
    let args = Args::new().push(*p).push(w.desc).ptr(wp).ptr(s).ptr(b);
    if t <= c.gemv_tokens {
        let ks = gemv_split(n, w.desc.row_bytes as usize / 16, t);
        let args = args.push(ks).ptr(x.ptr()).ptr(out.ptr());
        let launch = shape([div(n, 32 / ks as usize), t as u32, 1], 256);
        c.launch(Kernel::weight(WeightOp::MatmulGemv, w.weight), launch, args);
    } else {
        let args = args.ptr(x.ptr()).ptr(out.ptr());
        let launch = shape([div(n, 64), div(t, 64), 1], 128);
        c.launch(Kernel::weight(WeightOp::MatmulMma, w.weight), launch, args);
    }
}

/// Several matrices reading the same x: at most `gemv_tokens` tokens, consecutive matrices of
/// one weight format and one K share a launch (up to 4: `matmul_gemv_multi`); otherwise, and
/// for a matrix alone, one `matmul` each.
pub fn matmuls<X: Executor>(
    c: &Cuda<X>,
    p: &MatmulParams,
    x: &CudaBuf<X>,
    ws: &[&CudaMat<X>],
    outs: &mut [&mut CudaBuf<X>],
) {
    let t = p.tokens as usize;
    let mut i = 0;
    while i < ws.len().min(outs.len()) {
        let w0 = ws[i];
        let mut n = 1;
        while n < 4
            && i + n < ws.len().min(outs.len())
            && ws[i + n].weight == w0.weight
            && ws[i + n].desc.cols == w0.desc.cols
        {
            n += 1;
        }
        if n == 1 || t == 0 || t > c.gemv_tokens {
            for j in i..i + n {
                matmul(c, p, ws[j], x, outs[j]);
            }
            i += n;
            continue;
        }
        let k = w0.desc.cols as usize;
        let mut checks = [("x", x.len, (p.x_row0 as usize + t) * k); 5];
        for j in 0..n {
            checks[j + 1] = ("out", outs[i + j].len, t * ws[i + j].desc.rows as usize);
        }
        if !c.fits("matmuls", &checks[..n + 1]) {
            return;
        }
        let mut g = GemvMulti {
            count: n as u32,
            ..Default::default()
        };
        let rows: usize = ws[i..i + n].iter().map(|w| w.desc.rows as usize).sum();
        let chunks = ws[i..i + n]
            .iter()
            .map(|w| w.desc.row_bytes as usize / 16)
            .min()
            .unwrap_or(0);
        let ks = gemv_split(rows, chunks, t);
        g.ks = ks;
        let mut end = 0;
        for j in 0..n {
            end += div(ws[i + j].desc.rows as usize, 32 / ks as usize);
            g.ends[j] = end;
        }
        let pick = |j: usize| ws[i + j.min(n - 1)];
        let mut args = Args::new().push(*p).push(g);
        for j in 0..4 {
            args = args.push(pick(j).desc);
        }
        for j in 0..4 {
            let [w, s, b] = pick(j).ptrs();
            args = args.ptr(w).ptr(s).ptr(b);
        }
        args = args.ptr(x.ptr());
        for j in 0..4 {
            args = args.ptr(outs[i + j.min(n - 1)].ptr());
        }
        let launch = shape([end, t as u32, 1], 256);
        c.launch(Kernel::weight(WeightOp::MatmulGemvMulti, w0.weight), launch, args);
        i += n;
    }
}
