//! Each SIMD path of the CPU kernels against the portable one and the reference twin, with the
//! ISA forced through the function argument, so AVX-512, AVX2 and the portable fallback all run
//! on any machine that has them. Plus: the decode-step kernels allocate nothing once warm.

use std::sync::Mutex;

mod alloc_common;
mod common;

use common::{assert_close, cpu_cache, delta_net_inputs, delta_net_params, matrix, rand_vec, DeltaNetInputs};
use lily_core::{
    backend::{
        cpu::{isa::Isa, kv::CpuKv, simd, Cpu, Precision},
        params::*,
        Backend, KvDtype,
    },
    ops::{attention, delta_net, matmul, moe, norm, sigmoid, silu},
    quant::{Format, Matrix},
    safetensors::DType,
};

/// Tests of this file run one at a time so the allocation count sees only its own test.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

const FORMATS: &[(Format, DType)] = &[
    (Format::Affine { bits: 4, group: 64 }, DType::BF16),
    (Format::Affine { bits: 4, group: 32 }, DType::F16),
    (Format::Affine { bits: 4, group: 128 }, DType::F32),
    (Format::Affine { bits: 8, group: 64 }, DType::BF16),
    (Format::Affine { bits: 8, group: 32 }, DType::BF16),
    (Format::Affine { bits: 2, group: 64 }, DType::BF16),
    (Format::BF16, DType::BF16),
    (Format::F16, DType::BF16),
    (Format::F32, DType::BF16),
];

#[test]
fn every_isa_is_listed_and_portable_is_always_there() {
    let _g = serial();
    let all = Isa::all_available();
    assert_eq!(all.first(), Some(&Isa::Portable));
    assert!(all.contains(&Isa::get()));
}

#[test]
fn primitive_dots_match_portable_on_every_isa() {
    let _g = serial();
    for isa in Isa::all_available() {
        for n in [1usize, 7, 16, 33, 64, 100, 257] {
            let (a, b) = (rand_vec(n, 1, -1.0, 1.0), rand_vec(n, 2, -1.0, 1.0));
            let (f, p) = (simd::dot(isa, &a, &b), simd::dot_portable(&a, &b));
            assert!((f - p).abs() <= 1e-5 * n as f32, "{isa:?} dot n={n}: {f} vs {p}");
        }
        for k in [16usize, 40, 256, 300] {
            let w: Vec<Vec<f32>> = (0..4).map(|i| rand_vec(k, 10 + i, -1.0, 1.0)).collect();
            let x: Vec<Vec<f32>> = (0..4).map(|i| rand_vec(k, 20 + i, -1.0, 1.0)).collect();
            let d = simd::dot4x4(isa, [0, 1, 2, 3].map(|i| &w[i][..]), [0, 1, 2, 3].map(|i| &x[i][..]), k);
            for i in 0..4 {
                for t in 0..4 {
                    let r = simd::dot_portable(&w[i], &x[t]);
                    assert!((d[i][t] - r).abs() <= 1e-5 * k as f32, "{isa:?} dot4x4 k={k} ({i},{t})");
                }
            }
        }
    }
}

/// The tolerance (relative to the largest reference output) of a product of `format` in `prec`:
/// 2e-5 where it is exact to f32; 4-bit rows in the fast precision round x to one int8 plane
/// per group (half a step, max|x_g| / 254, per element).
fn tol(prec: Precision, format: Format) -> f32 {
    match (prec, format) {
        (Precision::Fast, Format::Affine { bits: 4, .. }) => 1e-2,
        _ => 2e-5,
    }
}

