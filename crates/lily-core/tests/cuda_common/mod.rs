//! The CUDA kernel tests, shared by the simulator (`tests/cuda_sim.rs`) and the real GPU
//! (`tests/cuda_device.rs`): each kernel against its plain-loop twin `Cpu::reference()` on shapes
//! with partial tiles, warps and groups; the tiny checkpoint end to end against the reference
//! backend. Each test is a function of the backend under test and a tolerance factor (1 for the
//! simulator; the GPU's reduction order gets a little more room); `cuda_tests!` turns the list
//! into `#[test]`s.

#![allow(dead_code)] // each test binary uses the subset it needs

// A test crate that uses this module declares `mod common; mod metal_common;` too.
use crate::common::{assert_close, filled_cache, matrix, rand_vec, run_attention};
pub use crate::metal_common::TinyCheckpoint;

use lily_core::{
    backend::{
        cpu::Cpu,
        cuda::{Cuda, Executor},
        params::*,
        Backend, KvDtype,
    },
    quant::{Format, Matrix},
    safetensors::DType,
};

#[macro_export]
macro_rules! cuda_tests {
    ($dev:expr, $tolx:expr; $($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                if let Some(mut c) = $dev() {
                    cuda_common::$name(&mut c, $tolx);
                }
            }
        )*
    };
}

/// Every shared test, for `cuda_tests!`.
#[macro_export]
macro_rules! all_cuda_tests {
    ($dev:expr, $tolx:expr) => {
        $crate::cuda_tests!($dev, $tolx;
            rms_norm_matches_cpu,
            add_rms_norm_matches_cpu,
            elementwise_matches_cpu,
            copy_rows_moves_rows_in_the_stream,
            kv_copy_matches_cpu,
            argmax_matches_cpu,
            matmul_gemv_matches_cpu,
            matmul_mma_matches_cpu,
            matmuls_match_cpu,
            embed_matches_cpu,
            qk_norm_rope_matches_cpu,
            qk_norm_rope_store_matches_cpu,
            kv_store_matches_cpu,
            attention_matches_cpu,
            delta_net_conv_matches_cpu,
            delta_net_matches_cpu,
            moe_route_matches_cpu,
            moe_experts_matches_cpu,
            moe_experts_sorted_matches_cpu,
            forward_f32_matches_cpu,
            forward_matches_cpu_at_bf16_tolerance,
            unsupported_shape_is_an_error_not_a_panic,
        );
    };
}

const TOL: f32 = 2e-5;

fn read_all<B: Backend>(b: &B, buf: &B::Buf, n: usize) -> Vec<f32> {
    let mut v = vec![0f32; n];
    b.read(buf, 0, &mut v).unwrap();
    v
}

fn read_ids<X: Executor>(c: &Cuda<X>, b: &<Cuda<X> as Backend>::Ids, n: usize) -> Vec<u32> {
    read_all(c, b, n).iter().map(|x| x.to_bits()).collect()
}

fn ids_buf<B: Backend>(b: &B, ids: &[u32]) -> B::Ids {
    let mut buf = b.alloc_ids(ids.len()).unwrap();
    b.write_ids(&mut buf, ids).unwrap();
    buf
}

/// Run `$body` with `$b` bound to the CPU reference and then to the CUDA backend `$dev`;
/// compare every returned vector.
macro_rules! both {
    ($dev:expr, $tol:expr, $what:expr, $b:ident => $body:expr) => {{
        let want: Vec<Vec<f32>> = {
            let $b = &Cpu::reference();
            $body
        };
        let got: Vec<Vec<f32>> = {
            let $b = &*$dev;
            $body
        };
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_close(g, w, $tol, &format!("{} output {i}", $what));
        }
    }};
}

pub fn rms_norm_matches_cpu<X: Executor>(dev: &mut Cuda<X>, tolx: f32) {
    for (rows, dim) in [(3, 100), (2, 300), (4, 16), (1, 2048), (2, 2050)] {
        let x = rand_vec(rows * dim, 1, -2.0, 2.0);
        let z = rand_vec(rows * dim, 4, -3.0, 3.0);
        let w = rand_vec(dim, 2, 0.5, 1.5);
        let p = RmsNormParams {
            rows: rows as u32,
            dim: dim as u32,
            eps: 1e-6,
        };
        both!(dev, tolx * TOL, format!("rms_norm(_gated) {rows}x{dim}"), b => {
            let (xb, zb, wb) = (b.upload(&x).unwrap(), b.upload(&z).unwrap(), b.upload(&w).unwrap());
            let (mut out, mut gated) = (b.alloc(rows * dim).unwrap(), b.alloc(rows * dim).unwrap());
            b.begin(lily_core::backend::StreamKind::Other).unwrap();
            b.rms_norm(&p, &xb, &wb, &mut out);
            b.rms_norm_gated(&p, &xb, &zb, &wb, &mut gated);
            b.finish().unwrap();
            vec![read_all(b, &out, rows * dim), read_all(b, &gated, rows * dim)]
        });
    }
}

