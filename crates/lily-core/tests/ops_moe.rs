//! The MoE family (moe_route; moe_experts: per-token and expert-sorted paths; the sort of
//! (token, slot) pairs by expert): the CPU kernels and the GPU kernels (Metal and CUDA, simulators
//! and devices: `gpu_tests!`) against the reference twins, and the router's rule on non-finite logits.

mod common;
#[macro_use]
mod gpu_common;

use common::{assert_close, matrix, norm_params, rand_vec, stored_matrix};
use gpu_common::{assert_near, ids_buf, read_all, ReadIds, TOL};
use lily_core::{
    backend::{
        cpu::Cpu,
        metal::{Executor, GemmTile, GemvRows, Metal},
        params::{MoeParams, RmsNormParams, RouteParams, RowsParams, MOE_TILE},
        Backend, GateUp, MoeAddNorm, MoeBlock, MoeExperts, MoeScratch, Router, Routing, StreamKind,
    },
    ops::moe::{cpu as moe_cpu, metal as moe_metal, reference},
    quant::{Format, Matrix},
    safetensors::DType,
};

mod cpu {
    use super::*;

    #[test]
    fn moe_matches_reference() {
        let (fast, refr) = (Cpu::new(), Cpu::reference());
        let (e, k, d, i) = (16usize, 8usize, 128usize, 64usize);
        // 1: decode; 6 and 8: a batched decode step (GEMV grouped by expert); 9: the tiled GEMM.
        for &t in &[1usize, 6, 8, 9] {
            let logits = rand_vec(t * e, 1 + t as u64, -3.0, 3.0);
            let rp = RouteParams {
                tokens: t as u32,
                experts: e as u32,
                top_k: k as u32,
                renorm: 1,
            };
            let (mut ia, mut ib) = (vec![0u32; t * k], vec![0u32; t * k]);
            let (mut wa, mut wb) = (vec![0f32; t * k], vec![0f32; t * k]);
            fast.moe_route(&rp, &logits, &mut ia, &mut wa);
            refr.moe_route(&rp, &logits, &mut ib, &mut wb);
            assert_eq!(ia, ib, "moe_route ids");
            assert_close(&wa, &wb, 1e-6, "moe_route weights");
            for wt in wa.chunks(k) {
                assert!(
                    (wt.iter().sum::<f32>() - 1.0).abs() < 1e-5,
                    "renormalised weights sum to 1"
                );
            }
            for format in [Format::BF16, Format::Affine { bits: 4, group: 64 }] {
                let gate = matrix(e, i, d, format, DType::BF16, 21);
                let up = matrix(e, i, d, format, DType::BF16, 22);
                let down = matrix(e, d, i, format, DType::BF16, 23);
                let x = rand_vec(t * d, 24, -1.0, 1.0);
                let mp = MoeParams {
                    tokens: t as u32,
                    top_k: k as u32,
                };
                let mut tmp = vec![0f32; t * k * (i + d)];
                let (mut a, mut b) = (vec![0f32; t * d], vec![0f32; t * d]);
                let experts = MoeExperts {
                    gate: &gate,
                    up: &up,
                    down: &down,
                    ids: &ia,
                    weights: &wa,
                };
                fast.moe_experts(&mp, &experts, &x, &mut tmp, &mut a);
                refr.moe_experts(&mp, &experts, &x, &mut tmp, &mut b);
                assert_close(&a, &b, 1e-5, &format!("moe_experts {format:?} t={t}"));
            }
        }
    }

    /// The sort twin on a hand-sorted case: ids [3 tokens, 2 slots] = [2, 0 | 0, 2 | 1, 0] over 4
    /// experts (expert 3 gets none), blocks of at most 2 rows.
    #[test]
    fn moe_sort_reference_by_hand() {
        let s = reference::moe_sort(&[2, 0, 0, 2, 1, 0], 4, 2);
        assert_eq!(s.order, [1, 2, 5, 4, 0, 3]);
        assert_eq!(s.pos, [4, 0, 1, 5, 3, 2]);
        assert_eq!(s.blocks, [[0, 0, 2], [0, 2, 1], [1, 3, 1], [2, 4, 2]]);
    }

    /// The CPU prefill's grouping of (token, slot) pairs by expert against the sort twin with one
    /// block per expert: the same order, one group per expert that has pairs.
    #[test]
    fn moe_grouping_matches_reference() {
        for (t, k, e) in [(41usize, 4usize, 12usize), (9, 2, 6), (100, 8, 70), (1, 8, 16)] {
            let ids = uneven_ids(t, k, e);
            let want = reference::moe_sort(&ids, e, usize::MAX);
            let (mut starts, mut order, mut groups) = (vec![7; e + 1], vec![0; t * k], vec![0; 3 * e]);
            let n = moe_cpu::group_by_expert(&ids, e, &mut starts, &mut order, &mut groups);
            assert_eq!(order, want.order, "order T={t} K={k} E={e}");
            let got: Vec<[u32; 3]> = groups[..3 * n].chunks(3).map(|g| [g[0], g[1], g[2]]).collect();
            assert_eq!(got, want.blocks, "groups T={t} K={k} E={e}");
        }
    }
}

gpu_tests!(
    moe_route_matches_reference,
    moe_router_matches_reference,
    moe_route_non_finite_is_safe,
    moe_experts_matches_reference,
    moe_experts_prefill_matches_reference,
    moe_experts_add_rms_norm_matches_reference,
    moe_add_rms_norm_matches_reference,
    gate_up_swiglu_matches_reference;
    metal:
    moe_experts_variants_match_reference,
    moe_sort_matches_reference,
    moe_experts_sorted_matches_reference,
);