#[test]
fn matmul_every_isa_and_format_matches_reference() {
    let _g = serial();
    for (isa, prec) in Isa::all_available()
        .into_iter()
        .flat_map(|i| [(i, Precision::Exact), (i, Precision::Fast)])
    {
        for (fi, &(format, sd)) in FORMATS.iter().enumerate() {
            // Every width of the outer-product kernel's last pass (t mod 6 = 0..5); n = 70 / 21: partial row blocks.
            for &(n, k, t, row0) in &[
                (37, 256, 1, 0),
                (300, 512, 1, 1),
                (70, 256, 5, 2),
                (21, 384, 19, 0),
                (40, 256, 3, 0),
                (48, 128, 4, 1),
                (33, 256, 2, 0),
                (16, 128, 12, 1),
            ] {
                let w = matrix(1, n, k, format, sd, 11 + fi as u64);
                let x = rand_vec((t + row0) * k, 5, -1.0, 1.0);
                let p = MatmulParams {
                    tokens: t as u32,
                    x_row0: row0 as u32,
                };
                let (mut a, mut b) = (vec![f32::NAN; t * n], vec![f32::NAN; t * n]);
                matmul::cpu::matmul_with(isa, prec, &p, &w, &x, &mut a);
                matmul::reference::matmul(&p, &w, &x, &mut b);
                let what = format!("{isa:?} {prec:?} matmul {format:?}/{sd:?} n={n} k={k} t={t}");
                assert_close(&a, &b, tol(prec, format), &what);
                // Where the fast path runs (the decode rows, or the int8 prefill), x rounded to one
                // plane moves the result.
                let engaged = t <= matmul::cpu::GEMV_BATCH_MAX || matmul::cpu::int8_prefill(isa, prec, &w);
                if tol(prec, format) > tol(Precision::Exact, format) && engaged {
                    let mut e = vec![f32::NAN; t * n];
                    matmul::cpu::matmul_with(isa, Precision::Exact, &p, &w, &x, &mut e);
                    assert_ne!(a, e, "{what}: no different from the exact precision");
                }
            }
        }
    }
}

#[test]
fn dequant_every_isa_matches_reference_exactly() {
    let _g = serial();
    for isa in Isa::all_available() {
        for (fi, &(format, sd)) in FORMATS.iter().enumerate() {
            let m = matrix(2, 5, 256, format, sd, 3 + fi as u64);
            let (mut a, mut b) = (vec![0f32; 256], vec![0f32; 256]);
            for (e, r) in [(0, 0), (1, 4), (1, 2)] {
                simd::dequant_row(isa, &m, m.stored_row(e, r), &mut a);
                m.dequant_row(e, r, &mut b);
                assert_eq!(a, b, "{isa:?} {format:?} e={e} r={r}");
            }
        }
    }
}

#[test]
fn gemm_every_pass_width_matches_reference() {
    let _g = serial();
    // 1..=25 tokens: every width of the outer-product kernel's passes (1..=12 on AVX-512, 1..=6 on
    // AVX2) and the even split of the rows over passes (AVX-512: 13 = 7 + 6, 25 = 9 + 8 + 8); 40
    // rows: a full and a partial tile block; 64-column groups of 4-bit rows (the 16-row AVX-512
    // dequantization, then 8 rows and a scalar tail).
    let format = Format::Affine { bits: 4, group: 64 };
    let (n, k) = (40, 192);
    let w = matrix(1, n, k, format, DType::BF16, 31);
    for t in 1..=25 {
        let x = rand_vec(t * k, 7 + t as u64, -1.0, 1.0);
        let p = MatmulParams {
            tokens: t as u32,
            x_row0: 0,
        };
        let mut b = vec![f32::NAN; t * n];
        matmul::reference::matmul(&p, &w, &x, &mut b);
        let mut outer: Option<Vec<f32>> = None;
        for isa in Isa::all_available() {
            let mut a = vec![f32::NAN; t * n];
            matmul::cpu::gemm(isa, &w, 0, &x, t, &mut a);
            assert_close(&a, &b, tol(Precision::Exact, format), &format!("{isa:?} gemm t={t}"));
            // One f32 FMA chain per output in column order, whatever the tile width and pass
            // width: the outer-product ISAs agree to the bit (so the prefill's accuracy is theirs).
            if simd::kmajor_rows(isa) > 0 {
                match &outer {
                    Some(o) => assert!(
                        o.iter().zip(&a).all(|(p, q)| p.to_bits() == q.to_bits()),
                        "{isa:?} gemm t={t}: not bitwise equal to the other outer-product ISA"
                    ),
                    None => outer = Some(a),
                }
            }
        }
    }
}