/// The fused residual add + norm kernels against the reference's unfused add, sigmoid_gate_add
/// and rms_norm: both outputs (the new residual x and the norm), at widths below, at and above
/// one block's 256 threads.
pub fn add_rms_norm_matches_cpu<X: Executor>(dev: &mut Cuda<X>, tolx: f32) {
    for (rows, dim) in [(3, 100), (2, 300), (1, 2048), (2, 2049)] {
        let n = rows * dim;
        let x = rand_vec(n, 11, -2.0, 2.0);
        let y = rand_vec(n, 12, -2.0, 2.0);
        let shared = rand_vec(n, 13, -2.0, 2.0);
        let gate = rand_vec(rows, 14, -4.0, 4.0);
        let w = rand_vec(dim, 15, 0.5, 1.5);
        let p = RmsNormParams {
            rows: rows as u32,
            dim: dim as u32,
            eps: 1e-6,
        };
        both!(dev, tolx * TOL, format!("add_rms_norm {rows}x{dim}"), b => {
            let (yb, sb, gb, wb) = (
                b.upload(&y).unwrap(),
                b.upload(&shared).unwrap(),
                b.upload(&gate).unwrap(),
                b.upload(&w).unwrap(),
            );
            let (mut x1, mut x2) = (b.upload(&x).unwrap(), b.upload(&x).unwrap());
            let (mut out1, mut out2) = (b.alloc(n).unwrap(), b.alloc(n).unwrap());
            b.begin(lily_core::backend::StreamKind::Other).unwrap();
            b.add_rms_norm(&p, &mut x1, &yb, &wb, &mut out1);
            b.add_gated_rms_norm(&p, &mut x2, &yb, &sb, &gb, &wb, &mut out2);
            b.finish().unwrap();
            vec![
                read_all(b, &x1, n),
                read_all(b, &out1, n),
                read_all(b, &x2, n),
                read_all(b, &out2, n),
            ]
        });
    }
}

pub fn elementwise_matches_cpu<X: Executor>(dev: &mut Cuda<X>, tolx: f32) {
    let (t, d) = (3, 300);
    let x = rand_vec(t * d, 6, -1.0, 1.0);
    let y = rand_vec(t * d, 7, -1.0, 1.0);
    let g = rand_vec(t, 8, -2.0, 2.0);
    let p = RowsParams {
        tokens: t as u32,
        dim: d as u32,
    };
    both!(dev, tolx * TOL, "add/swiglu/sigmoid_gate_add", b => {
        let (mut xb, yb, gb) = (b.upload(&x).unwrap(), b.upload(&y).unwrap(), b.upload(&g).unwrap());
        let mut s = b.alloc(t * d).unwrap();
        b.swiglu(&p, &xb, &yb, &mut s);
        b.add(&p, &mut xb, &yb);
        b.sigmoid_gate_add(&p, &yb, &gb, &mut xb);
        b.finish().unwrap();
        vec![read_all(b, &s, t * d), read_all(b, &xb, t * d)]
    });
}

/// `argmax` on the device against the host's: random rows, ties (the lowest index wins), the
/// maximum in the last element, a NaN (never wins), a prefix of the buffer.
pub fn argmax_matches_cpu<X: Executor>(dev: &mut Cuda<X>, tolx: f32) {
    let _ = tolx;
    let mut cases: Vec<(Vec<f32>, usize)> = vec![
        (rand_vec(248_320, 7, -8.0, 8.0), 248_320),
        (rand_vec(5000, 8, -1.0, 1.0), 3000),
    ];
    let mut tie = rand_vec(3000, 9, -1.0, 1.0);
    tie[100] = 5.0;
    tie[2900] = 5.0;
    tie[50] = f32::NAN;
    cases.push((tie, 3000));
    let mut last = vec![0.0f32; 1025];
    last[1024] = 1.0;
    cases.push((last, 1025));
    for (v, n) in cases {
        let want = Cpu::reference().argmax(&v, n).unwrap();
        let b = dev.upload(&v).unwrap();
        assert_eq!(dev.argmax(&b, n).unwrap(), want, "argmax of {n}");
    }
}

fn run_matmul<B: Backend>(b: &B, m: &Matrix, tokens: usize, x_row0: usize, x: &[f32]) -> Vec<f32> {
    let w = b.upload_matrix(m).unwrap();
    let xb = b.upload(x).unwrap();
    let mut out = b.alloc(tokens * m.rows).unwrap();
    let p = MatmulParams {
        tokens: tokens as u32,
        x_row0: x_row0 as u32,
    };
    b.matmul(&p, &w, &xb, &mut out);
    b.finish().unwrap();
    read_all(b, &out, tokens * m.rows)
}

