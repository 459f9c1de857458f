//! 4-bit rows times integer activations: the decode GEMV's inner product.
//!
//! Why: dequantizing 4-bit weights to f32 costs several vector instructions per 16 weights
//! (widen, convert or table lookup, FMA), so a core tops out below its share of memory
//! bandwidth. Multiplying the 4-bit codes by 8-bit integers instead uses the CPU's byte dot
//! products (`vpdpbusd` on AVX-512 VNNI / AVX-VNNI, `pmaddubsw` on AVX2, `sdot` on arm64): one
//! instruction per 64 (or 32, 16) weights, with the affine group form applied once per lane.
//!
//! Precision ([`Precision`]): in the exact mode x is not rounded to int8 (that would be a
//! bf16-class error). Each group of x is
//! written as [`PLANES`] int8 planes in fixed point, x ~= d_g (q0 + q1 / 256 + q2 / 256^2), with
//! d_g = max|x_g| / 127: plane 0 is round(x / d_g), each next plane rounds what is left at 256x
//! finer steps (a residual is within half a step, so |q1|, |q2| <= 128; a +128 carries into the
//! plane before as -128, the same value, so every plane fits i8). The error per element is at
//! most max|x_g| / (127 * 2 * 256^2) ~= 6e-8 max|x_g|, below f32 rounding of x itself, so the
//! engine's numbers stay within the fp32 tolerances of the tests (two planes measured 3e-2 max
//! |dlogit| between decode and prefill on a tiny model: an expert choice flipped). The fast mode
//! keeps plane 0 only, x ~= d_g q0 (llama.cpp's q8 activations, per weight group): a third of the
//! dot work, an error of up to d_g / 2 per element. The bias term of the affine form,
//! b_g sum_{j in g} x_j, uses the exact f32 group sums in both modes.
//!
//! Layouts:
//! - weights: the packed row as stored (byte j: element 2j in the low nibble, 2j+1 high);
//! - `xq` [planes * cols] i8, in blocks of 2B elements (B = [`Dot::block`] weight bytes): per block
//!   and plane, the B even elements, then the B odd ones, so the low / high nibbles of B loaded
//!   bytes meet their x values without a shuffle;
//! - lanes: 4 weight bytes (8 elements) feed one i32 accumulator lane, so lane L always covers
//!   elements 8L..8L+7 whatever B is; `cl` [cols / 8] holds s_g d_g per lane (the row's scale
//!   times x's step; groups are multiples of 8 elements).
//! - paired blocks ([`Dot::paired`]: the x86 kernels at one plane, the fast precision): two
//!   consecutive blocks of a row (2p, 2p+1)
//!   are read as one, their 8-byte pieces interleaved as `unpacklo / unpackhi_epi64` interleave
//!   them (slot 0: per 16 bytes, block 2p's first 8 then block 2p+1's first 8; slot 1: the second
//!   8 of each), and x's two block slots hold their elements in that order ([`x_pos`]). Each i32
//!   lane then sees one 16-byte piece of each block, and a 16-byte piece (32 elements) lies in one
//!   group (groups of 32k), so a lane's sums over both blocks share one scale: one convert, one
//!   scale permute and one FMA per lane and *pair* instead of per block (on Intel server cores
//!   the convert shares port 0 with the byte dots, which bound a batched step's lm_head). The
//!   last block of a row with an odd block count stays alone, in the plain order.
//!
//! Per lane the planes combine in i32 by shifts: acc = ((a0 << 8) + a1) << 8 + a2, where a_p sums
//! the lane's 8 code x q_p products (|acc| <= 8 * 15 * 128 * (2^16 + 2^8 + 1) < 2^31).
//! Result: sum_L cl[L] acc[L] / 256^2, one convert and one FMA per lane and block.

use super::isa::{multiversion, Isa};
use crate::{
    error::{Error, Result},
    quant::read_scalar,
    safetensors::DType,
};

/// int8 planes per activation element in the exact mode (the most any mode writes: buffers are
/// sized for it).
pub const PLANES: usize = 3;
/// log2 of the step ratio between consecutive planes.
const SHIFT: i32 = 8;

/// 256^(planes - 1): the weight of plane 0 in the combined lane sum.
const fn unit(planes: usize) -> f32 {
    (1u32 << (SHIFT as u32 * (planes as u32 - 1))) as f32
}

/// How the CPU's 4-bit matmuls round the activations (module docs): `Exact`, [`PLANES`] int8
/// planes per element (below f32 rounding of x, the engine's fp32 numbers); `Fast`, one plane
/// (q8 per weight group, as llama.cpp: a little below bf16 accuracy, a third of the dot work).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    #[default]
    Exact,
    Fast,
}

impl Precision {
    /// Int8 planes per activation element.
    pub fn planes(self) -> usize {
        match self {
            Precision::Exact => PLANES,
            Precision::Fast => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::Exact => "exact",
            Precision::Fast => "fast",
        }
    }

    /// `"exact"` or `"fast"`; anything else is an [`Error::InvalidArgument`].
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "exact" => Ok(Precision::Exact),
            "fast" => Ok(Precision::Fast),
            _ => Err(Error::InvalidArgument(format!(
                "precision must be \"exact\" or \"fast\", not {s:?}"
            ))),
        }
    }
}

/// The byte dot-product instruction a kernel uses; each has its block width B.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dot {
    /// Plain integer loops, B = 16.
    Portable,
    /// arm64 `sdot` (FEAT_DotProd: every Apple M chip), B = 16.
    NeonSdot,
    /// AVX2 `pmaddubsw` + `pmaddwd`, B = 32.
    Maddubs256,
    /// AVX-VNNI `vpdpbusd` on 256 bits, B = 32.
    AvxVnni256,
    /// AVX-512 VNNI + VL `vpdpbusd` on 256 bits, B = 32.
    Vnni256,
    /// AVX-512 BW `vpmaddubsw` + `vpmaddwd`, B = 64.
    Maddubs512,
    /// AVX-512 VNNI `vpdpbusd`, B = 64.
    Vnni512,
}

impl Dot {
    /// Weight bytes per block (B).
    pub fn block(self) -> usize {
        match self {
            Dot::Portable | Dot::NeonSdot => 16,
            Dot::Maddubs256 | Dot::AvxVnni256 | Dot::Vnni256 => 32,
            Dot::Maddubs512 | Dot::Vnni512 => 64,
        }
    }

    /// Whether x's `planes` planes pair consecutive blocks (module docs): the x86 kernels at one
    /// plane. (Three planes: a pair saves one convert of ~7 port-0 uops per block and token,
    /// while the batched kernel's 12 plane vectors per token and pair spilled: measured 20-30 %
    /// slower in cache, so they keep one block at a time.)
    pub fn paired(self, planes: usize) -> bool {
        planes == 1 && !matches!(self, Dot::Portable | Dot::NeonSdot)
    }

    /// The vector ISA the kernel belongs to (it is used only when that ISA is allowed).
    fn isa(self) -> Isa {
        match self {
            Dot::Portable | Dot::NeonSdot => Isa::Portable,
            Dot::Maddubs256 | Dot::AvxVnni256 => Isa::Avx2,
            Dot::Vnni256 | Dot::Maddubs512 | Dot::Vnni512 => Isa::Avx512,
        }
    }

