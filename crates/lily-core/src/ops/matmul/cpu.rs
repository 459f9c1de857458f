//! `matmul` / `matmuls` on the CPU: matrix products with in-kernel dequantization.
//!
//! - [`gemv`] (decode, one activation row): each weight row is dotted straight from its packed
//!   bytes ([`simd::rows_dot`]), so every weight byte is read once; rows are split into a few
//!   contiguous ranges per pool thread so both cores stream memory. [`gemv_many`]: several
//!   matrices reading the same x as one pool loop (`matmuls`), for one token or a batched step's.
//! - [`gemv_batch`] (a batched decode step, up to [`GEMV_BATCH_MAX`] rows; [`gemv_many`] of one
//!   matrix): the GEMV per row, each block of weight rows dotted with every activation row while
//!   it is in cache.
//! - [`gemm`] (prefill, many activation rows): a block of weight rows is dequantized once into
//!   an f32 tile (per-thread scratch), K-major for the outer-product kernel where the ISA has one
//!   (32 x up to 12 activation rows per pass on AVX-512, 16 x 6 on AVX2), else row-major for 4 x 4 dot tiles
//!   ([`simd::dot4x4`]); row blocks are the parallel tasks ([`tile_sweep`]). The MoE experts
//!   reuse the sweep; the chunked DeltaNet runs its products on [`simd::gemm_nn`].

use crate::{
    backend::{
        cpu::{
            int8::{Dot, Precision},
            isa::{multiversion, Isa},
            pool,
            scratch::{with_caller, with_task, Out},
            simd::{self, XRow, ROWS_BATCH},
        },
        params::MatmulParams,
    },
    quant::{Format, Matrix},
};

/// Weight rows per prefill tile: 16 rows x 2048 inputs = 128 KiB of f32, resident in L2 while
/// every activation row passes over it.
pub const TILE_ROWS: usize = 16;

/// Rows per decode task: about four tasks per pool thread, so a core slowed by another process
/// can hand work over, while each task still streams at least ~64 KiB; and at most ~2 MiB, so
/// the last task of a big matrix (the lm_head: 270 MB) leaves the other cores idle briefly.
fn gemv_chunk(rows: usize, row_bytes: usize) -> usize {
    let threads = pool::threads();
    let min_rows = (64 << 10) / row_bytes.max(1) + 1;
    let max_rows = ((2 << 20) / row_bytes.max(1)).max(min_rows);
    rows.div_ceil(4 * threads).clamp(min_rows, max_rows)
}

/// out[r] = row r of expert e . x for every row of `m` (decode GEMV).
/// Layout: `m` rows packed as stored; x [cols]; out [rows]. Threads: contiguous row ranges.
/// Accumulation: f32 per row, affine groups in the form sum_g s_g (q . x)_g + b_g sum_g x.
pub fn gemv(isa: Isa, prec: Precision, m: &Matrix, e: usize, x: &[f32], out: &mut [f32]) {
    if !simd::has_row_kernel(m) {
        // Formats without a fused kernel (2-bit): dequantize each row, then dot.
        let chunk = gemv_chunk(out.len(), m.bytes_per_row());
        pool::for_chunks(out, chunk, |c, o| {
            with_task(m.cols, |row| {
                for (i, v) in o.iter_mut().enumerate() {
                    simd::dequant_row(isa, m, m.stored_row(e, c * chunk + i), row);
                    *v = simd::dot(isa, row, &x[..m.cols]);
                }
            })
        });
        return;
    }
    gemv_many(isa, prec, &[m], e, x, 1, &mut [out])
}

/// Most matrices [`gemv_many`] takes in one call.
pub const MANY: usize = 8;