/// Every weight format (dense, and 2/4/8-bit with bf16/f16/f32 scales and groups of 32 to 128),
/// as a view (rows 3.. of the stored matrix): 16-byte rows and, for the dense formats, rows of
/// 70 columns (not 16-byte aligned: the element path and a K tail).
fn matmul_cases() -> Vec<(Matrix, usize)> {
    let mut cases = Vec::new();
    for (format, cols) in [
        (Format::F32, 70),
        (Format::F16, 70),
        (Format::BF16, 72),
        (Format::BF16, 256),
    ] {
        cases.push((format, DType::F32, cols));
    }
    for bits in [2, 4, 8] {
        for (sd, group) in [(DType::BF16, 64), (DType::F16, 32), (DType::F32, 128)] {
            cases.push((Format::Affine { bits, group }, sd, 256));
        }
    }
    cases
        .into_iter()
        .enumerate()
        .map(|(i, (format, sd, cols))| {
            let mut m = matrix(1, 71, cols, format, sd, 10 + i as u64);
            m.rows = 67; // a view: rows 3..70 (partial warps of 4 rows, a partial tile of 64)
            m.row_offset = 3;
            (m, cols)
        })
        .collect()
}

/// The decode GEMV (T <= 8): f32 throughout, 2e-5 of the reference. Besides matmul_cases, two
/// rows wider than one x staging pass of the kernel (8192 floats: a second, partial pass).
pub fn matmul_gemv_matches_cpu<X: Executor>(dev: &mut Cuda<X>, tolx: f32) {
    let mut cases = matmul_cases();
    for (i, (format, cols)) in [(Format::F32, 8200), (Format::Affine { bits: 4, group: 64 }, 8256)]
        .into_iter()
        .enumerate()
    {
        cases.push((matrix(1, 9, cols, format, DType::BF16, 40 + i as u64), cols));
    }
    for (i, (m, cols)) in cases.into_iter().enumerate() {
        for (tokens, x_row0) in [(1, 2), (5, 0)] {
            let x = rand_vec((tokens + x_row0) * cols, 20 + i as u64, -1.0, 1.0);
            let want = run_matmul(&Cpu::reference(), &m, tokens, x_row0, &x);
            let got = run_matmul(&*dev, &m, tokens, x_row0, &x);
            assert_close(
                &got,
                &want,
                tolx * TOL,
                &format!("matmul_gemv {:?} T={tokens}", m.format),
            );
        }
    }
}

/// The prefill GEMM on tensor cores (bf16 inputs, f32 accumulation): within 1e-2 of the largest
/// output (bf16 keeps 8 bits; a wrong fragment index is off by the order of the outputs).
pub fn matmul_mma_matches_cpu<X: Executor>(dev: &mut Cuda<X>, tolx: f32) {
    for (i, (m, cols)) in matmul_cases().into_iter().enumerate() {
        // 11: one partial token tile; 70: two token tiles, the second partial.
        for (tokens, x_row0) in [(11, 1), (70, 2)] {
            let x = rand_vec((tokens + x_row0) * cols, 30 + i as u64, -1.0, 1.0);
            let want = run_matmul(&Cpu::reference(), &m, tokens, x_row0, &x);
            let got = run_matmul(&*dev, &m, tokens, x_row0, &x);
            assert_close(
                &got,
                &want,
                tolx * 1e-2,
                &format!("matmul_mma {:?} T={tokens}", m.format),
            );
        }
    }
}

/// Several matrices reading one x (`matmuls`): runs of one format and K share a launch (up to 4,
/// then a new one), a different format or K starts another; every output as the reference's.
pub fn matmuls_match_cpu<X: Executor>(dev: &mut Cuda<X>, tolx: f32) {
    let q4 = Format::Affine { bits: 4, group: 64 };
    let q8 = Format::Affine { bits: 8, group: 64 };
    let specs = [
        (q4, 70),
        (q4, 33),
        (q8, 40),
        (q4, 5),
        (q4, 64),
        (q4, 1),
        (q4, 9),
        (q4, 130),
        (Format::BF16, 20),
        // Grouped with the q8 matrix 8 places before it (one launch, as the MoE block's router and
        // shared-expert gate): groups {0, 1, 3, 4}, {2, 9}, {5, 6, 7}, {8}.
        (q8, 17),
    ];
    let mats: Vec<Matrix> = specs
        .iter()
        .enumerate()
        .map(|(i, &(f, rows))| matrix(1, rows, 256, f, DType::BF16, 200 + i as u64))
        .collect();
    for tokens in [1usize, 3] {
        let x = rand_vec((tokens + 1) * 256, 210, -1.0, 1.0);
        let p = MatmulParams {
            tokens: tokens as u32,
            x_row0: 1,
        };
        both!(dev, tolx * TOL, format!("matmuls T={tokens}"), b => {
            let ws: Vec<_> = mats.iter().map(|m| b.upload_matrix(m).unwrap()).collect();
            let xb = b.upload(&x).unwrap();
            let mut outs: Vec<_> = mats.iter().map(|m| b.alloc(tokens * m.rows).unwrap()).collect();
            {
                let refs: Vec<_> = ws.iter().collect();
                let mut out_refs: Vec<_> = outs.iter_mut().collect();
                b.matmuls(&p, &xb, &refs, &mut out_refs);
            }
            b.finish().unwrap();
            outs.iter().zip(&mats).map(|(o, m)| read_all(b, o, tokens * m.rows)).collect::<Vec<_>>()
        });
    }
}

