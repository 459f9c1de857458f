//! SIMD primitives of the CPU backend with runtime dispatch: every primitive takes the [`Isa`]
//! to run (`isa.rs`: chosen once per process), so tests can run each path against the portable one.
//!
//! Primitives (all f32 accumulation):
//! - dot products of an activation with one weight row in every format, dequantizing in
//!   registers (4-bit, 8-bit affine; bf16, f16, f32), each weight byte read once;
//! - prefill GEMM tiles: an outer-product kernel on a K-major weight tile (32 or 16 rows x up to 6
//!   activation rows, AVX-512 / AVX2) with the dequantization straight into that layout, and a
//!   4 x 4 register-blocked dot tile (4 weight rows x 4 activation rows) elsewhere;
//! - fast row dequantization into f32 (GEMM tiles, embedding rows);
//! - small row-major f32 products by outer products ([`gemm_nn`]: the chunked DeltaNet's).
//!
//! 4-bit rows are multiplied by x written as integer planes, with the CPU's byte dot products
//! ([`int8`]); 8-bit and dense rows dequantize in registers against f32 x. The affine group form
//! y = sum_g s_g (sum_j q_j x_j) + b_g (sum_j x_j) needs per-group sums of x ([`group_sums`]).
//!
//! On arm64 the 4-bit dot uses `sdot` (hand-written); the other paths are fixed-width lane loops
//! that LLVM vectorizes to NEON (a baseline feature there).

use super::{
    int8::{self, Dot, Planes, Precision},
    isa::Isa,
    kv::KvRows,
};
use crate::backend::KvDtype;
use crate::{
    quant::{read_scalar, Format, Matrix},
    safetensors::DType,
};

/// Per-group sums of x (the bias term of the affine group form).
#[inline]
pub fn group_sums(x: &[f32], group: usize, out: &mut [f32]) {
    for (o, xg) in out.iter_mut().zip(x.chunks_exact(group)) {
        *o = sum(xg);
    }
}

/// Scales or biases of one row as f32 (`out[..groups]`).
#[inline]
pub fn scalars_f32(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        _ => out
            .iter_mut()
            .enumerate()
            .for_each(|(i, o)| *o = read_scalar(dtype, bytes, i)),
    }
}

/// Whether `m` has a fused in-register kernel (else rows are dequantized, then dotted).
pub fn has_row_kernel(m: &Matrix) -> bool {
    match m.format {
        Format::F32 | Format::F16 | Format::BF16 => true,
        Format::Affine { bits: 4, group } => group % 32 == 0 && m.cols % group == 0,
        Format::Affine { bits: 8, group } => group % 16 == 0 && m.cols % group == 0,
        Format::Affine { .. } => false,
    }
}

// ------------------------------------------------------------------------------------------------
// dot products

/// sum a_i b_i.
#[inline]
pub fn dot(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    match isa {
        // SAFETY: the ISA was checked available; pointers cover n elements.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::avx512::dot(a.as_ptr(), b.as_ptr(), n) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::avx2::dot(a.as_ptr(), b.as_ptr(), n) },
        _ => dot_portable(&a[..n], &b[..n]),
    }
}

#[inline]
pub fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// One prepared activation row for [`row_dot`] / [`rows_dot`]: x itself, per-group sums of x (the
/// affine bias term; empty for dense matrices) and, for 4-bit rows, x as integer planes
/// ([`int8`]).
#[derive(Clone, Copy)]
pub struct XRow<'a> {
    pub x: &'a [f32],
    pub gsum: &'a [f32],
    pub q4: Option<Planes<'a>>,
}

/// The int8 kernel for 4-bit rows of `m` (None for other formats).
fn q4_dot_kind(isa: Isa, m: &Matrix) -> Option<Dot> {
    match m.format {
        Format::Affine { bits: 4, group } if has_row_kernel(m) && group % 8 == 0 => Dot::pick(isa, m.cols),
        _ => None,
    }
}

/// The byte dot of the fused int8 row kernel for 4-bit rows of `m` on `isa` ([`int8::rows`]
/// without its portable fallback), if they have one.
pub fn int8_rows_dot(isa: Isa, m: &Matrix) -> Option<Dot> {
    match (m.format, q4_dot_kind(isa, m)) {
        (Format::Affine { group, .. }, Some(dot)) if dot.fused_rows(group, m.scale_dtype()) => Some(dot),
        _ => None,
    }
}

/// Group sums and plane steps are padded to whole chunks of [`int8::rows`].
fn padded_groups(m: &Matrix) -> usize {
    m.groups_per_row().next_multiple_of(int8::CHUNK_GROUPS)
}

/// Scratch floats [`prepare`] needs for a matrix with `cols` inputs: group sums and plane steps
/// (padded), then for 4-bit rows the planes (`PLANES * cols` bytes).
pub fn prep_len(m: &Matrix) -> usize {
    2 * padded_groups(m) + (int8::PLANES * m.cols).div_ceil(4)
}

/// Per-row scratch floats [`row_dot`] needs: the row's scales and biases as f32.
pub fn row_scratch_len(m: &Matrix) -> usize {
    2 * m.groups_per_row()
}

/// Fill `buf` (at least [`prep_len`]) with what [`row_dot`] needs for `m` and x: 4-bit rows get
/// x's int8 planes, as many as `prec` asks.
pub fn prepare(isa: Isa, prec: Precision, m: &Matrix, x: &[f32], buf: &mut [f32]) {
    let (g_n, g_pad) = (m.groups_per_row(), padded_groups(m));
    let (gsum, rest) = buf.split_at_mut(g_pad);
    let (dx, planes) = rest.split_at_mut(g_pad);
    if let Format::Affine { group, .. } = m.format {
        if has_row_kernel(m) {
            group_sums(&x[..m.cols], group, &mut gsum[..g_n]);
            gsum[g_n..].fill(0.0);
            if let Some(dot) = q4_dot_kind(isa, m) {
                int8::quantize(
                    isa,
                    dot,
                    prec.planes(),
                    &x[..m.cols],
                    group,
                    &mut dx[..g_n],
                    as_i8(planes),
                );
                dx[g_n..].fill(0.0);
            }
        }
    }
}

/// The i8 view of a float scratch buffer.
fn as_i8(v: &mut [f32]) -> &mut [i8] {
    // SAFETY: same allocation, 4 bytes per f32, i8 has no alignment or validity requirement.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut i8, v.len() * 4) }
}

/// The view of x and a buffer filled by [`prepare`] (with the same `isa` and `prec`).
pub fn view<'a>(isa: Isa, prec: Precision, m: &Matrix, x: &'a [f32], buf: &'a [f32]) -> XRow<'a> {
    let g_pad = padded_groups(m);
    let gsum = &buf[..g_pad];
    let q4 = q4_dot_kind(isa, m).map(|dot| {
        let planes = &buf[2 * g_pad..];
        Planes {
            dot,
            n: prec.planes(),
            dx: &buf[g_pad..2 * g_pad],
            gsum,
            // SAFETY: as in `as_i8`.
            xq: unsafe { std::slice::from_raw_parts(planes.as_ptr() as *const i8, planes.len() * 4) },
        }
    });
    XRow { x, gsum, q4 }
}

/// Stored rows `first..first + n` of a 4-bit matrix `m` (groups of `group`) for the int8 kernels.
fn q4_rows(m: &Matrix, group: usize, first: usize, n: usize) -> int8::Rows<'_> {
    let (w, scales, biases) = m.rows_parts(first, n);
    int8::Rows {
        w,
        scales,
        biases,
        dtype: m.scale_dtype(),
        cols: m.cols,
        group,
    }
}

/// out[i] = stored row `first + i` of `m` times the prepared x. `sb` is scratch of
/// [`row_scratch_len`] floats. `m` must have a row kernel ([`has_row_kernel`]). 4-bit rows run
/// [`int8::rows`] on the whole run (every per-row step in registers); the others, [`row_dot`].
#[inline(always)]
pub fn rows_dot(isa: Isa, m: &Matrix, first: usize, x: XRow, sb: &mut [f32], out: &mut [f32]) {
    match (m.format, x.q4) {
        (Format::Affine { bits: 4, group }, Some(planes)) => {
            int8::rows(&q4_rows(m, group, first, out.len()), &planes, out)
        }
        // `prepare` gives every 4-bit matrix with a row kernel its integer planes.
        (Format::Affine { bits: 4, .. }, None) => unreachable!("4-bit rows without a prepared x"),
        _ => {
            for (i, v) in out.iter_mut().enumerate() {
                *v = row_dot(isa, m, first + i, x, sb);
            }
        }
    }
}

/// Most prepared x [`rows_dot_batch`] takes in one call.
pub const ROWS_BATCH: usize = 8;

/// out[j * stride + i] = stored row `first + i` of `m` times the prepared `xs[j]`, for i < `n` and
/// up to [`ROWS_BATCH`] x (a batched decode step, an expert's tokens): what [`rows_dot`] gives
/// each x alone. 4-bit rows run [`int8::rows_batch`] (each weight block unpacked once for several
/// x); the others, [`rows_dot`] per x. `sb` as [`rows_dot`].
#[inline(always)]
pub fn rows_dot_batch(
    isa: Isa,
    m: &Matrix,
    first: usize,
    xs: &[XRow],
    n: usize,
    sb: &mut [f32],
    out: &mut [f32],
    stride: usize,
) {
    assert!(xs.len() <= ROWS_BATCH, "rows_dot_batch: {} x", xs.len());
    match (m.format, xs.first().and_then(|x| x.q4)) {
        (Format::Affine { bits: 4, group }, Some(_)) => {
            let rows = q4_rows(m, group, first, n);
            let planes: [Planes; ROWS_BATCH] = std::array::from_fn(|j| {
                xs[j.min(xs.len() - 1)]
                    .q4
                    .expect("every x of a 4-bit matrix has its planes (`prepare`)")
            });
            int8::rows_batch(&rows, &planes[..xs.len()], n, out, stride)
        }
        _ => {
            for (j, &x) in xs.iter().enumerate() {
                rows_dot(isa, m, first, x, sb, &mut out[j * stride..][..n]);
            }
        }
    }
}

/// Row `stored` of `m` times the prepared x, f32 accumulation, for 8-bit and dense rows (4-bit
/// rows go through [`rows_dot`]). `sb` is scratch of [`row_scratch_len`] floats.
/// Always inlined, so callers compiled per ISA vectorize the scale conversion too.
#[inline(always)]
pub fn row_dot(isa: Isa, m: &Matrix, stored: usize, x: XRow, sb: &mut [f32]) -> f32 {
    let (data, scales, biases) = m.row_parts(stored);
    let k = m.cols;
    match m.format {
        Format::Affine { bits: 8, group } => {
            let g_n = k / group;
            let sd = m.scale_dtype();
            let (s, b) = sb.split_at_mut(g_n);
            scalars_f32(sd, scales, s);
            scalars_f32(sd, biases, &mut b[..g_n]);
            dot_portable(&b[..g_n], &x.gsum[..g_n]) + q8_dot(isa, data, s, x.x, group)
        }
        // 4-bit rows run through `rows_dot` (a run of rows per call); others have no row kernel.
        Format::Affine { bits, .. } => unreachable!("no single-row kernel for {bits}-bit rows"),
        Format::BF16 => dense_dot(isa, DType::BF16, data, &x.x[..k]),
        Format::F16 => dense_dot(isa, DType::F16, data, &x.x[..k]),
        Format::F32 => dense_dot(isa, DType::F32, data, &x.x[..k]),
    }
}

/// sum_g s_g sum_{j in g} q_j x_j over an 8-bit row.
#[inline]
pub fn q8_dot(isa: Isa, data: &[u8], s: &[f32], x: &[f32], group: usize) -> f32 {
    let g_n = s.len();
    assert!(data.len() >= g_n * group && x.len() >= g_n * group);
    match isa {
        // SAFETY: ISA available; lengths checked above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::avx512::q8_dot(data.as_ptr(), s.as_ptr(), x.as_ptr(), g_n, group) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::avx2::q8_dot(data.as_ptr(), s.as_ptr(), x.as_ptr(), g_n, group) },
        _ => q8_dot_portable(data, s, x, group),
    }
}