/// outs[i][t * n_i + r] = row r of expert e of W_i . x[t] for up to [`MANY`] matrices sharing x
/// [tokens, k] (decode: one token; a batched decode step: up to [`GEMV_BATCH_MAX`]): x prepared
/// once per token and distinct format and width, and every matrix's row ranges are the tasks of
/// one pool loop (one fork-join and one tail instead of one per matrix; a layer's small
/// projections cost ~15 us each on their own). Several tokens: weight rows are dotted from their
/// packed bytes with every token while in cache, up to [`ROWS_BATCH`] tokens per call of the
/// batched row kernel ([`gemv_rows_batch`]): a decode step's 4-bit matrices over each task's whole
/// row range (the kernel's four row streams as long as at one token), more tokens or other formats
/// in blocks of [`GEMV_BATCH_ROWS`] rows; each token's result is bit for bit what it gets alone.
/// outs[i] holds tokens x W_i's rows.
pub fn gemv_many(
    isa: Isa,
    prec: Precision,
    ms: &[&Matrix],
    e: usize,
    x: &[f32],
    tokens: usize,
    outs: &mut [&mut [f32]],
) {
    let n = ms.len();
    assert!(
        n <= MANY && outs.len() == n && tokens >= 1,
        "gemv_many: {n} matrices, {tokens} tokens"
    );
    if ms.iter().any(|m| !simd::has_row_kernel(m)) {
        assert!(
            tokens == 1,
            "gemv_many: {tokens} tokens and a matrix without a row kernel"
        );
        for (m, out) in ms.iter().zip(outs.iter_mut()) {
            gemv(isa, prec, m, e, x, out);
        }
        return;
    }
    let k = ms[0].cols;
    assert!(
        ms.iter().all(|m| m.cols == k) && x.len() >= tokens * k,
        "gemv_many: x is [{tokens}, {k}]"
    );
    // Matrix i reads the x prepared at off[i] (per token, `total` floats apart): its own, or an
    // earlier one of the same format.
    let (mut off, mut total) = ([0usize; MANY], 0);
    let mut own = [false; MANY];
    for i in 0..n {
        match (0..i).find(|&j| ms[j].format == ms[i].format) {
            Some(j) => off[i] = off[j],
            None => (off[i], own[i], total) = (total, true, total + simd::prep_len(ms[i])),
        }
    }
    let (mut chunk, mut start) = ([0usize; MANY], [0usize; MANY + 1]);
    let mut out_p = [Out(std::ptr::null_mut()); MANY];
    for i in 0..n {
        assert!(outs[i].len() >= tokens * ms[i].rows, "gemv_many: output {i} too short");
        chunk[i] = gemv_chunk(ms[i].rows, ms[i].bytes_per_row());
        start[i + 1] = start[i] + ms[i].rows.div_ceil(chunk[i]);
        out_p[i] = Out(outs[i].as_mut_ptr());
    }
    with_caller(tokens * total, |buf| {
        for (t, bt) in buf.chunks_exact_mut(total).enumerate() {
            for i in (0..n).filter(|&i| own[i]) {
                let m = ms[i];
                simd::prepare(isa, prec, m, &x[t * k..][..k], &mut bt[off[i]..][..simd::prep_len(m)]);
            }
        }
        let buf: &[f32] = buf;
        let view = |m: &Matrix, i: usize, t: usize| {
            simd::view(
                isa,
                prec,
                m,
                &x[t * k..][..k],
                &buf[t * total + off[i]..][..simd::prep_len(m)],
            )
        };
        pool::for_each(start[n], |task| {
            let i = (0..n).rfind(|&i| start[i] <= task).unwrap_or(0);
            let (m, r0) = (ms[i], (task - start[i]) * chunk[i]);
            let rows = r0..(r0 + chunk[i]).min(m.rows);
            let sb_len = simd::row_scratch_len(m);
            if tokens == 1 {
                // SAFETY: rows r0.. of output i belong to this task alone.
                let o = unsafe { out_p[i].slice(r0, rows.len()) };
                return with_task(sb_len, |sb| gemv_rows(isa, m, e, r0, view(m, i, 0), sb, o));
            }
            // 4-bit rows and tokens for one call of the batched kernel (a decode step; it passes
            // over each 4 rows once per 4 tokens while they are in L1): the task's rows as one
            // block, so the kernel's four row streams are the task's quarters, long forward
            // streams as at one token (blocks of 32 rows made them 8 rows each, restarted every
            // 32 KiB). Otherwise blocks of GEMV_BATCH_ROWS, in cache across the token passes.
            let one_call = tokens <= ROWS_BATCH && matches!(m.format, Format::Affine { bits: 4, .. });
            let block = if one_call { chunk[i] } else { GEMV_BATCH_ROWS };
            with_task(sb_len + ROWS_BATCH * block, |scr| {
                let (sb, y) = scr.split_at_mut(sb_len);
                for b0 in rows.clone().step_by(block) {
                    let rn = block.min(rows.end - b0);
                    for t0 in (0..tokens).step_by(ROWS_BATCH) {
                        let tn = ROWS_BATCH.min(tokens - t0);
                        let xr: [XRow; ROWS_BATCH] = std::array::from_fn(|j| view(m, i, t0 + j.min(tn - 1)));
                        gemv_rows_batch(isa, m, e, b0, &xr[..tn], rn, sb, y);
                        for j in 0..tn {
                            // SAFETY: rows b0..b0 + rn of every token's output i belong to this task alone.
                            let dst = unsafe { out_p[i].slice((t0 + j) * m.rows + b0, rn) };
                            dst.copy_from_slice(&y[j * rn..][..rn]);
                        }
                    }
                }
            })
        });
    })
}