pub fn embed_matches_cpu<X: Executor>(dev: &mut Cuda<X>, tolx: f32) {
    for (format, sd, d) in [
        (Format::BF16, DType::F32, 72),
        (Format::F16, DType::F32, 300),
        (Format::Affine { bits: 4, group: 64 }, DType::BF16, 128),
    ] {
        let m = matrix(1, 50, d, format, sd, 30);
        let ids = [7u32, 0, 49, 7, 13];
        both!(dev, tolx * TOL, format!("embed {format:?}"), b => {
            let table = b.upload_matrix(&m).unwrap();
            let ib = ids_buf(b, &ids);
            let mut out = b.alloc(ids.len() * d).unwrap();
            b.embed(ids.len(), &table, &ib, &mut out);
            b.finish().unwrap();
            vec![read_all(b, &out, ids.len() * d)]
        });
    }
}

pub fn qk_norm_rope_matches_cpu<X: Executor>(dev: &mut Cuda<X>, tolx: f32) {
    // Small theta makes rotation errors loud; the second case has the real head shapes.
    for (t, pos0, h, kv, hd, rot, theta) in [(3, 5, 4, 2, 64, 16, 100.0), (2, 40, 16, 2, 256, 64, 1e7)] {
        let p = RopeParams {
            tokens: t,
            pos0,
            heads: h,
            kv_heads: kv,
            head_dim: hd,
            rotary_dim: rot,
            eps: 1e-6,
            theta,
        };
        let (t, h, kv, hd) = (t as usize, h as usize, kv as usize, hd as usize);
        let qg = rand_vec(t * h * 2 * hd, 40, -2.0, 2.0);
        let k = rand_vec(t * kv * hd, 41, -2.0, 2.0);
        let (qn, kn) = (rand_vec(hd, 42, 0.5, 1.5), rand_vec(hd, 43, 0.5, 1.5));
        both!(dev, tolx * 1e-4, format!("qk_norm_rope hd={hd}"), b => {
            let (qnb, knb) = (b.upload(&qn).unwrap(), b.upload(&kn).unwrap());
            let (mut qb, mut kb) = (b.upload(&qg).unwrap(), b.upload(&k).unwrap());
            b.qk_norm_rope(&p, &qnb, &knb, &mut qb, &mut kb);
            b.finish().unwrap();
            vec![read_all(b, &qb, qg.len()), read_all(b, &kb, k.len())]
        });
    }
}

/// The fused norm + RoPE + cache append against the reference's three ops: q in place, the
/// cache rows written (k normed and roped, v as given), in every cache dtype, a chunk that
/// crosses segment boundaries (rows 6..11 in segments of 4) and a single decode row.
pub fn qk_norm_rope_store_matches_cpu<X: Executor>(dev: &mut Cuda<X>, tolx: f32) {
    for (t, pos0, h, kv, hd, rot, dtype) in [
        (5, 6, 4, 2, 64, 16, KvDtype::BF16),
        (5, 6, 4, 2, 64, 16, KvDtype::F16),
        (1, 9, 16, 2, 256, 64, KvDtype::F32),
    ] {
        let p = RopeParams {
            tokens: t,
            pos0,
            heads: h,
            kv_heads: kv,
            head_dim: hd,
            rotary_dim: rot,
            eps: 1e-6,
            theta: 100.0,
        };
        let (t, h, w, hd) = (t as usize, h as usize, (kv * hd) as usize, hd as usize);
        let rows = pos0 as usize + t;
        let qg = rand_vec(t * h * 2 * hd, 44, -2.0, 2.0);
        let (k, v) = (rand_vec(t * w, 45, -2.0, 2.0), rand_vec(t * w, 46, -2.0, 2.0));
        let (qn, kn) = (rand_vec(hd, 47, 0.5, 1.5), rand_vec(hd, 48, 0.5, 1.5));
        // 16-bit caches round: a rounding step of the stored value is the tolerance there.
        let tol = if dtype == KvDtype::F32 { tolx * 1e-4 } else { 1e-2 };
        both!(dev, tol, format!("qk_norm_rope_store hd={hd} {dtype:?}"), b => {
            let (qnb, knb, vb) = (b.upload(&qn).unwrap(), b.upload(&kn).unwrap(), b.upload(&v).unwrap());
            let (mut qb, mut kb) = (b.upload(&qg).unwrap(), b.upload(&k).unwrap());
            let mut kc = filled_cache(b, w, pos0 as usize, rows, dtype, 4, 49);
            let mut vc = filled_cache(b, w, pos0 as usize, rows, dtype, 4, 50);
            b.kv_reserve(&mut kc, rows).unwrap();
            b.kv_reserve(&mut vc, rows).unwrap();
            b.qk_norm_rope_store(&p, &qnb, &knb, &mut qb, &mut kb, &vb, &mut kc, &mut vc);
            b.finish().unwrap();
            let (mut ko, mut vo) = (vec![0f32; rows * w], vec![0f32; rows * w]);
            b.kv_read(&kc, 0, &mut ko).unwrap();
            b.kv_read(&vc, 0, &mut vo).unwrap();
            vec![read_all(b, &qb, qg.len()), ko, vo]
        });
    }
}