/// Expert counts below, at and past a warp or simdgroup (16, 40, 70, 256: the real model's,
/// 300, 1000), K from 2 to 64, with and without renormalisation.
fn moe_route_matches_reference<B: Backend + ReadIds>(dev: &mut B, tolx: f32) {
    for (t, e, k, renorm) in [
        (4usize, 70usize, 8usize, 1u32),
        (3, 16, 8, 0),
        (2, 300, 2, 1),
        (3, 256, 8, 1),
        (2, 40, 5, 0),
        (1, 1000, 64, 1),
    ] {
        let logits = rand_vec(t * e, 100 + e as u64, -4.0, 4.0);
        let p = RouteParams {
            tokens: t as u32,
            experts: e as u32,
            top_k: k as u32,
            renorm,
        };
        let run = |ids: Vec<u32>, w: Vec<f32>| (ids, w);
        let cpu = Cpu::reference();
        let (ci, cw) = {
            let lb = cpu.upload(&logits).unwrap();
            let (mut ib, mut wb) = (cpu.alloc_ids(t * k).unwrap(), cpu.alloc(t * k).unwrap());
            cpu.moe_route(&p, &lb, &mut ib, &mut wb);
            run(cpu.ids(&ib), read_all(&cpu, &wb, t * k))
        };
        let m = &*dev;
        let lb = m.upload(&logits).unwrap();
        let (mut ib, mut wb) = (m.alloc_ids(t * k).unwrap(), m.alloc(t * k).unwrap());
        m.moe_route(&p, &lb, &mut ib, &mut wb);
        m.finish().unwrap();
        assert_eq!(m.ids(&ib), ci, "moe_route ids E={e} K={k}");
        assert_near(
            &read_all(m, &wb, t * k),
            &cw,
            tolx * TOL,
            &format!("moe_route weights E={e} K={k}"),
        );
    }
}

/// The rule `moe_route` follows on any logits (moe.metal, moe.cu): NaN ranks as -inf; +inf logits share
/// the probability equally and every finite one gets 0; when every logit is NaN or -inf, every
/// expert gets 1/E; top K by probability, ties to the lower id. On finite logits (and -inf ones
/// beside a finite one) it is the reference's softmax and top K. The ids and weights of one row.
fn route_rule(l: &[f32], k: usize, renorm: bool) -> (Vec<u32>, Vec<f32>) {
    let s: Vec<f32> = l
        .iter()
        .map(|&x| {
            if x.is_nan() {
                f32::MIN
            } else {
                x.clamp(f32::MIN, f32::MAX)
            }
        })
        .collect();
    let m = s.iter().copied().fold(f32::MIN, f32::max);
    let w: Vec<f32> = s
        .iter()
        .map(|&x| if x >= m - 110.0 { (x - m).exp() } else { 0.0 })
        .collect();
    let z: f32 = w.iter().sum();
    let p: Vec<f32> = w.iter().map(|v| v / z).collect();
    let mut order: Vec<usize> = (0..l.len()).collect();
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    let ids: Vec<u32> = order[..k].iter().map(|&e| e as u32).collect();
    let sum: f32 = order[..k].iter().map(|&e| p[e]).sum();
    let wts = order[..k]
        .iter()
        .map(|&e| if renorm { p[e] / sum } else { p[e] })
        .collect();
    (ids, wts)
}

/// Router logits rows of `e` experts with NaN, infinities, ties and extreme values (name, row).
fn non_finite_rows(e: usize, seed: u64) -> Vec<(&'static str, Vec<f32>)> {
    let nans = [
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7fc0_1234),
        f32::from_bits(0x7f80_0001), // signalling
        f32::from_bits(0xffff_ffff),
    ];
    let base = rand_vec(e, seed, -3.0, 3.0);
    let with = |every: usize, f: &dyn Fn(usize) -> f32| -> Vec<f32> {
        base.iter()
            .enumerate()
            .map(|(i, &x)| if i % every == 1 { f(i) } else { x })
            .collect()
    };
    let mut three_finite = vec![f32::NAN; e];
    for (j, i) in [e / 2, 1, e - 1].into_iter().enumerate() {
        three_finite[i] = j as f32;
    }
    let mut inf_and_nan: Vec<f32> = (0..e).map(|i| nans[i % nans.len()]).collect();
    for i in [e - 1, e / 3, 2] {
        inf_and_nan[i] = f32::INFINITY;
    }
    vec![
        ("finite", base.clone()),
        ("NaN among finite", with(3, &|i| nans[i % nans.len()])),
        ("all NaN", (0..e).map(|i| nans[i % nans.len()]).collect()),
        ("all equal", vec![0.25; e]),
        (
            "all zero, some -0",
            (0..e).map(|i| if i % 2 == 0 { 0.0 } else { -0.0 }).collect(),
        ),
        ("one +inf", {
            let mut r = base.clone();
            r[e / 2] = f32::INFINITY;
            r
        }),
        ("+inf among NaN", inf_and_nan),
        ("-inf among finite", with(2, &|_| f32::NEG_INFINITY)),
        ("all -inf", vec![f32::NEG_INFINITY; e]),
        ("all +inf", vec![f32::INFINITY; e]),
        ("NaN, -inf and three finite", {
            let mut r = three_finite.clone();
            r.iter_mut().step_by(4).for_each(|x| {
                if x.is_nan() {
                    *x = f32::NEG_INFINITY
                }
            });
            r
        }),
        (
            "extremes",
            with(2, &|i| [f32::MAX, f32::MIN, 1e30, -1e30, f32::MIN_POSITIVE][i % 5]),
        ),
        ("huge ties", vec![f32::MAX; e]),
    ]
    .into_iter()
    .chain(tie_at_rank_rows(&base))
    .collect()
}