#[test]
fn kmajor_tiles_match_reference_exactly() {
    let _g = serial();
    for isa in Isa::all_available().into_iter().filter(|&i| simd::kmajor_rows(i) > 0) {
        let r_n = simd::kmajor_rows(isa);
        for (fi, &(format, sd)) in FORMATS.iter().enumerate() {
            // 2304 columns: more groups of 32 (72) than the 4-bit path converts scales for at once (64).
            let (k, rows) = (2304, 2 * r_n + 8);
            let m = matrix(2, rows, k, format, sd, 21 + fi as u64);
            let mut b = vec![0f32; k];
            // Whole 8-row blocks, a partial tail, a tile short of full, at an odd first row; 29 rows:
            // one 16-row block (AVX-512), one of 8 and 5 rows left.
            for (e, r0, rn) in [
                (0, 0, r_n),
                (1, 3, r_n),
                (1, r_n, 13),
                (0, 8, 5),
                (1, 2 * r_n, 8),
                (0, 5, 29.min(r_n)),
            ] {
                let (mut wt, mut row) = (vec![f32::NAN; r_n * k], vec![0f32; k]);
                simd::dequant_kmajor(isa, &m, e, r0..r0 + rn, &mut wt, &mut row);
                for i in 0..rn {
                    m.dequant_row(e, r0 + i, &mut b);
                    let col: Vec<f32> = (0..k).map(|j| wt[j * r_n + i]).collect();
                    assert_eq!(col, b, "{isa:?} {format:?}/{sd:?} e={e} row {}", r0 + i);
                }
            }
        }
    }
}

fn moe_case(isa: Isa, prec: Precision, t: usize, format: Format) {
    let (e_n, i_n, d, k_n) = (12, 64, 128, 4);
    let gate = matrix(e_n, i_n, d, format, DType::BF16, 1);
    let up = matrix(e_n, i_n, d, format, DType::BF16, 2);
    let down = matrix(e_n, d, i_n, format, DType::BF16, 3);
    let x = rand_vec(t * d, 4, -1.0, 1.0);
    // Distinct experts per token, overlapping across tokens (so groups have several tokens);
    // expert 0 takes every token, so one call mixes experts with many and with few tokens.
    let ids: Vec<u32> = (0..t * k_n)
        .map(|i| match i % k_n {
            0 => 0,
            s => 1 + ((i / k_n) * 5 + s * 3) as u32 % (e_n as u32 - 1),
        })
        .collect();
    let w = rand_vec(t * k_n, 6, 0.0, 1.0);
    let p = MoeParams {
        tokens: t as u32,
        top_k: k_n as u32,
    };
    let mut tmp = vec![0f32; t * k_n * (i_n + d)];
    let (mut a, mut b) = (vec![f32::NAN; t * d], vec![f32::NAN; t * d]);
    moe::cpu::moe_experts_with(isa, prec, &p, &x, &ids, &w, &gate, &up, &down, &mut tmp, &mut a);
    moe::reference::moe_experts(&p, &x, &ids, &w, &gate, &up, &down, &mut b);
    let what = format!("{isa:?} {prec:?} moe {format:?} t={t}");
    // Fast: gate / up round x, down rounds silu(g) * u (heavy-tailed: the test's weights are
    // uniform in [-1, 1], so a group's max sits far above its typical element) to one plane each;
    // measured up to 3 % of the largest output. The kernels themselves are held to their exact
    // rounding bound in tests/cpu_int8.rs; this checks the wiring.
    let moe_tol = if tol(prec, format) > tol(Precision::Exact, format) {
        5e-2
    } else {
        tol(prec, format)
    };
    assert_close(&a, &b, moe_tol, &what);
    // The fast precision shows where an expert runs the row kernel: every expert of a batched
    // decode step, those with few tokens in a prefill.
    let fewest = (0..e_n).filter_map(|e| Some(ids.iter().filter(|&&i| i == e as u32).count()).filter(|&n| n > 0));
    let engaged = t <= matmul::cpu::GEMV_BATCH_MAX
        || fewest
            .min()
            .is_some_and(|n| n <= moe::cpu::rows_tokens_max(isa, prec, &gate));
    if tol(prec, format) > tol(Precision::Exact, format) && engaged {
        let mut e = vec![f32::NAN; t * d];
        moe::cpu::moe_experts_with(
            isa,
            Precision::Exact,
            &p,
            &x,
            &ids,
            &w,
            &gate,
            &up,
            &down,
            &mut tmp,
            &mut e,
        );
        assert_ne!(a, e, "{what}: no different from the exact precision");
    }
}