pub fn q8_dot_portable(data: &[u8], s: &[f32], x: &[f32], group: usize) -> f32 {
    let mut tot = 0f32;
    for (g, &sg) in s.iter().enumerate() {
        let mut acc = [0f32; 8];
        let wb = &data[g * group..][..group];
        let xg = &x[g * group..][..group];
        for (bytes, xs) in wb.chunks_exact(8).zip(xg.chunks_exact(8)) {
            for i in 0..8 {
                acc[i] += bytes[i] as f32 * xs[i];
            }
        }
        tot += sg * acc.iter().sum::<f32>();
    }
    tot
}

/// A dense (bf16 / f16 / f32) little-endian row times x.
#[inline]
pub fn dense_dot(isa: Isa, dtype: DType, data: &[u8], x: &[f32]) -> f32 {
    let k = x.len();
    assert!(data.len() >= k * dtype.size());
    match (isa, dtype) {
        // SAFETY: ISA available; length checked above.
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, DType::BF16) => unsafe { x86::avx512::dot16::<{ x86_elem::BF16 }>(data.as_ptr(), x.as_ptr(), k) },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, DType::F16) => unsafe { x86::avx512::dot16::<{ x86_elem::F16 }>(data.as_ptr(), x.as_ptr(), k) },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, DType::F32) => unsafe { x86::avx512::dot(data.as_ptr().cast(), x.as_ptr(), k) },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, DType::BF16) => unsafe { x86::avx2::dot16::<{ x86_elem::BF16 }>(data.as_ptr(), x.as_ptr(), k) },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, DType::F16) => unsafe { x86::avx2::dot16::<{ x86_elem::F16 }>(data.as_ptr(), x.as_ptr(), k) },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, DType::F32) => unsafe { x86::avx2::dot(data.as_ptr().cast(), x.as_ptr(), k) },
        _ => dense_dot_portable(dtype, data, x),
    }
}

pub fn dense_dot_portable(dtype: DType, data: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let mut row = [0f32; 8];
    let sz = dtype.size();
    let full = x.len() / 8 * 8;
    for (c, xs) in data[..full * sz].chunks_exact(8 * sz).zip(x.chunks_exact(8)) {
        scalars_f32(dtype, c, &mut row);
        for i in 0..8 {
            acc[i] += row[i] * xs[i];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for j in full..x.len() {
        s += read_scalar(dtype, data, j) * x[j];
    }
    s
}

// ------------------------------------------------------------------------------------------------
// GEMM tile and dequantization

/// e^x to ~2 ulp in straight-line f32 arithmetic, so loops over it vectorize (a libm `expf` call
/// per element does not): e^x = 2^n e^r with n = round(x / ln 2) by the 1.5 * 2^23 trick, r =
/// x - n ln 2 in two parts, e^r by Cephes' degree-6 minimax polynomial, 2^n built in the exponent
/// bits. x is clamped to [-87, 88] (results from ~1e-38 to ~1.7e38; e^-inf gives ~1e-38, not 0:
/// callers multiply it into sums that dwarf it); NaN stays NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const SHIFTER: f32 = 12_582_912.0; // 1.5 * 2^23
    let x = x.clamp(-87.0, 88.0);
    let t = x * std::f32::consts::LOG2_E + SHIFTER;
    let n = t - SHIFTER;
    let r = x - n * 0.693_359_4 + n * 2.121_944_4e-4;
    let mut p = 1.987_569_2e-4f32;
    p = p * r + 1.398_2e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // t's low mantissa bits hold 2^22 + n: shifted into the exponent field, the 2^22 falls off.
    y * f32::from_bits((t.to_bits() << 23).wrapping_add(127 << 23))
}

/// The sum of `x` in 16 interleaved partial sums (a single running sum is a chain of dependent
/// adds that cannot vectorize).
#[inline(always)]
pub fn sum(x: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        acc.iter_mut().zip(c).for_each(|(a, v)| *a += v);
    }
    chunks.remainder().iter().sum::<f32>() + acc.iter().sum::<f32>()
}

/// x sigma(x) with the vectorizable [`exp`].
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// 1 / (1 + e^-x) with the vectorizable [`exp`].
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// Asks for every cache line of `data` ahead of its use (x86_64; a hint, never faults). Used
/// where the hardware prefetcher sees no stream, e.g. rows a few KiB apart read once each.
#[inline(always)]
pub fn prefetch(data: &[f32]) {
    // SAFETY: f32 has no padding; the byte view covers the same memory.
    prefetch_bytes(unsafe { std::slice::from_raw_parts(data.as_ptr().cast(), 4 * data.len()) })
}