/// Finite rows whose r-th largest logit (r = 1, 2, 8, 16, 64) is shared by three experts spread
/// over the row (37 apart), the r - 1 above it distinct, every other logit lower (where E fits
/// them): the top K stops inside or just before the tie, which must go to the lower ids.
fn tie_at_rank_rows(base: &[f32]) -> Vec<(&'static str, Vec<f32>)> {
    let e = base.len();
    let names = [
        (1, "tie at rank 1"),
        (2, "tie at rank 2"),
        (8, "tie at rank 8"),
        (16, "tie at rank 16"),
        (64, "tie at rank 64"),
    ];
    names
        .into_iter()
        .filter(|&(r, _)| r + 2 <= e)
        .map(|(r, name)| {
            // Distinct ids spread over the row (37 is coprime with every E used here), the tied
            // three last, in descending id order so that the lowest id is not the first placed.
            let mut ids: Vec<usize> = Vec::new();
            let mut i = 5;
            while ids.len() < r + 2 {
                if !ids.contains(&(i % e)) {
                    ids.push(i % e);
                }
                i += 37;
            }
            ids[r - 1..].sort_unstable_by(|a, b| b.cmp(a));
            let mut row: Vec<f32> = base.iter().map(|x| x - 10.0).collect();
            for (j, &id) in ids.iter().enumerate() {
                row[id] = if j < r - 1 { 100.0 - j as f32 } else { 50.0 };
            }
            (name, row)
        })
        .collect()
}

/// `moe_route` on router logits with NaN (of several bit patterns), +-inf, all-equal, all-NaN
/// and extreme values (`non_finite_rows`), K < E and K = E, with and without renormalisation:
/// every token gets K distinct ids < E (the simulator bounds-checks every access) and finite
/// weights in [0, 1], as `route_rule` says; where the reference's softmax is defined (no NaN, no
/// +inf, a finite logit) ids and weights match `Cpu::reference()` too. The reference itself
/// always returns K distinct ids < E as well (a total-order sort of all E).
fn moe_route_non_finite_is_safe<B: Backend + ReadIds>(dev: &mut B, tolx: f32) {
    for (e, k) in [(70usize, 8usize), (16, 16), (300, 2), (1024, 64), (3, 1)] {
        let rows = non_finite_rows(e, 200 + e as u64);
        let t = rows.len();
        let logits: Vec<f32> = rows.iter().flat_map(|(_, r)| r.iter().copied()).collect();
        for renorm in [1u32, 0] {
            let p = RouteParams {
                tokens: t as u32,
                experts: e as u32,
                top_k: k as u32,
                renorm,
            };
            let cpu = Cpu::reference();
            let (ci, cw) = {
                let lb = cpu.upload(&logits).unwrap();
                let (mut ib, mut wb) = (cpu.alloc_ids(t * k).unwrap(), cpu.alloc(t * k).unwrap());
                cpu.moe_route(&p, &lb, &mut ib, &mut wb);
                (cpu.ids(&ib), read_all(&cpu, &wb, t * k))
            };
            let m = &*dev;
            let lb = m.upload(&logits).unwrap();
            let (mut ib, mut wb) = (m.alloc_ids(t * k).unwrap(), m.alloc(t * k).unwrap());
            m.moe_route(&p, &lb, &mut ib, &mut wb);
            m.finish().unwrap();
            let (gi, gw) = (m.ids(&ib), read_all(m, &wb, t * k));
            for (row, (what, l)) in rows.iter().enumerate() {
                let at = format!("moe_route E={e} K={k} renorm={renorm} {what:?}");
                let (ids, w) = (&gi[row * k..][..k], &gw[row * k..][..k]);
                let (ref_ids, ref_w) = (&ci[row * k..][..k], &cw[row * k..][..k]);
                for (name, ids) in [("GPU", ids), ("reference", ref_ids)] {
                    let mut seen = vec![false; e];
                    for &i in ids {
                        assert!((i as usize) < e, "{at}: {name} id {i} out of range: {ids:?}");
                        assert!(!seen[i as usize], "{at}: {name} id {i} twice: {ids:?}");
                        seen[i as usize] = true;
                    }
                }
                assert!(
                    w.iter().all(|x| x.is_finite() && (0.0..=1.0).contains(x)),
                    "{at}: weights {w:?}"
                );
                if renorm != 0 {
                    let sum: f32 = w.iter().sum();
                    assert!((sum - 1.0).abs() <= 1e-5, "{at}: weights sum to {sum}");
                }
                let (want_ids, want_w) = route_rule(l, k, renorm != 0);
                assert_eq!(ids, &want_ids[..], "{at}: ids");
                assert_near(w, &want_w, tolx * TOL, &format!("{at}: weights"));
                let defined = l.iter().all(|x| !x.is_nan() && *x != f32::INFINITY) && l.iter().any(|x| x.is_finite());
                if defined {
                    assert_eq!(ids, ref_ids, "{at}: ids against the reference");
                    assert_near(w, ref_w, tolx * TOL, &format!("{at}: weights against the reference"));
                }
            }
        }
    }
}