/// Rows 6..11 in segments of 4 (the chunk spans three segments) in every dtype, NaN, -0 and a
/// subnormal included; read back through kv_read.
/// copy_rows: a row into the middle of another buffer and back out, between kernels of one stream
/// (the second copy reads what the first wrote); out-of-bounds copies are errors.
pub fn copy_rows_moves_rows_in_the_stream<X: Executor>(dev: &mut Cuda<X>, tolx: f32) {
    let _ = tolx; // exact: copies
    let (w, rows) = (300, 4);
    let src = rand_vec(rows * w, 9, -1.0, 1.0);
    both!(dev, 0.0, "copy_rows", b => {
        let s = b.upload(&src).unwrap();
        let mut one = b.alloc(w).unwrap();
        let mut back = b.alloc(rows * w).unwrap();
        b.fill_zero(&mut back).unwrap();
        b.begin(lily_core::backend::StreamKind::Other).unwrap();
        b.copy_rows(&s, 2 * w, &mut one, 0, w).unwrap();
        b.copy_rows(&one, 0, &mut back, w, w).unwrap();
        b.copy_rows(&s, 3 * w + 5, &mut back, 3 * w, w - 5).unwrap();
        assert!(b.copy_rows(&s, 3 * w + 1, &mut one, 0, w).is_err(), "past the source");
        assert!(b.copy_rows(&s, 0, &mut one, 1, w).is_err(), "past the destination");
        b.finish().unwrap();
        vec![read_all(b, &back, rows * w)]
    });
}

/// kv_copy: rows 0..11 of a cache in segments of 4 (three segments, the last partly) copied into
/// a fresh cache bit for bit, in every dtype; the rows past them are left alone; a copy between
/// different layouts or of rows the source lacks is an error.
pub fn kv_copy_matches_cpu<X: Executor>(dev: &mut Cuda<X>, tolx: f32) {
    let _ = tolx; // exact: a copy
    let w = 24;
    for dtype in [KvDtype::F32, KvDtype::BF16, KvDtype::F16] {
        both!(dev, 0.0, format!("kv_copy {dtype:?}"), b => {
            let src = filled_cache(b, w, 14, 32, dtype, 4, 60);
            let mut dst = filled_cache(b, w, 16, 32, dtype, 4, 61);
            b.kv_copy(&src, &mut dst, 11).unwrap();
            let (mut got, mut want, mut kept) = (vec![0f32; 11 * w], vec![0f32; 11 * w], vec![0f32; 5 * w]);
            b.kv_read(&dst, 0, &mut got).unwrap();
            b.kv_read(&src, 0, &mut want).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want));
            b.kv_read(&dst, 11, &mut kept).unwrap();
            let mut other = b.kv_new(w + 1, dtype, 32, 4).unwrap();
            b.kv_reserve(&mut other, 11).unwrap();
            assert!(b.kv_copy(&src, &mut other, 11).is_err(), "different widths");
            assert!(b.kv_copy(&src, &mut dst, 17).is_err(), "rows the source lacks");
            vec![got, kept]
        });
    }
}

pub fn kv_store_matches_cpu<X: Executor>(dev: &mut Cuda<X>, tolx: f32) {
    let _ = tolx; // exact: both round to nearest even
    let (t, w, max) = (5, 40, 24);
    let x: Vec<f32> = rand_vec(t * w - 3, 50, -3.0, 3.0)
        .into_iter()
        .chain([f32::NAN, -0.0, 1e-40])
        .collect();
    for dtype in [KvDtype::F32, KvDtype::BF16, KvDtype::F16] {
        let p = KvStoreParams {
            tokens: t as u32,
            pos0: 6,
            width: w as u32,
        };
        both!(dev, 0.0, format!("kv_store {dtype:?}"), b => {
            let xb = b.upload(&x).unwrap();
            let mut cache = b.kv_new(w, dtype, max, 4).unwrap();
            b.kv_reserve(&mut cache, 11).unwrap();
            b.kv_store(&p, &xb, &mut cache);
            b.finish().unwrap();
            let mut out = vec![0f32; t * w];
            b.kv_read(&cache, 6, &mut out).unwrap();
            // NaN == NaN for the comparison: both must have stored a NaN.
            vec![out.iter().map(|v| if v.is_nan() { 1e30 } else { *v }).collect()]
        });
    }
}

