//! `matmul` on CUDA (`shaders/cuda/matmul.cu`): the f32 GEMV up to `Cuda::gemv_tokens` tokens
//! (one launch for up to 4 matrices reading the same x: `matmuls`; K split across warps when rows
//! are too few to fill the GPU: `gemv_split`), above it the bf16 tensor-core GEMM.

use crate::backend::{
    cuda::{
        div, gemv_split, gemv_split_rows,
        kernels::{Kernel, Weight, WeightOp},
        shape, Args, Cuda, CudaBuf, CudaMat, Executor, GemvMulti, GEMV_BLOCKS, GEMV_ROWS,
    },
    params::MatmulParams,
};

/// The tensor-core tile of `mma_tile` (shaders/cuda/common.cuh: MMA_T, MMA_N, MMA_THREADS; checked
/// against the source by `mma_tile_matches_the_shaders`): tokens x weight rows per block, threads.
pub const MMA_TOKENS: usize = 64;
pub const MMA_ROWS: usize = 128;
pub const MMA_THREADS: u32 = 256;

/// Rows a warp group owns in `matmul_gemv_multi` at 4 bits (matmul.cu's GEMV_WIDE_ROWS; checked
/// against the source by `gemv_wide_rows_match_the_shaders`): 6, so a layer's input projections
/// take one wave of blocks (DeltaNet's 12,352 rows: 259 blocks of 48 rows, where 386 blocks of 32
/// were 1.46 waves of [`GEMV_BLOCKS`]); other formats, and `matmul_gemv`, keep [`GEMV_ROWS`].
pub const GEMV_WIDE_ROWS_Q4: usize = 6;

/// The rows a warp group of `matmul_gemv_multi` owns for weights `w`.
fn gemv_multi_rows(w: Weight) -> usize {
    if w.suffix().starts_with("q4_") {
        GEMV_WIDE_ROWS_Q4
    } else {
        GEMV_ROWS
    }
}

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
        // At most one wave of blocks: a block loops over row blocks, staging x once (the
        // vocabulary projection: 7,760 row blocks, each staging x anew when launched one each).
        let blocks = div(n, 32 / ks as usize).min(div(GEMV_BLOCKS, t));
        let launch = shape([blocks, t as u32, 1], 256);
        c.launch(Kernel::weight(WeightOp::MatmulGemv, w.weight), launch, args);
    } else {
        let args = args.ptr(x.ptr()).ptr(out.ptr());
        let launch = shape([div(n, MMA_ROWS), div(t, MMA_TOKENS), 1], MMA_THREADS);
        c.launch(Kernel::weight(WeightOp::MatmulMma, w.weight), launch, args);
    }
}