/// `simd::gemm_nn` on every ISA against f64 sums: row counts around the 4-row block, column counts
/// around the vector widths and the 64 / 16-column blocks (masked tails), K = 0, strides wider
/// than the rows, C += and C -=, and lower-triangular A (whose skipped products are zeros).
#[test]
fn gemm_nn_every_isa_matches_naive() {
    let _g = serial();
    for isa in Isa::all_available() {
        let mut seed = 500;
        for &(m, n, k) in &[
            (1usize, 1usize, 1usize),
            (3, 7, 5),
            (4, 8, 64),
            (5, 15, 3),
            (6, 16, 17),
            (7, 17, 0),
            (9, 63, 33),
            (4, 64, 128),
            (13, 65, 40),
            (64, 128, 64),
            (22, 130, 22),
        ] {
            for (sub, lower) in [(false, false), (true, false), (false, true), (true, true)] {
                seed += 1;
                let (lda, ldb, ldc) = (k + 3, n + 5, n + 2);
                let mut a = rand_vec(m * lda, seed, -1.0, 1.0);
                if lower {
                    for i in 0..m {
                        for p in i + 1..k {
                            a[i * lda + p] = 0.0;
                        }
                    }
                }
                let b = rand_vec(k.max(1) * ldb, seed + 1, -1.0, 1.0);
                let c0 = rand_vec(m * ldc, seed + 2, -1.0, 1.0);
                let mut want = c0.clone();
                for i in 0..m {
                    for j in 0..n {
                        let s: f64 = (0..k).map(|p| a[i * lda + p] as f64 * b[p * ldb + j] as f64).sum();
                        let c = c0[i * ldc + j] as f64;
                        want[i * ldc + j] = if sub { c - s } else { c + s } as f32;
                    }
                }
                let mut c = c0.clone();
                let g = simd::GemmNn {
                    m,
                    n,
                    k,
                    lda,
                    ldb,
                    ldc,
                    sub,
                    lower,
                };
                simd::gemm_nn(isa, &g, &a, &b, &mut c);
                // Columns past n of each C row are left as they were.
                for i in 0..m {
                    assert_eq!(
                        c[i * ldc + n..][..ldc - n],
                        c0[i * ldc + n..][..ldc - n],
                        "{isa:?} {g:?}: C past n"
                    );
                }
                assert_close(&c, &want, 1e-5, &format!("gemm_nn {isa:?} {g:?}"));
            }
        }
    }
}

/// The chunked DeltaNet (`delta_net_with`: its products on `simd::gemm_nn`, the substitution in
/// blocks) on every ISA against the step recurrence and the chunked twin (`delta_net::reference`),
/// from a nonzero state: full chunks and a partial one (150 = 64 + 64 + 22), 65 (a chunk and one
/// step), 17 (one substitution block and one row), over the real head dims and small odd ones.
#[test]
fn delta_net_every_isa_matches_reference() {
    let _g = serial();
    for isa in Isa::all_available() {
        for &(hk, hv, dk, dv, t) in &[
            (2usize, 4usize, 128usize, 128usize, 150usize),
            (1, 2, 24, 40, 65),
            (1, 1, 16, 8, 17),
            (1, 2, 48, 24, 150),
        ] {
            let seed = (dk * 7 + dv + t) as u64;
            let DeltaNetInputs {
                qkv,
                a,
                b,
                a_log,
                dt_bias,
                s0,
            } = delta_net_inputs(t, [hk, hv, dk, dv], seed);
            let p = delta_net_params(t, hk, hv, dk, dv);
            let x: delta_net::DeltaNetIn = delta_net::DeltaNetIn::new(&p, &qkv, &a, &b, &a_log, &dt_bias);
            let (mut sa, mut sb, mut sc) = (s0.clone(), s0.clone(), s0);
            let n = t * hv * dv;
            let (mut oa, mut ob, mut oc) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
            delta_net::cpu::delta_net_with(isa, &x, &mut sa, &mut oa);
            delta_net::reference::delta_net(&x.slices(), &mut sb, &mut ob);
            delta_net::reference::delta_net_chunked(&x.slices(), &mut sc, &mut oc, delta_net::cpu::CHUNK);
            let what = format!("delta_net {isa:?} Dk={dk} Dv={dv} T={t}");
            assert_close(&oa, &ob, 2e-5, &format!("{what}: out vs the step recurrence"));
            assert_close(&sa, &sb, 2e-5, &format!("{what}: state vs the step recurrence"));
            assert_close(&oa, &oc, 5e-6, &format!("{what}: out vs the chunked twin"));
            assert_close(&sa, &sc, 5e-6, &format!("{what}: state vs the chunked twin"));
        }
    }
}