/// Most activation rows [`gemv_batch`] takes: a batched decode step (one row per sequence). Past
/// it the dequantized-tile [`gemm`] amortizes its dequantization better.
pub const GEMV_BATCH_MAX: usize = 8;

/// Weight rows per inner block of [`gemv_many`] over more tokens than one kernel call takes (or
/// rows without the batched 4-bit kernel): 32 rows of a 2048-wide 4-bit matrix (32 KiB) stay in
/// L1/L2 while every activation row is dotted with them.
const GEMV_BATCH_ROWS: usize = 32;

/// out[t * n + r] = W[r] . x[t] for t < tokens (a batched decode step, up to [`GEMV_BATCH_MAX`];
/// any prefill where [`int8_prefill`]): [`gemv_many`] of one matrix, each token's result exactly
/// what [`gemv`] gives it alone. Threads: contiguous row ranges, as [`gemv`].
pub fn gemv_batch(isa: Isa, prec: Precision, m: &Matrix, e: usize, x: &[f32], tokens: usize, out: &mut [f32]) {
    assert!(simd::has_row_kernel(m), "gemv_batch: {tokens} rows");
    gemv_many(isa, prec, &[m], e, x, tokens, &mut [out])
}

multiversion! {
    pub(crate) fn gemv_rows(m: &Matrix, e: usize, r0: usize, xr: XRow, sb: &mut [f32], out: &mut [f32]) = gemv_rows_body;
}

multiversion! {
    pub(crate) fn gemv_rows_batch(m: &Matrix, e: usize, r0: usize, xs: &[XRow], rn: usize, sb: &mut [f32], out: &mut [f32]) = gemv_rows_batch_body;
}

/// out[j * rn + i] = row r0 + i . xs[j] for i < rn, up to [`ROWS_BATCH`] x ([`simd::rows_dot_batch`]):
/// bit for bit [`gemv_rows`] per x.
#[inline(always)]
fn gemv_rows_batch_body(
    isa: Isa,
    m: &Matrix,
    e: usize,
    r0: usize,
    xs: &[XRow],
    rn: usize,
    sb: &mut [f32],
    out: &mut [f32],
) {
    simd::rows_dot_batch(isa, m, m.stored_row(e, r0), xs, rn, sb, out, rn)
}

/// out[i] = row r0 + i . x; compiled per ISA so the per-row scale conversion and bias term of
/// 8-bit rows vectorize too.
#[inline(always)]
fn gemv_rows_body(isa: Isa, m: &Matrix, e: usize, r0: usize, xr: XRow, sb: &mut [f32], out: &mut [f32]) {
    simd::rows_dot(isa, m, m.stored_row(e, r0), xr, sb, out)
}

/// Dequantize rows `rows` of expert `e` into `tile` ([rows.len(), cols], f32).
pub fn dequant_tile(isa: Isa, m: &Matrix, e: usize, rows: std::ops::Range<usize>, tile: &mut [f32]) {
    for (i, r) in rows.enumerate() {
        simd::dequant_row(isa, m, m.stored_row(e, r), &mut tile[i * m.cols..][..m.cols]);
    }
}