/// Several matrices reading the same x: at most `gemv_tokens` tokens, matrices of one weight
/// format and one K share a launch (up to 4: `matmul_gemv_multi`), wherever they stand in the
/// list (the MoE block's router and shared-expert gate, both 8-bit, around two 4-bit matrices:
/// two launches, not three); otherwise, and for a matrix alone, one `matmul` each.
pub fn matmuls<X: Executor>(
    c: &Cuda<X>,
    p: &MatmulParams,
    x: &CudaBuf<X>,
    ws: &[&CudaMat<X>],
    outs: &mut [&mut CudaBuf<X>],
) {
    let t = p.tokens as usize;
    let count = ws.len().min(outs.len());
    // Bit j: matrix j is done (a layer passes at most a handful).
    let mut done = 0u64;
    for i in 0..count.min(64) {
        if done & (1 << i) != 0 {
            continue;
        }
        let w0 = ws[i];
        let (mut group, mut n) = ([i; 4], 1);
        for j in i + 1..count.min(64) {
            if n < 4 && done & (1 << j) == 0 && ws[j].weight == w0.weight && ws[j].desc.cols == w0.desc.cols {
                group[n] = j;
                n += 1;
            }
        }
        for &j in &group[..n] {
            done |= 1 << j;
        }
        if n == 1 || t == 0 || t > c.gemv_tokens {
            for &j in &group[..n] {
                matmul(c, p, ws[j], x, outs[j]);
            }
            continue;
        }
        let k = w0.desc.cols as usize;
        let mut checks = [("x", x.len, (p.x_row0 as usize + t) * k); 5];
        for (check, &j) in checks[1..].iter_mut().zip(&group[..n]) {
            *check = ("out", outs[j].len, t * ws[j].desc.rows as usize);
        }
        if !c.fits("matmuls", &checks[..n + 1]) {
            return;
        }
        let mut g = GemvMulti {
            count: n as u32,
            ..Default::default()
        };
        let rows: usize = group[..n].iter().map(|&j| ws[j].desc.rows as usize).sum();
        let chunks = group[..n]
            .iter()
            .map(|&j| ws[j].desc.row_bytes as usize / 16)
            .min()
            .unwrap_or(0);
        let warp_rows = gemv_multi_rows(w0.weight);
        let ks = gemv_split_rows(rows, chunks, t, warp_rows);
        g.ks = ks;
        let mut end = 0;
        for (e, &j) in g.ends.iter_mut().zip(&group[..n]) {
            end += div(ws[j].desc.rows as usize, 8 / ks as usize * warp_rows);
            *e = end;
        }
        // Unused slots repeat the group's last matrix (never reached: the grid ends at ends[n - 1]).
        let pick = |slot: usize| group[slot.min(n - 1)];
        let mut args = Args::new().push(*p).push(g);
        for slot in 0..4 {
            args = args.push(ws[pick(slot)].desc);
        }
        for slot in 0..4 {
            let [w, s, b] = ws[pick(slot)].ptrs();
            args = args.ptr(w).ptr(s).ptr(b);
        }
        args = args.ptr(x.ptr());
        for slot in 0..4 {
            args = args.ptr(outs[pick(slot)].ptr());
        }
        let launch = shape([end, t as u32, 1], 256);
        c.launch(Kernel::weight(WeightOp::MatmulGemvMulti, w0.weight), launch, args);
    }
    for j in 64..count {
        matmul(c, p, ws[j], x, outs[j]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mma_tile_matches_the_shaders() {
        let common = crate::backend::cuda::kernels::HEADERS
            .iter()
            .find(|(name, _)| *name == "common.cuh")
            .map(|(_, src)| *src)
            .expect("common.cuh among the sources");
        for (name, value) in [
            ("MMA_T", MMA_TOKENS),
            ("MMA_N", MMA_ROWS),
            ("MMA_H", MMA_ROWS / 2),
            ("MMA_THREADS", MMA_THREADS as usize),
        ] {
            let line = format!("#define {name} {value} ");
            assert!(common.contains(&line), "common.cuh lacks `{line}`");
        }
    }

    #[test]
    fn gemv_wide_rows_match_the_shaders() {
        let source = |file: &str| {
            crate::backend::cuda::kernels::SOURCES
                .iter()
                .chain(crate::backend::cuda::kernels::HEADERS)
                .find(|(name, _)| *name == file)
                .map(|(_, src)| *src)
                .unwrap_or_else(|| panic!("{file} among the sources"))
        };
        let line = format!("#define GEMV_ROWS {GEMV_ROWS}\n");
        assert!(source("common.cuh").contains(&line), "common.cuh lacks `{line}`");
        let line = format!("#define GEMV_WIDE_ROWS(W) ((W::EPC) == 32 ? {GEMV_WIDE_ROWS_Q4} : GEMV_ROWS)\n");
        assert!(source("matmul.cu").contains(&line), "matmul.cu lacks `{line}`");
        // Only the 4-bit formats are 32 weights to a 16-byte chunk (W::EPC == 32).
        for s in crate::backend::cuda::kernels::WEIGHT_SUFFIXES {
            let w = Weight::from_suffix(s).unwrap();
            assert_eq!(gemv_multi_rows(w) == GEMV_WIDE_ROWS_Q4, s.starts_with("q4_"), "{s}");
        }
    }
}