#[test]
fn moe_every_isa_matches_reference() {
    let _g = serial();
    for isa in Isa::all_available() {
        for format in [
            Format::Affine { bits: 4, group: 64 },
            Format::Affine { bits: 8, group: 32 },
            Format::BF16,
        ] {
            // 40 tokens: ~13 per expert, two passes of the outer-product kernel.
            for t in [1, 3, 9, 40] {
                moe_case(isa, Precision::Exact, t, format);
                moe_case(isa, Precision::Fast, t, format);
            }
        }
    }
}

#[test]
fn attention_every_isa_matches_reference_across_key_blocks() {
    let _g = serial();
    // Decode past DECODE_SPLIT keys runs split partials; (6 heads per KV head, hd 80) leaves a
    // partial register tile in both rows and dims; 16 heads per KV head take two tiles of 8 rows,
    // 4 a tile with repeated rows; odd lengths leave an odd last key for the 2-key score tile.
    for &((h, kv, hd), t, pos0) in &[
        ((8, 2, 64), 1usize, 0usize),
        ((8, 2, 64), 1, 77),
        ((8, 2, 64), 5, 40),
        ((8, 2, 64), 70, 3),
        ((8, 2, 64), 1, 300),
        ((16, 2, 256), 1, 2100),
        ((16, 1, 64), 1, 332),
        ((6, 1, 80), 1, 700),
        ((6, 1, 80), 1, 5),
        // Decode tasks cover every KV head of a run of keys: 4 KV heads of 4 query heads, 1 KV
        // head per query head; runs of 128 keys and blocks of 64 cut one key short or past.
        ((16, 4, 64), 1, 200),
        ((4, 4, 32), 1, 128),
        ((4, 4, 32), 1, 62),
        ((8, 2, 64), 1, 63),
        // Prefill in place: a chunk crossing key blocks with 4 KV heads, tokens past one 8-row tile.
        ((16, 4, 64), 9, 37),
        ((8, 1, 32), 3, 0),
    ] {
        // Every dtype; segments of 64 rows cut key blocks and decode splits. Every kernel variant:
        // each ISA, and AVX-512 with avx512_bf16 where the CPU has it.
        for (kern, (dtype, seg)) in attention::cpu::Kernels::all_available()
            .into_iter()
            .flat_map(|i| [(KvDtype::F32, 1024), (KvDtype::BF16, 64), (KvDtype::F16, 64)].map(|d| (i, d)))
        {
            let len = pos0 + t;
            let qg = rand_vec(t * h * 2 * hd, 1, -1.0, 1.0);
            let kc = cpu_cache(&rand_vec(len * kv * hd, 2, -1.0, 1.0), kv * hd, dtype, seg);
            let vc = cpu_cache(&rand_vec(len * kv * hd, 3, -1.0, 1.0), kv * hd, dtype, seg);
            let p = AttentionParams {
                tokens: t as u32,
                pos0: pos0 as u32,
                heads: h as u32,
                kv_heads: kv as u32,
                head_dim: hd as u32,
                scale: 0.4,
            };
            let (mut a, mut b) = (vec![f32::NAN; t * h * hd], vec![f32::NAN; t * h * hd]);
            attention::cpu::attention_kernels(kern, &p, &qg, &kc, &vc, &mut a);
            attention::reference::attention(&p, &qg, &kc, &vc, &mut b);
            assert_close(
                &a,
                &b,
                1e-5,
                &format!("{kern:?} attention ({h}, {kv}, {hd}) t={t} pos0={pos0} {dtype:?} seg {seg}"),
            );
        }
    }
}

#[test]
fn gemv_tiles_split_rows_exactly() {
    let _g = serial();
    // Row counts around the task split, including fewer rows than threads.
    let format = Format::Affine { bits: 4, group: 64 };
    for n in [1usize, 2, 3, 57, 58, 1000] {
        let m = matrix(1, n, 128, format, DType::BF16, n as u64);
        let x = rand_vec(128, 9, -1.0, 1.0);
        let (mut a, mut b) = (vec![f32::NAN; n], vec![f32::NAN; n]);
        matmul::cpu::gemv(Isa::get(), Precision::Exact, &m, 0, &x, &mut a);
        matmul::reference::matmul(&MatmulParams { tokens: 1, x_row0: 0 }, &m, &x, &mut b);
        assert_close(&a, &b, 2e-5, &format!("gemv n={n}"));
    }
}

