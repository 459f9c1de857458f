//! Reference kernels: plain loops, f32 accumulation, written to be obviously correct.
//! Every other kernel (the fast CPU ones, Metal, CUDA) is tested against these.
//! Each function's shapes are those of the matching `Backend` method.

use crate::{
    backend::params::*,
    ops::{sigmoid, silu, softplus},
    quant::Matrix,
};

pub fn delta_net_conv(p: &ConvParams, w: &[f32], state: &mut [f32], x: &[f32], out: &mut [f32]) {
    let (c_n, taps) = (p.channels as usize, p.taps as usize);
    let hist = taps - 1;
    // Rows of [state; x]: row i < hist is state, else x[i - hist].
    let row = |i: usize, c: usize, state: &[f32]| {
        if i < hist {
            state[i * c_n + c]
        } else {
            x[(i - hist) * c_n + c]
        }
    };
    for t in 0..p.tokens as usize {
        for c in 0..c_n {
            let mut acc = 0f32;
            for j in 0..taps {
                acc += w[c * taps + j] * row(t + j, c, state);
            }
            out[t * c_n + c] = silu(acc);
        }
    }
    // New state: the last `hist` rows of [state; x].
    let total = hist + p.tokens as usize;
    let new: Vec<f32> = (0..hist * c_n)
        .map(|i| row(total - hist + i / c_n, i % c_n, state))
        .collect();
    state[..hist * c_n].copy_from_slice(&new);
}

/// Per-token DeltaNet inputs for value head `j`: (q, k) l2-normed (q scaled by Dk^-1/2), v, beta, decay g.
pub fn delta_net_inputs(
    p: &DeltaNetParams,
    qkv: &[f32],
    a: &[f32],
    b: &[f32],
    a_log: &[f32],
    dt_bias: &[f32],
    t: usize,
    j: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, f32, f32) {
    let (hk, hv, dk, dv) = (
        p.key_heads as usize,
        p.value_heads as usize,
        p.key_dim as usize,
        p.value_dim as usize,
    );
    let width = 2 * hk * dk + hv * dv;
    let row = &qkv[t * width..][..width];
    let kh = j / (hv / hk); // value head j reads q/k head j / (Hv/Hk)
    let l2 = |v: &[f32]| {
        let inv = 1.0 / (v.iter().map(|x| x * x).sum::<f32>() + 1e-6).sqrt();
        v.iter().map(|x| x * inv).collect::<Vec<f32>>()
    };
    let scale = 1.0 / (dk as f32).sqrt();
    let q: Vec<f32> = l2(&row[kh * dk..][..dk]).into_iter().map(|x| x * scale).collect();
    let k = l2(&row[hk * dk + kh * dk..][..dk]);
    let v = row[2 * hk * dk + j * dv..][..dv].to_vec();
    let beta = sigmoid(b[t * hv + j]);
    let g = -a_log[j].exp() * softplus(a[t * hv + j] + dt_bias[j]);
    (q, k, v, beta, g)
}

/// The step recurrence, token by token: decay, read, delta, write, read out.
pub fn delta_net(
    p: &DeltaNetParams,
    qkv: &[f32],
    a: &[f32],
    b: &[f32],
    a_log: &[f32],
    dt_bias: &[f32],
    state: &mut [f32],
    out: &mut [f32],
) {
    let (hv, dk, dv) = (p.value_heads as usize, p.key_dim as usize, p.value_dim as usize);
    for t in 0..p.tokens as usize {
        for j in 0..hv {
            let (q, k, v, beta, g) = delta_net_inputs(p, qkv, a, b, a_log, dt_bias, t, j);
            let s = &mut state[j * dk * dv..][..dk * dv]; // [Dk, Dv]
            let alpha = g.exp();
            s.iter_mut().for_each(|x| *x *= alpha);
            for c in 0..dv {
                let pred: f32 = (0..dk).map(|d| s[d * dv + c] * k[d]).sum();
                let delta = beta * (v[c] - pred);
                for d in 0..dk {
                    s[d * dv + c] += k[d] * delta;
                }
            }
            for c in 0..dv {
                out[(t * hv + j) * dv + c] = (0..dk).map(|d| s[d * dv + c] * q[d]).sum();
            }
        }
    }
}

/// Softmax over all E logits, top K by probability (ties: lower id first), optional renormalisation.
pub fn moe_route(p: &RouteParams, logits: &[f32], ids: &mut [u32], weights: &mut [f32]) {
    let (e_n, k_n) = (p.experts as usize, p.top_k as usize);
    for t in 0..p.tokens as usize {
        let l = &logits[t * e_n..][..e_n];
        let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let z: f32 = l.iter().map(|x| (x - m).exp()).sum();
        let probs: Vec<f32> = l.iter().map(|x| (x - m).exp() / z).collect();
        let mut order: Vec<usize> = (0..e_n).collect();
        order.sort_by(|&x, &y| probs[y].total_cmp(&probs[x]).then(x.cmp(&y)));
        let sum: f32 = order[..k_n].iter().map(|&e| probs[e]).sum();
        for k in 0..k_n {
            ids[t * k_n + k] = order[k] as u32;
            weights[t * k_n + k] = if p.renorm != 0 {
                probs[order[k]] / sum
            } else {
                probs[order[k]]
            };
        }
    }
}

pub fn moe_experts(
    p: &MoeParams,
    x: &[f32],
    ids: &[u32],
    weights: &[f32],
    gate: &Matrix,
    up: &Matrix,
    down: &Matrix,
    out: &mut [f32],
) {
    let (d, inter, k_n) = (gate.cols, gate.rows, p.top_k as usize);
    let mut row = vec![0f32; d.max(inter)];
    for t in 0..p.tokens as usize {
        let xt = &x[t * d..][..d];
        let o = &mut out[t * d..][..d];
        o.fill(0.0);
        for k in 0..k_n {
            let e = ids[t * k_n + k] as usize;
            let mut act = vec![0f32; inter];
            for r in 0..inter {
                gate.dequant_row(e, r, &mut row[..d]);
                let g: f32 = row[..d].iter().zip(xt).map(|(a, b)| a * b).sum();
                up.dequant_row(e, r, &mut row[..d]);
                let u: f32 = row[..d].iter().zip(xt).map(|(a, b)| a * b).sum();
                act[r] = silu(g) * u;
            }
            for r in 0..d {
                down.dequant_row(e, r, &mut row[..inter]);
                let y: f32 = row[..inter].iter().zip(&act).map(|(a, b)| a * b).sum();
                o[r] += weights[t * k_n + k] * y;
            }
        }
    }
}