    /// Whether this CPU can run it.
    pub fn available(self) -> bool {
        match self {
            Dot::Portable => true,
            #[cfg(target_arch = "aarch64")]
            Dot::NeonSdot => std::arch::is_aarch64_feature_detected!("dotprod"),
            #[cfg(target_arch = "x86_64")]
            Dot::Maddubs256 => Isa::Avx2.available(),
            #[cfg(target_arch = "x86_64")]
            Dot::AvxVnni256 => Isa::Avx2.available() && is_x86_feature_detected!("avxvnni"),
            #[cfg(target_arch = "x86_64")]
            Dot::Vnni256 | Dot::Vnni512 => Isa::Avx512.available() && is_x86_feature_detected!("avx512vnni"),
            #[cfg(target_arch = "x86_64")]
            Dot::Maddubs512 => Isa::Avx512.available(),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// Every kernel this CPU can run (the tests run each).
    pub fn all_available() -> Vec<Dot> {
        Self::BEST_FIRST.into_iter().filter(|d| d.available()).collect()
    }

    const BEST_FIRST: [Dot; 7] = [
        Dot::Vnni512,
        Dot::Maddubs512,
        Dot::Vnni256,
        Dot::AvxVnni256,
        Dot::Maddubs256,
        Dot::NeonSdot,
        Dot::Portable,
    ];

    /// The fastest kernel allowed by `isa` whose block divides rows of `cols` elements into
    /// whole blocks; `None` when no block fits (cols not a multiple of 32).
    pub fn pick(isa: Isa, cols: usize) -> Option<Dot> {
        let allowed = |d: Dot| match d.isa() {
            Isa::Portable => true,
            Isa::Avx2 => isa != Isa::Portable,
            Isa::Avx512 => isa == Isa::Avx512,
        };
        Self::BEST_FIRST
            .into_iter()
            .find(|&d| allowed(d) && cols % (2 * d.block()) == 0 && d.available())
    }
}

/// Quantize x [cols] (groups of `group` elements, a multiple of 8) into `planes` (1 ..=
/// [`PLANES`]) int8 planes in the block order of `dot`: `dx[g]` gets plane 0's step d_g,
/// `xq[..planes * cols]` the planes.
pub fn quantize(isa: Isa, dot: Dot, planes: usize, x: &[f32], group: usize, dx: &mut [f32], xq: &mut [i8]) {
    let (b, cols) = (dot.block(), x.len());
    assert!(
        group % 8 == 0 && cols % group == 0 && cols % (2 * b) == 0 && (1..=PLANES).contains(&planes),
        "int8: bad shape"
    );
    assert!(
        dx.len() >= cols / group && xq.len() >= planes * cols,
        "int8: buffers too small"
    );
    quantize_isa(isa, b, planes, x, group, dx, xq);
    if dot.paired(planes) {
        // Per pair of blocks, plane and half: block 2p's odd 8-byte pieces trade places with
        // block 2p+1's even ones (the `unpacklo / unpackhi_epi64` order, module docs).
        for pair in xq[..planes * cols].chunks_exact_mut(2 * 2 * b * planes) {
            let (s0, s1) = pair.split_at_mut(2 * b * planes);
            for (h0, h1) in s0.chunks_exact_mut(b).zip(s1.chunks_exact_mut(b)) {
                for (c0, c1) in h0.chunks_exact_mut(16).zip(h1.chunks_exact_mut(16)) {
                    c0[8..].swap_with_slice(&mut c1[..8]);
                }
            }
        }
    }
}

/// (x's block slot, byte position in it) of weight byte `byte` of block `blk` of a row of
/// `blocks` blocks, in `dot`'s layout for `planes` planes (module docs: paired blocks).
#[inline]
fn slot_of(dot: Dot, planes: usize, blocks: usize, blk: usize, byte: usize) -> (usize, usize) {
    if dot.paired(planes) && (blk | 1) < blocks {
        ((blk & !1) | (byte >> 3 & 1), (byte & !8) | ((blk & 1) << 3))
    } else {
        (blk, byte)
    }
}

/// Where element `i` of a row of `cols` sits in plane 0 of [`quantize`]'s output for `dot` and
/// `planes` planes (plane p is `p * 2 * dot.block()` further).
pub fn x_pos(dot: Dot, planes: usize, cols: usize, i: usize) -> usize {
    let b = dot.block();
    let (blk, k) = (i / (2 * b), i % (2 * b));
    let (slot, j) = slot_of(dot, planes, cols / (2 * b), blk, k / 2);
    slot * 2 * b * planes + (k % 2) * b + j
}

multiversion! {
    fn quantize_isa(b: usize, planes: usize, x: &[f32], group: usize, dx: &mut [f32], xq: &mut [i8]) = quantize_body;
}

/// Steps per group first; then per block and half (even or odd elements): the half's elements
/// gathered into a residual array, and per run of elements sharing a group and per plane, one
/// vectorizable loop over contiguous values (round, store, subtract).
#[inline(always)]
fn quantize_body(_isa: Isa, b: usize, planes: usize, x: &[f32], group: usize, dx: &mut [f32], xq: &mut [i8]) {
    for (d, xg) in dx.iter_mut().zip(x.chunks_exact(group)) {
        // 8 lanes (groups are multiples of 8), so the loop vectorizes.
        let mut m = [0f32; 8];
        for c in xg.chunks_exact(8) {
            for (mi, v) in m.iter_mut().zip(c) {
                *mi = mi.max(v.abs());
            }
        }
        *d = m.iter().fold(0f32, |a, &v| a.max(v)) / 127.0;
    }
    let run = b.min(group / 2);
    let mut r = [0f32; 64];
    let mut q = [[0f32; 64]; PLANES];
    for (blk, (xb, ob)) in x
        .chunks_exact(2 * b)
        .zip(xq.chunks_exact_mut(2 * b * planes))
        .enumerate()
    {
        for h in 0..2 {
            for (ri, pair) in r[..b].iter_mut().zip(xb.chunks_exact(2)) {
                *ri = pair[h];
            }
            for i0 in (0..b).step_by(run) {
                let step = dx[(blk * 2 * b + 2 * i0) / group];
                let inv = if step > 0.0 { 1.0 / step } else { 0.0 };
                let (mut stepp, mut invp) = (step, inv);
                for (p, qp) in q[..planes].iter_mut().enumerate() {
                    let lim = if p == 0 { 127.0 } else { 128.0 };
                    for (qi, ri) in qp[i0..i0 + run].iter_mut().zip(r[i0..i0 + run].iter_mut()) {
                        // f32::max / min drop a NaN (clamp would keep it), so q is finite and in range.
                        #[allow(clippy::manual_clamp)]
                        let v = (*ri * invp).round_ties_even().max(-lim).min(lim);
                        *qi = v;
                        *ri -= v * stepp;
                    }
                    stepp /= (1 << SHIFT) as f32;
                    invp *= (1 << SHIFT) as f32;
                }
                // A plane at +128 (its residual was exactly half a step up) becomes -128 and
                // carries one into the plane before: the same value, in i8 range. Plane 0 cannot
                // carry past 127 (x <= 127 d_g leaves no positive residual there).
                for p in (1..planes).rev() {
                    let (before, this) = q.split_at_mut(p);
                    for (a, b) in before[p - 1][i0..i0 + run]
                        .iter_mut()
                        .zip(this[0][i0..i0 + run].iter_mut())
                    {
                        let c = if *b >= 128.0 { 1.0 } else { 0.0 };
                        *b -= 256.0 * c;
                        *a += c;
                    }
                }
                for (p, qp) in q[..planes].iter().enumerate() {
                    let o = &mut ob[p * 2 * b + h * b + i0..][..run];
                    for (oi, &v) in o.iter_mut().zip(&qp[i0..i0 + run]) {
                        // SAFETY: v is a finite integer in [-128, 127] (f32 rounding could only
                        // push plane 0 to 128; min keeps it in range).
                        *oi = unsafe { v.min(127.0).to_int_unchecked::<i32>() } as i8;
                    }
                }
            }
        }
    }
}

/// Groups per chunk of [`rows`]: the step and group-sum arrays of x are padded with zeros to a
/// multiple of this.
pub const CHUNK_GROUPS: usize = 16;

/// Consecutive rows of a 4-bit affine matrix as stored: `w` [rows, cols / 2] packed codes,
/// `scales` / `biases` [rows, cols / group] of `dtype`.
#[derive(Clone, Copy)]
pub struct Rows<'a> {
    pub w: &'a [u8],
    pub scales: &'a [u8],
    pub biases: &'a [u8],
    pub dtype: DType,
    pub cols: usize,
    pub group: usize,
}

/// x prepared once for every row: `n` planes (1 or [`PLANES`]) in `dot`'s block order, plane-0
/// steps per group and exact f32 group sums (both zero-padded to a multiple of [`CHUNK_GROUPS`]).
#[derive(Clone, Copy)]
pub struct Planes<'a> {
    pub dot: Dot,
    pub n: usize,
    pub dx: &'a [f32],
    pub gsum: &'a [f32],
    pub xq: &'a [i8],
}

impl Dot {
    /// Whether [`rows`] has a fused kernel for this dot, group size and scale type (else it
    /// runs [`rows_portable`]): the x86 and arm64 kernels, MLX's group sizes, float scales.
    pub fn fused_rows(self, group: usize, dtype: DType) -> bool {
        self != Dot::Portable
            && matches!(group, 32 | 64 | 128)
            && matches!(dtype, DType::BF16 | DType::F16 | DType::F32)
    }
}

/// The shapes and lengths [`rows`] needs for `n` rows of `m` and x (the kernels read no further).
fn check_rows(m: &Rows, x: &Planes, n: usize) {
    let (g_n, sz) = (m.cols / m.group, m.dtype.size());
    let b = x.dot.block();
    assert!(
        m.group % 8 == 0 && m.cols % m.group == 0 && m.cols % (2 * b) == 0,
        "int8 rows: bad shape"
    );
    assert!(
        m.w.len() >= n * m.cols / 2
            && m.scales.len() >= n * g_n * sz
            && m.biases.len() >= n * g_n * sz
            && x.dx.len() >= g_n.next_multiple_of(CHUNK_GROUPS)
            && x.gsum.len() >= g_n.next_multiple_of(CHUNK_GROUPS)
            && x.xq.len() >= x.n * m.cols
            && (x.n == 1 || x.n == PLANES),
        "int8 rows: lengths"
    );
}