/// The routing from the block's input (`moe_router`: router and shared-gate GEMVs, then the
/// softmax, top K and renormalisation) against the reference's parts: identical expert ids,
/// weights and the shared gate's logit within the GEMV tolerance. The real router (256 x 2048,
/// 8-bit g64, top 8) at T = 1 and 3; E = 70 in bf16 with D = 100 (unaligned 200-byte rows: the
/// element path) and no renormalisation; f32 E = 16 with D = 1024 (CUDA splits K across warps:
/// several blocks a token even for 17 rows); T = 9 (past CUDA's GEMV tokens: the parts, its
/// bf16 GEMM within 1e-2) and a shared gate of another format (the parts). x scaled so the
/// logits spread over about +-3.
fn moe_router_matches_reference<B: Backend + ReadIds>(dev: &mut B, tolx: f32) {
    let q8 = Format::Affine { bits: 8, group: 64 };
    for (rf, sf, e, d, k, renorm, tokens) in [
        (q8, q8, 256usize, 2048usize, 8usize, 1u32, &[1usize, 3][..]),
        (Format::BF16, Format::BF16, 70, 100, 5, 0, &[1, 2]),
        (Format::F32, Format::F32, 16, 1024, 4, 1, &[1, 9]),
        (q8, Format::BF16, 40, 256, 8, 1, &[1]),
    ] {
        let router = matrix(1, e, d, rf, DType::BF16, 140 + e as u64);
        let gate = matrix(1, 1, d, sf, DType::BF16, 141);
        for &t in tokens {
            let a = 3.0 / (d as f32).sqrt();
            let x = rand_vec(t * d, 142 + t as u64, -a, a);
            let p = RouteParams {
                tokens: t as u32,
                experts: e as u32,
                top_k: k as u32,
                renorm,
            };
            let at = format!("moe_router {rf:?}/{sf:?} E={e} D={d} top {k} T={t}");
            let (ci, cw, cs, logits) = run_router(&Cpu::reference(), &p, &router, &gate, &x);
            // The test data leaves no near-tie at the K-th place (ids must match exactly).
            for l in logits.chunks(e) {
                let mut v = l.to_vec();
                v.sort_by(|a, b| b.total_cmp(a));
                assert!(
                    v[k - 1] - v[k] > 1e-3,
                    "{at}: logits {} and {} nearly tie",
                    v[k - 1],
                    v[k]
                );
            }
            let (gi, gw, gs, _) = run_router(&*dev, &p, &router, &gate, &x);
            assert_eq!(gi, ci, "{at} ids");
            // Past 8 tokens CUDA's parts run the bf16 tensor-core GEMM (as the other prefill tests).
            let tol = if t > 8 { 1e-2 } else { TOL };
            assert_near(&gw, &cw, tolx * tol, &format!("{at} weights"));
            assert_near(&gs, &cs, tolx * tol, &format!("{at} shared gate"));
        }
    }
}

/// `moe_router` on backend `b`: ids, weights [T, K], the shared gate's logit [T] and the logits
/// [T, E] (a fused kernel leaves the last as its scratch).
fn run_router<B: Backend + ReadIds>(
    b: &B,
    p: &RouteParams,
    router: &Matrix,
    gate: &Matrix,
    x: &[f32],
) -> (Vec<u32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let (t, e, k) = (p.tokens as usize, p.experts as usize, p.top_k as usize);
    let r = [router, gate].map(|m| b.upload_matrix(m).unwrap());
    let xb = b.upload(x).unwrap();
    let (mut lb, mut sb) = (b.alloc(t * e).unwrap(), b.alloc(t).unwrap());
    let (mut ib, mut wb) = (b.alloc_ids(t * k).unwrap(), b.alloc(t * k).unwrap());
    b.begin(StreamKind::Other).unwrap();
    let router = Router {
        router: &r[0],
        shared_gate: &r[1],
    };
    let mut out = Routing {
        logits: &mut lb,
        shared: &mut sb,
        ids: &mut ib,
        weights: &mut wb,
    };
    b.moe_router(p, &xb, &router, &mut out);
    b.finish().unwrap();
    (
        b.ids(&ib),
        read_all(b, &wb, t * k),
        read_all(b, &sb, t),
        read_all(b, &lb, t * e),
    )
}

/// `moe_experts` on backend `b`: the output [T, D].
#[allow(clippy::too_many_arguments)]
fn run_moe<B: Backend>(
    b: &B,
    gate: &Matrix,
    up: &Matrix,
    down: &Matrix,
    x: &[f32],
    ids: &[u32],
    w: &[f32],
    k: usize,
) -> Vec<f32> {
    let (t, d, inter) = (x.len() / down.rows, down.rows, gate.rows);
    let (g, u, dn) = (
        b.upload_matrix(gate).unwrap(),
        b.upload_matrix(up).unwrap(),
        b.upload_matrix(down).unwrap(),
    );
    let (xb, wb, ib) = (b.upload(x).unwrap(), b.upload(w).unwrap(), ids_buf(b, ids));
    let mut tmp = b.alloc(t * k * (inter + d)).unwrap();
    let mut out = b.alloc(t * d).unwrap();
    let p = MoeParams {
        tokens: t as u32,
        top_k: k as u32,
    };
    let experts = MoeExperts {
        gate: &g,
        up: &u,
        down: &dn,
        ids: &ib,
        weights: &wb,
    };
    b.moe_experts(&p, &experts, &xb, &mut tmp, &mut out);
    b.finish().unwrap();
    read_all(b, &out, t * d)
}