/// The micro-kernel sweep of one dequantized tile against `items` activation rows:
/// calls `emit(item, tile_row, value)` for tile_row < tile_rows, item < items, where
/// value = tile row . x row `xrow(item)` (k floats each). 4 x 4 register blocks; a partial
/// block repeats its last row and drops the duplicate results.
#[inline]
pub fn tile_products<'x>(
    isa: Isa,
    tile: &[f32],
    tile_rows: usize,
    k: usize,
    items: usize,
    xrow: impl Fn(usize) -> &'x [f32],
    mut emit: impl FnMut(usize, usize, f32),
) {
    let mut t0 = 0;
    while t0 < items {
        let tn = (items - t0).min(4);
        let xs = [0, 1, 2, 3].map(|j| xrow(t0 + j.min(tn - 1)));
        let mut r0 = 0;
        while r0 < tile_rows {
            let rn = (tile_rows - r0).min(4);
            let ws = [0, 1, 2, 3].map(|i| &tile[(r0 + i.min(rn - 1)) * k..][..k]);
            let d = simd::dot4x4(isa, ws, xs, k);
            for i in 0..rn {
                for j in 0..tn {
                    emit(t0 + j, r0 + i, d[i][j]);
                }
            }
            r0 += 4;
        }
        t0 += 4;
    }
}

/// Weight rows per prefill task ([`tile_sweep`]): the K-major tile's rows where the ISA has the
/// outer-product kernel (32 on AVX-512, 16 on AVX2), else [`TILE_ROWS`].
pub fn sweep_rows(isa: Isa) -> usize {
    match simd::kmajor_rows(isa) {
        0 => TILE_ROWS,
        r => r,
    }
}

/// Scratch floats [`tile_sweep`] needs for `k` columns.
pub fn sweep_scratch_len(isa: Isa, k: usize) -> usize {
    sweep_rows(isa) * k + k
}

/// The prefill sweep of one block of weight rows: dequantize rows `rows` (at most [`sweep_rows`])
/// of expert `e` of `m` once, then call `emit(item, i, W[rows.start + i] . xrow(item))` for every
/// item < items and i < rows.len(). `scr` holds [`sweep_scratch_len`] floats.
/// With the outer-product kernel: a K-major tile, up to [`simd::kmajor_cols`] activation rows per
/// pass (12 on AVX-512, 6 on AVX2), the rows split into passes as even as that allows (an expert's
/// ~8 tokens of a 256-token prompt in one pass on AVX-512, 4 + 4 on AVX2); otherwise a row-major
/// tile and 4 x 4 dot tiles ([`tile_products`]). Accumulation f32, one FMA chain per output in
/// column order whatever the pass width.
#[inline]
pub fn tile_sweep<'x>(
    isa: Isa,
    m: &Matrix,
    e: usize,
    rows: std::ops::Range<usize>,
    items: usize,
    xrow: impl Fn(usize) -> &'x [f32],
    scr: &mut [f32],
    mut emit: impl FnMut(usize, usize, f32),
) {
    let (r_n, k, rn) = (simd::kmajor_rows(isa), m.cols, rows.len());
    if r_n == 0 {
        let tile = &mut scr[..rn * k];
        dequant_tile(isa, m, e, rows, tile);
        tile_products(isa, tile, rn, k, items, xrow, emit);
        return;
    }
    let (wt, row) = scr.split_at_mut(r_n * k);
    simd::dequant_kmajor(isa, m, e, rows, wt, row);
    let mut acc = [[0f32; 32]; simd::TILE_N_WIDE];
    let (pass, mut t0) = (simd::kmajor_cols(isa), 0);
    while t0 < items {
        // Passes as even as the pass width allows: 8 tokens in one pass, 14 as 7 + 7 (not 12 + 2,
        // whose second pass spends 2 loads per 4 FMAs).
        let tn = (items - t0).div_ceil((items - t0).div_ceil(pass));
        let xs: [&[f32]; simd::TILE_N_WIDE] = std::array::from_fn(|j| xrow(t0 + j.min(tn - 1)));
        simd::tile_kxn_wide(isa, wt, xs, tn, k, &mut acc);
        for (j, a) in acc[..tn].iter().enumerate() {
            for (i, &v) in a[..rn].iter().enumerate() {
                emit(t0 + j, i, v);
            }
        }
        t0 += tn;
    }
}

/// out[t * n + r] = W[r] . x[t] for t < tokens (prefill GEMM), W = expert e of `m` [n, k].
/// Threads: one task per block of [`sweep_rows`] weight rows; each dequantizes its rows once
/// ([`tile_sweep`]).
pub fn gemm(isa: Isa, m: &Matrix, e: usize, x: &[f32], tokens: usize, out: &mut [f32]) {
    let (n, k) = (m.rows, m.cols);
    let o = Out(out.as_mut_ptr());
    let block = sweep_rows(isa);
    pool::for_each(n.div_ceil(block), |b| {
        let rows = b * block..((b + 1) * block).min(n);
        let r0 = rows.start;
        with_task(sweep_scratch_len(isa, k), |scr| {
            tile_sweep(
                isa,
                m,
                e,
                rows,
                tokens,
                |t| &x[t * k..][..k],
                scr,
                |t, i, v| {
                    // SAFETY: (token, row) pairs of this row block are written by this task only.
                    unsafe { o.set(t * n + r0 + i, v) }
                },
            );
        });
    });
}

