//! The attention family (qk_norm_rope, kv_store, attention): the CPU kernels and the GPU
//! kernels (Metal and CUDA, simulators and devices: `gpu_tests!`) against the reference twins, and RoPE itself on
//! hand-computed values. The KV caches are tried in every dtype (f32, bf16, f16) and with small
//! segments, so chunks and decode steps cross segment boundaries.

mod common;
#[macro_use]
mod gpu_common;

use common::{
    assert_close, attention_params, filled_cache, one_row, one_row_buffers, rand_vec, rope_params, run_attention,
};
use gpu_common::{assert_near, read_all, TOL};
use lily_core::{
    backend::{
        cpu::Cpu,
        cuda::{Cuda, Executor as CudaExecutor},
        metal::{Executor, Metal},
        params::{AttentionParams, KvStoreParams, RowsParams},
        Backend, KvDtype,
    },
    ops::attention::reference::norm_rope_head,
};

mod cpu {
    use super::*;
    use lily_core::{
        backend::{params::RopeParams, AttentionBatch, KvSeq},
        ops::attention::cpu::{attention_batch_kernels, attention_kernels, Kernels},
    };

    /// A batched decode step's attention core (`qk_norm_rope_store_attention_batch`: every
    /// sequence's norms, then its key runs, then its merges, one pool loop each) against each row
    /// run alone through `qk_norm_rope_store_attention` on its own caches: outputs and the stored
    /// rows bit for bit. Sequences at positions 0 to 300 (1 to 3 key runs of 128 at two threads,
    /// more at more), every dtype, segments of 16 and 1024; then `attention_batch` on every kernel
    /// variant this CPU has against `attention` on that variant.
    #[test]
    fn attention_batch_is_each_row_alone() {
        let b = Cpu::new();
        let (h, kv, hd, rot) = (8usize, 2usize, 256usize, 64);
        let (qw, width) = (h * 2 * hd, kv * hd);
        let rope = RopeParams {
            tokens: 0,
            pos0: 0,
            heads: h as u32,
            kv_heads: kv as u32,
            head_dim: hd as u32,
            rotary_dim: rot,
            eps: 1e-6,
            theta: 1e4,
        };
        let attn = AttentionParams {
            tokens: 0,
            pos0: 0,
            heads: h as u32,
            kv_heads: kv as u32,
            head_dim: hd as u32,
            scale: 1.0 / 16.0,
        };
        let (qn, kn) = (rand_vec(hd, 3, 0.5, 1.5), rand_vec(hd, 4, 0.5, 1.5));
        for positions in [&[37usize][..], &[0, 300, 130, 64, 17]] {
            let n = positions.len();
            let qg0 = rand_vec(n * qw, 1, -2.0, 2.0);
            let (k0, v) = (rand_vec(n * width, 2, -2.0, 2.0), rand_vec(n * width, 5, -1.0, 1.0));
            for dtype in [KvDtype::F32, KvDtype::BF16, KvDtype::F16] {
                for seg in [16, 1024] {
                    let cache = |i: usize, seed: u64| {
                        let mut c = filled_cache(&b, width, positions[i], 512, dtype, seg, seed + 10 * i as u64);
                        b.kv_reserve(&mut c, positions[i] + 1).unwrap();
                        c
                    };
                    let mut kcs: Vec<_> = (0..n).map(|i| cache(i, 7)).collect();
                    let mut vcs: Vec<_> = (0..n).map(|i| cache(i, 8)).collect();
                    let mut seqs: Vec<KvSeq<'_, _>> = kcs
                        .iter_mut()
                        .zip(vcs.iter_mut())
                        .zip(positions)
                        .map(|((k, v), &pos)| KvSeq { k, v, pos })
                        .collect();
                    let r = AttentionBatch::<Cpu> {
                        rope: RopeParams {
                            tokens: n as u32,
                            ..rope
                        },
                        attn: AttentionParams {
                            tokens: n as u32,
                            ..attn
                        },
                        q_norm: &qn,
                        k_norm: &kn,
                        v: &v,
                    };
                    let mut row = one_row_buffers(qw);
                    let mut one = one_row(&mut row);
                    let (mut qg, mut k, mut out) = (qg0.clone(), k0.clone(), vec![0f32; n * h * hd]);
                    b.qk_norm_rope_store_attention_batch(&r, &mut seqs, &mut qg, &mut k, &mut one, &mut out)
                        .unwrap();
                    for (i, &pos) in positions.iter().enumerate() {
                        let what = format!("{dtype:?} KV, segments of {seg}, row {i} at {pos}");
                        let (mut kc, mut vc) = (cache(i, 7), cache(i, 8));
                        let mut q1 = qg0[i * qw..][..qw].to_vec();
                        let mut k1 = k0[i * width..][..width].to_vec();
                        let mut out1 = vec![0f32; h * hd];
                        let (rope1, attn1) = (
                            RopeParams {
                                tokens: 1,
                                pos0: pos as u32,
                                ..rope
                            },
                            AttentionParams {
                                tokens: 1,
                                pos0: pos as u32,
                                ..attn
                            },
                        );
                        let v1 = v[i * width..][..width].to_vec();
                        b.qk_norm_rope_store_attention(
                            &rope1, &attn1, &qn, &kn, &mut q1, &mut k1, &v1, &mut kc, &mut vc, &mut out1,
                        );
                        assert!(bits(&out[i * h * hd..][..h * hd]) == bits(&out1), "{what}: output");
                        assert!(
                            bits(&rows(&b, &kcs[i], pos + 1)) == bits(&rows(&b, &kc, pos + 1)),
                            "{what}: K"
                        );
                        assert!(
                            bits(&rows(&b, &vcs[i], pos + 1)) == bits(&rows(&b, &vc, pos + 1)),
                            "{what}: V"
                        );
                        if dtype == KvDtype::BF16 && seg == 16 {
                            // The same attention on every kernel variant (bf16 dots included).
                            for kern in Kernels::all_available() {
                                let seqs: Vec<KvSeq<'_, _>> = kcs
                                    .iter_mut()
                                    .zip(vcs.iter_mut())
                                    .zip(positions)
                                    .map(|((k, v), &pos)| KvSeq { k, v, pos })
                                    .collect();
                                let mut all = vec![0f32; n * h * hd];
                                attention_batch_kernels(kern, &r.attn, &qg, &seqs, &mut all);
                                attention_kernels(kern, &attn1, &qg[i * qw..][..qw], &kc, &vc, &mut out1);
                                let got = &all[i * h * hd..][..h * hd];
                                assert!(bits(got) == bits(&out1), "{what}: {kern:?}");
                            }
                        }
                    }
                }
            }
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn attention_path_matches_reference() {
        let (fast, refr) = (Cpu::new(), Cpu::reference());
        // Real per-head shapes: hd 256, rotary 64, 8 query heads per KV head.
        let (h, kv, hd, t, pos0) = (8, 1, 256, 9, 5);
        let p = rope_params(t, pos0, h, kv, hd, 64, 1e4);
        let qg0 = rand_vec(t * h * 2 * hd, 1, -2.0, 2.0);
        let k0 = rand_vec(t * kv * hd, 2, -2.0, 2.0);
        let (qn, kn) = (rand_vec(hd, 3, 0.5, 1.5), rand_vec(hd, 4, 0.5, 1.5));
        let (mut qa, mut ka, mut qb, mut kb) = (qg0.clone(), k0.clone(), qg0.clone(), k0.clone());
        fast.qk_norm_rope(&p, &qn, &kn, &mut qa, &mut ka);
        refr.qk_norm_rope(&p, &qn, &kn, &mut qb, &mut kb);
        assert_close(&qa, &qb, 1e-6, "qk_norm_rope q");
        assert_close(&ka, &kb, 1e-6, "qk_norm_rope k");
        // Caches with pos0 earlier rows, then this chunk's keys appended; every dtype, segments
        // of 4 rows (a block of keys ends at each boundary) and of 1024.
        let width = kv * hd;
        let v = rand_vec(t * width, 7, -1.0, 1.0);
        let sp = KvStoreParams {
            tokens: t as u32,
            pos0: pos0 as u32,
            width: width as u32,
        };
        let ap = attention_params(t, pos0, h, kv, hd); // scale 1 / 16
        for dtype in [KvDtype::F32, KvDtype::BF16, KvDtype::F16] {
            for seg in [4, 1024] {
                let what = format!("{dtype:?} KV, segments of {seg}");
                let mut kc = filled_cache(&fast, width, pos0, 32, dtype, seg, 5);
                let mut vc = filled_cache(&fast, width, pos0, 32, dtype, seg, 6);
                let mut kc2 = filled_cache(&fast, width, pos0, 32, dtype, seg, 5);
                fast.kv_reserve(&mut kc, pos0 + t).unwrap();
                fast.kv_reserve(&mut kc2, pos0 + t).unwrap();
                fast.kv_reserve(&mut vc, pos0 + t).unwrap();
                fast.kv_store(&sp, &ka, &mut kc);
                refr.kv_store(&sp, &ka, &mut kc2);
                assert_eq!(
                    rows(&fast, &kc, pos0 + t),
                    rows(&fast, &kc2, pos0 + t),
                    "{what}: kv_store"
                );
                fast.kv_store(&sp, &v, &mut vc);
                let (mut a, mut b) = (vec![0f32; t * h * hd], vec![0f32; t * h * hd]);
                fast.attention(&ap, &qa, &kc, &vc, &mut a);
                refr.attention(&ap, &qa, &kc, &vc, &mut b);
                assert_close(&a, &b, 1e-5, &format!("{what}: attention"));
                // Decode steps on the same caches, across the next segment boundaries.
                for step in 0..6 {
                    let pos = pos0 + t + step;
                    fast.kv_reserve(&mut kc, pos + 1).unwrap();
                    fast.kv_reserve(&mut vc, pos + 1).unwrap();
                    let one = KvStoreParams {
                        tokens: 1,
                        pos0: pos as u32,
                        width: width as u32,
                    };
                    fast.kv_store(&one, &rand_vec(width, 80 + step as u64, -1.0, 1.0), &mut kc);
                    fast.kv_store(&one, &rand_vec(width, 90 + step as u64, -1.0, 1.0), &mut vc);
                    let q = rand_vec(h * 2 * hd, 100 + step as u64, -2.0, 2.0);
                    let dp = AttentionParams {
                        tokens: 1,
                        pos0: pos as u32,
                        ..ap
                    };
                    let (mut a, mut b) = (vec![0f32; h * hd], vec![0f32; h * hd]);
                    fast.attention(&dp, &q, &kc, &vc, &mut a);
                    refr.attention(&dp, &q, &kc, &vc, &mut b);
                    assert_close(&a, &b, 1e-5, &format!("{what}: decode step {step}"));
                }
            }
        }
    }

    fn rows(b: &Cpu, kv: &<Cpu as Backend>::Kv, n: usize) -> Vec<f32> {
        let mut out = vec![0f32; n * kv.width];
        b.kv_read(kv, 0, &mut out).unwrap();
        out
    }

    #[test]
    fn kv_dtypes_round_to_nearest_even_and_widen_exactly() {
        let b = Cpu::new();
        let x = vec![
            1.0,
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-9),
            -65504.0,
            1e-3,
            f32::NAN,
            3.0e38,
            -0.0,
        ];
        // bf16 keeps 8 significant bits: 1 + 2^-8 is a tie (rounds to even: 1.0), 1 + 3 * 2^-9
        // rounds up to 1 + 2^-7; f16's range ends at 65504 (3e38 overflows to infinity).
        let want_bf16 = [
            1.0,
            1.0,
            1.0 + 2f32.powi(-7),
            -65536.0,
            0.0009994507,
            f32::NAN,
            3.0040553e38,
            -0.0,
        ];
        let want_f16 = [
            1.0,
            1.0 + 2f32.powi(-8),
            1.0 + 6.0 / 1024.0,
            -65504.0,
            0.0010004044,
            f32::NAN,
            f32::INFINITY,
            -0.0,
        ];
        for (dtype, want) in [(KvDtype::BF16, want_bf16), (KvDtype::F16, want_f16)] {
            let mut kv = b.kv_new(x.len(), dtype, 4, 16).unwrap();
            b.kv_reserve(&mut kv, 1).unwrap();
            let p = KvStoreParams {
                tokens: 1,
                pos0: 0,
                width: x.len() as u32,
            };
            b.kv_store(&p, &x, &mut kv);
            let got = rows(&b, &kv, 1);
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                assert!(
                    g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                    "{dtype:?} [{i}]: {g} vs {w}"
                );
            }
        }
    }