#[test]
fn gemv_many_matches_one_gemv_each() {
    let _g = serial();
    // A layer's projections of one x: 4-bit of several heights (two sharing a prepared x), an
    // 8-bit router, a one-row gate, bf16, 4-bit group 32 (its own prepared x); and a 2-bit
    // matrix, which sends the call to the per-matrix path (one token only: `fuses` keeps a
    // batched step of it apart). One token (decode) and a batched decode step's several (each
    // token's result bit for bit its lone GEMV's, in both precisions).
    let (q4, q8) = (
        Format::Affine { bits: 4, group: 64 },
        Format::Affine { bits: 8, group: 64 },
    );
    let sets: [&[(usize, Format)]; 2] = [
        &[
            (700, q4),
            (33, q8),
            (64, q4),
            (1, q8),
            (9, Format::BF16),
            (50, Format::Affine { bits: 4, group: 32 }),
        ],
        &[(40, q4), (17, Format::Affine { bits: 2, group: 64 })],
    ];
    for prec in [Precision::Exact, Precision::Fast] {
        for (k, set) in sets.iter().enumerate() {
            let ms: Vec<Matrix> = set
                .iter()
                .enumerate()
                .map(|(i, &(rows, f))| matrix(1, rows, 256, f, DType::BF16, 10 * k as u64 + i as u64))
                .collect();
            let refs: Vec<&Matrix> = ms.iter().collect();
            let p = |t: usize| MatmulParams {
                tokens: t as u32,
                x_row0: 0,
            };
            assert!(matmul::cpu::fuses(&p(1), &refs), "set {k}: one token fuses");
            for tokens in [1usize, 3, 8, 9] {
                let fused = matmul::cpu::fuses(&p(tokens), &refs);
                assert_eq!(
                    fused,
                    tokens == 1 || (k == 0 && tokens <= 8),
                    "set {k}, {tokens} tokens: fuses"
                );
                if !fused {
                    continue;
                }
                let x = rand_vec(tokens * 256, 3 + tokens as u64, -1.0, 1.0);
                let mut outs: Vec<Vec<f32>> = ms.iter().map(|m| vec![f32::NAN; tokens * m.rows]).collect();
                let mut slices: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
                matmul::cpu::gemv_many(Isa::get(), prec, &refs, 0, &x, tokens, &mut slices);
                for (m, got) in ms.iter().zip(&outs) {
                    for t in 0..tokens {
                        let mut want = vec![0f32; m.rows];
                        matmul::cpu::gemv(Isa::get(), prec, m, 0, &x[t * 256..][..256], &mut want);
                        assert_eq!(
                            &got[t * m.rows..][..m.rows],
                            &want[..],
                            "gemv_many {prec:?} set {k}, token {t} of {tokens}, {} rows {:?}",
                            m.rows,
                            m.format
                        );
                    }
                }
            }
        }
    }
}

struct DecodeBufs {
    w: Matrix,
    gate: Matrix,
    up: Matrix,
    down: Matrix,
    norm_w: Vec<f32>,
    x: Vec<f32>,
    y: Vec<f32>,
    qg: Vec<f32>,
    kc: CpuKv,
    vc: CpuKv,
    att: Vec<f32>,
    tmp: Vec<f32>,
    out: Vec<f32>,
    qkv: Vec<f32>,
    gates: Vec<f32>,
    state: Vec<f32>,
    core: Vec<f32>,
}

/// The kernels of one decode step at small shapes of the real layout, on preallocated buffers.
fn decode_step_kernels(isa: Isa, s: &mut DecodeBufs) {
    norm::cpu::rms_norm(
        &RmsNormParams {
            rows: 1,
            dim: 128,
            eps: 1e-6,
        },
        &s.x,
        &s.norm_w,
        &mut s.out,
    );
    matmul::cpu::matmul_with(
        isa,
        Precision::Exact,
        &MatmulParams { tokens: 1, x_row0: 0 },
        &s.w,
        &s.x,
        &mut s.y,
    );
    let ap = AttentionParams {
        tokens: 1,
        pos0: 40,
        heads: 8,
        kv_heads: 2,
        head_dim: 64,
        scale: 0.125,
    };
    attention::cpu::attention_with(isa, &ap, &s.qg, &s.kc, &s.vc, &mut s.att);
    let (ids, wt) = ([1u32, 5, 7, 2], [0.4f32, 0.3, 0.2, 0.1]);
    let mp = MoeParams { tokens: 1, top_k: 4 };
    moe::cpu::moe_experts_with(
        isa,
        Precision::Exact,
        &mp,
        &s.x,
        &ids,
        &wt,
        &s.gate,
        &s.up,
        &s.down,
        &mut s.tmp,
        &mut s.out,
    );
    let dp = delta_net_params(1, 2, 4, 32, 32);
    let (a, rest) = s.gates.split_at(4);
    let (b, rest) = rest.split_at(4);
    let (alog, dtb) = rest.split_at(4);
    let x: delta_net::DeltaNetIn = delta_net::DeltaNetIn::new(&dp, &s.qkv, a, b, alog, dtb);
    delta_net::cpu::delta_net(&x, &mut s.state, &mut s.core);
}