/// The fused shared-expert input half, out = silu(x gate^T) * (x up^T), against the reference's
/// parts (two matmuls and swiglu), and the scratch it leaves: rows that leave a partial warp group
/// or simdgroup (37), the real shared expert's 512 x 2048 in 4-bit, K split across warps (f32,
/// 1024 columns, 20 rows), gate and up of different formats (the unfused fallback); one decode
/// token and a few (CUDA's GEMV range; Metal's fallback to its parts past one token).
fn gate_up_swiglu_matches_reference<B: Backend>(dev: &mut B, tolx: f32) {
    let q4 = Format::Affine { bits: 4, group: 64 };
    for (gf, uf, n, k) in [
        (Format::BF16, Format::BF16, 37usize, 64usize),
        (q4, q4, 512, 2048),
        (Format::F32, Format::F32, 20, 1024),
        (
            Format::Affine { bits: 8, group: 32 },
            Format::Affine { bits: 8, group: 32 },
            40,
            96,
        ),
        (q4, Format::BF16, 24, 128),
    ] {
        let gate = matrix(1, n, k, gf, DType::BF16, 130);
        let up = matrix(1, n, k, uf, DType::BF16, 131);
        for t in [1usize, 3] {
            let x = rand_vec(t * k, 132 + t as u64, -1.0, 1.0);
            let p = RowsParams {
                tokens: t as u32,
                dim: n as u32,
            };
            both!(dev, tolx * TOL, format!("gate_up_swiglu {gf:?}/{uf:?} {n}x{k} T={t}"), b => {
                let (g, u, xb) = (b.upload_matrix(&gate).unwrap(), b.upload_matrix(&up).unwrap(), b.upload(&x).unwrap());
                let (mut gs, mut us, mut out) = (b.alloc(t * n).unwrap(), b.alloc(t * n).unwrap(), b.alloc(t * n).unwrap());
                b.begin(StreamKind::Other).unwrap();
                b.gate_up_swiglu(&p, &GateUp { gate: &g, up: &u }, &xb, &mut gs, &mut us, &mut out);
                b.finish().unwrap();
                vec![read_all(b, &out, t * n)]
            });
        }
    }
}

/// Gate, up and down of `e` experts: gate_up fused [E, 2I, D] of random codes seen as two views
/// (the HF layout) with down [E, D, I] when `fused`, else three MLX-quantized matrices.
fn experts(
    format: Format,
    sd: DType,
    e: usize,
    d: usize,
    inter: usize,
    fused: bool,
    seed: u64,
) -> (Matrix, Matrix, Matrix) {
    if !fused {
        return (
            matrix(e, inter, d, format, sd, seed),
            matrix(e, inter, d, format, sd, seed + 1),
            matrix(e, d, inter, format, sd, seed + 2),
        );
    }
    let mut gate = stored_matrix(format, sd, e * 2 * inter, d, seed);
    (gate.experts, gate.rows, gate.expert_stride) = (e, inter, 2 * inter);
    let mut up = gate.clone();
    up.row_offset = inter;
    let mut down = stored_matrix(format, sd, e * d, inter, seed + 1);
    (down.experts, down.rows, down.expert_stride) = (e, d, d);
    (gate, up, down)
}

/// An expert case: (weight format, scale dtype, D, I, gate/up as views of one fused tensor).
type ExpertCase = (Format, DType, usize, usize, bool);
/// Separate 4-bit matrices, whole tiles: I = 192, D = 256.
const Q4_SEPARATE: ExpertCase = (Format::Affine { bits: 4, group: 64 }, DType::BF16, 256, 192, false);

/// The per-token (decode) path of `moe_experts` (6 experts, top 2) on `dev` as it is set up.
/// Fused views: I = 37 and D = 70 leave a Metal simdgroup with fewer rows than the GEMV
/// variant's (r2: 37 = 4 x 8 + 5; r4: 37 = 2 x 16 + 5 and 70 = 4 x 16 + 6), I = 40 a partial
/// threadgroup of r4. Separate matrices: I = 192 rows, and D = 1024 in f32 (256 chunks a row, 20
/// rows: CUDA splits K across 8 warps of a row group, `gemv_split`, with a partial last group).
fn moe_experts_decode_cases<B: Backend>(dev: &B, tolx: f32, what: &str) {
    let (e, k) = (6usize, 2usize);
    for (format, sd, d, inter, fused) in [
        (Format::Affine { bits: 4, group: 32 }, DType::BF16, 64, 96, true),
        (Format::BF16, DType::F32, 70, 37, true),
        (Format::Affine { bits: 8, group: 8 }, DType::F16, 48, 40, true),
        Q4_SEPARATE,
        (Format::BF16, DType::F32, 256, 192, false),
        (Format::F32, DType::F32, 1024, 20, false),
    ] {
        let (gate, up, down) = experts(format, sd, e, d, inter, fused, 110);
        for t in [1usize, 3, 5] {
            let x = rand_vec(t * d, 112, -1.0, 1.0);
            // At T = 3 the second token has the same expert in both slots.
            let ids: Vec<u32> = match t {
                3 => vec![5, 0, 2, 2, 1, 4],
                _ => (0..t * k).map(|i| ((i * 5 + 1) % e) as u32).collect(),
            };
            let w = rand_vec(t * k, 113, 0.0, 1.0);
            let want = run_moe(&Cpu::reference(), &gate, &up, &down, &x, &ids, &w, k);
            let got = run_moe(dev, &gate, &up, &down, &x, &ids, &w, k);
            let at = format!("moe_experts {format:?} I={inter} D={d} T={t}{what}");
            assert_near(&got, &want, tolx * TOL, &at);
        }
    }
}

fn moe_experts_matches_reference<B: Backend>(dev: &mut B, tolx: f32) {
    moe_experts_decode_cases(&*dev, tolx, "");
}