    #[test]
    fn segments_grow_on_demand_and_trim_gives_them_back() {
        let b = Cpu::new();
        let mut kv = b.kv_new(512, KvDtype::BF16, 100, 16).unwrap();
        assert_eq!((b.kv_rows(&kv), b.kv_bytes(&kv)), (0, 0));
        b.kv_reserve(&mut kv, 17).unwrap();
        assert_eq!((b.kv_rows(&kv), b.kv_bytes(&kv)), (32, 32 * 512 * 2));
        b.kv_reserve(&mut kv, 5).unwrap(); // never shrinks
        assert_eq!(b.kv_rows(&kv), 32);
        let err = b.kv_reserve(&mut kv, 101).unwrap_err().to_string();
        assert!(err.contains("101") && err.contains("100"), "{err}");
        b.kv_trim(&mut kv, 1);
        assert_eq!(b.kv_rows(&kv), 16);
        b.kv_trim(&mut kv, 0);
        assert_eq!(b.kv_rows(&kv), 0);
        assert!(
            b.kv_new(8, KvDtype::F32, 4, 12).is_err(),
            "segments must be a power of two"
        );
    }

    #[test]
    fn rope_rotates_only_the_rotary_dims() {
        // RMSNorm with w = 1 then RoPE at position 0 is the identity rotation: only the norm acts.
        let mut v: Vec<f32> = (0..8).map(|i| i as f32 + 1.0).collect();
        let ms = v.iter().map(|x| x * x).sum::<f32>() / 8.0;
        let normed: Vec<f32> = v.iter().map(|x| x / (ms + 1e-6).sqrt()).collect();
        norm_rope_head(&mut v, &[1.0; 8], 1e-6, 4, 100.0, 0);
        assert_close(&v, &normed, 1e-6, "pos 0");
        // At position 1, dims 4..8 are untouched and (0, 2) rotate by angle 1 rad (inv_freq_0 = 1).
        let mut w = normed.clone();
        norm_rope_head(&mut w, &[1.0; 8], 0.0, 4, 100.0, 1);
        assert_close(&w[4..], &normed[4..], 1e-6, "pass-through dims");
        let (c, s) = (1f32.cos(), 1f32.sin());
        assert!((w[0] - (normed[0] * c - normed[2] * s)).abs() < 1e-5);
        assert!((w[2] - (normed[2] * c + normed[0] * s)).abs() < 1e-5);
    }
}