/// out [T, N] = x[x_row0.., K] W^T: GEMV for one token, batched GEMV for a few, tiled GEMM for more
/// (the exact precision).
pub fn matmul(p: &MatmulParams, w: &Matrix, x: &[f32], out: &mut [f32]) {
    matmul_with(Isa::get(), Precision::Exact, p, w, x, out)
}

/// Whether a dense prefill of `m` runs the int8 row kernel per token ([`gemv_batch`]) rather than
/// the f32 tile GEMM: in the fast precision only (one int8 plane), for 4-bit rows with a fused
/// kernel, on the VNNI dots only: with AVX2's `pmaddubsw` pair (4 instructions per 32 bytes and
/// token) the two paths measured even, with `vpdpbusd` (2) the row kernel runs ~5 instructions per
/// 64 weights and token against the f32 tile's ~7 (argued, not measured: this VM has no VNNI).
/// (The MoE experts choose per expert, by its token count: `moe::cpu::rows_tokens_max`.)
pub fn int8_prefill(isa: Isa, prec: Precision, m: &Matrix) -> bool {
    prec == Precision::Fast
        && simd::int8_rows_dot(isa, m).is_some_and(|d| matches!(d, Dot::Vnni512 | Dot::Vnni256 | Dot::AvxVnni256))
}

/// [`matmul`] on the ISA `isa` in the precision `prec`.
pub fn matmul_with(isa: Isa, prec: Precision, p: &MatmulParams, w: &Matrix, x: &[f32], out: &mut [f32]) {
    let (tokens, x_row0) = (p.tokens as usize, p.x_row0 as usize);
    let (n, k) = (w.rows, w.cols);
    assert!(
        out.len() >= tokens * n && x.len() >= (x_row0 + tokens) * k,
        "matmul: buffers too small"
    );
    let x = &x[x_row0 * k..(x_row0 + tokens) * k];
    if tokens == 1 {
        gemv(isa, prec, w, 0, x, &mut out[..n]);
    } else if (tokens <= GEMV_BATCH_MAX && simd::has_row_kernel(w)) || int8_prefill(isa, prec, w) {
        gemv_batch(isa, prec, w, 0, x, tokens, out);
    } else if tokens > 1 {
        gemm(isa, w, 0, x, tokens, out);
    }
}

/// Whether [`matmuls`] takes these matrices as one pool loop ([`gemv_many`]): 1 ..= [`MANY`]
/// matrices of one width and either one token or a batched decode step's few (up to
/// [`GEMV_BATCH_MAX`], every matrix with a row kernel: what [`matmul_with`] would run on each).
pub fn fuses(p: &MatmulParams, ws: &[&Matrix]) -> bool {
    let t = p.tokens as usize;
    (1..=MANY).contains(&ws.len())
        && ws.iter().all(|w| w.cols == ws[0].cols)
        && (t == 1 || (t <= GEMV_BATCH_MAX && ws.iter().all(|w| simd::has_row_kernel(w))))
}

/// outs[i] = x W_i^T for matrices reading the same x (a layer's input projections) where
/// [`fuses`] says so: one pool loop over every matrix's rows ([`gemv_many`]).
pub fn matmuls(prec: Precision, p: &MatmulParams, x: &[f32], ws: &[&Matrix], outs: &mut [&mut Vec<f32>]) {
    assert!(fuses(p, ws), "matmuls: {} matrices of {} tokens", ws.len(), p.tokens);
    let t = p.tokens as usize;
    let x = &x[p.x_row0 as usize * ws[0].cols..];
    let mut slices: [&mut [f32]; MANY] = Default::default();
    for ((s, out), w) in slices.iter_mut().zip(outs.iter_mut()).zip(ws) {
        *s = &mut out[..t * w.rows];
    }
    gemv_many(Isa::get(), prec, ws, 0, x, t, &mut slices[..ws.len()])
}