/// Prefill (one block per token) and decode (split over the keys, empty splits included, then
/// the reduce) on partial tiles of 16 rows, GQA groups of 2, 4 and 8 (the real shapes last), in
/// every cache dtype; segments of 4 and 16 rows put boundaries inside tiles and splits, and a
/// sequence past 1024 rows crosses a default-size segment.
pub fn attention_matches_cpu<X: Executor>(dev: &mut Cuda<X>, tolx: f32) {
    for (h, kv, hd, pos0, t, steps, dtype, seg) in [
        (4, 2, 32, 0, 13, 0, KvDtype::F32, 1024),
        (8, 2, 64, 3, 5, 2, KvDtype::BF16, 4),
        (4, 1, 32, 30, 1, 3, KvDtype::F16, 16),
        (16, 2, 256, 20, 3, 1, KvDtype::BF16, 16),
        (4, 2, 32, 1100, 2, 2, KvDtype::BF16, 1024),
    ] {
        let want = run_attention(&Cpu::reference(), h, kv, hd, pos0, t, steps, dtype, seg);
        let got = run_attention(&*dev, h, kv, hd, pos0, t, steps, dtype, seg);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_close(
                g,
                w,
                tolx * TOL,
                &format!("attention H={h} Hkv={kv} hd={hd} {dtype:?} seg {seg} call {i}"),
            );
        }
    }
}

pub fn delta_net_conv_matches_cpu<X: Executor>(dev: &mut Cuda<X>, tolx: f32) {
    let (c, taps) = (300, 4);
    let w = rand_vec(c * taps, 70, -1.0, 1.0);
    both!(dev, tolx * TOL, "delta_net_conv", b => {
        let wb = b.upload(&w).unwrap();
        let mut state = b.alloc((taps - 1) * c).unwrap();
        let mut outs = Vec::new();
        for (i, t) in [5usize, 1, 2, 1].into_iter().enumerate() {
            let x = b.upload(&rand_vec(t * c, 71 + i as u64, -2.0, 2.0)).unwrap();
            let mut out = b.alloc(t * c).unwrap();
            let p = ConvParams { tokens: t as u32, channels: c as u32, taps: taps as u32 };
            b.delta_net_conv(&p, &wb, &mut state, &x, &mut out);
            b.finish().unwrap();
            outs.push(read_all(b, &out, t * c));
        }
        outs.push(read_all(b, &state, (taps - 1) * c));
        outs
    });
}

/// `delta_net` over successive calls of `calls[i]` tokens from a random nonzero state: each
/// call's output, then the final state.
fn delta_net_calls<B: Backend>(b: &B, hk: usize, hv: usize, dk: usize, dv: usize, calls: &[usize]) -> Vec<Vec<f32>> {
    let seed = 80;
    let width = 2 * hk * dk + hv * dv;
    let al = b.upload(&rand_vec(hv, seed, -3.0, 0.7)).unwrap();
    let dt = b.upload(&rand_vec(hv, seed + 1, -1.0, 1.0)).unwrap();
    let mut state = b.upload(&rand_vec(hv * dk * dv, seed + 2, -1.0, 1.0)).unwrap();
    let mut outs = Vec::new();
    for (i, &t) in calls.iter().enumerate() {
        let s = seed + 10 * (i as u64 + 1);
        let qkv = b.upload(&rand_vec(t * width, s, -1.0, 1.0)).unwrap();
        let a = b.upload(&rand_vec(t * hv, s + 1, -2.0, 2.0)).unwrap();
        let bb = b.upload(&rand_vec(t * hv, s + 2, -2.0, 2.0)).unwrap();
        let mut out = b.alloc(t * hv * dv).unwrap();
        let p = DeltaNetParams {
            tokens: t as u32,
            key_heads: hk as u32,
            value_heads: hv as u32,
            key_dim: dk as u32,
            value_dim: dv as u32,
        };
        b.delta_net(&p, &qkv, &a, &bb, &al, &dt, &mut state, &mut out);
        b.finish().unwrap();
        outs.push(read_all(b, &out, t * hv * dv));
    }
    outs.push(read_all(b, &state, hv * dk * dv));
    outs
}