gpu_tests!(
    qk_norm_rope_matches_reference,
    qk_norm_rope_store_matches_reference,
    kv_store_matches_reference,
    attention_matches_reference,
    attention_peaky_scores_match_reference,
    attention_other_head_groups_match_reference,
    unsupported_shape_is_an_error_not_a_panic,
    kv_copy_matches_reference,
    kv_share_copies_on_write;
    metal: attention_splits_match_reference;
    cuda: attention_decode_long_matches_reference, qk_norm_rope_store_attention_matches_reference,
        attention_one_warp_a_head_matches_reference, decode_of_more_than_16_heads_a_kv_head_is_an_error,
);

fn qk_norm_rope_matches_reference<B: Backend>(dev: &mut B, tolx: f32) {
    // Small theta makes rotation errors loud; the second case has the real head shapes.
    for (t, pos0, h, kv, hd, rot, theta) in [(3, 5, 4, 2, 64, 16, 100.0), (2, 40, 16, 2, 256, 64, 1e7)] {
        let p = rope_params(t, pos0, h, kv, hd, rot, theta);
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
fn qk_norm_rope_store_matches_reference<B: Backend>(dev: &mut B, tolx: f32) {
    for (t, pos0, h, kv, hd, rot, dtype) in [
        (5, 6, 4, 2, 64, 16, KvDtype::BF16),
        (5, 6, 4, 2, 64, 16, KvDtype::F16),
        (1, 9, 16, 2, 256, 64, KvDtype::F32),
    ] {
        let p = rope_params(t, pos0, h, kv, hd, rot, 100.0);
        let w = kv * hd;
        let rows = pos0 + t;
        let qg = rand_vec(t * h * 2 * hd, 44, -2.0, 2.0);
        let (k, v) = (rand_vec(t * w, 45, -2.0, 2.0), rand_vec(t * w, 46, -2.0, 2.0));
        let (qn, kn) = (rand_vec(hd, 47, 0.5, 1.5), rand_vec(hd, 48, 0.5, 1.5));
        // 16-bit caches round: a rounding step of the stored value is the tolerance there.
        let tol = if dtype == KvDtype::F32 { tolx * 1e-4 } else { 1e-2 };
        both!(dev, tol, format!("qk_norm_rope_store hd={hd} {dtype:?}"), b => {
            let (qnb, knb, vb) = (b.upload(&qn).unwrap(), b.upload(&kn).unwrap(), b.upload(&v).unwrap());
            let (mut qb, mut kb) = (b.upload(&qg).unwrap(), b.upload(&k).unwrap());
            let mut kc = filled_cache(b, w, pos0, rows, dtype, 4, 49);
            let mut vc = filled_cache(b, w, pos0, rows, dtype, 4, 50);
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
fn kv_store_matches_reference<B: Backend>(dev: &mut B, tolx: f32) {
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

/// (H, Hkv, hd, pos0, T, decode steps, dtype, segment rows): partial tiles; GQA groups of 2, 4
/// and 8 (the real head shapes: 8 per KV head, hd 256); every cache dtype; segments of 4 and 16
/// rows put boundaries inside tiles and splits; a sequence past 1024 rows crosses a default-size
/// segment. A prefill of T tokens on pos0 cached rows, then the decode steps.
/// The prefill chunks also cover CUDA's `attention_prefill` blocks (64 query rows: 64 / G tokens
/// of the G heads of a KV head): several blocks with a partial last one (17, 19 and 21 tokens at
/// G = 8, 40 at G = 4, 75 at G = 3, whose blocks of 21 tokens x 3 heads leave a row unused), every
/// dtype at the real head shapes, chunks starting mid-cache (pos0 > 0) across segment boundaries.
const ATTENTION_CASES: [AttentionCase; 10] = [
    (4, 2, 32, 0, 13, 0, KvDtype::F32, 1024),
    (8, 2, 64, 3, 5, 2, KvDtype::BF16, 4),
    (4, 1, 32, 30, 1, 3, KvDtype::F16, 16),
    (16, 2, 256, 20, 3, 1, KvDtype::BF16, 16),
    (4, 2, 32, 1100, 2, 2, KvDtype::BF16, 1024),
    (16, 2, 256, 37, 21, 0, KvDtype::F16, 16),
    (16, 2, 256, 45, 19, 1, KvDtype::F32, 32),
    (16, 2, 256, 9, 17, 0, KvDtype::BF16, 8),
    (8, 2, 64, 50, 40, 0, KvDtype::BF16, 64),
    (6, 2, 32, 5, 75, 0, KvDtype::F16, 8),
];

/// (H, Hkv, hd, pos0, T, decode steps, dtype, segment rows).
type AttentionCase = (usize, usize, usize, usize, usize, usize, KvDtype, usize);

/// `ATTENTION_CASES` on `dev` as it is set up, against the reference.
fn attention_cases<B: Backend>(dev: &B, tolx: f32, what: &str) {
    for case in ATTENTION_CASES {
        attention_case(dev, tolx, case, what);
    }
}

/// One case's prefill and decode steps on `dev` against the reference, call by call (q of
/// amplitude 1.5: a nearly flat softmax).
fn attention_case<B: Backend>(dev: &B, tolx: f32, case: AttentionCase, what: &str) {
    attention_case_q(dev, tolx, case, what, 1.5);
}

/// [`attention_case`] with q (and the gate) uniform in [-q_amp, q_amp].
fn attention_case_q<B: Backend>(dev: &B, tolx: f32, case: AttentionCase, what: &str, q_amp: f32) {
    let (h, kv, hd, pos0, t, steps, dtype, seg) = case;
    let want = run_attention(&Cpu::reference(), h, kv, hd, pos0, t, steps, dtype, seg, q_amp);
    let got = run_attention(dev, h, kv, hd, pos0, t, steps, dtype, seg, q_amp);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_near(
            g,
            w,
            tolx * TOL,
            &format!("attention H={h} Hkv={kv} hd={hd} {dtype:?} seg {seg}{what}, call {i}"),
        );
    }
}

fn attention_matches_reference<B: Backend>(dev: &mut B, tolx: f32) {
    attention_cases(&*dev, tolx, "");
}

/// A peaky softmax, as a trained model's: q of amplitude 12 gives scores of std ~4 at hd 256, so a
/// few rows carry most of the weight and an error in one row's score or probability is not
/// averaged away over hundreds of near-equal weights (the cases above, at amplitude 1.5, have a
/// nearly flat softmax). The decode at the real head shapes, every dtype, one stage and several,
/// then a prefill.
fn attention_peaky_scores_match_reference<B: Backend>(dev: &mut B, tolx: f32) {
    for case in [
        (16, 2, 256, 20, 1, 2, KvDtype::BF16, 16),
        (16, 2, 256, 300, 1, 2, KvDtype::BF16, 64),
        (16, 2, 256, 1100, 1, 1, KvDtype::F16, 1024),
        (16, 2, 256, 45, 1, 1, KvDtype::F32, 32),
        (16, 2, 256, 9, 17, 0, KvDtype::BF16, 8),
    ] {
        attention_case_q(&*dev, tolx, case, ", q amplitude 12", 12.0);
    }
}

/// Decode at hd 256 with GQA groups other than the model's 8, which change how a block's warps
/// share the query heads (CUDA: two heads a warp where the group is even, one where it is odd or
/// where the parts' merge would not fit a stage; one warp a head where two would not fit 512
/// threads): 16 (32 heads on 2 KV heads), 6, 5 and 4, short and past 1024 rows, in every dtype.
fn attention_other_head_groups_match_reference<B: Backend>(dev: &mut B, tolx: f32) {
    for case in [
        (32, 2, 256, 40, 1, 2, KvDtype::BF16, 16),
        (32, 2, 256, 1100, 1, 1, KvDtype::BF16, 256),
        (12, 2, 256, 1100, 1, 1, KvDtype::BF16, 1024),
        (10, 2, 256, 77, 1, 2, KvDtype::F32, 32),
        (8, 2, 256, 300, 1, 2, KvDtype::F16, 64),
    ] {
        attention_case(&*dev, tolx, case, ", other head groups");
    }
}

/// Metal's decode splits the keys (flash decoding) past `split_rows`: at 16 rows every decode
/// case above takes the split path, and with at most 2 splits the split rows grow past 16 (17
/// rows, not a multiple of the tile, at 34 rows).
fn attention_splits_match_reference<X: Executor>(dev: &mut Metal<X>, tolx: f32) {
    let saved = (dev.split_rows, dev.max_splits);
    for max_splits in [dev.max_splits, 2] {
        (dev.split_rows, dev.max_splits) = (16, max_splits);
        attention_cases(&*dev, tolx, &format!(", splits of 16+ rows, at most {max_splits}"));
    }
    (dev.split_rows, dev.max_splits) = saved;
}

/// CUDA's decode attention past 1024 rows at the real head shapes (16 heads on 2 KV heads, hd 256):
/// splits of 32 rows (a bf16 stage of two tiles, the pair loads of hd % 64 == 0), most of the
/// 64 splits non-empty, so both levels of the in-launch combine add several partials; every
/// dtype; segment boundaries inside splits. Several calls in a row: the split counters must be
/// back at 0 after each.
fn attention_decode_long_matches_reference<B: Backend>(dev: &mut B, tolx: f32) {
    for (pos0, steps, dtype, seg) in [
        (1300, 2, KvDtype::BF16, 256),
        (1100, 1, KvDtype::F16, 1024),
        (1030, 1, KvDtype::F32, 64),
    ] {
        let what = format!(", decode at {pos0} rows");
        attention_case(&*dev, tolx, (16, 2, 256, pos0, 1, steps, dtype, seg), &what);
    }
}

/// CUDA's decode attention with one warp per query head (`LILY_CUDA_ATTENTION_WARPS=1`, and the
/// path of shapes whose two warps a head would not fit a block): the default runs two, each
/// scoring every other sub-tile and merging through shared memory, so this path is not otherwise
/// taken at the real head shapes. The plain cases, long decodes, and the fused launch.
fn attention_one_warp_a_head_matches_reference<X: CudaExecutor>(dev: &mut Cuda<X>, tolx: f32) {
    let saved = dev.attention_warps;
    dev.attention_warps = 1;
    attention_cases(&*dev, tolx, ", one warp a head");
    attention_decode_long_matches_reference(dev, tolx);
    qk_norm_rope_store_attention_matches_reference(dev, tolx);
    dev.attention_warps = saved;
}

/// CUDA's decode attention runs a KV head's query heads in one block of at most 512 threads: a
/// decode of 32 heads on one KV head is a typed error (a prefill chunk of them still runs), and the
/// stream stays usable.
fn decode_of_more_than_16_heads_a_kv_head_is_an_error<X: CudaExecutor>(dev: &mut Cuda<X>, tolx: f32) {
    let m = &*dev;
    let (h, kv, hd) = (32usize, 1usize, 64usize);
    let p = AttentionParams {
        tokens: 1,
        pos0: 3,
        heads: h as u32,
        kv_heads: kv as u32,
        head_dim: hd as u32,
        scale: 1.0,
    };
    let qg = m.alloc(h * 2 * hd).unwrap();
    let kc = filled_cache(m, kv * hd, 4, 64, KvDtype::BF16, 16, 1);
    let mut out = m.alloc(h * hd).unwrap();
    m.attention(&p, &qg, &kc, &kc, &mut out);
    let err = m.finish().unwrap_err().to_string();
    assert!(err.contains("32 query heads per KV head"), "{err}");
    m.finish().unwrap();
    attention_case(
        m,
        tolx,
        (32, 1, 64, 3, 5, 0, KvDtype::BF16, 16),
        ", 32 heads a KV head, prefill",
    );
}

/// `qk_norm_rope_store_attention` (CUDA: one launch for a decode step, the attention blocks norm
/// and rope q and the block holding the new row stores it) against the reference's two ops: the
/// output and both caches after three decode steps in a row (the split counters back at 0, the
/// new row moving through a stage), at the real head shapes in every dtype (the new row in the
/// first and in the second tile of a stage, on segment boundaries) and at small heads (hd 32: one
/// dim a lane; hd 64) with rotary dims not a multiple of 32; a prefill chunk takes the two ops.
fn qk_norm_rope_store_attention_matches_reference<B: Backend>(dev: &mut B, tolx: f32) {
    for case in [
        (16, 2, 256, 64, 9, 1, KvDtype::BF16, 16),
        (16, 2, 256, 64, 1300, 1, KvDtype::BF16, 256),
        (16, 2, 256, 64, 1055, 1, KvDtype::F16, 32),
        (16, 2, 256, 64, 47, 1, KvDtype::F32, 16),
        (4, 2, 32, 16, 30, 1, KvDtype::F16, 4),
        (8, 2, 64, 24, 70, 1, KvDtype::BF16, 8),
        (16, 2, 256, 64, 20, 5, KvDtype::BF16, 16),
    ] {
        let (h, _, hd, _, pos0, _, dtype, _) = case;
        let want = fused_attention_steps(&Cpu::reference(), case);
        let got = fused_attention_steps(&*dev, case);
        // 16-bit caches round: a rounding step of a stored value is the cache's tolerance there.
        let (tol_out, tol_cache) = if dtype == KvDtype::F32 {
            (tolx * 1e-4, tolx * 1e-4)
        } else {
            (tolx * 1e-3, 1e-2)
        };
        let n = got.len();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let (tol, what) = if i + 2 < n {
                (tol_out, "out")
            } else {
                (tol_cache, "cache")
            };
            let at = format!("qk_norm_rope_store_attention H={h} hd={hd} at {pos0} {dtype:?}: {what} {i}");
            assert_near(g, w, tol, &at);
        }
    }
}

/// A chunk of T tokens then 3 decode steps through `qk_norm_rope_store_attention` on a cache of
/// pos0 rows: each call's out, then both caches. Case (H, Hkv, hd, rotary_dim, pos0, T, dtype,
/// segment rows).
fn fused_attention_steps<B: Backend>(
    b: &B,
    (h, kv, hd, rot, pos0, t, dtype, seg): (usize, usize, usize, usize, usize, usize, KvDtype, usize),
) -> Vec<Vec<f32>> {
    let (w, steps) = (kv * hd, 3);
    let rows = pos0 + t + steps;
    let (qn, kn) = (rand_vec(hd, 90, 0.5, 1.5), rand_vec(hd, 91, 0.5, 1.5));
    let (qnb, knb) = (b.upload(&qn).unwrap(), b.upload(&kn).unwrap());
    let mut kc = filled_cache(b, w, pos0, rows, dtype, seg, 92);
    let mut vc = filled_cache(b, w, pos0, rows, dtype, seg, 93);
    let mut outs = Vec::new();
    let mut pos = pos0;
    for (i, n) in std::iter::once(t).chain(std::iter::repeat_n(1, steps)).enumerate() {
        let i = i as u64;
        let mut qg = b.upload(&rand_vec(n * h * 2 * hd, 94 + i, -2.0, 2.0)).unwrap();
        let mut k = b.upload(&rand_vec(n * w, 100 + i, -2.0, 2.0)).unwrap();
        let v = b.upload(&rand_vec(n * w, 110 + i, -2.0, 2.0)).unwrap();
        let mut out = b.alloc(n * h * hd).unwrap();
        b.kv_reserve(&mut kc, pos + n).unwrap();
        b.kv_reserve(&mut vc, pos + n).unwrap();
        let rope = rope_params(n, pos, h, kv, hd, rot, 1e4);
        let p = attention_params(n, pos, h, kv, hd);
        b.qk_norm_rope_store_attention(&rope, &p, &qnb, &knb, &mut qg, &mut k, &v, &mut kc, &mut vc, &mut out);
        b.finish().unwrap();
        outs.push(read_all(b, &out, n * h * hd));
        pos += n;
    }
    let (mut ko, mut vo) = (vec![0f32; pos * w], vec![0f32; pos * w]);
    b.kv_read(&kc, 0, &mut ko).unwrap();
    b.kv_read(&vc, 0, &mut vo).unwrap();
    outs.push(ko);
    outs.push(vo);
    outs
}

/// Shapes the kernels do not support (a head_dim not a multiple of 32, buffers too small) are
/// errors from `finish` naming the op, not faults, and the backend keeps working after one.
fn unsupported_shape_is_an_error_not_a_panic<B: Backend>(dev: &mut B, tolx: f32) {
    let m = &*dev;
    for (t, h, kv) in [(1usize, 4usize, 2usize), (2, 3, 1)] {
        let p = AttentionParams {
            tokens: t as u32,
            pos0: 0,
            heads: h as u32,
            kv_heads: kv as u32,
            head_dim: 48,
            scale: 1.0,
        };
        let qg = m.alloc(t * h * 2 * 48).unwrap();
        let kc = filled_cache(m, kv * 48, t, 64, KvDtype::BF16, 16, 1);
        let mut out = m.alloc(t * h * 48).unwrap();
        m.attention(&p, &qg, &kc, &kc, &mut out);
        let err = m.finish().unwrap_err().to_string();
        assert!(err.contains("attention") && err.contains("48"), "{err}");
        m.finish().unwrap(); // the error is reported once; the stream is usable again
    }
    let small = m.alloc(4).unwrap();
    let mut o = m.alloc(4).unwrap();
    let rp = RowsParams { tokens: 2, dim: 4 };
    m.swiglu(&rp, &small, &small, &mut o);
    let err = m.finish().unwrap_err().to_string();
    assert!(err.contains("swiglu") && err.contains("needs 8"), "{err}");
    // Still computing right.
    qk_norm_rope_matches_reference(dev, tolx);
}

/// kv_copy: rows 0..11 of a cache in segments of 4 (three segments, the last partly) copied into
/// a fresh cache bit for bit, in every dtype; the rows past them are left alone; a copy between
/// different layouts or of rows the source lacks is an error.
fn kv_copy_matches_reference<B: Backend>(dev: &mut B, tolx: f32) {
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
            assert_eq!(got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
            b.kv_read(&dst, 11, &mut kept).unwrap();
            let mut other = b.kv_new(w + 1, dtype, 32, 4).unwrap();
            b.kv_reserve(&mut other, 11).unwrap();
            assert!(b.kv_copy(&src, &mut other, 11).is_err(), "different widths");
            assert!(b.kv_copy(&src, &mut dst, 17).is_err(), "rows the source lacks");
            vec![got, kept]
        });
    }
}

/// kv_share: a cache sharing rows 0..11 of a 14-row source in segments of 4 holds the source's
/// two whole segments (the same memory: `kv_segments` ids) and a copy of the partial third; it
/// reads like the source. Writes after `kv_unshare` go to private copies: into a shared segment
/// of the fork (as after a trim below it), into the fork's own partial segment, into a shared
/// segment of the source, and through `kv_copy` into a fork; the other side's rows stay as they
/// were, bit for bit. Sharing rows the source lacks is an error.
fn kv_share_copies_on_write<B: Backend>(dev: &mut B, tolx: f32) {
    let _ = tolx; // exact: copies
    let w = 24;
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for dtype in [KvDtype::F32, KvDtype::BF16] {
        both!(dev, 0.0, format!("kv_share {dtype:?}"), b => {
            let seg_bytes = 4 * w * dtype.size();
            let mut src = filled_cache(b, w, 14, 32, dtype, 4, 70);
            let read = |kv: &_, rows: usize| {
                let mut out = vec![0f32; rows * w];
                b.kv_read(kv, 0, &mut out).unwrap();
                out
            };
            let before = read(&src, 14);
            let mut fork = b.kv_share(&src, 11).unwrap();
            assert_eq!((b.kv_rows(&fork), b.kv_bytes(&fork)), (12, 3 * seg_bytes));
            let (s, f) = (b.kv_segments(&src), b.kv_segments(&fork));
            assert_eq!(f.iter().map(|x| x.shared).collect::<Vec<_>>(), [true, true, false]);
            assert_eq!(s.iter().map(|x| x.shared).collect::<Vec<_>>(), [true, true, false, false]);
            assert_eq!((f[0].id, f[1].id), (s[0].id, s[1].id), "whole segments: the same memory");
            assert_ne!(f[2].id, s[2].id, "the partial segment: a copy");
            assert!(f.iter().all(|x| x.bytes == seg_bytes));
            assert_eq!(bits(&read(&fork, 11)), bits(&before[..11 * w]));
            // The fork writes rows 5..7 (shared segment 1) and 11 (its own segment 2).
            let store = |kv: &mut _, row0: usize, rows: usize, seed: u64| {
                b.kv_unshare(kv, row0, rows).unwrap();
                let x = b.upload(&rand_vec(rows * w, seed, -1.0, 1.0)).unwrap();
                let p = KvStoreParams { tokens: rows as u32, pos0: row0 as u32, width: w as u32 };
                b.kv_store(&p, &x, kv);
                b.finish().unwrap();
            };
            store(&mut fork, 5, 2, 71);
            store(&mut fork, 11, 1, 72);
            assert_eq!(bits(&read(&src, 14)), bits(&before), "the source's rows after the fork wrote");
            let f = b.kv_segments(&fork);
            assert_eq!(f.iter().map(|x| x.shared).collect::<Vec<_>>(), [true, false, false]);
            assert_eq!(f[0].id, b.kv_segments(&src)[0].id);
            let forked = read(&fork, 12);
            assert_eq!(bits(&forked[..5 * w]), bits(&before[..5 * w]));
            assert_eq!(bits(&forked[7 * w..11 * w]), bits(&before[7 * w..11 * w]));
            assert_ne!(bits(&forked[5 * w..7 * w]), bits(&before[5 * w..7 * w]), "the fork's write landed");
            // The source writes row 1 (segment 0, still shared): the fork keeps its row 1.
            store(&mut src, 1, 1, 73);
            assert_eq!(bits(&read(&fork, 12)), bits(&forked), "the fork's rows after the source wrote");
            assert!(!b.kv_segments(&src)[0].shared && !b.kv_segments(&fork)[0].shared);
            // kv_copy into a cache that shares its segments leaves the sharer alone.
            let mut again = b.kv_share(&src, 8).unwrap();
            assert_eq!(b.kv_rows(&again), 8, "whole segments only: nothing copied");
            let src_now = read(&src, 14);
            b.kv_copy(&fork, &mut again, 8).unwrap();
            assert_eq!(bits(&read(&src, 14)), bits(&src_now), "the source after a kv_copy into its fork");
            assert_eq!(bits(&read(&again, 8)), bits(&forked[..8 * w]));
            assert!(b.kv_share(&src, 17).is_err(), "rows the source lacks");
            let empty = b.kv_share(&src, 0).unwrap();
            assert_eq!(b.kv_rows(&empty), 0);
            vec![before, forked, read(&src, 14)]
        });
    }
}
