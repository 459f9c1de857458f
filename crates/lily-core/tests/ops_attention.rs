//! The attention family (qk_norm_rope, kv_store, attention): the CPU kernels and the Metal
//! kernels (simulator; the device on macOS) against the reference twins, and RoPE itself on
//! hand-computed values.

mod common;
#[macro_use]
mod metal_common;

use common::{assert_close, rand_vec};
use lily_core::{
    backend::{
        cpu::Cpu,
        metal::{Executor, Metal},
        params::{AttentionParams, KvStoreParams, RopeParams},
        Backend,
    },
    ops::attention::reference::norm_rope_head,
};
use metal_common::{assert_near, read_all, TOL};

mod cpu {
    use super::*;

    #[test]
    fn attention_path_matches_reference() {
        let (fast, refr) = (Cpu::new(), Cpu::reference());
        // Real per-head shapes: hd 256, rotary 64, 8 query heads per KV head.
        let (h, kv, hd, t, pos0) = (8, 1, 256, 9, 5);
        let p = RopeParams {
            tokens: t as u32,
            pos0: pos0 as u32,
            heads: h,
            kv_heads: kv,
            head_dim: hd,
            rotary_dim: 64,
            eps: 1e-6,
            theta: 1e4,
        };
        let (hd, h, kv) = (hd as usize, h as usize, kv as usize);
        let qg0 = rand_vec(t * h * 2 * hd, 1, -2.0, 2.0);
        let k0 = rand_vec(t * kv * hd, 2, -2.0, 2.0);
        let (qn, kn) = (rand_vec(hd, 3, 0.5, 1.5), rand_vec(hd, 4, 0.5, 1.5));
        let (mut qa, mut ka, mut qb, mut kb) = (qg0.clone(), k0.clone(), qg0.clone(), k0.clone());
        fast.qk_norm_rope(&p, &qn, &kn, &mut qa, &mut ka);
        refr.qk_norm_rope(&p, &qn, &kn, &mut qb, &mut kb);
        assert_close(&qa, &qb, 1e-6, "qk_norm_rope q");
        assert_close(&ka, &kb, 1e-6, "qk_norm_rope k");
        // Cache with pos0 earlier rows, then this chunk's keys appended.
        let max_seq = 32;
        let mut kc = rand_vec(max_seq * kv * hd, 5, -1.0, 1.0);
        let mut vc = rand_vec(max_seq * kv * hd, 6, -1.0, 1.0);
        let v = rand_vec(t * kv * hd, 7, -1.0, 1.0);
        let sp = KvStoreParams {
            tokens: t as u32,
            pos0: pos0 as u32,
            width: (kv * hd) as u32,
        };
        let mut kc2 = kc.clone();
        fast.kv_store(&sp, &ka, &mut kc);
        refr.kv_store(&sp, &ka, &mut kc2);
        assert_eq!(kc, kc2);
        fast.kv_store(&sp, &v, &mut vc);
        let ap = AttentionParams {
            tokens: t as u32,
            pos0: pos0 as u32,
            heads: h as u32,
            kv_heads: kv as u32,
            head_dim: hd as u32,
            scale: 1.0 / 16.0,
        };
        let (mut a, mut b) = (vec![0f32; t * h * hd], vec![0f32; t * h * hd]);
        fast.attention(&ap, &qa, &kc, &vc, &mut a);
        refr.attention(&ap, &qa, &kc, &vc, &mut b);
        assert_close(&a, &b, 1e-5, "attention");
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

metal_tests!(
    qk_norm_rope_matches_reference,
    kv_store_matches_reference,
    attention_matches_reference,
    unsupported_shape_is_an_error_not_a_panic,
);

fn qk_norm_rope_matches_reference<X: Executor>(dev: &mut Metal<X>, tolx: f32) {
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

fn kv_store_matches_reference<X: Executor>(dev: &mut Metal<X>, tolx: f32) {
    let _ = tolx; // exact
    let (t, w, max) = (3, 40, 10);
    let x = rand_vec(t * w, 50, -1.0, 1.0);
    let p = KvStoreParams {
        tokens: t as u32,
        pos0: 6,
        width: w as u32,
    };
    both!(dev, 0.0, "kv_store", b => {
        let xb = b.upload(&x).unwrap();
        let mut cache = b.alloc(max * w).unwrap();
        b.kv_store(&p, &xb, &mut cache);
        b.finish().unwrap();
        vec![read_all(b, &cache, max * w)]
    });
}

/// Prefill of `t` tokens on a cache already holding `pos0` rows, then `decode` single steps.
fn run_attention<B: Backend>(
    b: &B,
    h: usize,
    kv: usize,
    hd: usize,
    pos0: usize,
    t: usize,
    decode: usize,
) -> Vec<Vec<f32>> {
    let max = pos0 + t + decode;
    let kc = b.upload(&rand_vec(max * kv * hd, 60, -1.0, 1.0)).unwrap();
    let vc = b.upload(&rand_vec(max * kv * hd, 61, -1.0, 1.0)).unwrap();
    let mut outs = Vec::new();
    let mut pos = pos0;
    for (i, n) in std::iter::once(t).chain(std::iter::repeat_n(1, decode)).enumerate() {
        let qg = b.upload(&rand_vec(n * h * 2 * hd, 62 + i as u64, -1.5, 1.5)).unwrap();
        let mut out = b.alloc(n * h * hd).unwrap();
        let p = AttentionParams {
            tokens: n as u32,
            pos0: pos as u32,
            heads: h as u32,
            kv_heads: kv as u32,
            head_dim: hd as u32,
            scale: 1.0 / (hd as f32).sqrt(),
        };
        b.attention(&p, &qg, &kc, &vc, &mut out);
        b.finish().unwrap();
        outs.push(read_all(b, &out, n * h * hd));
        pos += n;
    }
    outs
}

fn attention_matches_reference<X: Executor>(dev: &mut Metal<X>, tolx: f32) {
    // (H, Hkv, hd, pos0, T, decode steps): partial tiles of 8 rows; decode past split_rows = 16
    // takes the split (flash-decoding) path; the last case has the real head shapes (8 per KV head).
    for (h, kv, hd, pos0, t, steps) in [
        (4, 2, 32, 0, 13, 0),
        (8, 2, 64, 3, 5, 2),
        (4, 1, 32, 30, 1, 3),
        (16, 2, 256, 20, 3, 1),
    ] {
        let want = run_attention(&Cpu::reference(), h, kv, hd, pos0, t, steps);
        let saved = dev.split_rows;
        dev.split_rows = 16;
        let got = run_attention(&*dev, h, kv, hd, pos0, t, steps);
        dev.split_rows = saved;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_near(g, w, tolx * TOL, &format!("attention H={h} Hkv={kv} hd={hd} call {i}"));
        }
    }
}

fn unsupported_shape_is_an_error_not_a_panic<X: Executor>(dev: &mut Metal<X>, tolx: f32) {
    let _ = tolx;
    let m = &*dev;
    let p = AttentionParams {
        tokens: 1,
        pos0: 0,
        heads: 4,
        kv_heads: 2,
        head_dim: 48,
        scale: 1.0,
    };
    let (qg, kc) = (m.alloc(4 * 96).unwrap(), m.alloc(2 * 48).unwrap());
    let mut out = m.alloc(4 * 48).unwrap();
    m.attention(&p, &qg, &kc, &kc, &mut out);
    let err = m.finish().unwrap_err().to_string();
    assert!(err.contains("head_dim"), "{err}");
    m.finish().unwrap(); // the error is reported once; the stream is usable again
}