/// The decode cases with every Metal GEMV variant (2 and 4 rows per simdgroup).
fn moe_experts_variants_match_reference<X: Executor>(dev: &mut Metal<X>, tolx: f32) {
    let saved = dev.variants;
    for gemv in GemvRows::ALL {
        dev.variants.gemv = gemv;
        moe_experts_decode_cases(&*dev, tolx, &format!(" {gemv:?}"));
    }
    dev.variants = saved;
}

/// The prefill path of `moe_experts` (T > 8: expert-sorted tiles; on CUDA the bf16 tensor cores)
/// on uneven routing: one expert with more than two 64-row tiles, one with a single token (expert
/// 6: the last pair), one with none (expert 4), partial token tiles; within 1e-2 of the largest
/// output (bf16 inputs; Metal's f32 path is held to 2e-5 by moe_experts_sorted_matches_reference).
/// Shapes: I = 192, D = 256 (whole tiles); fused gate_up views with I = 96 (a partial gate / up
/// tile of 64), D = 160 (down: 128 + 32 rows, K steps 64 + 64 + 32 and 64 + 32); D = 200 at 8 bits
/// (unaligned 200-byte rows: the element path; down 128 + 72 rows, K = 40 < one step); dense
/// bf16 with D = 70, I = 37 (everything partial and unaligned).
fn moe_experts_prefill_matches_reference<B: Backend>(dev: &mut B, tolx: f32) {
    let (e, k) = (7usize, 2usize);
    for (format, sd, d, inter, fused) in [
        Q4_SEPARATE,
        (Format::BF16, DType::F32, 256, 192, false),
        (Format::Affine { bits: 4, group: 32 }, DType::BF16, 160, 96, true),
        (Format::Affine { bits: 8, group: 8 }, DType::F16, 200, 40, false),
        (Format::BF16, DType::F32, 70, 37, true),
    ] {
        let (gate, up, down) = experts(format, sd, e, d, inter, fused, 110);
        for t in [9usize, 90] {
            let x = rand_vec(t * d, 113, -1.0, 1.0);
            // Slot 0 of most tokens goes to expert 1 (> 128 rows at T = 90), expert 4 gets none,
            // expert 6 only the last pair.
            let ids: Vec<u32> = (0..t * k)
                .map(|i| {
                    if i + 1 == t * k {
                        6
                    } else if i % 2 == 0 && i % 10 != 0 {
                        1
                    } else {
                        [0u32, 2, 3, 5][(i / 2) % 4]
                    }
                })
                .collect();
            let w = rand_vec(t * k, 114, 0.1, 1.0);
            let want = run_moe(&Cpu::reference(), &gate, &up, &down, &x, &ids, &w, k);
            let got = run_moe(&*dev, &gate, &up, &down, &x, &ids, &w, k);
            assert_near(
                &got,
                &want,
                tolx * 1e-2,
                &format!("moe_experts prefill {format:?} I={inter} D={d} T={t}"),
            );
        }
    }
}

/// `moe_experts_add_rms_norm` (ops/norm: the routed experts summed into the residual with the gated
/// shared expert, then the next norm) against the reference's parts (`moe_experts` into mix, then
/// `add_gated_rms_norm`): both outputs, the new residual x and the norm h (which was the experts'
/// input). T = 1 and 3: the per-pair GEMVs and one combine + norm kernel; T = 9: the prefill path
/// (on a GPU its parts; CUDA's bf16 tensor cores there, hence 1e-2). D = 70: unaligned rows (CUDA's
/// strided path), partial simdgroups; D = 64 and 256: CUDA's register path; top 2 of 6 and the real
/// model's top 8, of 12.
fn moe_experts_add_rms_norm_matches_reference<B: Backend>(dev: &mut B, tolx: f32) {
    let cases: [(Format, DType, usize, usize, bool, usize, usize); 3] = [
        (Format::Affine { bits: 4, group: 32 }, DType::BF16, 64, 96, true, 6, 2),
        (Format::BF16, DType::F32, 70, 37, true, 6, 2),
        (
            Format::Affine { bits: 4, group: 64 },
            DType::BF16,
            256,
            64,
            false,
            12,
            8,
        ),
    ];
    for (format, sd, d, inter, fused, e, k) in cases {
        let (gate, up, down) = experts(format, sd, e, d, inter, fused, 120);
        for t in [1usize, 3, 9] {
            let n = t * d;
            let (h, x) = (rand_vec(n, 121, -1.0, 1.0), rand_vec(n, 122, -2.0, 2.0));
            let (shared, shared_gate) = (rand_vec(n, 123, -1.0, 1.0), rand_vec(t, 124, -4.0, 4.0));
            let norm_w = rand_vec(d, 125, 0.5, 1.5);
            let ids: Vec<u32> = (0..t * k).map(|i| (((i / k) * 5 + (i % k) * 7) % e) as u32).collect();
            let weights = rand_vec(t * k, 126, 0.0, 1.0);
            let (moe, norm) = moe_norm_params(t, k, d);
            let tol = if t > 8 { 1e-2 } else { TOL };
            let at = format!("moe_experts_add_rms_norm {format:?} I={inter} D={d} T={t} top {k} of {e}");
            both!(dev, tolx * tol, at, b => {
                let mats = [&gate, &up, &down].map(|m| b.upload_matrix(m).unwrap());
                let (ib, wb) = (ids_buf(b, &ids), b.upload(&weights).unwrap());
                let (sb, gb, nw) = (b.upload(&shared).unwrap(), b.upload(&shared_gate).unwrap(), b.upload(&norm_w).unwrap());
                let (mut xb, mut hb) = (b.upload(&x).unwrap(), b.upload(&h).unwrap());
                let (mut tmp, mut mix) = (b.alloc(t * k * (inter + d)).unwrap(), b.alloc(n).unwrap());
                b.begin(StreamKind::Other).unwrap();
                let [gate, up, down] = &mats;
                let experts = MoeExperts { gate, up, down, ids: &ib, weights: &wb };
                let r = MoeAddNorm { experts, shared: &sb, shared_gate: &gb, norm_w: &nw };
                b.moe_experts_add_rms_norm(&moe, &norm, &r, &mut tmp, &mut mix, &mut xb, &mut hb);
                b.finish().unwrap();
                vec![read_all(b, &xb, n), read_all(b, &hb, n)]
            });
        }
    }
}