/// Tiny heads (Dk = 16: fewer rows than warps x lanes), Dv not a multiple of 32 (40: a partial
/// warp of columns), the real head dims (128, 2 value heads per key head) and Dk = 256; prefills
/// (both kernels paths) then decode steps (errors compound over steps).
pub fn delta_net_matches_cpu<X: Executor>(dev: &mut Cuda<X>, tolx: f32) {
    // 7-token calls take the step kernel, 30-token ones the prep + scan path (Dk <= 128), Dk = 256
    // the step kernel at any length; the state carries across both.
    let steps: Vec<usize> = [7, 30].into_iter().chain(std::iter::repeat_n(1, 12)).collect();
    for (hk, hv, dk, dv, calls) in [
        (2usize, 4usize, 16usize, 16usize, &steps[..]),
        (1, 2, 24, 40, &steps[..5]),
        (2, 4, 128, 128, &steps[..4]),
        (1, 1, 256, 32, &[9usize, 20][..]),
    ] {
        both!(dev, tolx * 1e-4, format!("delta_net Dk={dk} Dv={dv}"), b => delta_net_calls(b, hk, hv, dk, dv, calls));
    }
}

pub fn moe_route_matches_cpu<X: Executor>(dev: &mut Cuda<X>, tolx: f32) {
    for (t, e, k, renorm) in [(3usize, 256usize, 8usize, 1u32), (2, 40, 5, 0), (1, 1000, 64, 1)] {
        let logits = rand_vec(t * e, 90 + e as u64, -4.0, 4.0);
        let p = RouteParams {
            tokens: t as u32,
            experts: e as u32,
            top_k: k as u32,
            renorm,
        };
        let cpu = Cpu::reference();
        let (mut ci, mut cw) = (vec![0u32; t * k], vec![0f32; t * k]);
        cpu.moe_route(&p, &logits, &mut ci, &mut cw);
        let lb = dev.upload(&logits).unwrap();
        let (mut ib, mut wb) = (dev.alloc_ids(t * k).unwrap(), dev.alloc(t * k).unwrap());
        dev.moe_route(&p, &lb, &mut ib, &mut wb);
        dev.finish().unwrap();
        assert_eq!(read_ids(dev, &ib, t * k), ci, "moe_route ids E={e} K={k}");
        assert_close(
            &read_all(&*dev, &wb, t * k),
            &cw,
            tolx * TOL,
            &format!("moe_route weights E={e}"),
        );
    }
}

/// The decode path of `moe_experts`; the f32 case (D = 1024: 256 chunks a row, 20 rows) has K split
/// across 8 warps of a row group (`gemv_split`), with a partial last group.
pub fn moe_experts_matches_cpu<X: Executor>(dev: &mut Cuda<X>, tolx: f32) {
    let (e, k) = (6usize, 2usize);
    for (format, sd, d, inter) in [
        (Format::Affine { bits: 4, group: 64 }, DType::BF16, 256usize, 192usize),
        (Format::BF16, DType::F32, 256, 192),
        (Format::F32, DType::F32, 1024, 20),
    ] {
        let gate = matrix(e, inter, d, format, sd, 100);
        let up = matrix(e, inter, d, format, sd, 101);
        let down = matrix(e, d, inter, format, sd, 102);
        for t in [1usize, 5] {
            let x = rand_vec(t * d, 103, -1.0, 1.0);
            let ids: Vec<u32> = (0..t * k).map(|i| ((i * 5 + 1) % e) as u32).collect();
            let w = rand_vec(t * k, 104, 0.1, 1.0);
            both!(dev, tolx * TOL, format!("moe_experts {format:?} T={t}"), b => {
                let (g, u, dn) = (b.upload_matrix(&gate).unwrap(), b.upload_matrix(&up).unwrap(), b.upload_matrix(&down).unwrap());
                let (xb, ib, wb) = (b.upload(&x).unwrap(), ids_buf(b, &ids), b.upload(&w).unwrap());
                let mut tmp = b.alloc(t * k * (inter + d)).unwrap();
                let mut out = b.alloc(t * d).unwrap();
                let p = MoeParams { tokens: t as u32, top_k: k as u32 };
                b.moe_experts(&p, &xb, &ib, &wb, &g, &u, &dn, &mut tmp, &mut out);
                b.finish().unwrap();
                vec![read_all(b, &out, t * d)]
            });
        }
    }
}

