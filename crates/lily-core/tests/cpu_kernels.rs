//! Every production CPU kernel against its plain-loop reference twin, through the `Backend`
//! interface, on shapes with partial blocks and every weight format.

mod common;

use common::{assert_close, matrix, rand_vec};
use lily_core::{
    backend::{cpu::Cpu, params::*, Backend},
    quant::Format,
    safetensors::DType,
};

fn both() -> (Cpu, Cpu) {
    (Cpu::new(), Cpu::reference())
}

fn delta_net_case(t: usize, seed: u64) {
    delta_net_heads_case(t, seed, 2, 4);
}

fn delta_net_heads_case(t: usize, seed: u64, hk: usize, hv: usize) {
    let (fast, refr) = both();
    let (dk, dv) = (128usize, 128usize);
    let width = 2 * hk * dk + hv * dv;
    let qkv = rand_vec(t * width, seed, -1.0, 1.0);
    let a = rand_vec(t * hv, seed + 1, -3.0, 3.0);
    let b = rand_vec(t * hv, seed + 2, -3.0, 3.0);
    let a_log = rand_vec(hv, seed + 3, -5.0, 0.7);
    let dt_bias = rand_vec(hv, seed + 4, -1.0, 1.0);
    let s0 = rand_vec(hv * dk * dv, seed + 5, -0.1, 0.1);
    let p = DeltaNetParams {
        tokens: t as u32,
        key_heads: hk as u32,
        value_heads: hv as u32,
        key_dim: dk as u32,
        value_dim: dv as u32,
    };
    let (mut sa, mut sb) = (s0.clone(), s0);
    let (mut oa, mut ob) = (vec![0f32; t * hv * dv], vec![0f32; t * hv * dv]);
    fast.delta_net(&p, &qkv, &a, &b, &a_log, &dt_bias, &mut sa, &mut oa);
    refr.delta_net(&p, &qkv, &a, &b, &a_log, &dt_bias, &mut sb, &mut ob);
    assert_close(&oa, &ob, 2e-5, &format!("delta_net out t={t}"));
    assert_close(&sa, &sb, 2e-5, &format!("delta_net state t={t}"));
}

#[test]
fn delta_net_chunked_matches_step_recurrence() {
    delta_net_case(1, 1); // decode step
    delta_net_case(2, 2);
    delta_net_case(64, 3); // one full chunk
    delta_net_case(150, 4); // 64 + 64 + 22
                            // Decode runs several heads per task (here 3 on two threads, the last run shorter).
    delta_net_heads_case(1, 5, 4, 20);
    delta_net_heads_case(3, 6, 4, 20);
}

#[test]
fn delta_net_decode_steps_match_reference() {
    // Many single steps: state errors compound over tokens.
    let (fast, refr) = both();
    let (hk, hv, dk, dv) = (1usize, 2usize, 128usize, 128usize);
    let width = 2 * hk * dk + hv * dv;
    let p = DeltaNetParams {
        tokens: 1,
        key_heads: hk as u32,
        value_heads: hv as u32,
        key_dim: dk as u32,
        value_dim: dv as u32,
    };
    let (a_log, dt_bias) = (rand_vec(hv, 1, -4.0, 0.5), rand_vec(hv, 2, -1.0, 1.0));
    let (mut sa, mut sb) = (vec![0f32; hv * dk * dv], vec![0f32; hv * dk * dv]);
    let (mut oa, mut ob) = (vec![0f32; hv * dv], vec![0f32; hv * dv]);
    for step in 0..64 {
        let qkv = rand_vec(width, 100 + step, -1.0, 1.0);
        let (a, b) = (rand_vec(hv, 200 + step, -2.0, 2.0), rand_vec(hv, 300 + step, -2.0, 2.0));
        fast.delta_net(&p, &qkv, &a, &b, &a_log, &dt_bias, &mut sa, &mut oa);
        refr.delta_net(&p, &qkv, &a, &b, &a_log, &dt_bias, &mut sb, &mut ob);
        assert_close(&oa, &ob, 1e-5, &format!("step {step}"));
    }
    assert_close(&sa, &sb, 1e-5, "state after 64 steps");
}

#[test]
fn delta_net_conv_matches_reference() {
    let (fast, refr) = both();
    // 300 channels: one partial channel block; 2500: two full blocks and a partial one. T below,
    // at and above the history length.
    for (c, taps) in [(300, 4), (300, 2), (40, 5), (2500, 4)] {
        let w = rand_vec(c * taps, 1, -1.0, 1.0);
        for &t in &[1usize, 2, 3, 5, 70] {
            let x = rand_vec(t * c, 2 + t as u64, -2.0, 2.0);
            let st0 = rand_vec((taps - 1) * c, 9, -2.0, 2.0);
            let (mut sa, mut sb) = (st0.clone(), st0);
            let (mut a, mut b) = (vec![0f32; t * c], vec![0f32; t * c]);
            let p = ConvParams {
                tokens: t as u32,
                channels: c as u32,
                taps: taps as u32,
            };
            fast.delta_net_conv(&p, &w, &mut sa, &x, &mut a);
            refr.delta_net_conv(&p, &w, &mut sb, &x, &mut b);
            assert_close(&a, &b, 1e-6, &format!("conv out c={c} taps={taps} t={t}"));
            assert_close(&sa, &sb, 0.0, &format!("conv state c={c} taps={taps} t={t}"));
        }
    }
}

#[test]
fn moe_matches_reference() {
    let (fast, refr) = both();
    let (e, k, d, i) = (16usize, 8usize, 128usize, 64usize);
    for &t in &[1usize, 6] {
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
            fast.moe_experts(&mp, &x, &ia, &wa, &gate, &up, &down, &mut tmp, &mut a);
            refr.moe_experts(&mp, &x, &ia, &wa, &gate, &up, &down, &mut tmp, &mut b);
            assert_close(&a, &b, 1e-5, &format!("moe_experts {format:?} t={t}"));
        }
    }
}