/// The MoE block end's parameters: T tokens, top K, the norm over T rows of D (eps 1e-6).
fn moe_norm_params(t: usize, k: usize, d: usize) -> (MoeParams, RmsNormParams) {
    let moe = MoeParams {
        tokens: t as u32,
        top_k: k as u32,
    };
    (moe, norm_params(t, d))
}

/// `moe_add_rms_norm` (the MoE block after routing: routed experts, shared expert, residual, next
/// norm) against the reference's parts (the shared expert's `gate_up_swiglu` and down `matmul`,
/// then `moe_experts_add_rms_norm`): the new residual x and the norm h. The model's widths (D =
/// 2048, I = Is = 512, top 8; E = 16, not 256: the routed matrices are generated whole and only
/// the chosen experts' rows matter, the last expert among them), 4 bits with group 64 (gate / up
/// views of one fused tensor, the checkpoint's layout) and 8 bits with group 32; T = 1 and 3 (a
/// batched decode step): on CUDA the shared expert as each token's pair K of the expert GEMVs, on
/// Metal as T more pairs after the T*K routed ones. The shared expert in another format (bf16)
/// takes the parts on every backend, in another group (4 bits, group 32 beside 64) on CUDA (Metal
/// reads it through its own descriptor: pairs); T = 9 the prefill path (CUDA's bf16 tensor cores
/// there, hence 1e-2).
fn moe_add_rms_norm_matches_reference<B: Backend>(dev: &mut B, tolx: f32) {
    let (d, inter, e, k) = (2048usize, 512usize, 16usize, 8usize);
    let q4 = Format::Affine { bits: 4, group: 64 };
    // (expert format, shared expert format, T)
    let cases = [
        (q4, q4, 1usize),
        (q4, q4, 3),
        (
            Format::Affine { bits: 8, group: 32 },
            Format::Affine { bits: 8, group: 32 },
            3,
        ),
        (q4, Format::BF16, 3),
        (q4, Format::Affine { bits: 4, group: 32 }, 1),
        (q4, q4, 9),
    ];
    for (format, shared_format, t) in cases {
        let (gate, up, down) = experts(format, DType::BF16, e, d, inter, format == q4, 130);
        let sg = stored_matrix(shared_format, DType::BF16, inter, d, 131);
        let su = stored_matrix(shared_format, DType::BF16, inter, d, 132);
        let sd = stored_matrix(shared_format, DType::BF16, d, inter, 133);
        let n = t * d;
        let (h, x) = (rand_vec(n, 134, -1.0, 1.0), rand_vec(n, 135, -2.0, 2.0));
        let shared_logit = rand_vec(t, 136, -4.0, 4.0);
        let norm_w = rand_vec(d, 137, 0.5, 1.5);
        // Distinct per token; expert e - 1 in token 0's last slot.
        let ids: Vec<u32> = (0..t * k)
            .map(|i| ((i / k) * 3 + (i % k) * 2 + 1) as u32 % e as u32)
            .collect();
        let weights = rand_vec(t * k, 138, 0.0, 1.0);
        let (moe, norm) = moe_norm_params(t, k, d);
        let tol = if t > 8 { 1e-2 } else { TOL };
        let at = format!("moe_add_rms_norm experts {format:?} shared {shared_format:?} T={t}");
        both!(dev, tolx * tol, at, b => {
            let mats = [&gate, &up, &down, &sg, &su, &sd].map(|m| b.upload_matrix(m).unwrap());
            let (ib, wb) = (ids_buf(b, &ids), b.upload(&weights).unwrap());
            let (lb, nw) = (b.upload(&shared_logit).unwrap(), b.upload(&norm_w).unwrap());
            let (mut xb, mut hb) = (b.upload(&x).unwrap(), b.upload(&h).unwrap());
            let mut tmp = b.alloc(t * (k + 1) * (inter + d)).unwrap();
            let mut mix = b.alloc(n).unwrap();
            let [mut g, mut u, mut act] = [0; 3].map(|_| b.alloc(t * inter).unwrap());
            let mut y = b.alloc(n).unwrap();
            b.begin(StreamKind::Other).unwrap();
            let [gate, up, down, shared_gate, shared_up, shared_down] = &mats;
            let r = MoeBlock {
                experts: MoeExperts { gate, up, down, ids: &ib, weights: &wb },
                shared_gate,
                shared_up,
                shared_down,
                shared_inter: inter as u32,
                shared_logit: &lb,
                norm_w: &nw,
            };
            let mut s = MoeScratch { tmp: &mut tmp, mix: &mut mix, g: &mut g, u: &mut u, act: &mut act, y: &mut y };
            b.moe_add_rms_norm(&moe, &norm, &r, &mut s, &mut xb, &mut hb);
            b.finish().unwrap();
            vec![read_all(b, &xb, n), read_all(b, &hb, n)]
        });
    }
}