/// The prefill path of `moe_experts` (T > 8: expert-sorted tiles on the bf16 tensor cores) on
/// uneven routing: one expert with more than two 64-row tiles, one with none, partial tiles and a
/// partial column tile (I = 192 is not a multiple of 64); within 1e-2 of the largest output.
pub fn moe_experts_sorted_matches_cpu<X: Executor>(dev: &mut Cuda<X>, tolx: f32) {
    let (e, d, inter, k) = (6usize, 256usize, 192usize, 2usize);
    for (format, sd) in [
        (Format::Affine { bits: 4, group: 64 }, DType::BF16),
        (Format::BF16, DType::F32),
    ] {
        let gate = matrix(e, inter, d, format, sd, 110);
        let up = matrix(e, inter, d, format, sd, 111);
        let down = matrix(e, d, inter, format, sd, 112);
        for t in [9usize, 90] {
            let x = rand_vec(t * d, 113, -1.0, 1.0);
            // Slot 0 of most tokens goes to expert 1 (> 128 rows at T = 90), expert 4 gets none.
            let ids: Vec<u32> = (0..t * k)
                .map(|i| {
                    if i % 2 == 0 && i % 10 != 0 {
                        1
                    } else {
                        [0u32, 2, 3, 5][(i / 2) % 4]
                    }
                })
                .collect();
            let w = rand_vec(t * k, 114, 0.1, 1.0);
            both!(dev, tolx * 1e-2, format!("moe_experts sorted {format:?} T={t}"), b => {
                let (g, u, dn) = (b.upload_matrix(&gate).unwrap(), b.upload_matrix(&up).unwrap(), b.upload_matrix(&down).unwrap());
                let (xb, ib, wb) = (b.upload(&x).unwrap(), ids_buf(b, &ids), b.upload(&w).unwrap());
                let mut tmp = b.alloc(t * k * (inter + d)).unwrap();
                let mut out = b.alloc(t * d).unwrap();
                let p = MoeParams { tokens: t as u32, top_k: k as u32 };
                b.moe_experts(&p, &xb, &ib, &wb, &g, &u, &dn, &mut tmp, &mut out);
                b.finish().unwrap();
                vec![read_all(b, &out, t * d)]
            });
        }
    }
}

/// The tiny checkpoint end to end with every matmul on the f32 GEMV: logits of a 40-token
/// prefill (every position) and 3 decode steps within 1e-4 of the reference backend.
pub fn forward_f32_matches_cpu<X: Executor>(dev: &mut Cuda<X>, tolx: f32) {
    let ckpt = TinyCheckpoint::write();
    let want = ckpt.logits(&Cpu::reference());
    let saved = dev.gemv_tokens;
    dev.gemv_tokens = usize::MAX;
    let got = ckpt.logits(&*dev);
    dev.gemv_tokens = saved;
    let worst = crate::metal_common::assert_logits_close(&got, &want, tolx, "tiny model, f32 GEMV");
    eprintln!("tiny model, f32: max |Δlogit| / max(1, max |logit|) = {worst:.2e}");
}

/// The same with the prefill matmuls on the bf16 tensor cores: every logit within 5e-2 of the
/// largest (bf16 inputs keep 8 bits), and the argmax of every position the reference's wherever
/// the reference's top two differ by more than that.
pub fn forward_matches_cpu_at_bf16_tolerance<X: Executor>(dev: &mut Cuda<X>, tolx: f32) {
    let ckpt = TinyCheckpoint::write();
    let want = ckpt.logits(&Cpu::reference());
    let got = ckpt.logits(&*dev);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_close(
            g,
            w,
            tolx * 5e-2,
            &format!("tiny model (bf16 prefill GEMMs) position {i}"),
        );
        let argmax = |v: &[f32]| (0..v.len()).max_by(|&a, &b| v[a].total_cmp(&v[b])).unwrap();
        let mut sorted = w.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let scale = w.iter().fold(1f32, |m, v| m.max(v.abs()));
        if sorted[0] - sorted[1] > 5e-2 * scale {
            assert_eq!(argmax(g), argmax(w), "position {i}: argmax");
        }
    }
}

/// Shapes the kernels do not support are errors from `finish`, not faults, and the backend
/// keeps working after one.
pub fn unsupported_shape_is_an_error_not_a_panic<X: Executor>(dev: &mut Cuda<X>, tolx: f32) {
    let _ = tolx;
    let qg = dev.alloc(2 * 3 * 2 * 48).unwrap();
    let k = filled_cache(&*dev, 48, 2, 64, KvDtype::BF16, 16, 1);
    let mut out = dev.alloc(2 * 3 * 48).unwrap();
    let p = AttentionParams {
        tokens: 2,
        pos0: 0,
        heads: 3,
        kv_heads: 1,
        head_dim: 48, // not a multiple of 32
        scale: 1.0,
    };
    dev.attention(&p, &qg, &k, &k, &mut out);
    let e = dev.finish().unwrap_err().to_string();
    assert!(e.contains("attention"), "{e}");
    let small = dev.alloc(4).unwrap();
    let mut o = dev.alloc(4).unwrap();
    let rp = RowsParams { tokens: 2, dim: 4 };
    dev.swiglu(&rp, &small, &small, &mut o);
    let e = dev.finish().unwrap_err().to_string();
    assert!(e.contains("swiglu") && e.contains("needs 8"), "{e}");
    // Still usable.
    rms_norm_matches_cpu(dev, 1.0);
}
