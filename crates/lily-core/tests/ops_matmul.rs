//! The matmul family: the CPU kernels (GEMV, tiled GEMM, every weight format) and the GPU
//! kernels (Metal and CUDA, simulators and devices: `gpu_tests!`; every path, Metal's GPU-family
//! variants, CUDA's tensor-core GEMM) against the reference twin; weight-row dequantization and fused-matrix views.

mod common;
#[macro_use]
mod gpu_common;

use common::{assert_close, matrix, rand_vec, stored_matrix};
use gpu_common::{assert_near, read_all, TOL};
use lily_core::{
    backend::{
        cpu::{isa::Isa, Cpu},
        cuda::{Cuda, Executor as CudaExecutor},
        metal::{Executor, GemmTile, GemvRows, Metal, Variants},
        params::MatmulParams,
        Backend,
    },
    quant::{Format, Matrix},
    safetensors::{Bytes, DType},
};

mod cpu {
    use super::*;

    const FORMATS: [Format; 7] = [
        Format::F32,
        Format::F16,
        Format::BF16,
        Format::Affine { bits: 4, group: 64 },
        Format::Affine { bits: 4, group: 128 },
        Format::Affine { bits: 8, group: 32 },
        Format::Affine { bits: 2, group: 64 },
    ];

    #[test]
    fn matmul_matches_reference() {
        let (fast, refr) = (Cpu::new(), Cpu::reference());
        for (fi, &format) in FORMATS.iter().enumerate() {
            // T = 5 and 8: the batched GEMV (a batched decode step); 9 and 19: the tiled GEMM.
            for &(n, k, t, row0) in &[
                (37, 128, 1, 0),
                (70, 256, 5, 2),
                (45, 128, 8, 1),
                (45, 128, 9, 0),
                (16, 384, 19, 0),
            ] {
                let w = matrix(1, n, k, format, DType::BF16, 11 + fi as u64);
                let x = rand_vec((t + row0) * k, 5, -1.0, 1.0);
                let p = MatmulParams {
                    tokens: t as u32,
                    x_row0: row0 as u32,
                };
                let (mut a, mut b) = (vec![f32::NAN; t * n], vec![f32::NAN; t * n]);
                fast.matmul(&p, &w, &x, &mut a);
                refr.matmul(&p, &w, &x, &mut b);
                assert_close(&a, &b, 1e-5, &format!("matmul {format:?} n={n} k={k} t={t}"));
            }
        }
    }

    /// A batched decode step's matmul gives each row exactly what that row's lone decode gets.
    #[test]
    fn batched_gemv_rows_equal_lone_gemv() {
        let fast = Cpu::new();
        for (fi, &format) in FORMATS[..6].iter().enumerate() {
            let (n, k, t) = (70, 256, 6);
            let w = matrix(1, n, k, format, DType::BF16, 31 + fi as u64);
            let x = rand_vec(t * k, 6, -1.0, 1.0);
            let mut all = vec![f32::NAN; t * n];
            fast.matmul(
                &MatmulParams {
                    tokens: t as u32,
                    x_row0: 0,
                },
                &w,
                &x,
                &mut all,
            );
            for row in 0..t {
                let mut one = vec![f32::NAN; n];
                fast.matmul(
                    &MatmulParams {
                        tokens: 1,
                        x_row0: row as u32,
                    },
                    &w,
                    &x,
                    &mut one,
                );
                assert_eq!(one, all[row * n..][..n], "{format:?} row {row}");
            }
        }
    }

    #[test]
    fn dequant_matches_reference() {
        for (fi, &format) in FORMATS.iter().enumerate() {
            let m = matrix(2, 9, 256, format, DType::BF16, 3 + fi as u64);
            let (mut a, mut b) = (vec![0f32; 256], vec![0f32; 256]);
            for (e, r) in [(0, 0), (1, 8), (1, 3)] {
                lily_core::backend::cpu::simd::dequant_row(Isa::get(), &m, m.stored_row(e, r), &mut a);
                m.dequant_row(e, r, &mut b);
                assert_eq!(a, b, "{format:?} e={e} r={r}");
            }
        }
    }

    #[test]
    fn fused_gate_up_views_select_the_right_rows() {
        // HF stores gate_up [E, 2I, D]; the gate view is rows 0..I of each expert, up rows I..2I.
        let (e, i, d) = (3, 4, 64);
        let full = matrix(e, 2 * i, d, Format::BF16, DType::BF16, 5);
        let view = |off| Matrix {
            rows: i,
            expert_stride: 2 * i,
            row_offset: off,
            ..full.clone()
        };
        let (gate, up) = (view(0), view(i));
        let (mut a, mut b) = (vec![0f32; d], vec![0f32; d]);
        gate.dequant_row(2, 1, &mut a);
        full.dequant_row(2, 1, &mut b);
        assert_eq!(a, b);
        up.dequant_row(2, 1, &mut a);
        full.dequant_row(2, i + 1, &mut b);
        assert_eq!(a, b);
    }
}