/// [`prefetch`] of any bytes.
#[inline(always)]
pub fn prefetch_bytes(data: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for i in (0..data.len()).step_by(64) {
        // SAFETY: prefetch is a hint on an in-bounds address.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            _mm_prefetch::<_MM_HINT_T0>(data.as_ptr().add(i) as *const i8)
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

/// Which of the kernels' element loaders reads `rows` (f32, bf16, f16), its base pointer as bytes
/// and the values it holds.
fn kv_elems(rows: KvRows) -> (u8, *const u8, usize) {
    match rows {
        KvRows::F32(v) => (x86_elem::F32, v.as_ptr().cast(), v.len()),
        KvRows::Half(KvDtype::BF16, v) => (x86_elem::BF16, v.as_ptr().cast(), v.len()),
        KvRows::Half(KvDtype::F16, v) => (x86_elem::F16, v.as_ptr().cast(), v.len()),
        KvRows::Half(KvDtype::F32, _) => unreachable!("an f32 cache stores f32 rows"),
    }
}

/// Cache lines walked into L2 (`prefetcht1`) a few at a time by the decode-attention kernels: the
/// next block's K and V rows (two byte ranges), spread over every inner step of the current
/// block's score and P.V passes so the memory stream runs at a steady rate for the whole block.
/// (Before, the first KV head's score pass, about a quarter of a block's work, prefetched whole K
/// row s + 8 and V row s as it scored key s, through a per-line loop in every inner step: bursts
/// at four times the rate memory is read on average, idle memory for the other three quarters,
/// and bookkeeping in the hot loop. On the Xeon, one core, bf16 at 128K: 55-60 -> 34-42 ms CPU
/// time a step, 512 keys in L2 0.18-0.21 -> 0.13-0.15 ms.) Into L2, not L1: the rows are read a
/// whole block later and a block (128 KiB at bf16 and Qwen3.6's shapes) is larger than L1.
/// `step` issues `rate / 256` lines on average; a hint that never faults, kept inside the ranges
/// it was given.
#[derive(Clone, Copy, Debug)]
pub struct Fetch {
    cur: usize,
    end: usize,
    then: (usize, usize),
    rate: u32,
    credit: u32,
}

impl Fetch {
    /// Nothing to fetch.
    pub fn none() -> Fetch {
        Fetch {
            cur: 0,
            end: 0,
            then: (0, 0),
            rate: 0,
            credit: 0,
        }
    }

    /// The cache lines of `first`, then of `second`, spread evenly over `steps` calls of `step`.
    pub fn new(first: KvRows, second: KvRows, steps: usize) -> Fetch {
        let range = |rows: KvRows| {
            let (e, ptr, len) = kv_elems(rows);
            let bytes = len * if e == x86_elem::F32 { 4 } else { 2 };
            (ptr as usize, ptr as usize + bytes)
        };
        let (a, b) = (range(first), range(second));
        let lines = (a.1 - a.0).div_ceil(64) + (b.1 - b.0).div_ceil(64);
        Fetch {
            cur: a.0,
            end: a.1,
            then: b,
            rate: (256 * lines).div_ceil(steps.max(1)).min(u32::MAX as usize) as u32,
            credit: 0,
        }
    }

    /// One inner step's share of the lines.
    #[inline(always)]
    pub fn step(&mut self) {
        self.credit += self.rate;
        while self.credit >= 256 {
            self.credit -= 256;
            if self.cur >= self.end {
                if self.then.0 >= self.then.1 {
                    self.rate = 0;
                    self.credit = 0;
                    return;
                }
                (self.cur, self.end) = self.then;
                self.then = (0, 0);
            }
            #[cfg(target_arch = "x86_64")]
            // SAFETY: prefetch is a hint on an address inside the rows this was made from.
            unsafe {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
                _mm_prefetch::<_MM_HINT_T1>(self.cur as *const i8)
            };
            self.cur += 64;
        }
    }
}

/// Inner steps of [`qk8`] on `isa` for kn keys of hd values: [`Fetch::step`] calls.
pub fn qk8_steps(isa: Isa, kn: usize, hd: usize) -> usize {
    match isa {
        Isa::Avx512 => kn.div_ceil(2) * (hd / 16),
        _ => kn * (hd / 8),
    }
}

/// Inner steps of one [`pv8x32`] call on `isa` for kn keys: [`Fetch::step`] calls.
pub fn pv8x32_steps(isa: Isa, kn: usize) -> usize {
    match isa {
        Isa::Avx512 => kn,
        _ => 4 * kn,
    }
}

/// Element loaders of the attention kernels (a const generic: one kernel body per dtype).
mod x86_elem {
    pub const F32: u8 = 0;
    pub const BF16: u8 = 1;
    pub const F16: u8 = 2;
}

/// `kernel::<E>(args)` for the element type `elem` ([`x86_elem`]) of a KV row ([`kv_elems`]).
#[cfg(target_arch = "x86_64")]
macro_rules! by_elem {
    ($elem:expr, $($f:ident)::+ ($($a:expr),*)) => {
        match $elem {
            x86_elem::F32 => $($f)::+::<{ x86_elem::F32 }>($($a),*),
            x86_elem::BF16 => $($f)::+::<{ x86_elem::BF16 }>($($a),*),
            _ => $($f)::+::<{ x86_elem::F16 }>($($a),*),
        }
    };
}

/// acc[r][..] += sum over s < kn of p[r * kn + s] * v[s * stride..][..32], for 8 rows r: the
/// decode-attention P.V tile (8 query heads x 32 dims, V rows `stride` values apart, f32 or 16-bit
/// widened in registers). AVX-512 and AVX2 (the caller picks it for those ISAs: the portable loop
/// does not vectorize into registers). `fetch` steps once per key of each pass ([`pv8x32_steps`]).
pub fn pv8x32(isa: Isa, p: &[f32], kn: usize, v: KvRows, stride: usize, acc: &mut [[f32; 32]; 8], fetch: &mut Fetch) {
    assert!(matches!(isa, Isa::Avx512 | Isa::Avx2), "pv8x32: AVX-512 or AVX2 only");
    if kn == 0 {
        return;
    }
    let (elem, v, len) = kv_elems(v);
    assert!(
        p.len() >= 8 * kn && len >= (kn - 1) * stride + 32,
        "pv8x32: short input"
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the ISA is available; the reads stay inside p and v (checked above).
    unsafe {
        let rows = std::array::from_fn(|r| p.as_ptr().add(r * kn));
        match isa {
            Isa::Avx512 => by_elem!(elem, x86::avx512::pv8x32(rows, v, stride, kn, acc, fetch)),
            _ => by_elem!(elem, x86::avx2::pv8x32(rows, v, stride, kn, acc, fetch)),
        }
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (acc, v, elem, fetch); // Isa::Avx512 and Avx2 exist only on x86_64
}

/// out[r * ostride + s] = scale * q[r] . k[s * stride..][..hd] for 8 query rows r and keys s < kn: the
/// decode-attention scores of a GQA group (the query heads of one KV head), each K row (f32, or
/// 16-bit widened in registers) loaded once for all 8 rows. AVX-512 and AVX2, hd a multiple of 16.
/// `fetch` steps once per inner step ([`qk8_steps`]): the caller's rows for later blocks, fetched
/// at a steady rate.
#[allow(clippy::too_many_arguments)]
pub fn qk8(
    isa: Isa,
    q: [&[f32]; 8],
    (k, stride): (KvRows, usize),
    kn: usize,
    hd: usize,
    scale: f32,
    (out, ostride): (&mut [f32], usize),
    fetch: &mut Fetch,
) {
    assert!(matches!(isa, Isa::Avx512 | Isa::Avx2), "qk8: AVX-512 or AVX2 only");
    if kn == 0 {
        return;
    }
    let (elem, k, len) = kv_elems(k);
    assert!(
        hd % 16 == 0
            && q.iter().all(|r| r.len() >= hd)
            && len >= (kn - 1) * stride + hd
            && ostride >= kn
            && out.len() >= 7 * ostride + kn,
        "qk8: short input"
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the ISA is available; the reads and writes stay inside q, k and out (checked above).
    unsafe {
        let (q, o) = (q.map(|r| r.as_ptr()), out.as_mut_ptr());
        match isa {
            Isa::Avx512 => by_elem!(
                elem,
                x86::avx512::qk8(q, (k, stride), kn, hd, scale, (o, ostride), fetch)
            ),
            _ => by_elem!(elem, x86::avx2::qk8(q, (k, stride), kn, hd, scale, (o, ostride), fetch)),
        }
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (q, k, elem, scale, out, ostride, fetch);
}

/// x split into two bf16 parts, hi = bf16(x) and lo = bf16(x - hi) (both round to nearest even;
/// inputs and outputs below 2^-126 flushed to zero, as `vdpbf16ps` reads them): |x - hi - lo| <=
/// 2^-16 |x| (hi errs by at most half an ulp of 8 significant bits, 2^-8 |x|, and lo re-rounds that
/// remainder to 8 bits), so hi . k + lo . k carries ~16 of x's 24 significant bits into a bf16
/// pair dot product. avx512_bf16 only ([`Isa::bf16_dot_available`]).
pub fn split_bf16(x: &[f32], hi: &mut [u16], lo: &mut [u16]) {
    assert!(Isa::Avx512.bf16_dot_available(), "split_bf16: no avx512_bf16");
    assert!(hi.len() >= x.len() && lo.len() >= x.len(), "split_bf16: short output");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: avx512_bf16 checked; the reads and writes stay inside x, hi and lo (checked above).
    unsafe {
        x86::bf16dot::split(x.as_ptr(), x.len(), hi.as_mut_ptr(), lo.as_mut_ptr())
    };
}

/// [`qk8`] for a bf16 cache on avx512_bf16: out[r * ostride + s] = scale * (hi_r . k_s + lo_r .
/// k_s) for 8 query rows r, each product pair by `vdpbf16ps` on the stored K row (no widening).
/// q is the rows' [`split_bf16`] parts packed by [`pack_q8_bf16`] (one pointer, fixed offsets). Error against the f32 dot product: q's
/// split, |q - hi - lo| <= 2^-16 |q| elementwise, so |err| <= 2^-16 sum_j |q_j k_j| plus the f32
/// summation's rounding (as the f32 kernel's, in another order). hd a multiple of 32; `ahead` as
/// [`qk8`] (bf16 streams: `stride` and the row width in values).
#[allow(clippy::too_many_arguments)]
pub fn qk8_bf16(
    q: &[u16],
    (k, stride): (&[u16], usize),
    kn: usize,
    hd: usize,
    scale: f32,
    (out, ostride): (&mut [f32], usize),
    ahead: [(&[u16], usize, usize); 2],
) {
    assert!(Isa::Avx512.bf16_dot_available(), "qk8_bf16: no avx512_bf16");
    if kn == 0 {
        return;
    }
    assert!(
        hd % 32 == 0
            && q.len() >= 16 * hd
            && k.len() >= (kn - 1) * stride + hd
            && ostride >= kn
            && out.len() >= 7 * ostride + kn,
        "qk8_bf16: short input"
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: avx512_bf16 checked; the reads and writes stay inside q, k and out (checked above),
    // the prefetches inside the `ahead` rows (counted from their lengths).
    unsafe {
        let ahead = ahead.map(|(rows, stride, width)| x86::Ahead {
            ptr: rows.as_ptr().cast(),
            stride: 2 * stride,
            bytes: 2 * width,
            n: if rows.len() >= width {
                (rows.len() - width) / stride.max(1) + 1
            } else {
                0
            },
        });
        x86::bf16dot::qk8(
            q.as_ptr(),
            (k.as_ptr(), stride),
            kn,
            hd,
            scale,
            (out.as_mut_ptr(), ostride),
            ahead,
        )
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (q, k, stride, hd, scale, out, ostride, ahead);
}

/// 8 query rows (hd values each) as [`qk8_bf16`] reads them: each row's [`split_bf16`] parts,
/// packed per 32 dims as [chunk][row][hi, lo][32] (`out` holds 16 hd values; `tmp` 2 hd).
pub fn pack_q8_bf16(q: [&[f32]; 8], hd: usize, tmp: &mut [u16], out: &mut [u16]) {
    assert!(
        hd % 32 == 0 && out.len() >= 16 * hd && tmp.len() >= 2 * hd,
        "pack_q8_bf16: short buffers"
    );
    for (r, qr) in q.iter().enumerate() {
        let (hi, lo) = tmp[..2 * hd].split_at_mut(hd);
        split_bf16(&qr[..hd], hi, lo);
        for (c, (h, l)) in hi.chunks_exact(32).zip(lo.chunks_exact(32)).enumerate() {
            let o = &mut out[(c * 16 + 2 * r) * 32..][..64];
            o[..32].copy_from_slice(h);
            o[32..].copy_from_slice(l);
        }
    }
}

/// [`pv8x32`] for a bf16 cache on avx512_bf16: acc[r][..] += sum over s < kn of p_s v_s[..32] for
/// 8 rows, with each row's weights split into bf16 parts ([`split_bf16`]): p[r * pstride..] holds
/// hi_0 .. hi_kn, then from `pstride / 2` lo_0 .. lo_kn, each padded with a zero at kn when kn is
/// odd. Keys go in pairs: two V rows interleaved by 16-bit unpacks, one `vdpbf16ps` per part, row
/// and 16 dims. Error against f32 weights: |p - hi - lo| <= 2^-16 p, so |err| <= 2^-16 sum_s p_s
/// |v_s| plus f32 summation rounding.
pub fn pv8x32_bf16(p: &[u16], pstride: usize, kn: usize, v: &[u16], stride: usize, acc: &mut [[f32; 32]; 8]) {
    assert!(Isa::Avx512.bf16_dot_available(), "pv8x32_bf16: no avx512_bf16");
    if kn == 0 {
        return;
    }
    let kn2 = kn.next_multiple_of(2);
    assert!(
        pstride >= 2 * kn2 && p.len() >= 7 * pstride + pstride / 2 + kn2 && v.len() >= (kn - 1) * stride + 32,
        "pv8x32_bf16: short input"
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: avx512_bf16 checked; the reads stay inside p and v (checked above).
    unsafe {
        x86::bf16dot::pv8x32(p.as_ptr(), pstride, kn, v.as_ptr(), stride, acc)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, pstride, v, stride, acc);
}

/// out[i][t] = w[i] . x[t] for 4 weight rows and 4 activation rows of length k (f32).
#[inline]
pub fn dot4x4(isa: Isa, w: [&[f32]; 4], x: [&[f32]; 4], k: usize) -> [[f32; 4]; 4] {
    assert!(w.iter().chain(x.iter()).all(|r| r.len() >= k));
    match isa {
        // SAFETY: ISA available; every row holds at least k floats.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::dot4x4_avx512(w.map(|r| r.as_ptr()), x.map(|r| r.as_ptr()), k) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::dot4x4_avx2(w.map(|r| r.as_ptr()), x.map(|r| r.as_ptr()), k) },
        _ => {
            let mut o = [[0f32; 4]; 4];
            for i in 0..4 {
                for t in 0..4 {
                    o[i][t] = dot_portable(&w[i][..k], &x[t][..k]);
                }
            }
            o
        }
    }
}

/// Rows of the K-major weight tile that [`tile_kxn`] multiplies: 32 (two zmm) with AVX-512, 16 (two
/// ymm) with AVX2; 0 where there is no outer-product kernel (use [`dot4x4`]).
pub fn kmajor_rows(isa: Isa) -> usize {
    match isa {
        Isa::Avx512 if cfg!(target_arch = "x86_64") => 32,
        Isa::Avx2 if cfg!(target_arch = "x86_64") => 16,
        _ => 0,
    }
}

/// out[t][r] = sum_j wt[j][r] x[t][j] for r < [`kmajor_rows`]`(isa)` and t < `n` (1..=6): a K-major
/// tile wt [k][R] (R weight rows side by side) against n activation rows, by outer products (no
/// horizontal sums), compiled per n so a short pass spends no FMAs on absent rows.
/// Only for ISAs where `kmajor_rows(isa) > 0`; others get zeros.
#[inline]
pub fn tile_kxn(isa: Isa, wt: &[f32], x: [&[f32]; 6], n: usize, k: usize, out: &mut [[f32; 32]; 6]) {
    assert!(wt.len() >= kmajor_rows(isa) * k && (1..=6).contains(&n) && x[..n].iter().all(|r| r.len() >= k));
    #[cfg(target_arch = "x86_64")]
    {
        let xp = x.map(|r| r.as_ptr());
        macro_rules! by_n {
            ($f:ident) => {
                // SAFETY: ISA available; the tile and the first n rows hold k columns.
                unsafe {
                    match n {
                        1 => x86::$f::<1>(wt.as_ptr(), xp, k, out),
                        2 => x86::$f::<2>(wt.as_ptr(), xp, k, out),
                        3 => x86::$f::<3>(wt.as_ptr(), xp, k, out),
                        4 => x86::$f::<4>(wt.as_ptr(), xp, k, out),
                        5 => x86::$f::<5>(wt.as_ptr(), xp, k, out),
                        _ => x86::$f::<6>(wt.as_ptr(), xp, k, out),
                    }
                }
            };
        }
        match isa {
            Isa::Avx512 => return by_n!(tile32xn_avx512),
            Isa::Avx2 => return by_n!(tile16xn_avx2),
            Isa::Portable => {}
        }
    }
    *out = [[0.0; 32]; 6];
}

/// Most activation rows one pass of [`tile_kxn_wide`] takes.
pub const TILE_N_WIDE: usize = 12;

/// Activation rows per pass of the outer-product kernel ([`tile_kxn_wide`]): 12 with AVX-512 (24
/// of its 32 registers accumulate: 2 weight loads and 12 broadcasts per 24 FMAs, and a 256-token
/// prompt sweeps each tile 22 times instead of 43), 6 with AVX2 (12 of its 16; [`tile_kxn`]); 0
/// where there is no outer-product kernel.
pub fn kmajor_cols(isa: Isa) -> usize {
    match kmajor_rows(isa) {
        32 => TILE_N_WIDE,
        0 => 0,
        _ => 6,
    }
}

/// [`tile_kxn`] for up to [`kmajor_cols`]`(isa)` activation rows (1..=12 with AVX-512, 1..=6 with
/// AVX2): out[t][r] = sum_j wt[j][r] x[t][j] for r < [`kmajor_rows`]`(isa)`, t < n. The same f32
/// FMA chain per output (one per column, in column order) as [`tile_kxn`], so the same bits.
/// Only for ISAs where `kmajor_rows(isa) > 0`; others get zeros.
#[inline]
pub fn tile_kxn_wide(
    isa: Isa,
    wt: &[f32],
    x: [&[f32]; TILE_N_WIDE],
    n: usize,
    k: usize,
    out: &mut [[f32; 32]; TILE_N_WIDE],
) {
    assert!(
        wt.len() >= kmajor_rows(isa) * k
            && (1..=kmajor_cols(isa).max(1)).contains(&n)
            && x[..n].iter().all(|r| r.len() >= k)
    );
    #[cfg(target_arch = "x86_64")]
    {
        if isa == Isa::Avx512 {
            let xp = x.map(|r| r.as_ptr());
            macro_rules! by_n {
                ($($n:literal)*) => {
                    // SAFETY: ISA available; the tile and the first n rows hold k columns.
                    unsafe {
                        match n {
                            $($n => x86::tile32x12_avx512::<$n>(wt.as_ptr(), xp, k, out),)*
                            _ => x86::tile32x12_avx512::<12>(wt.as_ptr(), xp, k, out),
                        }
                    }
                };
            }
            return by_n!(1 2 3 4 5 6 7 8 9 10 11);
        }
    }
    let (head, _) = out.split_at_mut(6);
    let head: &mut [[f32; 32]; 6] = head.try_into().expect("6 rows");
    tile_kxn(isa, wt, std::array::from_fn(|t| x[t]), n, k, head)
}

/// The shape of a [`gemm_nn`] call: C [m, n] (row stride `ldc`) plus or minus A [m, k] (row
/// stride `lda`) times B [k, n] (row stride `ldb`), all row-major f32.
#[derive(Clone, Copy, Debug)]
pub struct GemmNn {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
    /// C -= A B instead of C += A B.
    pub sub: bool,
    /// A is lower triangular (a[i][p] = 0 for p > i): the products with those zeros may be
    /// skipped (the result is the same: each skipped term adds an exact zero).
    pub lower: bool,
}

/// c[i ldc + j] += (or -= when `g.sub`) sum_p a[i lda + p] b[p ldb + j] for i < m, j < n, p < k:
/// the small dense products of the chunked DeltaNet (ops/delta_net/cpu.rs), where both operands
/// are row-major. Outer products: a register block of C (4 rows x 64 columns on AVX-512, 4 x 16 on
/// AVX2: 16 / 8 accumulators) takes, per p, one row of B in vectors and a broadcast of each A
/// element, so no horizontal sums and no transposes; column tails are masked. Accumulation: each
/// output is one f32 FMA chain from its value in C, over p in order (portable: mul then add).
pub fn gemm_nn(isa: Isa, g: &GemmNn, a: &[f32], b: &[f32], c: &mut [f32]) {
    let GemmNn {
        m, n, k, lda, ldb, ldc, ..
    } = *g;
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        lda >= k
            && ldb >= n
            && ldc >= n
            && a.len() >= (m - 1) * lda + k
            && (k == 0 || b.len() >= (k - 1) * ldb + n)
            && c.len() >= (m - 1) * ldc + n,
        "gemm_nn: {g:?} with A {}, B {}, C {} floats",
        a.len(),
        b.len(),
        c.len()
    );
    match isa {
        // SAFETY: the ISA was checked available; the extents were checked above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::gemm_nn_avx512(g, a.as_ptr(), b.as_ptr(), c.as_mut_ptr()) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::gemm_nn_avx2(g, a.as_ptr(), b.as_ptr(), c.as_mut_ptr()) },
        _ => gemm_nn_portable(g, a, b, c),
    }
}

/// [`gemm_nn`] in plain loops (row-outer, so the j loop vectorizes to the build's baseline).
pub fn gemm_nn_portable(g: &GemmNn, a: &[f32], b: &[f32], c: &mut [f32]) {
    let GemmNn {
        m,
        n,
        k,
        lda,
        ldb,
        ldc,
        sub,
        lower,
    } = *g;
    for i in 0..m {
        let ci = &mut c[i * ldc..][..n];
        let kend = if lower { k.min(i + 1) } else { k };
        for p in 0..kend {
            let av = if sub { -a[i * lda + p] } else { a[i * lda + p] };
            ci.iter_mut().zip(&b[p * ldb..][..n]).for_each(|(x, y)| *x += av * y);
        }
    }
}

/// The K-major tile of rows `rows` of expert `e` of `m`: wt[j * R + i] = W[rows.start + i][j] for
/// R = [`kmajor_rows`]`(isa)` > 0 (columns i >= rows.len() are left as they were). 4-bit affine rows
/// with groups of a multiple of 32 are dequantized straight into that layout, 8 rows at a time
/// (transposed as packed words, then one nibble position per output vector: as few instructions
/// per weight as the row-major dequantization); other formats go through `row` ([cols] floats).
pub fn dequant_kmajor(isa: Isa, m: &Matrix, e: usize, rows: std::ops::Range<usize>, wt: &mut [f32], row: &mut [f32]) {
    let (r_n, k) = (kmajor_rows(isa), m.cols);
    assert!(r_n > 0 && rows.len() <= r_n && wt.len() >= r_n * k && row.len() >= k);
    // Whole 8-row blocks of 4-bit rows go straight into the layout (x86: r_n > 0 only there).
    let q4 = matches!(m.format, Format::Affine { bits: 4, group } if group % 32 == 0 && k % group == 0);
    let fast = if cfg!(target_arch = "x86_64") && q4 {
        rows.len() / 8 * 8
    } else {
        0
    };
    #[cfg(target_arch = "x86_64")]
    {
        // AVX-512: 16 rows per call (one zmm per nibble position), the packed rows prefetched ahead.
        let wide = if isa == Isa::Avx512 { fast / 16 * 16 } else { 0 };
        for i in (0..wide).step_by(16) {
            // SAFETY: ISA available; 16 stored rows exist; wt holds r_n * k.
            unsafe { x86::dequant16_kmajor_q4_avx512(m, m.stored_row(e, rows.start + i), wt.as_mut_ptr().add(i), r_n) };
        }
        for i in (wide..fast).step_by(8) {
            // SAFETY: AVX2 is part of every ISA with r_n > 0; 8 stored rows exist; wt holds r_n * k.
            unsafe { x86::dequant8_kmajor_q4(m, m.stored_row(e, rows.start + i), wt.as_mut_ptr().add(i), r_n) };
        }
    }
    for i in fast..rows.len() {
        dequant_row(isa, m, m.stored_row(e, rows.start + i), row);
        for (j, &v) in row[..k].iter().enumerate() {
            wt[j * r_n + i] = v;
        }
    }
}

/// Dequantize one stored row of `m` into `out[..cols]` (natural element order).
pub fn dequant_row(isa: Isa, m: &Matrix, stored: usize, out: &mut [f32]) {
    match isa {
        // SAFETY: ISA available; the body is safe code compiled with wider vectors.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx2 => unsafe { x86::dequant_row_avx2(m, stored, out) },
        _ => dequant_row_generic(m, stored, out),
    }
}

#[inline(always)]
pub(crate) fn dequant_row_generic(m: &Matrix, stored: usize, out: &mut [f32]) {
    let (data, scales, biases) = m.row_parts(stored);
    let cols = m.cols;
    match m.format {
        Format::BF16 => scalars_f32(DType::BF16, data, &mut out[..cols]),
        Format::F16 => (0..cols).for_each(|j| out[j] = read_scalar(DType::F16, data, j)),
        Format::F32 => (0..cols).for_each(|j| out[j] = read_scalar(DType::F32, data, j)),
        Format::Affine { bits, group } if (bits == 4 || bits == 8) && cols % group == 0 && group % 8 == 0 => {
            let sd = m.scale_dtype();
            let gb = group * bits as usize / 8;
            for g in 0..cols / group {
                let (s, b) = (read_scalar(sd, scales, g), read_scalar(sd, biases, g));
                let o = &mut out[g * group..][..group];
                let d = &data[g * gb..][..gb];
                if bits == 4 {
                    for (pair, &byte) in o.chunks_exact_mut(2).zip(d) {
                        pair[0] = s * (byte & 15) as f32 + b;
                        pair[1] = s * (byte >> 4) as f32 + b;
                    }
                } else {
                    for (v, &byte) in o.iter_mut().zip(d) {
                        *v = s * byte as f32 + b;
                    }
                }
            }
        }
        Format::Affine { bits, group } => {
            // Any other width (2-bit) or group: element by element, as `Matrix::dequant_row`.
            let sd = m.scale_dtype();
            let mask = (1u32 << bits) - 1;
            for j in 0..cols {
                let bit = j * bits as usize;
                let w = bit / 32;
                let word = u32::from_le_bytes([data[4 * w], data[4 * w + 1], data[4 * w + 2], data[4 * w + 3]]);
                let q = (word >> (bit % 32)) & mask;
                out[j] = read_scalar(sd, scales, j / group) * q as f32 + read_scalar(sd, biases, j / group);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The x86_64 kernels. Each is `unsafe` because it needs its target features (checked by
    //! [`super::Isa::available`] before any call) and reads through raw pointers whose extents the
    //! safe wrappers check.
    use std::arch::x86_64::*;

    use super::Fetch;
    use crate::quant::{Format, Matrix};

    /// Bytes ahead of the current weight read to prefetch: the 4/8-bit kernels spend enough
    /// instructions per byte that the out-of-order window alone may keep too few cache-line
    /// misses in flight. Rows of a matrix are contiguous, so this runs into the next rows; a
    /// prefetch never faults, even past the end of the mapping.
    const PREFETCH: usize = 2048;

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dequant_row_avx2(m: &Matrix, stored: usize, out: &mut [f32]) {
        super::dequant_row_generic(m, stored, out)
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    // -- one kernel shape per width ----------------------------------------------------------------

    /// One register width's f32 operations under one set of names, so a kernel whose shape is the
    /// same at every width is written once, as an `#[inline(always)]` body generic over the width,
    /// and stamped per width inside a `#[target_feature]` wrapper ([`per_width`]): the body and
    /// these methods inline into the wrapper and its intrinsics compile with the wrapper's
    /// features, the same instructions as a kernel written out per width.
    trait Width {
        type F: Copy;
        /// f32 lanes per register.
        const L: usize;
        /// Query rows per pass of [`pv8x32`] (its accumulators fill the register file).
        const PV_ROWS: usize;
        unsafe fn zero() -> Self::F;
        unsafe fn load(p: *const f32) -> Self::F;
        unsafe fn store(p: *mut f32, v: Self::F);
        unsafe fn set1(v: f32) -> Self::F;
        /// a b + c
        unsafe fn fma(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
        unsafe fn add(a: Self::F, b: Self::F) -> Self::F;
        /// The sum of the lanes.
        unsafe fn reduce(v: Self::F) -> f32;
        /// L values at element j of a row of E as f32 ([`load16`], [`load8`]).
        unsafe fn elems<const E: u8>(row: *const u8, j: usize) -> Self::F;
        /// [`dot`]'s end: the tail j in i..n (n - i < L) and the sum of the 4 accumulators.
        unsafe fn dot_tail(acc: [Self::F; 4], a: *const f32, b: *const f32, i: usize, n: usize) -> f32;
        /// sum_{j in group g} w_j x_j as L partial sums (8-bit codes w).
        unsafe fn q8_group(w: *const u8, x: *const f32, g: usize, group: usize) -> Self::F;
        /// Keys per pass of [`qk8`] (1 or 2).
        const QK_KEYS: usize;
        /// [`qk8`]'s end for keys s.. (`QK_KEYS` of them, those < kn): the sums of the accumulators
        /// `a[r][t]` (row r, key s + t), times `scale`, into out[r * ostride + s + t].
        unsafe fn qk_store(a: [[Self::F; 2]; 8], scale: f32, out: (*mut f32, usize), s: usize, kn: usize);
    }

    /// AVX-512: 16 lanes in zmm registers.
    struct W512;
    /// AVX2: 8 lanes in ymm registers.
    struct W256;

    /// The methods of [`Width`] that are one intrinsic (or helper) each, for vectors `$f`.
    macro_rules! width_ops {
        ($f:ty, zero = $zero:ident, load = $load:ident, store = $store:ident, set1 = $set1:ident, fma = $fma:ident,
         add = $add:ident, reduce = $reduce:ident, elems = $elems:ident, q8_group = $q8:ident) => {
            type F = $f;
            #[inline(always)]
            unsafe fn zero() -> $f {
                unsafe { $zero() }
            }
            #[inline(always)]
            unsafe fn load(p: *const f32) -> $f {
                unsafe { $load(p) }
            }
            #[inline(always)]
            unsafe fn store(p: *mut f32, v: $f) {
                unsafe { $store(p, v) }
            }
            #[inline(always)]
            unsafe fn set1(v: f32) -> $f {
                unsafe { $set1(v) }
            }
            #[inline(always)]
            unsafe fn fma(a: $f, b: $f, c: $f) -> $f {
                unsafe { $fma(a, b, c) }
            }
            #[inline(always)]
            unsafe fn add(a: $f, b: $f) -> $f {
                unsafe { $add(a, b) }
            }
            #[inline(always)]
            unsafe fn reduce(v: $f) -> f32 {
                unsafe { $reduce(v) }
            }
            #[inline(always)]
            unsafe fn elems<const E: u8>(row: *const u8, j: usize) -> $f {
                unsafe { $elems::<E>(row, j) }
            }
            #[inline(always)]
            unsafe fn q8_group(w: *const u8, x: *const f32, g: usize, group: usize) -> $f {
                unsafe { $q8(w, x, g, group) }
            }
        };
    }

    impl Width for W512 {
        const L: usize = 16;
        const PV_ROWS: usize = 8;
        width_ops! {
            __m512, zero = _mm512_setzero_ps, load = _mm512_loadu_ps, store = _mm512_storeu_ps, set1 = _mm512_set1_ps,
            fma = _mm512_fmadd_ps, add = _mm512_add_ps, reduce = _mm512_reduce_add_ps, elems = load16,
            q8_group = q8_group_avx512
        }

        const QK_KEYS: usize = 2;

        #[inline(always)]
        unsafe fn qk_store(a: [[__m512; 2]; 8], scale: f32, (out, ostride): (*mut f32, usize), s: usize, kn: usize) {
            unsafe {
                let pair = s + 1 < kn;
                // Element n of the sums: row n / 2, key s + n % 2.
                let sums = hsum16(std::array::from_fn(|i| {
                    std::array::from_fn(|t| a[(4 * i + t) / 2][t % 2])
                }));
                let mut o = [0f32; 16];
                _mm512_storeu_ps(o.as_mut_ptr(), _mm512_mul_ps(sums, _mm512_set1_ps(scale)));
                for r in 0..8 {
                    *out.add(r * ostride + s) = o[2 * r];
                    if pair {
                        *out.add(r * ostride + s + 1) = o[2 * r + 1];
                    }
                }
            }
        }

        /// The tail by masked loads into a spare accumulator.
        #[inline(always)]
        unsafe fn dot_tail(mut acc: [__m512; 4], a: *const f32, b: *const f32, i: usize, n: usize) -> f32 {
            unsafe {
                if i < n {
                    let m: __mmask16 = (1u32 << (n - i)) as u16 - 1;
                    acc[1] = _mm512_fmadd_ps(
                        _mm512_maskz_loadu_ps(m, a.add(i)),
                        _mm512_maskz_loadu_ps(m, b.add(i)),
                        acc[1],
                    );
                }
                _mm512_reduce_add_ps(_mm512_add_ps(
                    _mm512_add_ps(acc[0], acc[1]),
                    _mm512_add_ps(acc[2], acc[3]),
                ))
            }
        }
    }

    impl Width for W256 {
        const L: usize = 8;
        const PV_ROWS: usize = 4;
        width_ops! {
            __m256, zero = _mm256_setzero_ps, load = _mm256_loadu_ps, store = _mm256_storeu_ps, set1 = _mm256_set1_ps,
            fma = _mm256_fmadd_ps, add = _mm256_add_ps, reduce = hsum256, elems = load8, q8_group = q8_group_avx2
        }

        const QK_KEYS: usize = 1;

        #[inline(always)]
        unsafe fn qk_store(a: [[__m256; 2]; 8], scale: f32, (out, ostride): (*mut f32, usize), s: usize, _: usize) {
            unsafe {
                // Per 128-bit half: u0 = [a0, a1, a2, a3] and u1 = [a4 .. a7] partial sums.
                let t: [__m256; 4] = std::array::from_fn(|i| _mm256_hadd_ps(a[2 * i][0], a[2 * i + 1][0]));
                let (u0, u1) = (_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3]));
                let sums = _mm256_add_ps(
                    _mm256_permute2f128_ps::<0x20>(u0, u1),
                    _mm256_permute2f128_ps::<0x31>(u0, u1),
                );
                let mut o = [0f32; 8];
                _mm256_storeu_ps(o.as_mut_ptr(), _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
                for (r, &x) in o.iter().enumerate() {
                    *out.add(r * ostride + s) = x;
                }
            }
        }

        /// The tail element by element after the horizontal sum.
        #[inline(always)]
        unsafe fn dot_tail(acc: [__m256; 4], a: *const f32, b: *const f32, mut i: usize, n: usize) -> f32 {
            unsafe {
                let mut s = hsum256(_mm256_add_ps(
                    _mm256_add_ps(acc[0], acc[1]),
                    _mm256_add_ps(acc[2], acc[3]),
                ));
                while i < n {
                    s += *a.add(i) * *b.add(i);
                    i += 1;
                }
                s
            }
        }
    }

    /// The kernels of one width (module `$m`: `dot`, `q8_dot`, `dot16`, `pv8x32`, `qk8`), each a
    /// `#[target_feature]` wrapper around its generic body below.
    macro_rules! per_width {
        ($m:ident, $w:ty, $feat:literal) => {
            pub mod $m {
                use super::*;

                #[target_feature(enable = $feat)]
                pub unsafe fn dot(a: *const f32, b: *const f32, n: usize) -> f32 {
                    unsafe { super::dot::<$w>(a, b, n) }
                }
                #[target_feature(enable = $feat)]
                pub unsafe fn q8_dot(w: *const u8, s: *const f32, x: *const f32, groups: usize, group: usize) -> f32 {
                    unsafe { super::q8_dot::<$w>(w, s, x, groups, group) }
                }
                #[target_feature(enable = $feat)]
                pub unsafe fn dot16<const E: u8>(w: *const u8, x: *const f32, k: usize) -> f32 {
                    unsafe { super::dot16::<$w, E>(w, x, k) }
                }
                #[target_feature(enable = $feat)]
                pub unsafe fn pv8x32<const E: u8>(
                    p: [*const f32; 8],
                    v: *const u8,
                    stride: usize,
                    kn: usize,
                    acc: &mut [[f32; 32]; 8],
                    fetch: &mut Fetch,
                ) {
                    unsafe { super::pv8x32::<$w, E, { <$w as Width>::PV_ROWS }>(p, v, stride, kn, acc, fetch) }
                }
                #[allow(clippy::too_many_arguments)]
                #[target_feature(enable = $feat)]
                pub unsafe fn qk8<const E: u8>(
                    q: [*const f32; 8],
                    k: (*const u8, usize),
                    kn: usize,
                    hd: usize,
                    scale: f32,
                    out: (*mut f32, usize),
                    fetch: &mut Fetch,
                ) {
                    unsafe { super::qk8::<$w, E>(q, k, kn, hd, scale, out, fetch) }
                }
            }
        };
    }

    per_width!(avx512, W512, "avx512f,avx512bw,avx512vl,avx2,fma,f16c");
    per_width!(avx2, W256, "avx2,fma,f16c");

    // -- dot f32 ---------------------------------------------------------------------------------

    /// sum a_i b_i; 4 independent accumulators hide the FMA latency.
    #[inline(always)]
    unsafe fn dot<W: Width>(a: *const f32, b: *const f32, n: usize) -> f32 {
        unsafe {
            let mut acc = [W::zero(); 4];
            let mut i = 0;
            while i + 4 * W::L <= n {
                for u in 0..4 {
                    acc[u] = W::fma(W::load(a.add(i + W::L * u)), W::load(b.add(i + W::L * u)), acc[u]);
                }
                i += 4 * W::L;
            }
            while i + W::L <= n {
                acc[0] = W::fma(W::load(a.add(i)), W::load(b.add(i)), acc[0]);
                i += W::L;
            }
            W::dot_tail(acc, a, b, i, n)
        }
    }

    // -- 8-bit rows ------------------------------------------------------------------------------

    /// sum_g s_g sum_{j in g} w_j x_j: two groups at a time into two accumulators.
    #[inline(always)]
    unsafe fn q8_dot<W: Width>(w: *const u8, s: *const f32, x: *const f32, groups: usize, group: usize) -> f32 {
        unsafe {
            let (mut t0, mut t1) = (W::zero(), W::zero());
            let mut g = 0;
            while g + 2 <= groups {
                t0 = W::fma(W::set1(*s.add(g)), W::q8_group(w, x, g, group), t0);
                t1 = W::fma(W::set1(*s.add(g + 1)), W::q8_group(w, x, g + 1, group), t1);
                g += 2;
            }
            if g < groups {
                t0 = W::fma(W::set1(*s.add(g)), W::q8_group(w, x, g, group), t0);
            }
            W::reduce(W::add(t0, t1))
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    #[inline]
    unsafe fn q8_group_avx512(w: *const u8, x: *const f32, g: usize, group: usize) -> __m512 {
        unsafe {
            let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            let mut off = g * group;
            while off + 32 <= (g + 1) * group {
                _mm_prefetch::<_MM_HINT_T0>(w.add(off + PREFETCH) as *const i8);
                let v0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(w.add(off) as *const __m128i)));
                let v1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(w.add(off + 16) as *const __m128i)));
                a0 = _mm512_fmadd_ps(v0, _mm512_loadu_ps(x.add(off)), a0);
                a1 = _mm512_fmadd_ps(v1, _mm512_loadu_ps(x.add(off + 16)), a1);
                off += 32;
            }
            if off < (g + 1) * group {
                let v0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(w.add(off) as *const __m128i)));
                a0 = _mm512_fmadd_ps(v0, _mm512_loadu_ps(x.add(off)), a0);
            }
            _mm512_add_ps(a0, a1)
        }
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn q8_group_avx2(w: *const u8, x: *const f32, g: usize, group: usize) -> __m256 {
        unsafe {
            let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut off = g * group;
            while off < (g + 1) * group {
                let v0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(w.add(off) as *const __m128i)));
                let v1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(w.add(off + 8) as *const __m128i)));
                a0 = _mm256_fmadd_ps(v0, _mm256_loadu_ps(x.add(off)), a0);
                a1 = _mm256_fmadd_ps(v1, _mm256_loadu_ps(x.add(off + 8)), a1);
                off += 16;
            }
            _mm256_add_ps(a0, a1)
        }
    }

    // -- bf16 / f16 ------------------------------------------------------------------------------

    /// A 16-bit row (E: bf16 widened by a shift into the f32 high half, f16 by F16C) times x.
    #[inline(always)]
    unsafe fn dot16<W: Width, const E: u8>(w: *const u8, x: *const f32, k: usize) -> f32 {
        unsafe {
            let mut acc0 = W::zero();
            let mut i = 0;
            while i + W::L <= k {
                acc0 = W::fma(W::elems::<E>(w, i), W::load(x.add(i)), acc0);
                i += W::L;
            }
            let mut s = W::reduce(acc0);
            let dt = if E == super::x86_elem::BF16 {
                crate::safetensors::DType::BF16
            } else {
                crate::safetensors::DType::F16
            };
            while i < k {
                s += super::read_scalar(dt, std::slice::from_raw_parts(w, 2 * k), i) * *x.add(i);
                i += 1;
            }
            s
        }
    }

    // -- GEMM tile ---------------------------------------------------------------------------------

    /// 4 weight rows x 4 activation rows: 16 zmm accumulators, 8 loads per 16 FMAs; the k tail
    /// uses masked loads.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub unsafe fn dot4x4_avx512(w: [*const f32; 4], x: [*const f32; 4], k: usize) -> [[f32; 4]; 4] {
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); 4]; 4];
            let mut j = 0;
            while j < k {
                let m: __mmask16 = if k - j >= 16 {
                    0xffff
                } else {
                    ((1u32 << (k - j)) - 1) as u16
                };
                let wv = [0, 1, 2, 3].map(|i| _mm512_maskz_loadu_ps(m, w[i].add(j)));
                for t in 0..4 {
                    let xv = _mm512_maskz_loadu_ps(m, x[t].add(j));
                    for i in 0..4 {
                        acc[i][t] = _mm512_fmadd_ps(wv[i], xv, acc[i][t]);
                    }
                }
                j += 16;
            }
            let mut o = [[0f32; 4]; 4];
            _mm512_storeu_ps(o.as_mut_ptr() as *mut f32, hsum16(acc));
            o
        }
    }

    /// The 16 horizontal sums of acc[i][t] in one vector, element 4 i + t: a transpose-and-add
    /// tree (45 shuffles and adds, where 16 separate reductions take ~130).
    #[target_feature(enable = "avx512f")]
    unsafe fn hsum16(acc: [[__m512; 4]; 4]) -> __m512 {
        let v: [__m512; 16] = std::array::from_fn(|n| acc[n / 4][n % 4]);
        // Pairs: per 128-bit lane [a0+a2, b0+b2, a1+a3, b1+b3].
        let p: [__m512; 8] = std::array::from_fn(|n| {
            _mm512_add_ps(
                _mm512_unpacklo_ps(v[2 * n], v[2 * n + 1]),
                _mm512_unpackhi_ps(v[2 * n], v[2 * n + 1]),
            )
        });
        // Quads: per lane [a, b, c, d] (each that lane's sum).
        let q: [__m512; 4] = std::array::from_fn(|n| {
            let (x, y) = (_mm512_castps_pd(p[2 * n]), _mm512_castps_pd(p[2 * n + 1]));
            _mm512_add_ps(
                _mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)),
            )
        });
        // Lanes: [q0 L0+L1, q0 L2+L3, q1 L0+L1, q1 L2+L3], then across the two halves.
        let h: [__m512; 2] = std::array::from_fn(|n| {
            let (x, y) = (q[2 * n], q[2 * n + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
            )
        });
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(h[0], h[1]),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(h[0], h[1]),
        )
    }

    /// 16 values at element j of a KV row as f32 (E: f32, bf16 widened by a shift into the high
    /// half, f16 by F16C). Inlined into the kernels, which have the features.
    #[inline(always)]
    unsafe fn load16<const E: u8>(row: *const u8, j: usize) -> __m512 {
        unsafe {
            match E {
                super::x86_elem::F32 => _mm512_loadu_ps(row.cast::<f32>().add(j)),
                super::x86_elem::BF16 => {
                    let h = _mm256_loadu_si256(row.add(2 * j).cast());
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
                }
                _ => _mm512_cvtph_ps(_mm256_loadu_si256(row.add(2 * j).cast())),
            }
        }
    }

    /// [`load16`] for 8 values (AVX2).
    #[inline(always)]
    unsafe fn load8<const E: u8>(row: *const u8, j: usize) -> __m256 {
        unsafe {
            match E {
                super::x86_elem::F32 => _mm256_loadu_ps(row.cast::<f32>().add(j)),
                super::x86_elem::BF16 => {
                    let h = _mm_loadu_si128(row.add(2 * j).cast());
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
                }
                _ => _mm256_cvtph_ps(_mm_loadu_si128(row.add(2 * j).cast())),
            }
        }
    }

    /// Bytes per element of E.
    const fn elem_size(e: u8) -> usize {
        if e == super::x86_elem::F32 {
            4
        } else {
            2
        }
    }

    /// Decode attention P.V tile: acc[r] += sum_s p[r][s] v[s][0..32] for 8 query rows, with V rows
    /// `stride` values apart (E: their dtype). Per pass R rows x 32 dims over all kn keys (the
    /// kn x 32 V tile stays in L1 between passes): on AVX-512 one pass, 16 zmm accumulators, per
    /// key 2 V loads (widened in registers) and 8 broadcasts feed 16 FMAs; in AVX2's 16 ymm
    /// registers four passes of 4 rows x 16 dims (8 accumulators; per key 2 V loads and 4
    /// broadcasts feed 8 FMAs).
    #[inline(always)]
    unsafe fn pv8x32<W: Width, const E: u8, const R: usize>(
        p: [*const f32; 8],
        v: *const u8,
        stride: usize,
        kn: usize,
        acc: &mut [[f32; 32]; 8],
        fetch: &mut Fetch,
    ) {
        unsafe {
            for pass in 0..8 / R {
                let r0 = pass * R;
                for half in 0..32 / (2 * W::L) {
                    let d0 = half * 2 * W::L;
                    let mut a: [[W::F; 2]; R] = std::array::from_fn(|r| {
                        [
                            W::load(acc[r0 + r].as_ptr().add(d0)),
                            W::load(acc[r0 + r].as_ptr().add(d0 + W::L)),
                        ]
                    });
                    for s in 0..kn {
                        fetch.step();
                        let row = v.add(s * stride * elem_size(E));
                        let (v0, v1) = (W::elems::<E>(row, d0), W::elems::<E>(row, d0 + W::L));
                        for r in 0..R {
                            let b = W::set1(*p[r0 + r].add(s));
                            a[r][0] = W::fma(v0, b, a[r][0]);
                            a[r][1] = W::fma(v1, b, a[r][1]);
                        }
                    }
                    for r in 0..R {
                        W::store(acc[r0 + r].as_mut_ptr().add(d0), a[r][0]);
                        W::store(acc[r0 + r].as_mut_ptr().add(d0 + W::L), a[r][1]);
                    }
                }
            }
        }
    }

    /// Rows to prefetch alongside a kernel's own: row s (`bytes` long, `stride` bytes apart) for
    /// s < n.
    #[derive(Clone, Copy)]
    pub struct Ahead {
        pub ptr: *const u8,
        pub stride: usize,
        pub bytes: usize,
        pub n: usize,
    }

    /// Prefetch part `part` of `parts` of row s of each stream that has it (into L1; a hint that
    /// never faults): every `parts`-th line from line `part`, so a kernel spreads a row's
    /// prefetches over its inner loop (the avx512_bf16 kernels; the widening ones take a
    /// [`Fetch`]). Issued as a burst per key (32 lines at bf16, 64 at f32,
    /// every KV head's K and V), they overflowed the core's miss buffers: spread over the 16
    /// steps of a key's scores, decode attention at 32K on one Zen 5 core went 11.8 -> 8.1 ms
    /// (f32) and 7.4 -> 6.5 ms (bf16).
    #[inline(always)]
    unsafe fn prefetch_part(ahead: &[Ahead; 2], s: usize, part: usize, parts: usize) {
        for a in ahead {
            if s < a.n {
                for o in (64 * part..a.bytes).step_by(64 * parts) {
                    unsafe { _mm_prefetch::<_MM_HINT_T0>(a.ptr.add(s * a.stride + o).cast()) };
                }
            }
        }
    }

    /// Decode attention scores of 8 query rows, `QK_KEYS` keys at a time into 8 x `QK_KEYS`
    /// accumulators, each K row widened in registers once for the 8 rows. AVX-512: two keys into
    /// 16 zmm accumulators (per 16 dims: 2 K loads and 8 q loads feed 16 FMAs), the 16 sums by one
    /// transpose-and-add tree; an odd last key runs as a pair with itself. AVX2 (16 ymm
    /// registers): one key into 8 accumulators (per 8 dims: 1 K load and 8 q loads feed 8 FMAs),
    /// the 8 sums by a hadd tree.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn qk8<W: Width, const E: u8>(
        q: [*const f32; 8],
        (k, stride): (*const u8, usize),
        kn: usize,
        hd: usize,
        scale: f32,
        out: (*mut f32, usize),
        fetch: &mut Fetch,
    ) {
        unsafe {
            let row = |s: usize| k.add(s * stride * elem_size(E));
            for s in (0..kn).step_by(W::QK_KEYS) {
                let keys: [*const u8; 2] = std::array::from_fn(|t| row(if s + t < kn { s + t } else { s }));
                let mut a = [[W::zero(); 2]; 8];
                for j in (0..hd).step_by(W::L) {
                    fetch.step();
                    let x: [W::F; 2] = std::array::from_fn(|t| {
                        if t < W::QK_KEYS {
                            W::elems::<E>(keys[t], j)
                        } else {
                            W::zero()
                        }
                    });
                    for r in 0..8 {
                        let qv = W::load(q[r].add(j));
                        for t in 0..W::QK_KEYS {
                            a[r][t] = W::fma(qv, x[t], a[r][t]);
                        }
                    }
                }
                W::qk_store(a, scale, out, s, kn);
            }
        }
    }

    /// The avx512_bf16 kernels of decode attention on a bf16 cache (`vdpbf16ps`: per f32 lane,
    /// acc += a0 b0 + a1 b1 over a pair of bf16 values, each product exact in f32). AVX-512 only,
    /// so written at that width, not over [`Width`].
    pub mod bf16dot {
        use super::*;

        /// The bf16 values of a 512-bit register of 16-bit lanes (same bits).
        #[inline(always)]
        fn bh(v: __m512i) -> __m512bh {
            // SAFETY: both are 64 bytes of plain bits.
            unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
        }

        /// [`super::super::split_bf16`], 16 values at a time (a masked tail).
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
        pub unsafe fn split(x: *const f32, n: usize, hi: *mut u16, lo: *mut u16) {
            unsafe {
                for i in (0..n).step_by(16) {
                    let m: __mmask16 = if n - i >= 16 { !0 } else { (1u16 << (n - i)) - 1 };
                    let v = _mm512_maskz_loadu_ps(m, x.add(i));
                    let h = std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(v));
                    let hf = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)));
                    let l = std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(_mm512_sub_ps(v, hf)));
                    _mm256_mask_storeu_epi16(hi.add(i).cast(), m, h);
                    _mm256_mask_storeu_epi16(lo.add(i).cast(), m, l);
                }
            }
        }

        /// [`super::super::qk8_bf16`]: two keys at a time into 16 accumulators (row r, key t), per
        /// 32 dims 2 K loads, 16 q loads (each part of each row, at fixed offsets of one pointer)
        /// and 32 `vdpbf16ps` (hi then lo into the same accumulator: 2 dependent per 32 dims, ~12
        /// cycles of latency under the 16 cycles of the pass's 32 at two a cycle); the 16 sums by
        /// one transpose-and-add tree per pair, as [`qk8`]. An odd last key runs as a pair with
        /// itself.
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
        pub unsafe fn qk8(
            q: *const u16,
            (k, stride): (*const u16, usize),
            kn: usize,
            hd: usize,
            scale: f32,
            (out, ostride): (*mut f32, usize),
            ahead: [Ahead; 2],
        ) {
            unsafe {
                let sc = _mm512_set1_ps(scale);
                for s in (0..kn).step_by(2) {
                    let pair = s + 1 < kn;
                    let rows = [k.add(s * stride), k.add(if pair { s + 1 } else { s } * stride)];
                    // Accumulator n = 2 r + t (element n of the sums: row r, key s + t).
                    let mut a = [[_mm512_setzero_ps(); 4]; 4];
                    for j in (0..hd).step_by(32) {
                        for t in 0..2 {
                            prefetch_part(&ahead, s + t, j / 32, hd / 32);
                        }
                        let kv = rows.map(|row| bh(_mm512_loadu_si512(row.add(j).cast())));
                        let qc = q.add(16 * j);
                        for r in 0..8 {
                            let (i, t0) = (r / 2, 2 * (r % 2));
                            for part in 0..2 {
                                let qv = bh(_mm512_loadu_si512(qc.add(64 * r + 32 * part).cast()));
                                for t in 0..2 {
                                    a[i][t0 + t] = _mm512_dpbf16_ps(a[i][t0 + t], qv, kv[t]);
                                }
                            }
                        }
                    }
                    let mut o = [0f32; 16];
                    _mm512_storeu_ps(o.as_mut_ptr(), _mm512_mul_ps(hsum16(a), sc));
                    for r in 0..8 {
                        *out.add(r * ostride + s) = o[2 * r];
                        if pair {
                            *out.add(r * ostride + s + 1) = o[2 * r + 1];
                        }
                    }
                }
            }
        }

        /// [`super::super::pv8x32_bf16`]: per pair of keys and 32 dims, the two V rows loaded
        /// (64 bytes each) and interleaved by `vpunpcklwd` / `vpunpckhwd` into (v_s, v_s+1) pairs
        /// per dim (within 128-bit lanes: the low unpack holds dims 8 l + 0..4, the high one 8 l +
        /// 4..8 of lane l), then per row the broadcast (hi_s, hi_s+1) and (lo_s, lo_s+1) pairs into
        /// both halves: 2 loads + 2 shuffles + 16 broadcasts + 32 `vdpbf16ps` per 2 keys, 26 per key
        /// where the widening tile takes 2 V loads, 2 widenings, 8 broadcasts and 16 FMAs (30, plus
        /// the widening's shifts). The accumulators hold the unpacks' dim order: permuted on the
        /// way in and out.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")]
        pub unsafe fn pv8x32(
            p: *const u16,
            pstride: usize,
            kn: usize,
            v: *const u16,
            stride: usize,
            acc: &mut [[f32; 32]; 8],
        ) {
            unsafe {
                // Unpack order from dims (0..16 | 16..32 of the row) and back.
                let to_lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
                let to_hi = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
                let back0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
                let back1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
                let mut a: [[__m512; 2]; 8] = std::array::from_fn(|r| {
                    let (x0, x1) = (
                        _mm512_loadu_ps(acc[r].as_ptr()),
                        _mm512_loadu_ps(acc[r].as_ptr().add(16)),
                    );
                    [
                        _mm512_permutex2var_ps(x0, to_lo, x1),
                        _mm512_permutex2var_ps(x0, to_hi, x1),
                    ]
                });
                let pair = |r: usize, part: usize, s: usize| {
                    let at = p.add(r * pstride + part * (pstride / 2) + s);
                    bh(_mm512_set1_epi32(at.cast::<i32>().read_unaligned()))
                };
                for s in (0..kn).step_by(2) {
                    let v0 = _mm512_loadu_si512(v.add(s * stride).cast());
                    let v1 = if s + 1 < kn {
                        _mm512_loadu_si512(v.add((s + 1) * stride).cast())
                    } else {
                        _mm512_setzero_si512()
                    };
                    let (lo, hi) = (bh(_mm512_unpacklo_epi16(v0, v1)), bh(_mm512_unpackhi_epi16(v0, v1)));
                    for (r, ar) in a.iter_mut().enumerate() {
                        let (ph, pl) = (pair(r, 0, s), pair(r, 1, s));
                        ar[0] = _mm512_dpbf16_ps(ar[0], ph, lo);
                        ar[1] = _mm512_dpbf16_ps(ar[1], ph, hi);
                        ar[0] = _mm512_dpbf16_ps(ar[0], pl, lo);
                        ar[1] = _mm512_dpbf16_ps(ar[1], pl, hi);
                    }
                }
                for (r, ar) in a.iter().enumerate() {
                    _mm512_storeu_ps(acc[r].as_mut_ptr(), _mm512_permutex2var_ps(ar[0], back0, ar[1]));
                    _mm512_storeu_ps(acc[r].as_mut_ptr().add(16), _mm512_permutex2var_ps(ar[0], back1, ar[1]));
                }
            }
        }
    }

    /// Outer-product GEMM micro-kernels: wt is a K-major tile [k][2 L] (2 L weight rows side by
    /// side, L lanes per register), x N <= 6 activation rows. Per k: two weight vectors times N
    /// broadcast activations into 2 N accumulators (at N = 6: 2 loads + 6 broadcasts per 12 FMAs,
    /// 15 of AVX2's 16 registers; no horizontal sums). out[t][r] = row r . x[t].
    macro_rules! tile_kernel {
        ($name:ident, $feat:literal, $l:literal, $zero:ident, $load:ident, $bcast:ident, $fma:ident, $store:ident) => {
            #[target_feature(enable = $feat)]
            pub unsafe fn $name<const N: usize>(
                wt: *const f32,
                x: [*const f32; 6],
                k: usize,
                out: &mut [[f32; 32]; 6],
            ) {
                unsafe {
                    let mut c = [[$zero(); 2]; N];
                    for j in 0..k {
                        let w0 = $load(wt.add(2 * $l * j));
                        let w1 = $load(wt.add(2 * $l * j + $l));
                        for (t, ct) in c.iter_mut().enumerate() {
                            let b = $bcast(*x[t].add(j));
                            ct[0] = $fma(w0, b, ct[0]);
                            ct[1] = $fma(w1, b, ct[1]);
                        }
                    }
                    for (t, ct) in c.iter().enumerate() {
                        $store(out[t].as_mut_ptr(), ct[0]);
                        $store(out[t].as_mut_ptr().add($l), ct[1]);
                    }
                }
            }
        };
    }

    tile_kernel!(
        tile32xn_avx512,
        "avx512f,avx512bw,avx512vl,avx2,fma",
        16,
        _mm512_setzero_ps,
        _mm512_loadu_ps,
        _mm512_set1_ps,
        _mm512_fmadd_ps,
        _mm512_storeu_ps
    );
    tile_kernel!(
        tile16xn_avx2,
        "avx2,fma",
        8,
        _mm256_setzero_ps,
        _mm256_loadu_ps,
        _mm256_set1_ps,
        _mm256_fmadd_ps,
        _mm256_storeu_ps
    );

    /// [`tile32xn_avx512`] for N <= 12 activation rows: 2 N = 24 accumulators, the two weight
    /// vectors and a broadcast take 27 of the 32 zmm registers; per column 2 loads and N broadcasts
    /// per 2 N FMAs (at N = 12, 14 load ops per 24 FMAs against 8 per 12 at N = 6), and the tile
    /// is swept half as often. out[t][r] = row r . x[t], one FMA chain per output in column order.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub unsafe fn tile32x12_avx512<const N: usize>(
        wt: *const f32,
        x: [*const f32; super::TILE_N_WIDE],
        k: usize,
        out: &mut [[f32; 32]; super::TILE_N_WIDE],
    ) {
        unsafe {
            let mut c = [[_mm512_setzero_ps(); 2]; N];
            for j in 0..k {
                let w0 = _mm512_loadu_ps(wt.add(32 * j));
                let w1 = _mm512_loadu_ps(wt.add(32 * j + 16));
                for (t, ct) in c.iter_mut().enumerate() {
                    let b = _mm512_set1_ps(*x[t].add(j));
                    ct[0] = _mm512_fmadd_ps(w0, b, ct[0]);
                    ct[1] = _mm512_fmadd_ps(w1, b, ct[1]);
                }
            }
            for (t, ct) in c.iter().enumerate() {
                _mm512_storeu_ps(out[t].as_mut_ptr(), ct[0]);
                _mm512_storeu_ps(out[t].as_mut_ptr().add(16), ct[1]);
            }
        }
    }

    /// [`super::gemm_nn`] with AVX-512: C blocks of up to 4 rows x 64 columns (16 accumulators; per
    /// p, 4 row loads of B and 4 broadcast A elements per 16 FMAs), the column tail 16 at a time
    /// with masked loads and stores.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub unsafe fn gemm_nn_avx512(g: &super::GemmNn, a: *const f32, b: *const f32, c: *mut f32) {
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
        #[inline]
        unsafe fn block<const MR: usize, const NV: usize, const SUB: bool>(
            g: &super::GemmNn,
            a: *const f32,
            b: *const f32,
            c: *mut f32,
            kend: usize,
            mask: [__mmask16; NV],
        ) {
            unsafe {
                let mut acc: [[__m512; NV]; MR] = std::array::from_fn(|i| {
                    std::array::from_fn(|v| _mm512_maskz_loadu_ps(mask[v], c.add(i * g.ldc + 16 * v)))
                });
                for p in 0..kend {
                    let bv: [__m512; NV] =
                        std::array::from_fn(|v| _mm512_maskz_loadu_ps(mask[v], b.add(p * g.ldb + 16 * v)));
                    for (i, ai) in acc.iter_mut().enumerate() {
                        let av = _mm512_set1_ps(*a.add(i * g.lda + p));
                        for (x, &y) in ai.iter_mut().zip(&bv) {
                            *x = if SUB {
                                _mm512_fnmadd_ps(av, y, *x)
                            } else {
                                _mm512_fmadd_ps(av, y, *x)
                            };
                        }
                    }
                }
                for (i, ai) in acc.iter().enumerate() {
                    for (v, &x) in ai.iter().enumerate() {
                        _mm512_mask_storeu_ps(c.add(i * g.ldc + 16 * v), mask[v], x);
                    }
                }
            }
        }
        unsafe {
            let (m, n, k) = (g.m, g.n, g.k);
            macro_rules! rows {
                ($nv:literal, $i0:expr, $j0:expr, $kend:expr, $mask:expr) => {{
                    let (a, b, c) = (a.add($i0 * g.lda), b.add($j0), c.add($i0 * g.ldc + $j0));
                    match (m - $i0, g.sub) {
                        (1, false) => block::<1, $nv, false>(g, a, b, c, $kend, $mask),
                        (2, false) => block::<2, $nv, false>(g, a, b, c, $kend, $mask),
                        (3, false) => block::<3, $nv, false>(g, a, b, c, $kend, $mask),
                        (_, false) => block::<4, $nv, false>(g, a, b, c, $kend, $mask),
                        (1, true) => block::<1, $nv, true>(g, a, b, c, $kend, $mask),
                        (2, true) => block::<2, $nv, true>(g, a, b, c, $kend, $mask),
                        (3, true) => block::<3, $nv, true>(g, a, b, c, $kend, $mask),
                        (_, true) => block::<4, $nv, true>(g, a, b, c, $kend, $mask),
                    }
                }};
            }
            for i0 in (0..m).step_by(4) {
                let kend = if g.lower { k.min(i0 + 4) } else { k };
                let mut j0 = 0;
                while j0 + 64 <= n {
                    rows!(4, i0, j0, kend, [0xffff; 4]);
                    j0 += 64;
                }
                while j0 < n {
                    let left = (n - j0).min(16);
                    let mask = ((1u32 << left) - 1) as __mmask16;
                    rows!(1, i0, j0, kend, [mask]);
                    j0 += 16;
                }
            }
        }
    }

    /// [`super::gemm_nn`] with AVX2: C blocks of up to 4 rows x 16 columns (8 accumulators; per p,
    /// 2 row loads of B and 4 broadcasts per 8 FMAs), the column tail 8 at a time with masked loads
    /// and stores.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn gemm_nn_avx2(g: &super::GemmNn, a: *const f32, b: *const f32, c: *mut f32) {
        #[target_feature(enable = "avx2,fma")]
        #[inline]
        unsafe fn block<const MR: usize, const NV: usize, const SUB: bool, const MASKED: bool>(
            g: &super::GemmNn,
            a: *const f32,
            b: *const f32,
            c: *mut f32,
            kend: usize,
            mask: __m256i,
        ) {
            unsafe {
                let ld = |p: *const f32| {
                    if MASKED {
                        _mm256_maskload_ps(p, mask)
                    } else {
                        _mm256_loadu_ps(p)
                    }
                };
                let mut acc: [[__m256; NV]; MR] =
                    std::array::from_fn(|i| std::array::from_fn(|v| ld(c.add(i * g.ldc + 8 * v))));
                for p in 0..kend {
                    let bv: [__m256; NV] = std::array::from_fn(|v| ld(b.add(p * g.ldb + 8 * v)));
                    for (i, ai) in acc.iter_mut().enumerate() {
                        let av = _mm256_set1_ps(*a.add(i * g.lda + p));
                        for (x, &y) in ai.iter_mut().zip(&bv) {
                            *x = if SUB {
                                _mm256_fnmadd_ps(av, y, *x)
                            } else {
                                _mm256_fmadd_ps(av, y, *x)
                            };
                        }
                    }
                }
                for (i, ai) in acc.iter().enumerate() {
                    for (v, &x) in ai.iter().enumerate() {
                        let p = c.add(i * g.ldc + 8 * v);
                        if MASKED {
                            _mm256_maskstore_ps(p, mask, x)
                        } else {
                            _mm256_storeu_ps(p, x)
                        }
                    }
                }
            }
        }
        unsafe {
            let (m, n, k) = (g.m, g.n, g.k);
            macro_rules! rows {
                ($nv:literal, $masked:literal, $i0:expr, $j0:expr, $kend:expr, $mask:expr) => {{
                    let (a, b, c) = (a.add($i0 * g.lda), b.add($j0), c.add($i0 * g.ldc + $j0));
                    match (m - $i0, g.sub) {
                        (1, false) => block::<1, $nv, false, $masked>(g, a, b, c, $kend, $mask),
                        (2, false) => block::<2, $nv, false, $masked>(g, a, b, c, $kend, $mask),
                        (3, false) => block::<3, $nv, false, $masked>(g, a, b, c, $kend, $mask),
                        (_, false) => block::<4, $nv, false, $masked>(g, a, b, c, $kend, $mask),
                        (1, true) => block::<1, $nv, true, $masked>(g, a, b, c, $kend, $mask),
                        (2, true) => block::<2, $nv, true, $masked>(g, a, b, c, $kend, $mask),
                        (3, true) => block::<3, $nv, true, $masked>(g, a, b, c, $kend, $mask),
                        (_, true) => block::<4, $nv, true, $masked>(g, a, b, c, $kend, $mask),
                    }
                }};
            }
            let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            for i0 in (0..m).step_by(4) {
                let kend = if g.lower { k.min(i0 + 4) } else { k };
                let mut j0 = 0;
                while j0 + 16 <= n {
                    rows!(2, false, i0, j0, kend, lane);
                    j0 += 16;
                }
                while j0 < n {
                    let left = (n - j0).min(8) as i32;
                    let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), lane);
                    rows!(1, true, i0, j0, kend, mask);
                    j0 += 8;
                }
            }
        }
    }

    /// 8 consecutive stored 4-bit affine rows (groups a multiple of 32) into 8 columns of a K-major
    /// tile: wt[j * stride + i] = s_i,g q_i,j + b_i,g for i < 8, j < cols. Per 32 columns: the 16
    /// bytes of each row (four 32-bit words of 8 nibbles) are transposed so that word c of all 8 rows
    /// sits in one register (lane i = row i); nibble n of that word is column 8 c + n of every row:
    /// shift, mask, convert, scale and bias (the rows' vectors), one store. The checks, the group
    /// loop and the scales and biases: [`kmajor_q4_groups`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dequant8_kmajor_q4(m: &Matrix, stored: usize, wt: *mut f32, stride: usize) {
        unsafe {
            let mask = _mm256_set1_epi32(15);
            kmajor_q4_groups::<8>(m, stored, "dequant8_kmajor_q4", |w, cols, columns, sv, bv| {
                let (s, b) = (_mm256_loadu_ps(sv.as_ptr()), _mm256_loadu_ps(bv.as_ptr()));
                for c0 in columns.step_by(32) {
                    prefetch_rows(w, c0 / 2, cols / 2, false);
                    // Rows r and r + 4 in the two 128-bit halves; a 4 x 4 word transpose per half.
                    let v: [__m256i; 4] = std::array::from_fn(|r| {
                        // SAFETY: c0 + 32 <= cols, and each row holds cols / 2 bytes (asserted).
                        let lo = _mm_loadu_si128(w[r].add(c0 / 2) as *const __m128i);
                        let hi = _mm_loadu_si128(w[r + 4].add(c0 / 2) as *const __m128i);
                        _mm256_set_m128i(hi, lo)
                    });
                    let (a0, a1) = (_mm256_unpacklo_epi32(v[0], v[1]), _mm256_unpackhi_epi32(v[0], v[1]));
                    let (a2, a3) = (_mm256_unpacklo_epi32(v[2], v[3]), _mm256_unpackhi_epi32(v[2], v[3]));
                    let words = [
                        _mm256_unpacklo_epi64(a0, a2),
                        _mm256_unpackhi_epi64(a0, a2),
                        _mm256_unpacklo_epi64(a1, a3),
                        _mm256_unpackhi_epi64(a1, a3),
                    ];
                    for (c, &w) in words.iter().enumerate() {
                        let mut w = w;
                        for n in 0..8 {
                            let q = _mm256_cvtepi32_ps(_mm256_and_si256(w, mask));
                            // mul then add, rounded twice as the reference does (an FMA would differ in the last bit)
                            let v = _mm256_add_ps(_mm256_mul_ps(s, q), b);
                            _mm256_storeu_ps(wt.add((c0 + 8 * c + n) * stride), v);
                            w = _mm256_srli_epi32::<4>(w);
                        }
                    }
                }
            });
        }
    }

    /// [`dequant8_kmajor_q4`] for 16 consecutive rows with AVX-512: wt[j * stride + i] = s_i,g q_i,j +
    /// b_i,g for i < 16, j < cols. Per 32 columns the 16 bytes of each row are loaded as four zmm of
    /// four rows each (rows r, r + 4, r + 8, r + 12 in the 128-bit lanes) and 4 x 4 word-transposed
    /// within each lane, so word c of row i lands in lane i of one register; then shift, mask,
    /// convert, scale, bias (mul then add, as the reference) and one 64-byte store per nibble
    /// position: half the instructions per weight of the 8-row AVX2 version. The packed rows are
    /// prefetched [`KMAJOR_AHEAD`] bytes ahead: an expert's rows are read once per prefill chunk,
    /// straight from DRAM, in 16 streams of 1 KiB or less (too short for the hardware prefetcher
    /// to ramp up: with ~8 tokens per expert the 8-row version spent most of its time on the loads).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn dequant16_kmajor_q4_avx512(m: &Matrix, stored: usize, wt: *mut f32, stride: usize) {
        unsafe {
            let mask = _mm512_set1_epi32(15);
            kmajor_q4_groups::<16>(m, stored, "dequant16_kmajor_q4_avx512", |w, cols, columns, sv, bv| {
                let (s, b) = (_mm512_loadu_ps(sv.as_ptr()), _mm512_loadu_ps(bv.as_ptr()));
                for c0 in columns.step_by(32) {
                    prefetch_rows(w, c0 / 2, cols / 2, false);
                    let v: [__m512i; 4] = std::array::from_fn(|r| {
                        // SAFETY: c0 + 32 <= cols, and each row holds cols / 2 bytes (asserted).
                        let ld = |i: usize| _mm_loadu_si128(w[i].add(c0 / 2) as *const __m128i);
                        let lo = _mm256_set_m128i(ld(r + 4), ld(r));
                        let hi = _mm256_set_m128i(ld(r + 12), ld(r + 8));
                        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
                    });
                    let (a0, a1) = (_mm512_unpacklo_epi32(v[0], v[1]), _mm512_unpackhi_epi32(v[0], v[1]));
                    let (a2, a3) = (_mm512_unpacklo_epi32(v[2], v[3]), _mm512_unpackhi_epi32(v[2], v[3]));
                    let words = [
                        _mm512_unpacklo_epi64(a0, a2),
                        _mm512_unpackhi_epi64(a0, a2),
                        _mm512_unpacklo_epi64(a1, a3),
                        _mm512_unpackhi_epi64(a1, a3),
                    ];
                    for (c, &w) in words.iter().enumerate() {
                        let mut w = w;
                        for n in 0..8 {
                            let q = _mm512_cvtepi32_ps(_mm512_and_si512(w, mask));
                            // mul then add, rounded twice as the reference does (an FMA would differ in the last bit)
                            let v = _mm512_add_ps(_mm512_mul_ps(s, q), b);
                            _mm512_storeu_ps(wt.add((c0 + 8 * c + n) * stride), v);
                            w = _mm512_srli_epi32::<4>(w);
                        }
                    }
                }
            });
        }
    }

    /// What the K-major 4-bit dequantizations of `R` consecutive stored rows share (the width's
    /// kernel is `block`): the format and row lengths checked (`name` in the messages), the rows'
    /// first bytes prefetched, and per group, in order, `block(rows' packed bytes, cols, the
    /// group's columns, the R rows' scales, their biases)`. The scales and biases are converted
    /// to f32 a piece of groups at a time (vectorized for bf16) and each group's pair is built
    /// once (it was two dtype dispatches per row every 32 columns: by instruction count about as
    /// much as the vector work, which an expert's ~8 tokens do not amortize). Inlined into the
    /// `#[target_feature]` kernel, `block` with it.
    #[inline(always)]
    unsafe fn kmajor_q4_groups<const R: usize>(
        m: &Matrix,
        stored: usize,
        name: &str,
        mut block: impl FnMut(&[*const u8; R], usize, std::ops::Range<usize>, &[f32; R], &[f32; R]),
    ) {
        const PIECE: usize = 64;
        let Format::Affine { group, .. } = m.format else {
            unreachable!("{name} takes 4-bit affine rows")
        };
        let (sd, cols) = (m.scale_dtype(), m.cols);
        let (sz, g_n) = (sd.size(), cols / group);
        let parts: [(&[u8], &[u8], &[u8]); R] = std::array::from_fn(|i| m.row_parts(stored + i));
        assert!(
            parts
                .iter()
                .all(|p| p.0.len() >= cols / 2 && p.1.len() >= g_n * sz && p.2.len() >= g_n * sz),
            "{name}: row lengths"
        );
        let w: [*const u8; R] = parts.map(|p| p.0.as_ptr());
        let (mut sc, mut bi) = ([[0f32; PIECE]; R], [[0f32; PIECE]; R]);
        unsafe { prefetch_rows(&w, 0, cols / 2, true) };
        for g0 in (0..g_n).step_by(PIECE) {
            let gn = PIECE.min(g_n - g0);
            for i in 0..R {
                super::scalars_f32(sd, &parts[i].1[g0 * sz..][..gn * sz], &mut sc[i][..gn]);
                super::scalars_f32(sd, &parts[i].2[g0 * sz..][..gn * sz], &mut bi[i][..gn]);
            }
            for gi in 0..gn {
                // The R rows' scale and bias of group g0 + gi.
                let (sv, bv): ([f32; R], [f32; R]) =
                    (std::array::from_fn(|i| sc[i][gi]), std::array::from_fn(|i| bi[i][gi]));
                let first = (g0 + gi) * group;
                block(&w, cols, first..first + group, &sv, &bv);
            }
        }
    }

    /// Bytes ahead of the current column that the K-major dequantizations prefetch in each row:
    /// 4 cache lines of 16 rows = 64 misses in flight at most, about what a core's miss buffers hold.
    const KMAJOR_AHEAD: usize = 256;

    /// Prefetch for the K-major dequantizations, whose rows (`rows[i]`, `len` packed bytes each)
    /// are read side by side, `at` bytes in: at the start (`first`) the rows' first
    /// [`KMAJOR_AHEAD`] bytes, then at each cache line boundary the line [`KMAJOR_AHEAD`] ahead.
    #[inline(always)]
    unsafe fn prefetch_rows<const R: usize>(rows: &[*const u8; R], at: usize, len: usize, first: bool) {
        let lines = if first {
            0..KMAJOR_AHEAD.min(len)
        } else if at % 64 == 0 && at + KMAJOR_AHEAD < len {
            at + KMAJOR_AHEAD..at + KMAJOR_AHEAD + 1
        } else {
            return;
        };
        for l in lines.step_by(64) {
            for &r in rows {
                // SAFETY: a prefetch never faults; l < len, inside the row.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(r.wrapping_add(l) as *const i8) };
            }
        }
    }

    /// AVX2 has 16 ymm registers: two 4 x 2 passes (8 accumulators + 4 rows + 1 x each).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot4x4_avx2(w: [*const f32; 4], x: [*const f32; 4], k: usize) -> [[f32; 4]; 4] {
        unsafe {
            let mut o = [[0f32; 4]; 4];
            let k8 = k / 8 * 8;
            for half in 0..2 {
                let mut acc = [[_mm256_setzero_ps(); 2]; 4];
                let mut j = 0;
                while j < k8 {
                    let wv = [0, 1, 2, 3].map(|i| _mm256_loadu_ps(w[i].add(j)));
                    for t in 0..2 {
                        let xv = _mm256_loadu_ps(x[2 * half + t].add(j));
                        for i in 0..4 {
                            acc[i][t] = _mm256_fmadd_ps(wv[i], xv, acc[i][t]);
                        }
                    }
                    j += 8;
                }
                for i in 0..4 {
                    for t in 0..2 {
                        let mut s = hsum256(acc[i][t]);
                        for jj in k8..k {
                            s += *w[i].add(jj) * *x[2 * half + t].add(jj);
                        }
                        o[i][2 * half + t] = s;
                    }
                }
            }
            o
        }
    }
}