#[test]
fn decode_kernels_do_not_allocate_once_warm() {
    let _g = serial();
    let q4 = Format::Affine { bits: 4, group: 64 };
    let mut s = DecodeBufs {
        w: matrix(1, 512, 128, q4, DType::BF16, 1),
        gate: matrix(8, 64, 128, q4, DType::BF16, 2),
        up: matrix(8, 64, 128, q4, DType::BF16, 3),
        down: matrix(8, 128, 64, q4, DType::BF16, 4),
        norm_w: vec![1.0; 128],
        x: rand_vec(128, 5, -1.0, 1.0),
        y: vec![0.0; 512],
        qg: rand_vec(8 * 128, 6, -1.0, 1.0),
        kc: cpu_cache(&rand_vec(41 * 128, 7, -1.0, 1.0), 128, KvDtype::BF16, 1024),
        vc: cpu_cache(&rand_vec(41 * 128, 8, -1.0, 1.0), 128, KvDtype::BF16, 1024),
        att: vec![0.0; 8 * 64],
        tmp: vec![0.0; 4 * (64 + 128)],
        out: vec![0.0; 128],
        qkv: rand_vec(2 * 2 * 32 + 4 * 32, 9, -1.0, 1.0),
        gates: rand_vec(16, 10, -1.0, 1.0),
        state: vec![0.0; 4 * 32 * 32],
        core: vec![0.0; 4 * 32],
    };
    let isa = Isa::get();
    // Warm every pool thread's scratch (which thread runs which task varies).
    // Each step runs as the engine runs it: one task of the pool (`Backend::run`).
    let step = |s: &mut DecodeBufs| Cpu::run(|| decode_step_kernels(isa, s));
    for _ in 0..50 {
        step(&mut s);
    }
    // The test harness may allocate on its own thread meanwhile (reporting another test), so a
    // per-step allocation must show in every round; a stray one in a single round is not ours.
    let n = (0..3)
        .map(|_| {
            let before = alloc_common::all_allocations();
            for _ in 0..20 {
                step(&mut s);
            }
            alloc_common::all_allocations() - before
        })
        .min()
        .unwrap_or(0);
    // The pool allocates nothing per loop or session; an allocation inside a kernel would add
    // at least one per step (20 per round).
    assert_eq!(n, 0, "{n} allocations in 20 warm decode steps");
}

#[test]
fn vector_exp_matches_libm() {
    // Every 1/1024 from -87 to 88, against f64 exp: relative error within 3 ulp.
    let mut worst = 0f64;
    for i in -87 * 1024..=88 * 1024 {
        let x = i as f32 / 1024.0;
        let (got, want) = (simd::exp(x) as f64, (x as f64).exp());
        worst = worst.max(((got - want) / want).abs());
    }
    assert!(worst < 3.0 * f32::EPSILON as f64, "exp: worst relative error {worst:e}");
    // Outside the clamp: tiny / huge but finite; NaN stays NaN.
    assert!(simd::exp(f32::NEG_INFINITY) < 1e-37 && simd::exp(-1e4) >= 0.0);
    assert!(simd::exp(100.0).is_finite() && simd::exp(100.0) > 1e38);
    assert!(simd::exp(f32::NAN).is_nan());
    for i in -2000..=2000 {
        let x = i as f32 / 50.0;
        let (s, r) = (simd::silu(x), silu(x));
        assert!((s - r).abs() <= 1e-6 * r.abs().max(1.0), "silu({x}): {s} vs {r}");
        let (s, r) = (simd::sigmoid(x), sigmoid(x));
        assert!((s - r).abs() <= 1e-6, "sigmoid({x}): {s} vs {r}");
    }
}