gpu_tests!(
    matmul_matches_reference,
    matmuls_match_reference,
    weights_at_an_offset_match_reference;
    metal: matmul_variants_match_reference;
    cuda: matmul_mma_matches_reference, gemv_wide_range_x_matches_reference,
);

fn run_matmul<B: Backend>(b: &B, m: &Matrix, tokens: usize, x_row0: usize, x: &[f32]) -> Vec<f32> {
    let w = b.upload_matrix(m).unwrap();
    let xb = b.upload(x).unwrap();
    let mut out = b.alloc(tokens * m.rows).unwrap();
    b.matmul(
        &MatmulParams {
            tokens: tokens as u32,
            x_row0: x_row0 as u32,
        },
        &w,
        &xb,
        &mut out,
    );
    b.finish().unwrap();
    read_all(b, &out, tokens * m.rows)
}

/// Every weight format (dense, and 2/4/8-bit with bf16/f16/f32 scales and groups of 32 to 128),
/// as views: rows 3..70 of a 71-row MLX-quantized matrix (partial warps of 4 rows, a partial
/// tile of 64) and rows 3..40 of a 41-row one of random codes (a partial tile of 4 rows); 256
/// columns (16-byte rows) and, for the dense formats, 70 (not 16-byte aligned: the element path
/// and a K tail past the last 8 columns) or 72.
fn matmul_cases() -> Vec<(Matrix, usize)> {
    let mut cases = Vec::new();
    for (format, cols) in [
        (Format::F32, 70),
        (Format::F16, 70),
        (Format::BF16, 70),
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
    let mut views = Vec::new();
    for (i, (format, sd, cols)) in cases.into_iter().enumerate() {
        let seed = 10 + i as u64;
        for (mut m, rows) in [
            (matrix(1, 71, cols, format, sd, seed), 67),
            (stored_matrix(format, sd, 41, cols, seed), 37),
        ] {
            m.rows = rows;
            m.row_offset = 3;
            views.push((m, cols));
        }
    }
    views
}

/// The decode and small-batch paths (T <= 8: the GEMVs, Metal's 8-token GEMM) on every case of
/// `matmul_cases`, f32 throughout, within 2e-5 of the reference; and two rows wider than one x
/// staging pass of the CUDA GEMV (8192 floats: a second, partial pass).
fn matmul_matches_reference<B: Backend>(dev: &mut B, tolx: f32) {
    let mut cases = matmul_cases();
    for (i, (format, cols)) in [(Format::F32, 8200), (Format::Affine { bits: 4, group: 64 }, 8256)]
        .into_iter()
        .enumerate()
    {
        cases.push((matrix(1, 9, cols, format, DType::BF16, 40 + i as u64), cols));
    }
    // More row blocks than CUDA's GEMV grid (264 blocks, 32 rows each at these K): a block runs
    // several row blocks, x staged once (int8 planes; f32 for the dense matrix).
    for (i, (format, cols)) in [(Format::Affine { bits: 4, group: 64 }, 256), (Format::F32, 64)]
        .into_iter()
        .enumerate()
    {
        cases.push((matrix(1, 9000, cols, format, DType::BF16, 45 + i as u64), cols));
    }
    // Looping blocks on 4- and 8-bit rows of 2 and 3 warp steps of 32 chunks, the last partial:
    // at 5 tokens the grid (52 blocks) is smaller than the 63 row blocks.
    for (i, bits) in [4, 8].into_iter().enumerate() {
        let format = Format::Affine { bits, group: 64 };
        cases.push((matrix(1, 2000, 1536, format, DType::BF16, 47 + i as u64), 1536));
    }
    for (i, (m, cols)) in cases.into_iter().enumerate() {
        for (tokens, x_row0) in [(1, 2), (5, 0)] {
            let x = rand_vec((tokens + x_row0) * cols, 20 + i as u64, -1.0, 1.0);
            let want = run_matmul(&Cpu::reference(), &m, tokens, x_row0, &x);
            let got = run_matmul(&*dev, &m, tokens, x_row0, &x);
            assert_near(&got, &want, tolx * TOL, &format!("matmul {:?} T={tokens}", m.format));
        }
    }
}

/// CUDA's prefill GEMM on tensor cores (T > 8: bf16 inputs, f32 accumulation): within 1e-2 of
/// the largest output (bf16 keeps 8 bits; a wrong fragment index is off by the order of the
/// outputs). 11 tokens: one partial token tile; 70: two token tiles, the second partial. Beside
/// `matmul_cases`, matrices over several 128-row tiles (`mma_tile`: two halves of 64) with a
/// partial last one (197 rows: 128 + 64 + 5; 300: 128 + 128 + 44, an empty second half) and K
/// steps of 64 with a partial last one on the 16-byte path (K = 96, 136, 192 + 0).
fn matmul_mma_matches_reference<X: CudaExecutor>(dev: &mut Cuda<X>, tolx: f32) {
    let mut cases = matmul_cases();
    for (i, (format, rows, cols)) in [
        (Format::Affine { bits: 4, group: 32 }, 200, 96),
        (Format::Affine { bits: 8, group: 64 }, 303, 192),
        (Format::BF16, 200, 136),
    ]
    .into_iter()
    .enumerate()
    {
        let mut m = matrix(1, rows, cols, format, DType::BF16, 50 + i as u64);
        m.rows = rows - 3;
        m.row_offset = 3;
        cases.push((m, cols));
    }
    for (i, (m, cols)) in cases.into_iter().enumerate() {
        for (tokens, x_row0) in [(11, 1), (70, 2)] {
            let x = rand_vec((tokens + x_row0) * cols, 30 + i as u64, -1.0, 1.0);
            let want = run_matmul(&Cpu::reference(), &m, tokens, x_row0, &x);
            let got = run_matmul(&*dev, &m, tokens, x_row0, &x);
            assert_near(
                &got,
                &want,
                tolx * 1e-2,
                &format!("matmul_mma {:?} T={tokens}", m.format),
            );
        }
    }
}

/// Several matrices reading one x (`matmuls`): on CUDA runs of one format and K share a launch
/// (up to 4, then a new one), a different format or K starts another; every output as the
/// reference's.
fn matmuls_match_reference<B: Backend>(dev: &mut B, tolx: f32) {
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

/// Every kernel path of Metal's `matmul` and every GPU-family variant of the GEMV (T = 1) and
/// of the simdgroup-matrix GEMM (T > 8, f32 like the GEMV) against the reference.
fn matmul_variants_match_reference<X: Executor>(dev: &mut Metal<X>, tolx: f32) {
    let saved = dev.variants;
    let mut cases = vec![
        (Format::F32, DType::F32, 70),
        (Format::F16, DType::F32, 70),
        (Format::BF16, DType::F32, 70),
    ];
    for bits in [2, 4, 8] {
        for (sd, group) in [(DType::BF16, 64), (DType::F16, 32), (DType::F32, 128)] {
            cases.push((Format::Affine { bits, group }, sd, 256));
        }
    }
    for (i, (format, sd, cols)) in cases.into_iter().enumerate() {
        let mut m = stored_matrix(format, sd, 41, cols, 10 + i as u64);
        m.rows = 37; // a view: rows 3..40 of the stored 41 (partial tile of 4 rows)
        m.row_offset = 3;
        // 1: GEMV (37 rows: a partial group of rows for both r2 and r4); 5: the 8-token GEMM;
        // 11 and 41: the simdgroup-matrix GEMM on partial tiles (41 tokens = two token tiles,
        // 37 rows = a partial row tile of 32 or 64, cols 70 = a partial K step with a tail past
        // the last 8 columns).
        for (tokens, x_row0) in [(1, 2), (5, 0), (11, 1), (41, 2)] {
            let x = rand_vec((tokens + x_row0) * cols, 20 + i as u64, -1.0, 1.0);
            let want = run_matmul(&Cpu::reference(), &m, tokens, x_row0, &x);
            // The variants of the path this T takes (the other choice changes nothing).
            let variants: Vec<Variants> = match tokens {
                1 => GemvRows::ALL.map(|gemv| Variants { gemv, ..saved }).to_vec(),
                2..=8 => vec![saved],
                _ => GemmTile::ALL.map(|gemm| Variants { gemm, ..saved }).to_vec(),
            };
            for v in variants {
                dev.variants = v;
                let got = run_matmul(&*dev, &m, tokens, x_row0, &x);
                assert_near(
                    &got,
                    &want,
                    tolx * TOL,
                    &format!("matmul {format:?} scales {sd:?} T={tokens} {v:?}"),
                );
            }
        }
    }
    dev.variants = saved;
}

/// Weights that sit inside a larger mapping, as checkpoint tensors do: a 4-byte-aligned offset
/// (wrapped in place by the Metal device, the offset bound with the buffer) and a 2-byte-aligned one
/// (copied once). Both must give the reference result.
fn weights_at_an_offset_match_reference<B: Backend>(dev: &mut B, tolx: f32) {
    let (rows, cols) = (37usize, 256usize);
    for (format, offset) in [
        (Format::Affine { bits: 4, group: 64 }, 4100usize),
        (Format::BF16, 20002),
    ] {
        let mut m = stored_matrix(format, DType::BF16, rows, cols, 140);
        let shift = |b: &Bytes| {
            let mut v = vec![0xa5u8; offset];
            v.extend_from_slice(b.as_slice());
            v.extend_from_slice(&[0x5a; 100]);
            Bytes::from_slice(&v).slice(offset, b.len())
        };
        m.data = shift(&m.data);
        if let Some(g) = m.groups.as_mut() {
            (g.scales, g.biases) = (shift(&g.scales), shift(&g.biases));
        }
        let x = rand_vec(3 * cols, 141, -1.0, 1.0);
        both!(dev, tolx * TOL, format!("matmul {format:?} at offset {offset}"), b => vec![run_matmul(b, &m, 1, 0, &x), run_matmul(b, &m, 3, 0, &x)]);
    }
}

/// x for `gemv_wide_range_x_matches_reference`, token by token: t0 random in [-1, 1] with, in
/// every 16 columns, +-1e6 beside 1e-6, 0 and -1e-6 (one plane scale per 16-byte weight chunk
/// spans 12 decades); t1 runs of 16 columns cycling through all zeros, 1e-6 x random, 1e3 x random
/// with one -5e4, and max 127 (plane step 1) beside halves of steps (0.5, -2.5, 0.5 + 0.5 / 256:
/// the plane carries); t2 random with one 1e4 in every 64 (a chunk needs its third plane to stay
/// within 2e-5 of the output: two planes leave ~1e-4).
fn wide_range_x(cols: usize, seed: u64) -> Vec<f32> {
    let r = rand_vec(3 * cols, seed, -1.0, 1.0);
    let mut x = r.clone();
    for j in 0..cols {
        x[j] = match j % 16 {
            5 => {
                if j % 32 == 5 {
                    1e6
                } else {
                    -1e6
                }
            }
            6 => 1e-6,
            7 => 0.0,
            8 => -1e-6,
            _ => r[j],
        };
        let k = cols + j;
        x[k] = match (j / 16) % 4 {
            0 => 0.0,
            1 => 1e-6 * r[k],
            2 => {
                if j % 16 == 3 {
                    -5e4
                } else {
                    1e3 * r[k]
                }
            }
            _ => {
                [127.0, 0.5, -2.5, 0.5 + 0.5 / 256.0, -0.5, 1.5, 63.5, -126.5][j % 8]
                    * if j % 16 >= 8 { 1.0 } else { -1.0 }
            }
        };
        let k = 2 * cols + j;
        if j % 64 == 17 {
            x[k] = 1e4;
        }
    }
    x
}

/// The CUDA GEMV's int8 activation planes (4- and 8-bit weights: x staged per 16-byte chunk as
/// three int8 planes with a chunk scale, common.cuh) on x of huge dynamic range (`wide_range_x`),
/// each token within 2e-5 of its own largest output: groups of 32, 64 and 128 with bf16 / f16 / f32
/// scales, K of 3 to 258 chunks (a partial warp step of 32 chunks; 8256 columns at 4 bits: a second,
/// partial staging pass), 9 rows (a block's warps split K) and 70 rows (a partial row group).
fn gemv_wide_range_x_matches_reference<X: CudaExecutor>(dev: &mut Cuda<X>, tolx: f32) {
    let cases = [
        (4, 32, DType::BF16, 96),
        (4, 64, DType::F16, 320),
        (4, 128, DType::F32, 384),
        (4, 64, DType::BF16, 8256),
        (8, 32, DType::BF16, 96),
        (8, 64, DType::F32, 320),
        (8, 128, DType::F16, 1152),
    ];
    for (i, &(bits, group, sd, cols)) in cases.iter().enumerate() {
        for rows in [9, 70] {
            let m = matrix(1, rows, cols, Format::Affine { bits, group }, sd, 60 + i as u64);
            let x = wide_range_x(cols, 70 + i as u64);
            let want = run_matmul(&Cpu::reference(), &m, 3, 0, &x);
            let got = run_matmul(&*dev, &m, 3, 0, &x);
            for t in 0..3 {
                let at = t * rows..(t + 1) * rows;
                assert_near(
                    &got[at.clone()],
                    &want[at],
                    tolx * TOL,
                    &format!("gemv {bits}-bit g{group} K={cols} rows={rows} token {t}"),
                );
            }
        }
    }
}
