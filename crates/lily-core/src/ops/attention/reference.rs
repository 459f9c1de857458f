//! The reference twins of the attention ops (shapes: `ops/attention/mod.rs`): RoPE angles in
//! f64, a full softmax over every visible key.

use crate::{
    backend::{
        cpu::kv::CpuKv,
        params::{AttentionParams, KvStoreParams, RopeParams},
    },
    ops::sigmoid,
};

/// RMSNorm of one head vector, then rotate-half RoPE on its first `rot` dims at position `pos`.
pub fn norm_rope_head(v: &mut [f32], w: &[f32], eps: f32, rot: usize, theta: f32, pos: usize) {
    let hd = v.len();
    let inv = 1.0 / (v.iter().map(|x| x * x).sum::<f32>() / hd as f32 + eps).sqrt();
    for j in 0..hd {
        v[j] = v[j] * inv * w[j];
    }
    let half = rot / 2;
    for j in 0..half {
        // inv_freq_j = theta^(-2j/rot); angle in f64 so long positions stay exact.
        let angle = pos as f64 * (theta as f64).powf(-2.0 * j as f64 / rot as f64);
        let (sin, cos) = (angle.sin() as f32, angle.cos() as f32);
        let (a, b) = (v[j], v[j + half]);
        v[j] = a * cos - b * sin;
        v[j + half] = b * cos + a * sin;
    }
}

pub fn qk_norm_rope(p: &RopeParams, q_norm: &[f32], k_norm: &[f32], qg: &mut [f32], k: &mut [f32]) {
    let hd = p.head_dim as usize;
    let rot = p.rotary_dim as usize;
    for t in 0..p.tokens as usize {
        let pos = p.pos0 as usize + t;
        for h in 0..p.heads as usize {
            let base = (t * p.heads as usize + h) * 2 * hd;
            norm_rope_head(&mut qg[base..base + hd], q_norm, p.eps, rot, p.theta, pos);
        }
        for h in 0..p.kv_heads as usize {
            let base = (t * p.kv_heads as usize + h) * hd;
            norm_rope_head(&mut k[base..base + hd], k_norm, p.eps, rot, p.theta, pos);
        }
    }
}

/// cache row pos0 + t = x[t] (rounded to the cache's dtype), row by row.
pub fn kv_store(p: &KvStoreParams, x: &[f32], cache: &mut CpuKv) {
    let w = p.width as usize;
    for t in 0..p.tokens as usize {
        cache.store_row(p.pos0 as usize + t, 0, &x[t * w..][..w]);
    }
}

pub fn attention(p: &AttentionParams, qg: &[f32], k_cache: &CpuKv, v_cache: &CpuKv, out: &mut [f32]) {
    let (h_n, kv_n, hd) = (p.heads as usize, p.kv_heads as usize, p.head_dim as usize);
    let group = h_n / kv_n;
    let mut row = vec![0f32; hd];
    for t in 0..p.tokens as usize {
        let len = p.pos0 as usize + t + 1; // causal: cache rows 0..=pos
        for h in 0..h_n {
            let q = &qg[(t * h_n + h) * 2 * hd..][..hd];
            let gate = &qg[(t * h_n + h) * 2 * hd + hd..][..hd];
            let kvh = h / group;
            let scores: Vec<f32> = (0..len)
                .map(|s| {
                    k_cache.row_f32(s, kvh * hd, &mut row);
                    q.iter().zip(&row).map(|(a, b)| a * b).sum::<f32>() * p.scale
                })
                .collect();
            let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f32 = e.iter().sum();
            let o = &mut out[(t * h_n + h) * hd..][..hd];
            o.fill(0.0);
            for s in 0..len {
                v_cache.row_f32(s, kvh * hd, &mut row);
                for j in 0..hd {
                    o[j] += e[s] / z * row[j];
                }
            }
            for j in 0..hd {
                o[j] *= sigmoid(gate[j]);
            }
        }
    }
}
