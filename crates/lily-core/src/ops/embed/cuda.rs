//! `embed` on CUDA (`shaders/cuda/embed.cu`): one thread per output value, a block row per token.

use crate::backend::cuda::{
    kernels::{Kernel, WeightOp},
    rows_launch, Args, Cuda, CudaBuf, CudaMat, Executor,
};

pub fn embed<X: Executor>(c: &Cuda<X>, tokens: usize, table: &CudaMat<X>, ids: &CudaBuf<X>, out: &mut CudaBuf<X>) {
    let d = table.desc.cols as usize;
    if !c.fits("embed", &[("ids", ids.len, tokens), ("out", out.len, tokens * d)]) {
        return;
    }
    let [w, s, b] = table.ptrs();
    let args = Args::new()
        .push(tokens as u32)
        .push(table.desc)
        .ptr(w)
        .ptr(s)
        .ptr(b)
        .ptr(ids.ptr())
        .ptr(out.ptr());
    c.launch(
        Kernel::weight(WeightOp::Embed, table.weight),
        rows_launch(d, tokens),
        args,
    );
}