/// `x86::<dot>::$f::<P>(args)`: the fused kernel `$f` (`rows`, `rows_batch`) of the byte dot
/// `$dot` for `$planes` planes (1 or [`PLANES`]).
#[cfg(target_arch = "x86_64")]
macro_rules! fused {
    ($dot:expr, $planes:expr, $f:ident($($a:expr),*)) => {
        if $planes == 1 {
            fused!(@p 1, $dot, $f($($a),*))
        } else {
            fused!(@p PLANES, $dot, $f($($a),*))
        }
    };
    (@p $p:expr, $dot:expr, $f:ident($($a:expr),*)) => {
        match $dot {
            Dot::Vnni512 => x86::vnni512::$f::<{ $p }>($($a),*),
            Dot::Maddubs512 => x86::maddubs512::$f::<{ $p }>($($a),*),
            Dot::Vnni256 => x86::vnni256::$f::<{ $p }>($($a),*),
            Dot::AvxVnni256 => x86::avxvnni256::$f::<{ $p }>($($a),*),
            Dot::Maddubs256 => x86::maddubs256::$f::<{ $p }>($($a),*),
            _ => unreachable!("fused_rows"),
        }
    };
}

/// out[r] = sum_g s_g (w_g . x_g) + b_g sum(x_g) for every row r of `m` (4-bit codes, x as
/// `x`'s planes). The decode GEMV's inner loop.
pub fn rows(m: &Rows, x: &Planes, out: &mut [f32]) {
    check_rows(m, x, out.len());
    #[cfg(target_arch = "x86_64")]
    if x.dot.fused_rows(m.group, m.dtype) && x.dot.available() {
        // SAFETY: lengths checked above; the kernel's CPU features were checked by `available`;
        // the group size and dtype are the ones the kernels handle (`fused_rows`).
        unsafe { fused!(x.dot, x.n, rows(m, x, out)) }
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if x.dot == Dot::NeonSdot && x.dot.fused_rows(m.group, m.dtype) && x.dot.available() {
        // SAFETY: lengths checked above; `dotprod` checked by `available`; groups of 32k.
        unsafe {
            if x.n == 1 {
                neon::rows_sdot::<1>(m, x, out)
            } else {
                neon::rows_sdot::<PLANES>(m, x, out)
            }
        };
        return;
    }
    rows_portable(m, x, out)
}

/// Tokens per pass of [`rows_batch`]'s fused kernels: each weight block's nibbles, unpacked once,
/// meet this many tokens' planes in registers (more tokens run in further passes over the same
/// rows, which stay in L1).
pub const BATCH_TOKENS: usize = 4;

/// out[j * stride + r] = row r of `m` times token j's planes `xs[j]`, for r < `n` and every token
/// j (a batched decode step; the fast precision's MoE experts): what [`rows`] gives each token
/// alone, bit for bit (the same integer lane sums, the same f32 order per row and token), with
/// each loaded weight block unpacked once for up to [`BATCH_TOKENS`] tokens and the row's scales
/// converted once per chunk for all of them. Every x must have the same dot and plane count.
/// The portable twin (no batched form) runs [`rows`] per token.
pub fn rows_batch(m: &Rows, xs: &[Planes], n: usize, out: &mut [f32], stride: usize) {
    let Some(x0) = xs.first() else { return };
    assert!(
        stride >= n && out.len() >= (xs.len() - 1) * stride + n,
        "int8 rows_batch: output"
    );
    if xs.len() == 1 {
        // One token (most experts of a batched decode step): the row kernel, whose four rows
        // share each x load (the batched kernel takes one row at a time on 256 bits).
        return rows(m, x0, &mut out[..n]);
    }
    assert!(
        xs.iter().all(|x| x.dot == x0.dot && x.n == x0.n),
        "int8 rows_batch: planes of one kind"
    );
    #[cfg(target_arch = "x86_64")]
    if x0.dot.fused_rows(m.group, m.dtype) && x0.dot.available() {
        // The shape and length checks of `rows`, per token.
        for x in xs {
            check_rows(m, x, n);
        }
        // SAFETY: lengths checked above; the kernel's CPU features were checked by `available`;
        // the group size and dtype are the ones the kernels handle (`fused_rows`).
        unsafe { fused!(x0.dot, x0.n, rows_batch(m, xs, n, out, stride)) }
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if x0.dot == Dot::NeonSdot && x0.dot.fused_rows(m.group, m.dtype) && x0.dot.available() {
        for x in xs {
            check_rows(m, x, n);
        }
        // SAFETY: lengths checked above; `dotprod` checked by `available`; groups of 32k.
        unsafe {
            if x0.n == 1 {
                neon::rows_batch_sdot::<1>(m, xs, n, out, stride)
            } else {
                neon::rows_batch_sdot::<PLANES>(m, xs, n, out, stride)
            }
        };
        return;
    }
    for (j, x) in xs.iter().enumerate() {
        rows(m, x, &mut out[j * stride..][..n]);
    }
}

/// The twin of the fused kernels, and the path of the other dots: per row and piece of up to
/// 2048 elements, the lane scales s_g d_g (one conversion per group in the piece), [`dot`], and
/// the bias term (stack scratch only: the decode loop allocates nothing). Any group size.
pub fn rows_portable(m: &Rows, x: &Planes, out: &mut [f32]) {
    let (g_n, sz) = (m.cols / m.group, m.dtype.size());
    let mut cl = [0f32; 256];
    let piece = cl.len() * 8;
    for (r, o) in out.iter_mut().enumerate() {
        let (sc, bi) = (&m.scales[r * g_n * sz..], &m.biases[r * g_n * sz..]);
        let w = &m.w[r * m.cols / 2..][..m.cols / 2];
        let mut tot: f32 = (0..g_n).map(|g| read_scalar(m.dtype, bi, g) * x.gsum[g]).sum();
        for p0 in (0..m.cols).step_by(piece) {
            let pl = piece.min(m.cols - p0);
            // The groups overlapping this piece, each filling its lanes (8 elements per lane).
            let mut e = p0;
            while e < p0 + pl {
                let g = e / m.group;
                let end = ((g + 1) * m.group).min(p0 + pl);
                cl[(e - p0) / 8..(end - p0) / 8].fill(read_scalar(m.dtype, sc, g) * x.dx[g]);
                e = end;
            }
            tot += dot(x.dot, x.n, &w[p0 / 2..][..pl / 2], &x.xq[p0 * x.n..], &cl[..pl / 8]);
        }
        *o = tot;
    }
}

/// The row's sum over lanes (module docs) for a 4-bit row `w` [cols / 2] and `xq` (`planes`
/// planes), `cl` prepared for `dot`.
#[inline]
pub fn dot(dot: Dot, planes: usize, w: &[u8], xq: &[i8], cl: &[f32]) -> f32 {
    let b = dot.block();
    let blocks = w.len() / b;
    assert!(
        w.len() % b == 0
            && (1..=PLANES).contains(&planes)
            && xq.len() >= planes * 2 * w.len()
            && cl.len() >= w.len() / 4,
        "int8 dot: lengths"
    );
    let (w, xq, cl) = (w.as_ptr(), xq.as_ptr(), cl.as_ptr());
    // SAFETY: each kernel reads blocks * B weight bytes, blocks * 2B * planes x bytes and
    // blocks * B / 4 lane scales, all checked above; the kernel's CPU features were checked
    // by `available` when `dot` was picked.
    unsafe {
        match dot {
            #[cfg(target_arch = "aarch64")]
            Dot::NeonSdot => neon::sdot16(planes, w, xq, cl, blocks),
            _ => dot_portable(
                dot,
                planes,
                std::slice::from_raw_parts(w, blocks * b),
                std::slice::from_raw_parts(xq, blocks * 2 * b * planes),
                std::slice::from_raw_parts(cl, blocks * b / 4),
            ),
        }
    }
}

/// The twin every kernel is tested against: the same sums with plain integer loops, in `dot`'s
/// x layout (its B, its pairing), one block and lane at a time.
pub fn dot_portable(dot: Dot, planes: usize, w: &[u8], xq: &[i8], cl: &[f32]) -> f32 {
    let b = dot.block();
    let blocks = w.len() / b;
    let mut tot = 0f32;
    for (blk, wb) in w.chunks_exact(b).enumerate() {
        for (l, wl) in wb.chunks_exact(4).enumerate() {
            let mut acc = 0i32;
            for p in 0..planes {
                acc <<= SHIFT;
                for (i, &byte) in wl.iter().enumerate() {
                    let (slot, j) = slot_of(dot, planes, blocks, blk, 4 * l + i);
                    let (even, odd) = xq[slot * 2 * b * planes + p * 2 * b..][..2 * b].split_at(b);
                    acc += (byte & 15) as i32 * even[j] as i32 + (byte >> 4) as i32 * odd[j] as i32;
                }
            }
            tot += cl[blk * b / 4 + l] * acc as f32;
        }
    }
    tot / unit(planes)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! The fused [`super::rows`] kernels, one per instruction choice, generated from one body
    //! (`rows_kernel!`) over the vector operations of each width (`width!`).
    use std::arch::x86_64::*;

    use super::{unit, Planes, Rows, BATCH_TOKENS, SHIFT};
    use crate::safetensors::DType;

    /// Weight bytes ahead of the current block to prefetch. A core streams rows faster than the
    /// hardware prefetcher alone keeps cache-line misses in flight; rows of a matrix are
    /// contiguous, so this runs into the next rows (a prefetch never faults, even past the end).
    /// Measured on 2 quiet Xeon cores, a 9 MB matrix from DRAM: none 9.4 GB/s, 2 KiB 14.3,
    /// 4 KiB 13.8, 8 KiB 13.2 (read bandwidth 24 GB/s).
    const PREFETCH: usize = 2048;

    /// The pair of byte dots acc + lo.xe + hi.xo, per instruction choice: `dpbusd` twice (VNNI),
    /// or `maddubs` summed to i32 by `madd` with ones (u4 x s8 pairs: |2 * 15 * 127| and the sum
    /// of two such fit i16 without saturating).
    macro_rules! dot2 {
        ($name:ident, $feat:literal, $v:ty, dpbusd = $dp:ident) => {
            #[target_feature(enable = $feat)]
            #[inline]
            fn $name(a: $v, lo: $v, xe: $v, hi: $v, xo: $v) -> $v {
                $dp($dp(a, lo, xe), hi, xo)
            }
        };
        ($name:ident, $feat:literal, $v:ty, maddubs = $mb:ident, $add16:ident, $madd:ident, $add32:ident, $ones:ident) => {
            #[target_feature(enable = $feat)]
            #[inline]
            fn $name(a: $v, lo: $v, xe: $v, hi: $v, xo: $v) -> $v {
                $add32(a, $madd($add16($mb(lo, xe), $mb(hi, xo)), $ones(1)))
            }
        };
    }

    dot2! { vnni512_2, "avx512f,avx512bw,avx512vnni", __m512i, dpbusd = _mm512_dpbusd_epi32 }
    dot2! { vnni256_2, "avx2,avx512f,avx512vl,avx512vnni", __m256i, dpbusd = _mm256_dpbusd_epi32 }
    dot2! { avxvnni256_2, "avx2,avxvnni", __m256i, dpbusd = _mm256_dpbusd_avx_epi32 }
    dot2! {
        maddubs512_2, "avx512f,avx512bw", __m512i,
        maddubs = _mm512_maddubs_epi16, _mm512_add_epi16, _mm512_madd_epi16, _mm512_add_epi32, _mm512_set1_epi16
    }
    dot2! {
        maddubs256_2, "avx2", __m256i,
        maddubs = _mm256_maddubs_epi16, _mm256_add_epi16, _mm256_madd_epi16, _mm256_add_epi32, _mm256_set1_epi16
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// `vpshufb` control moving each i32 lane's three low bytes up one byte (a zero, 0x80, below):
    /// [`shl8_512`]. Indices are within each 16-byte lane, as `vpshufb` reads them.
    pub(super) static SHL8: [i8; 64] = {
        let mut c = [0i8; 64];
        let mut i = 0;
        while i < 64 {
            c[i] = if i % 4 == 0 { -128 } else { (i % 16 - 1) as i8 };
            i += 1;
        }
        c
    };

    /// v << 8 per i32 lane on 512 bits as a byte shuffle (each lane's bytes b0 b1 b2 moved up one,
    /// a zero below, b3 dropped), not a shift: on Intel server cores the 512-bit shifts and byte
    /// dots both issue on port 0 only, which the exact mode's six dots per block already fill,
    /// while `vpshufb` issues on port 5 (Intel's port tables: argued, not yet measured). Equal to
    /// the shift for |v| < 2^23, which the planes' partial sums stay under (module docs: |a0| <=
    /// 8 * 15 * 127, and (a0 << 8) + a1 < 2^22 before the second shift).
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    pub(super) fn shl8_512(v: __m512i) -> __m512i {
        // SAFETY: SHL8 holds 64 bytes.
        unsafe { _mm512_shuffle_epi8(v, _mm512_loadu_si512(SHL8.as_ptr() as *const __m512i)) }
    }

    /// v << 8 per i32 lane on 256 bits: a shift. AVX2 has 16 registers, and the shuffle's control
    /// would take one the batched kernel needs (on Zen 4 the shuffle form measured 5-10 % slower
    /// on the lm_head of a batched step; both are one single-cycle uop there).
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) fn shl8_256(v: __m256i) -> __m256i {
        _mm256_slli_epi32::<8>(v)
    }

    #[cfg(test)]
    mod tests {
        use std::arch::x86_64::*;

        /// SHL8 as `vpshufb` control is << 8 on every i32 in the planes' range (checked with the
        /// 256-bit shuffle, whose per-lane semantics the 512-bit one shares, and on 512 bits where
        /// the CPU has AVX-512 BW).
        #[test]
        fn shl8_control_is_a_shift_by_8_in_range() {
            if !is_x86_feature_detected!("avx2") {
                return;
            }
            let mut vals: Vec<i32> = vec![0, 1, -1, 255, -256, (1 << 23) - 1, -(1 << 23), 15240, -15240, 3_917_000];
            let mut s = 0x9e37_79b9u32;
            for _ in 0..4096 {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                vals.push((s as i32) >> 8); // |v| < 2^23
            }
            for c in vals.chunks(16) {
                let mut v = [0i32; 16];
                v[..c.len()].copy_from_slice(c);
                let want: Vec<i32> = v.iter().map(|x| x << 8).collect();
                let mut got = [0i32; 16];
                // SAFETY: AVX2 checked above; 16 i32 buffers.
                unsafe {
                    let ctl = _mm256_loadu_si256(super::SHL8.as_ptr() as *const __m256i);
                    for h in 0..2 {
                        let x = _mm256_loadu_si256(v.as_ptr().add(8 * h) as *const __m256i);
                        _mm256_storeu_si256(got.as_mut_ptr().add(8 * h) as *mut __m256i, _mm256_shuffle_epi8(x, ctl));
                    }
                }
                assert_eq!(got.to_vec(), want, "256-bit shuffle of {v:?}");
                if is_x86_feature_detected!("avx512bw") {
                    // SAFETY: AVX-512 BW checked; 16 i32 buffers.
                    unsafe {
                        let x = _mm512_loadu_si512(v.as_ptr() as *const __m512i);
                        _mm512_storeu_si512(got.as_mut_ptr() as *mut __m512i, super::shl8_512(x));
                    }
                    assert_eq!(got.to_vec(), want, "512-bit shl8 of {v:?}");
                }
            }
        }
    }

    /// The vector operations of [`rows_kernel`] for one register width, under the same names.
    macro_rules! width {
        ($m:ident, $feat:literal, b = $b:literal, lanes = $lanes:literal, $vi:ty, $vf:ty, $half:ty,
         load = $load:ident, loadh = $loadh:ident, loadf = $loadf:ident, set1 = $set1:ident, set1f = $set1f:ident,
         and = $and:ident, srli = $srli:ident, slli32 = $slli32:ident, shl8 = $shl8:path, addi = $addi:ident, zero = $zero:ident, zerof = $zerof:ident,
         cvt = $cvt:ident, fma = $fma:ident, mul = $mul:ident, hsum = $hsum:path, perm = $perm:expr,
         unpacklo = $unpacklo:ident, unpackhi = $unpackhi:ident,
         widen16 = $widen16:ident, cvtph = $cvtph:ident, cast = $cast:ident, part = $part:ident) => {
            mod $m {
                use std::arch::x86_64::*;

                use crate::safetensors::DType;

                pub type I = $vi;
                pub type F = $vf;
                /// Weight bytes per block, i32 lanes per register, groups per chunk (f32 lanes).
                pub const B: usize = $b;
                pub const LANES: usize = $lanes;
                pub const CG: usize = $lanes;

                #[target_feature(enable = $feat)]
                #[inline]
                pub unsafe fn load(p: *const i8) -> I {
                    unsafe { $load(p as *const I) }
                }
                #[target_feature(enable = $feat)]
                #[inline]
                pub unsafe fn loadf(p: *const f32) -> F {
                    unsafe { $loadf(p) }
                }
                #[target_feature(enable = $feat)]
                #[inline]
                pub fn nibbles(v: I) -> (I, I) {
                    let m = $set1(15);
                    ($and(v, m), $and($srli::<4>(v), m))
                }
                /// Two consecutive blocks' weight bytes as the paired slots (module docs): per
                /// 16 bytes, 8 of `v0` then 8 of `v1`; the first 8 of each, then the second 8.
                #[target_feature(enable = $feat)]
                #[inline]
                pub fn pair(v0: I, v1: I) -> (I, I) {
                    ($unpacklo(v0, v1), $unpackhi(v0, v1))
                }
                /// Blocks `blk` and `blk + 1` of the row at `w` as the paired slots, each split
                /// into its (lo, hi) nibbles; both blocks' bytes PREFETCH on are fetched first.
                #[target_feature(enable = $feat)]
                #[inline]
                pub unsafe fn pair_nibbles(w: *const u8, blk: usize) -> [(I, I); 2] {
                    unsafe {
                        for s in 0..2 {
                            let at = w.wrapping_add((blk + s) * B + super::PREFETCH);
                            _mm_prefetch::<_MM_HINT_T0>(at as *const i8);
                        }
                        let (u0, u1) = pair(
                            load(w.add(blk * B) as *const i8),
                            load(w.add((blk + 1) * B) as *const i8),
                        );
                        [nibbles(u0), nibbles(u1)]
                    }
                }
                /// x's two slots of the pair at block `blk` (plane p of slot s at (s P + p) 2B):
                /// each plane's two halves.
                #[target_feature(enable = $feat)]
                #[inline]
                pub unsafe fn pair_x<const P: usize>(xq: *const i8, blk: usize) -> [[(I, I); P]; 2] {
                    unsafe {
                        let xb = xq.add(blk * 2 * B * P);
                        std::array::from_fn(|s| {
                            std::array::from_fn(|p| {
                                let o = (s * P + p) * 2 * B;
                                (load(xb.add(o)), load(xb.add(o + B)))
                            })
                        })
                    }
                }
                /// v << 8 per i32 lane (chaining the planes).
                #[target_feature(enable = $feat)]
                #[inline]
                pub fn shift(v: I) -> I {
                    const _: () = assert!(super::SHIFT == 8);
                    $shl8(v)
                }
                #[target_feature(enable = $feat)]
                #[inline]
                pub fn add(a: I, b: I) -> I {
                    $addi(a, b)
                }
                #[target_feature(enable = $feat)]
                #[inline]
                pub fn zero() -> I {
                    $zero()
                }
                #[target_feature(enable = $feat)]
                #[inline]
                pub fn zerof() -> F {
                    $zerof()
                }
                #[target_feature(enable = $feat)]
                #[inline]
                pub fn set1f(v: f32) -> F {
                    $set1f(v)
                }
                /// t + cvt(acc) * s
                #[target_feature(enable = $feat)]
                #[inline]
                pub fn fma_i(acc: I, s: F, t: F) -> F {
                    $fma($cvt(acc), s, t)
                }
                #[target_feature(enable = $feat)]
                #[inline]
                pub fn fma(a: F, b: F, t: F) -> F {
                    $fma(a, b, t)
                }
                #[target_feature(enable = $feat)]
                #[inline]
                pub fn mul(a: F, b: F) -> F {
                    $mul(a, b)
                }
                #[target_feature(enable = $feat)]
                #[inline]
                pub fn hsum(v: F) -> f32 {
                    $hsum(v)
                }
                /// Lane i of the result is `table[idx[i]]`.
                #[target_feature(enable = $feat)]
                #[inline]
                pub unsafe fn perm(idx: *const i32, table: F) -> F {
                    unsafe { ($perm)($load(idx as *const I), table) }
                }
                pub(super) use super::$part as groups_part;

                /// The `perm` index of each block j of a chunk: lane L covers elements 2Bj + 8L, and
                /// gets its group in the chunk.
                #[inline(always)]
                pub fn lane_groups(group: usize) -> [[i32; LANES]; 16] {
                    let mut idx = [[0i32; LANES]; 16];
                    for (j, v) in idx.iter_mut().enumerate().take(CG * group / (2 * B)) {
                        for (l, e) in v.iter_mut().enumerate() {
                            *e = ((2 * B * j + 8 * l) / group) as i32;
                        }
                    }
                    idx
                }

                /// The `perm` index of each pair q of blocks of a chunk (paired slots, module
                /// docs): lane L's first byte came from block 2q + (4L / 8 mod 2), byte 4L with
                /// bit 3 cleared, and the lane's bytes in both slots lie in that byte's group.
                #[inline(always)]
                pub fn pair_groups(group: usize) -> [[i32; LANES]; 8] {
                    let mut idx = [[0i32; LANES]; 8];
                    for (q, v) in idx.iter_mut().enumerate().take(CG * group / (4 * B)) {
                        for (l, e) in v.iter_mut().enumerate() {
                            let (blk, byte) = (2 * q + (4 * l >> 3 & 1), 4 * l & !8);
                            *e = ((2 * B * blk + 2 * byte) / group) as i32;
                        }
                    }
                    idx
                }

                /// Rows `rows` of `m` (`row_w` weight bytes, `row_s` scale bytes each): their
                /// weights, scales and biases. The scales and biases about as far ahead as the
                /// weights' prefetch are asked for.
                #[inline(always)]
                pub unsafe fn row_ptrs<const R: usize>(
                    m: &super::Rows,
                    rows: [usize; R],
                    (row_w, row_s): (usize, usize),
                ) -> [[*const u8; R]; 3] {
                    unsafe {
                        let ahead = (super::PREFETCH / row_w).max(1) * row_s;
                        let w: [*const u8; R] = std::array::from_fn(|i| m.w.as_ptr().add(rows[i] * row_w));
                        let sc: [*const u8; R] = std::array::from_fn(|i| m.scales.as_ptr().add(rows[i] * row_s));
                        let bi: [*const u8; R] = std::array::from_fn(|i| m.biases.as_ptr().add(rows[i] * row_s));
                        for i in 0..R {
                            for l in (0..row_s).step_by(64) {
                                _mm_prefetch::<_MM_HINT_T0>(sc[i].wrapping_add(ahead + l) as *const i8);
                                _mm_prefetch::<_MM_HINT_T0>(bi[i].wrapping_add(ahead + l) as *const i8);
                            }
                        }
                        [w, sc, bi]
                    }
                }

                /// A chunk's `ng` (<= `CG`) scales and biases of type `dt` at `sc` and `bi` as f32
                /// (zeros past `ng`).
                #[inline(always)]
                pub unsafe fn chunk(dt: DType, sc: *const u8, bi: *const u8, ng: usize) -> (F, F) {
                    unsafe {
                        if ng == CG {
                            (groups(dt, sc), groups(dt, bi))
                        } else {
                            (groups_part(dt, sc, ng), groups_part(dt, bi, ng))
                        }
                    }
                }

                /// `CG` scales (or biases) of type `dt` at `p` as f32.
                #[target_feature(enable = $feat)]
                #[inline]
                pub unsafe fn groups(dt: DType, p: *const u8) -> F {
                    unsafe {
                        match dt {
                            DType::BF16 => $cast($slli32::<16>($widen16($loadh(p as *const $half)))),
                            DType::F16 => $cvtph($loadh(p as *const $half)),
                            _ => $loadf(p as *const f32),
                        }
                    }
                }
            }
        };
    }

    /// The first `n` < 16 groups at `p` (a row of fewer than 16 groups): masked loads, zeros
    /// past `n`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    pub(super) unsafe fn groups_part512(dt: DType, p: *const u8, n: usize) -> __m512 {
        let k = (1u32 << n) as u16 - 1;
        unsafe {
            match dt {
                DType::BF16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                    _mm256_maskz_loadu_epi16(k, p as *const i16),
                ))),
                DType::F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p as *const i16)),
                _ => _mm512_maskz_loadu_ps(k, p as *const f32),
            }
        }
    }

    /// The first `n` < 8 groups at `p`: a zero-padded copy (AVX2 has no 16-bit masked load).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    pub(super) unsafe fn groups_part256(dt: DType, p: *const u8, n: usize) -> __m256 {
        let mut pad = [0u8; 32];
        unsafe {
            std::ptr::copy_nonoverlapping(p, pad.as_mut_ptr(), n * dt.size());
            w256::groups(dt, pad.as_ptr())
        }
    }

    width!(
        w512,
        "avx512f,avx512bw,avx512vl,avx2,fma,f16c",
        b = 64,
        lanes = 16,
        __m512i,
        __m512,
        __m256i,
        load = _mm512_loadu_si512,
        loadh = _mm256_loadu_si256,
        loadf = _mm512_loadu_ps,
        set1 = _mm512_set1_epi8,
        set1f = _mm512_set1_ps,
        and = _mm512_and_si512,
        srli = _mm512_srli_epi16,
        slli32 = _mm512_slli_epi32,
        shl8 = super::shl8_512,
        addi = _mm512_add_epi32,
        zero = _mm512_setzero_si512,
        zerof = _mm512_setzero_ps,
        cvt = _mm512_cvtepi32_ps,
        fma = _mm512_fmadd_ps,
        mul = _mm512_mul_ps,
        hsum = _mm512_reduce_add_ps,
        perm = |i, t| _mm512_permutexvar_ps(i, t),
        unpacklo = _mm512_unpacklo_epi64,
        unpackhi = _mm512_unpackhi_epi64,
        widen16 = _mm512_cvtepu16_epi32,
        cvtph = _mm512_cvtph_ps,
        cast = _mm512_castsi512_ps,
        part = groups_part512
    );
    width!(
        w256,
        "avx2,fma,f16c",
        b = 32,
        lanes = 8,
        __m256i,
        __m256,
        __m128i,
        load = _mm256_loadu_si256,
        loadh = _mm_loadu_si128,
        loadf = _mm256_loadu_ps,
        set1 = _mm256_set1_epi8,
        set1f = _mm256_set1_ps,
        and = _mm256_and_si256,
        srli = _mm256_srli_epi16,
        slli32 = _mm256_slli_epi32,
        shl8 = super::shl8_256,
        addi = _mm256_add_epi32,
        zero = _mm256_setzero_si256,
        zerof = _mm256_setzero_ps,
        cvt = _mm256_cvtepi32_ps,
        fma = _mm256_fmadd_ps,
        mul = _mm256_mul_ps,
        hsum = super::hsum256,
        perm = |i, t| _mm256_permutevar8x32_ps(t, i),
        unpacklo = _mm256_unpacklo_epi64,
        unpackhi = _mm256_unpackhi_epi64,
        widen16 = _mm256_cvtepu16_epi32,
        cvtph = _mm256_cvtph_ps,
        cast = _mm256_castsi256_ps,
        part = groups_part256
    );

    /// [`super::rows`] for one width and byte dot. Per row: for each chunk of `CG` groups, the
    /// scales times x's steps (one register: the chunk's lane-scale table) and one FMA of the
    /// biases with x's group sums; per block of B weight bytes (per pair of blocks at one plane:
    /// module docs), the planes' byte dots, and
    /// t += cvt(acc) * table[lane's group] (a permute by a per-call index table). One
    /// horizontal sum per row. Four rows at a time, one from each quarter of the run: x's plane
    /// loads (six of a block's eight loads) serve all four, and each quarter is still a plain
    /// forward stream for the hardware prefetcher. Measured on this VM: one core, 512 x 2048 in
    /// L2, 75 ns per row one at a time, 61 two at a time, 51 four, 54 eight; a whole decode step
    /// (lily synth, 4 layers) 36 tok/s one at a time, 31 with four adjacent rows (four streams
    /// in one page confuse the prefetcher), 46-48 with four quarters.
    macro_rules! rows_kernel {
        ($name:ident, $feat:literal, $w:ident, $dot2:ident) => {
            #[target_feature(enable = $feat)]
            pub unsafe fn $name<const P: usize>(m: &Rows, x: &Planes, out: &mut [f32]) {
                use $w::*;

                /// Rows `rows` of the run into `out[rows[i]]`.
                #[target_feature(enable = $feat)]
                #[inline]
                unsafe fn run<const R: usize, const P: usize>(
                    m: &Rows,
                    x: &Planes,
                    (idx, pidx): (&[[i32; LANES]; 16], &[[i32; LANES]; 8]),
                    rows: [usize; R],
                    out: &mut [f32],
                ) {
                    unsafe {
                        let (g_n, sz) = (m.cols / m.group, m.dtype.size());
                        let (row_w, row_s) = (m.cols / 2, g_n * sz);
                        let unit = set1f(1.0 / unit(P));
                        let xq = x.xq.as_ptr();
                        let [w, sc, bi] = row_ptrs(m, rows, (row_w, row_s));
                        let (mut t, mut table, mut blk) = ([zerof(); R], [zerof(); R], 0);
                        for g0 in (0..g_n).step_by(CG) {
                            let ng = CG.min(g_n - g0);
                            let step = mul(loadf(x.dx.as_ptr().add(g0)), unit);
                            let gsum = loadf(x.gsum.as_ptr().add(g0));
                            for i in 0..R {
                                let (s, b) = chunk(m.dtype, sc[i].add(g0 * sz), bi[i].add(g0 * sz), ng);
                                table[i] = mul(s, step);
                                t[i] = fma(b, gsum, t[i]);
                            }
                            // Blocks of this chunk, and pairs of them (one plane: module docs).
                            let nb = ng * m.group / (2 * B);
                            let np = if P == 1 { nb / 2 } else { 0 };
                            for ix in pidx.iter().take(np) {
                                let xp = pair_x::<P>(xq, blk);
                                for i in 0..R {
                                    let [(l0, h0), (l1, h1)] = pair_nibbles(w[i], blk);
                                    // The planes' dots side by side (short dependency chains), each
                                    // over both slots, then ((a0 << 8) + a1) << 8 + a2.
                                    let a: [I; P] = std::array::from_fn(|p| {
                                        let a = $dot2(zero(), l0, xp[0][p].0, h0, xp[0][p].1);
                                        $dot2(a, l1, xp[1][p].0, h1, xp[1][p].1)
                                    });
                                    let acc = a[1..].iter().fold(a[0], |acc, &ap| add(shift(acc), ap));
                                    t[i] = fma_i(acc, perm(ix.as_ptr(), table[i]), t[i]);
                                }
                                blk += 2;
                            }
                            // One block at a time: the row's odd last block, or every block
                            // (three planes).
                            for ix in &idx[2 * np..nb] {
                                let xb = xq.add(blk * 2 * B * P);
                                let xp: [(I, I); P] =
                                    std::array::from_fn(|p| (load(xb.add(p * 2 * B)), load(xb.add(p * 2 * B + B))));
                                for i in 0..R {
                                    _mm_prefetch::<_MM_HINT_T0>(w[i].wrapping_add(blk * B + PREFETCH) as *const i8);
                                    let (lo, hi) = nibbles(load(w[i].add(blk * B) as *const i8));
                                    let a: [I; P] = std::array::from_fn(|p| $dot2(zero(), lo, xp[p].0, hi, xp[p].1));
                                    let acc = a[1..].iter().fold(a[0], |acc, &ap| add(shift(acc), ap));
                                    t[i] = fma_i(acc, perm(ix.as_ptr(), table[i]), t[i]);
                                }
                                blk += 1;
                            }
                        }
                        for (&r, ti) in rows.iter().zip(t) {
                            out[r] = hsum(ti);
                        }
                    }
                }

                unsafe {
                    let (idx, pidx) = (lane_groups(m.group), pair_groups(m.group));
                    // Four sequential streams (one per quarter of the rows), so each stays a plain
                    // forward stream for the hardware prefetcher.
                    let q = out.len() / 4;
                    for k in 0..q {
                        run::<4, P>(m, x, (&idx, &pidx), [k, k + q, k + 2 * q, k + 3 * q], out);
                    }
                    for r in 4 * q..out.len() {
                        run::<1, P>(m, x, (&idx, &pidx), [r], out);
                    }
                }
            }
        };
    }

    /// [`super::rows_batch`] for one width and byte dot: [`rows_kernel`]'s loop with a token
    /// dimension. R rows (one from each R-th of the run, as there) times T <= `BATCH_TOKENS`
    /// tokens per pass: per chunk, each row's scales and biases are converted once and meet
    /// every token's steps and group sums (R x T lane-scale tables); per block (per pair of
    /// blocks at one plane, interleaved once for all tokens), each row's
    /// weight bytes are loaded and split into nibbles once, then dotted with every token's
    /// planes, the planes chained in the accumulator (acc = dot(acc << 8, next plane): the same
    /// i32 as the row kernel's sum of shifted plane dots). The f32 steps per (row, token) are the
    /// row kernel's, in its order, so the results are bit-identical to it. R = 1 on 256 bits
    /// (16 registers: 4 accumulators, a row's 2 nibble vectors, a token's up to 6 plane vectors;
    /// R = 2 spilled and measured no faster on this loaded VM), 4 on 512 (32 registers; the
    /// pairs' 16 nibble vectors leave a few f32 sums on the stack: ~7 spills per pass of 224
    /// instructions, off the dot port). Further tokens run in further
    /// passes over the same R rows (in L1 by then); a tail of fewer than R rows repeats its
    /// last row (the duplicate writes the same value).
    macro_rules! rows_batch_kernel {
        ($name:ident, $feat:literal, $w:ident, $dot2:ident) => {
            #[target_feature(enable = $feat)]
            pub unsafe fn $name<const P: usize>(m: &Rows, xs: &[Planes], n: usize, out: &mut [f32], stride: usize) {
                use $w::*;
                const R: usize = if LANES == 16 { 4 } else { 1 };

                #[target_feature(enable = $feat)]
                #[inline]
                unsafe fn run<const T: usize, const P: usize>(
                    m: &Rows,
                    xs: [&Planes; T],
                    (idx, pidx): (&[[i32; LANES]; 16], &[[i32; LANES]; 8]),
                    rows: [usize; R],
                    out: *mut f32,
                    stride: usize,
                ) {
                    unsafe {
                        let (g_n, sz) = (m.cols / m.group, m.dtype.size());
                        let (row_w, row_s) = (m.cols / 2, g_n * sz);
                        let unit = set1f(1.0 / unit(P));
                        let [w, sc, bi] = row_ptrs(m, rows, (row_w, row_s));
                        let xq: [*const i8; T] = std::array::from_fn(|j| xs[j].xq.as_ptr());
                        let (mut t, mut table) = ([[zerof(); T]; R], [[zerof(); T]; R]);
                        let mut blk = 0;
                        for g0 in (0..g_n).step_by(CG) {
                            let ng = CG.min(g_n - g0);
                            let step: [F; T] = std::array::from_fn(|j| mul(loadf(xs[j].dx.as_ptr().add(g0)), unit));
                            let gsum: [F; T] = std::array::from_fn(|j| loadf(xs[j].gsum.as_ptr().add(g0)));
                            for i in 0..R {
                                let (s, b) = chunk(m.dtype, sc[i].add(g0 * sz), bi[i].add(g0 * sz), ng);
                                for j in 0..T {
                                    table[i][j] = mul(s, step[j]);
                                    t[i][j] = fma(b, gsum[j], t[i][j]);
                                }
                            }
                            // Blocks of this chunk, and pairs of them (one plane: module docs).
                            let nb = ng * m.group / (2 * B);
                            let np = if P == 1 { nb / 2 } else { 0 };
                            for ix in pidx.iter().take(np) {
                                // Each row's pair of blocks, interleaved and split once for all tokens.
                                let wn: [[(I, I); 2]; R] = std::array::from_fn(|i| pair_nibbles(w[i], blk));
                                for j in 0..T {
                                    let xp = pair_x::<P>(xq[j], blk);
                                    for i in 0..R {
                                        let [(l0, h0), (l1, h1)] = wn[i];
                                        let mut acc = $dot2(zero(), l0, xp[0][0].0, h0, xp[0][0].1);
                                        acc = $dot2(acc, l1, xp[1][0].0, h1, xp[1][0].1);
                                        for p in 1..P {
                                            acc = $dot2(shift(acc), l0, xp[0][p].0, h0, xp[0][p].1);
                                            acc = $dot2(acc, l1, xp[1][p].0, h1, xp[1][p].1);
                                        }
                                        t[i][j] = fma_i(acc, perm(ix.as_ptr(), table[i][j]), t[i][j]);
                                    }
                                }
                                blk += 2;
                            }
                            // One block at a time: the row's odd last block, or every block
                            // (three planes).
                            for ix in &idx[2 * np..nb] {
                                let wn: [(I, I); R] = std::array::from_fn(|i| {
                                    _mm_prefetch::<_MM_HINT_T0>(w[i].wrapping_add(blk * B + PREFETCH) as *const i8);
                                    nibbles(load(w[i].add(blk * B) as *const i8))
                                });
                                for j in 0..T {
                                    let xb = xq[j].add(blk * 2 * B * P);
                                    let xp: [(I, I); P] =
                                        std::array::from_fn(|p| (load(xb.add(p * 2 * B)), load(xb.add(p * 2 * B + B))));
                                    for i in 0..R {
                                        let (lo, hi) = wn[i];
                                        let mut acc = $dot2(zero(), lo, xp[0].0, hi, xp[0].1);
                                        for &(xe, xo) in &xp[1..] {
                                            acc = $dot2(shift(acc), lo, xe, hi, xo);
                                        }
                                        t[i][j] = fma_i(acc, perm(ix.as_ptr(), table[i][j]), t[i][j]);
                                    }
                                }
                                blk += 1;
                            }
                        }
                        for i in 0..R {
                            for j in 0..T {
                                *out.add(j * stride + rows[i]) = hsum(t[i][j]);
                            }
                        }
                    }
                }

                unsafe {
                    let (idx, pidx) = (lane_groups(m.group), pair_groups(m.group));
                    let o = out.as_mut_ptr();
                    let q = n / R;
                    let tail = n - R * q;
                    for k in 0..q + (tail > 0) as usize {
                        let rows: [usize; R] = if k < q {
                            std::array::from_fn(|i| k + i * q)
                        } else {
                            std::array::from_fn(|i| R * q + i.min(tail - 1))
                        };
                        for t0 in (0..xs.len()).step_by(BATCH_TOKENS) {
                            let x = &xs[t0..];
                            let o = o.add(t0 * stride);
                            match x.len() {
                                1 => run::<1, P>(m, [&x[0]], (&idx, &pidx), rows, o, stride),
                                2 => run::<2, P>(m, [&x[0], &x[1]], (&idx, &pidx), rows, o, stride),
                                3 => run::<3, P>(m, [&x[0], &x[1], &x[2]], (&idx, &pidx), rows, o, stride),
                                _ => run::<4, P>(m, [&x[0], &x[1], &x[2], &x[3]], (&idx, &pidx), rows, o, stride),
                            }
                        }
                    }
                }
            }
        };
    }

    /// The fused kernels of one byte dot (`$dot2`, at the width `$w`): `$m::rows` and
    /// `$m::rows_batch`.
    macro_rules! dot_kernels {
        ($m:ident, $feat:literal, $w:ident, $dot2:ident) => {
            pub mod $m {
                use super::*;

                rows_kernel!(rows, $feat, $w, $dot2);
                rows_batch_kernel!(rows_batch, $feat, $w, $dot2);
            }
        };
    }

    dot_kernels! { vnni512, "avx512f,avx512bw,avx512vl,avx2,fma,f16c,avx512vnni", w512, vnni512_2 }
    dot_kernels! { maddubs512, "avx512f,avx512bw,avx512vl,avx2,fma,f16c", w512, maddubs512_2 }
    dot_kernels! { vnni256, "avx2,fma,f16c,avx512f,avx512vl,avx512vnni", w256, vnni256_2 }
    dot_kernels! { avxvnni256, "avx2,fma,f16c,avxvnni", w256, avxvnni256_2 }
    dot_kernels! { maddubs256, "avx2,fma,f16c", w256, maddubs256_2 }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    //! The arm64 kernel, B = 16: per block one 16-byte load, nibbles by `and` / `ushr`, per
    //! plane two `sdot`s (the codes 0..15 are valid signed bytes), convert, FMA with the 4 lane
    //! scales. `sdot` is written as inline assembly because its intrinsic is not stable Rust yet.
    use std::arch::{aarch64::*, asm};

    use super::{unit, Planes, Rows, BATCH_TOKENS, SHIFT};
    use crate::quant::read_scalar;

    /// Weight bytes ahead of the current read to prefetch (as the x86 kernels).
    const PREFETCH: usize = 2048;

    #[target_feature(enable = "neon,dotprod")]
    #[inline]
    unsafe fn sdot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
        let mut acc = acc;
        // SAFETY: register-only instruction; the caller enabled `dotprod`.
        unsafe {
            asm!("sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b", acc = inout(vreg) acc, a = in(vreg) a, b = in(vreg) b,
                 options(pure, nomem, nostack));
        }
        acc
    }

    #[target_feature(enable = "neon,dotprod")]
    pub unsafe fn sdot16(planes: usize, w: *const u8, xq: *const i8, cl: *const f32, blocks: usize) -> f32 {
        unsafe {
            let m = vdupq_n_u8(15);
            let mut t = vdupq_n_f32(0.0);
            for i in 0..blocks {
                let v = vld1q_u8(w.add(i * 16));
                let lo = vreinterpretq_s8_u8(vandq_u8(v, m));
                let hi = vreinterpretq_s8_u8(vshrq_n_u8::<4>(v));
                let x = xq.add(i * 32 * planes);
                let mut acc = vdupq_n_s32(0);
                for p in 0..planes {
                    if p > 0 {
                        acc = vshlq_n_s32::<SHIFT>(acc);
                    }
                    acc = sdot(sdot(acc, lo, vld1q_s8(x.add(p * 32))), hi, vld1q_s8(x.add(p * 32 + 16)));
                }
                t = vfmaq_f32(t, vcvtq_f32_s32(acc), vld1q_f32(cl.add(i * 4)));
            }
            vaddvq_f32(t) / unit(planes)
        }
    }

    /// [`super::rows`] on arm64, the shape of the x86 fused kernels: four rows at a time, one from
    /// each quarter of the run (each a plain forward stream for the prefetcher), x's plane loads
    /// (six per 32-weight block) shared by the four. Groups are whole blocks (32 | group), so a
    /// block's lane scale is one scalar per row and group, s_g d_g / unit(P), applied by one
    /// `fmla` by element; the biases meet x's group sums in a scalar FMA per group.
    /// Per block and row: 1 load, `and` + `ushr`, 6 `sdot`, 2 `shl`, `scvtf`, `fmla` (12 + 1.5
    /// shared loads), where [`sdot16`] after the lane-table fill of [`super::rows_portable`] spends
    /// ~23 (its own 6 plane loads, a table load and ~4 table stores per block).
    #[target_feature(enable = "neon,dotprod")]
    pub unsafe fn rows_sdot<const P: usize>(m: &Rows, x: &Planes, out: &mut [f32]) {
        let q = out.len() / 4;
        unsafe {
            for k in 0..q {
                run::<4, P>(m, x, [k, k + q, k + 2 * q, k + 3 * q], out);
            }
            for r in 4 * q..out.len() {
                run::<1, P>(m, x, [r], out);
            }
        }
    }

    #[target_feature(enable = "neon,dotprod")]
    #[inline]
    unsafe fn run<const R: usize, const P: usize>(m: &Rows, x: &Planes, rows: [usize; R], out: &mut [f32]) {
        let (g_n, bpg) = (m.cols / m.group, m.group / 32);
        unsafe {
            let mask = vdupq_n_u8(15);
            let (w, sc, bi) = row_parts(m, rows);
            let (mut t, mut bias) = ([vdupq_n_f32(0.0); R], [0f32; R]);
            for g in 0..g_n {
                let step = x.dx[g] / unit(P);
                let ls: [f32; R] = std::array::from_fn(|i| read_scalar(m.dtype, sc[i], g) * step);
                for i in 0..R {
                    bias[i] = read_scalar(m.dtype, bi[i], g).mul_add(x.gsum[g], bias[i]);
                }
                for blk in g * bpg..(g + 1) * bpg {
                    let xb = x.xq.as_ptr().add(blk * 32 * P);
                    let xp: [(int8x16_t, int8x16_t); P] =
                        std::array::from_fn(|p| (vld1q_s8(xb.add(p * 32)), vld1q_s8(xb.add(p * 32 + 16))));
                    for i in 0..R {
                        let (lo, hi) = nibbles(w[i], blk, mask);
                        let mut acc = vdupq_n_s32(0);
                        for (p, &(xl, xh)) in xp.iter().enumerate() {
                            if p > 0 {
                                acc = vshlq_n_s32::<SHIFT>(acc);
                            }
                            acc = sdot(sdot(acc, lo, xl), hi, xh);
                        }
                        t[i] = vfmaq_n_f32(t[i], vcvtq_f32_s32(acc), ls[i]);
                    }
                }
            }
            for i in 0..R {
                out[rows[i]] = vaddvq_f32(t[i]) + bias[i];
            }
        }
    }

    /// Rows `rows` of the run: their packed weights (`cols / 2` bytes each), scales and biases.
    /// Unsafe: the rows must be inside the run (the weights' pointers are not checked).
    #[inline(always)]
    unsafe fn row_parts<'a, const R: usize>(
        m: &Rows<'a>,
        rows: [usize; R],
    ) -> ([*const u8; R], [&'a [u8]; R], [&'a [u8]; R]) {
        let row_s = m.cols / m.group * m.dtype.size();
        (
            // SAFETY: the caller's rows are inside the run.
            std::array::from_fn(|i| unsafe { m.w.as_ptr().add(rows[i] * (m.cols / 2)) }),
            std::array::from_fn(|i| &m.scales[rows[i] * row_s..][..row_s]),
            std::array::from_fn(|i| &m.biases[rows[i] * row_s..][..row_s]),
        )
    }

    /// Block `blk` (16 bytes, 32 weights) of the packed row at `w` as its low and high nibbles
    /// (`mask` = 15 in every byte), the line [`PREFETCH`] bytes ahead prefetched.
    #[inline(always)]
    unsafe fn nibbles(w: *const u8, blk: usize, mask: uint8x16_t) -> (int8x16_t, int8x16_t) {
        let at = w.wrapping_add(blk * 16 + PREFETCH);
        unsafe {
            // SAFETY: a prefetch never faults; the caller keeps the block inside the row.
            asm!("prfm pldl1keep, [{p}]", p = in(reg) at, options(nostack, readonly, preserves_flags));
            let v = vld1q_u8(w.add(blk * 16));
            (
                vreinterpretq_s8_u8(vandq_u8(v, mask)),
                vreinterpretq_s8_u8(vshrq_n_u8::<4>(v)),
            )
        }
    }

    /// [`super::rows_batch`] on arm64: [`run`]'s loop with a token dimension, R = 4 rows (one
    /// from each quarter of the run, as [`rows_sdot`]) times T <= `BATCH_TOKENS` tokens per pass.
    /// Per group, each row's scale is read once and meets every token's step (one vector per
    /// row: lane j is token j's lane scale, applied by `fmla` by element); per block, each row's
    /// 16 weight bytes are loaded and split into nibbles once, then dotted with every token's
    /// planes (x's six plane loads per token shared by the four rows). Registers (32 q): 16
    /// accumulators, 8 nibble vectors, 4 scale vectors, a token's 6 plane vectors (a few spill
    /// at T = 4). Per block and row, T tokens: 1 load, `and` + `ushr`, then per token 6 `sdot`,
    /// 2 `shl`, `scvtf`, `fmla` (+ 1.5 shared plane loads), where [`rows_sdot`] per token
    /// repeats the load and the nibble split. Each (row, token) takes [`run`]'s integer lane
    /// sums and f32 steps in its order, so the results are bit-identical to [`rows_sdot`].
    /// Further tokens run in further passes over the same rows (in L1 by then); a tail of fewer
    /// than 4 rows runs one row at a time, as [`rows_sdot`].
    #[target_feature(enable = "neon,dotprod")]
    pub unsafe fn rows_batch_sdot<const P: usize>(m: &Rows, xs: &[Planes], n: usize, out: &mut [f32], stride: usize) {
        let q = n / 4;
        let o = out.as_mut_ptr();
        unsafe {
            for k in 0..q + (n - 4 * q) {
                for t0 in (0..xs.len()).step_by(BATCH_TOKENS) {
                    let (x, o) = (&xs[t0..], o.add(t0 * stride));
                    if k < q {
                        let rows = [k, k + q, k + 2 * q, k + 3 * q];
                        match x.len() {
                            1 => run_batch::<4, 1, P>(m, [&x[0]], rows, o, stride),
                            2 => run_batch::<4, 2, P>(m, [&x[0], &x[1]], rows, o, stride),
                            3 => run_batch::<4, 3, P>(m, [&x[0], &x[1], &x[2]], rows, o, stride),
                            _ => run_batch::<4, 4, P>(m, [&x[0], &x[1], &x[2], &x[3]], rows, o, stride),
                        }
                    } else {
                        let rows = [3 * q + k];
                        match x.len() {
                            1 => run_batch::<1, 1, P>(m, [&x[0]], rows, o, stride),
                            2 => run_batch::<1, 2, P>(m, [&x[0], &x[1]], rows, o, stride),
                            3 => run_batch::<1, 3, P>(m, [&x[0], &x[1], &x[2]], rows, o, stride),
                            _ => run_batch::<1, 4, P>(m, [&x[0], &x[1], &x[2], &x[3]], rows, o, stride),
                        }
                    }
                }
            }
        }
    }

    /// Rows `rows` times tokens `xs` into `out[j * stride + rows[i]]` ([`rows_batch_sdot`]).
    #[target_feature(enable = "neon,dotprod")]
    #[inline]
    unsafe fn run_batch<const R: usize, const T: usize, const P: usize>(
        m: &Rows,
        xs: [&Planes; T],
        rows: [usize; R],
        out: *mut f32,
        stride: usize,
    ) {
        const { assert!(T <= BATCH_TOKENS && BATCH_TOKENS == 4) };
        let (g_n, bpg) = (m.cols / m.group, m.group / 32);
        unsafe {
            let mask = vdupq_n_u8(15);
            let (w, sc, bi) = row_parts(m, rows);
            let (mut t, mut bias) = ([[vdupq_n_f32(0.0); T]; R], [[0f32; T]; R]);
            for g in 0..g_n {
                // [`run`]'s lane scale and bias term per (row, token), in its order.
                let step: [f32; T] = std::array::from_fn(|j| xs[j].dx[g] / unit(P));
                let ls: [float32x4_t; R] = std::array::from_fn(|i| {
                    let s = read_scalar(m.dtype, sc[i], g);
                    let l: [f32; 4] = std::array::from_fn(|j| if j < T { s * step[j] } else { 0.0 });
                    vld1q_f32(l.as_ptr())
                });
                for i in 0..R {
                    let b = read_scalar(m.dtype, bi[i], g);
                    for j in 0..T {
                        bias[i][j] = b.mul_add(xs[j].gsum[g], bias[i][j]);
                    }
                }
                for blk in g * bpg..(g + 1) * bpg {
                    let wn: [(int8x16_t, int8x16_t); R] = std::array::from_fn(|i| nibbles(w[i], blk, mask));
                    // The token loop written out (J a constant in each copy), so `t` stays in
                    // registers and the lane of `ls` is an immediate (a loop LLVM left rolled at
                    // T = 3, 4 kept `t` on the stack and branched on the lane).
                    macro_rules! token {
                        ($j:literal) => {
                            if $j < T {
                                let xb = xs[$j].xq.as_ptr().add(blk * 32 * P);
                                let xp: [(int8x16_t, int8x16_t); P] =
                                    std::array::from_fn(|p| (vld1q_s8(xb.add(p * 32)), vld1q_s8(xb.add(p * 32 + 16))));
                                for i in 0..R {
                                    let (lo, hi) = wn[i];
                                    let mut acc = vdupq_n_s32(0);
                                    for (p, &(xl, xh)) in xp.iter().enumerate() {
                                        if p > 0 {
                                            acc = vshlq_n_s32::<SHIFT>(acc);
                                        }
                                        acc = sdot(sdot(acc, lo, xl), hi, xh);
                                    }
                                    t[i][$j] = vfmaq_laneq_f32::<$j>(t[i][$j], vcvtq_f32_s32(acc), ls[i]);
                                }
                            }
                        };
                    }
                    token!(0);
                    token!(1);
                    token!(2);
                    token!(3);
                }
            }
            for i in 0..R {
                for j in 0..T {
                    *out.add(j * stride + rows[i]) = vaddvq_f32(t[i][j]) + bias[i][j];
                }
            }
        }
    }
}