/// Top-k ids [T, K] (distinct per token) with uneven counts: expert 0 in every token at a slot
/// that rotates with t, the others from the first E - 2 experts, so the last two get none.
fn uneven_ids(t: usize, k: usize, e: usize) -> Vec<u32> {
    (0..t)
        .flat_map(|ti| {
            let mut row = vec![0u32];
            let mut c = 1 + (ti * 5) % (e - 3);
            while row.len() < k {
                if !row.contains(&(c as u32)) {
                    row.push(c as u32);
                }
                c = 1 + (c + ti % 3) % (e - 3);
            }
            row.rotate_right(ti % k);
            row
        })
        .collect()
}

/// moe_histogram -> moe_scan -> moe_scatter (the GPU routing of the sorted MoE path) against a
/// the reference twin (`reference::moe_sort`, a plain stable sort), exactly: block map, sorted
/// order and its inverse. Shapes: several
/// sort blocks of 32 tokens with a partial last one, experts with 0, < 32, exactly 32 and > 64
/// tokens, E not a multiple of 32 (a partial simdgroup in the scan) and E > 32 (several).
fn moe_sort_matches_reference<X: Executor>(dev: &mut Metal<X>, tolx: f32) {
    let _ = tolx; // exact
    let mut cases: Vec<(usize, usize, usize, Vec<u32>)> = vec![
        (41, 4, 12, uneven_ids(41, 4, 12)),
        (9, 2, 6, uneven_ids(9, 2, 6)),
        (100, 8, 70, uneven_ids(100, 8, 70)),
    ];
    // Exactly 32 tokens for expert 3, 65 for expert 1, none for the rest.
    let (t, k) = (97, 1);
    cases.push((t, k, 40, (0..t).map(|i| if i < 32 { 3 } else { 1 }).collect()));
    for (t, k, e, ids) in cases {
        let want = reference::moe_sort(&ids, e, MOE_TILE);
        let m = &*dev;
        let ib = ids_buf(m, &ids);
        let p = MoeParams {
            tokens: t as u32,
            top_k: k as u32,
        };
        let got = moe_metal::moe_sort(m, &p, &ib, e).unwrap();
        assert_eq!(got.blocks, want.blocks, "moe_sort blocks T={t} K={k} E={e}");
        assert_eq!(got.order, want.order, "moe_sort order T={t} K={k} E={e}");
        assert_eq!(got.pos, want.pos, "moe_sort pos T={t} K={k} E={e}");
    }
}

/// Expert e's tokens of `ids` [T, K].
fn tokens_per_expert(ids: &[u32], e: usize) -> Vec<usize> {
    let mut n = vec![0; e];
    for &i in ids {
        n[i as usize] += 1;
    }
    n
}

/// The prefill path of `moe_experts` (T above `moe_gemm_tokens`): histogram, scan, scatter and
/// block map on the GPU, expert GEMMs over 32-row blocks. Shapes: an expert with more than 32
/// tokens (two blocks, the second partial), experts with a handful of tokens, experts with none
/// (ids of the last experts never chosen), I and D that leave partial 32-row tiles and partial
/// K steps (D = 70: a tail past the last 8 columns), 4-bit and dense weights; the sorted path
/// must also agree with the per-token kernels it replaces, and repeat bit for bit. Every tile
/// variant (32 and 64 weight rows; I = 96 and D = 70, 80 leave a partial 64-row tile).
fn moe_experts_sorted_matches_reference<X: Executor>(dev: &mut Metal<X>, tolx: f32) {
    let saved_variants = dev.variants;
    // (format, scales, D, I, E, T, K)
    let cases = [
        (Format::Affine { bits: 4, group: 32 }, DType::BF16, 64, 96, 12, 41, 4),
        (Format::BF16, DType::F32, 70, 36, 6, 9, 2),
        (Format::Affine { bits: 8, group: 16 }, DType::F16, 80, 48, 9, 70, 3),
    ];
    for (format, sd, d, inter, e, t, k) in cases {
        let (gate, up, down) = experts(format, sd, e, d, inter, true, 120);
        let x = rand_vec(t * d, 122, -1.0, 1.0);
        let ids = uneven_ids(t, k, e);
        let n = tokens_per_expert(&ids, e);
        assert!(n[0] == t && n[e - 1] == 0 && n[e - 2] == 0, "{n:?}");
        let w = rand_vec(t * k, 123, 0.0, 1.0);
        let what = format!("moe_experts sorted {format:?} E={e} T={t} K={k} per expert {n:?}");
        let go = |b: &Metal<X>| run_moe(b, &gate, &up, &down, &x, &ids, &w, k);
        let want = run_moe(&Cpu::reference(), &gate, &up, &down, &x, &ids, &w, k);
        let saved = dev.moe_gemm_tokens;
        dev.moe_gemm_tokens = u32::MAX;
        let per_token = go(dev);
        dev.moe_gemm_tokens = 8;
        for gemm in GemmTile::ALL {
            dev.variants.gemm = gemm;
            let what = format!("{what} {gemm:?}");
            let sorted = go(dev);
            let again = go(dev);
            assert_near(&sorted, &want, tolx * TOL, &what);
            assert_near(
                &sorted,
                &per_token,
                tolx * TOL,
                &format!("{what} vs the per-token kernels"),
            );
            assert!(
                sorted.iter().zip(&again).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{what}: two runs differ"
            );
        }
        dev.moe_gemm_tokens = saved;
    }
    dev.variants = saved_variants;
}
