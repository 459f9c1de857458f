//! The reference twins of the DeltaNet ops (shapes: `ops/delta_net/mod.rs`).

use super::DeltaNetIn;
use crate::{backend::params::ConvParams, ops::silu};

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
pub fn delta_net_inputs(x: &DeltaNetIn, t: usize, j: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>, f32, f32) {
    let (qs, ks, v) = x.heads(t, j);
    let l2 = |r: &[f32]| {
        let inv = 1.0 / (r.iter().map(|e| e * e).sum::<f32>() + 1e-6).sqrt();
        r.iter().map(|e| e * inv).collect::<Vec<f32>>()
    };
    let scale = 1.0 / (x.p.key_dim as f32).sqrt();
    let q: Vec<f32> = l2(qs).into_iter().map(|e| e * scale).collect();
    let (beta, g) = x.gates(t, j);
    (q, l2(ks), v.to_vec(), beta, g)
}

/// The step recurrence, token by token: decay, read, delta, write, read out.
pub fn delta_net(x: &DeltaNetIn, state: &mut [f32], out: &mut [f32]) {
    let (t_n, _, hv, dk, dv) = x.p.dims();
    for t in 0..t_n {
        for j in 0..hv {
            let (q, k, v, beta, g) = delta_net_inputs(x, t, j);
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

/// The chunked (parallel) form of [`delta_net`] (architecture.md 6.1), written as the formulas
/// read: per value head, chunks of `chunk` tokens (the last one partial), each solving for the
/// chunk's corrected values V' against the incoming state, then emitting O and the new state.
/// The same result as the step recurrence up to f32 rounding; the twin that the production
/// chunked kernels (CPU: 64-token chunks; Metal: 32) are checked against.
/// Per chunk of n tokens, with q, k, v, beta, g as in the step form and S the incoming state:
/// gam_i = g_0 + .. + g_i; A[i, s] = beta_i (k_i . k_s) e^(gam_i - gam_s) for s < i;
/// (I + A) U = diag(beta) V and (I + A) W = diag(beta e^gam) K (forward substitution);
/// V' = U - W S; O_i = e^gam_i q_i S + sum_{s <= i} (q_i . k_s) e^(gam_i - gam_s) V'_s;
/// S <- e^gam_{n-1} S + sum_s e^(gam_{n-1} - gam_s) k_s V'_s^T.
pub fn delta_net_chunked(x: &DeltaNetIn, state: &mut [f32], out: &mut [f32], chunk: usize) {
    assert!(chunk > 0, "delta_net_chunked: chunks of 0 tokens");
    let (t_n, _, hv, dk, dv) = x.p.dims();
    let dot = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(u, v)| u * v).sum::<f32>();
    for j in 0..hv {
        let s = &mut state[j * dk * dv..][..dk * dv]; // [Dk, Dv]
        for t0 in (0..t_n).step_by(chunk) {
            let n = chunk.min(t_n - t0);
            let (mut q, mut k, mut v, mut beta, mut gam) = (vec![], vec![], vec![], vec![], vec![]);
            let mut acc = 0f32;
            for i in 0..n {
                let (qi, ki, vi, bi, gi) = delta_net_inputs(x, t0 + i, j);
                acc += gi;
                q.push(qi);
                k.push(ki);
                v.push(vi);
                beta.push(bi);
                gam.push(acc);
            }
            let decay = |i: usize, r: usize| (gam[i] - gam[r]).exp(); // r <= i: never above 1
            let mut u: Vec<Vec<f32>> = Vec::with_capacity(n);
            let mut w: Vec<Vec<f32>> = Vec::with_capacity(n);
            for i in 0..n {
                let mut ui: Vec<f32> = v[i].iter().map(|x| beta[i] * x).collect();
                let mut wi: Vec<f32> = k[i].iter().map(|x| beta[i] * gam[i].exp() * x).collect();
                for r in 0..i {
                    let a_ir = beta[i] * dot(&k[i], &k[r]) * decay(i, r);
                    ui.iter_mut().zip(&u[r]).for_each(|(x, y)| *x -= a_ir * y);
                    wi.iter_mut().zip(&w[r]).for_each(|(x, y)| *x -= a_ir * y);
                }
                u.push(ui);
                w.push(wi);
            }
            // V' = U - W S, in place of U.
            for i in 0..n {
                for c in 0..dv {
                    u[i][c] -= (0..dk).map(|d| w[i][d] * s[d * dv + c]).sum::<f32>();
                }
            }
            for i in 0..n {
                for c in 0..dv {
                    let from_state = gam[i].exp() * (0..dk).map(|d| q[i][d] * s[d * dv + c]).sum::<f32>();
                    let in_chunk: f32 = (0..=i).map(|r| dot(&q[i], &k[r]) * decay(i, r) * u[r][c]).sum();
                    out[((t0 + i) * hv + j) * dv + c] = from_state + in_chunk;
                }
            }
            let last = n - 1;
            for d in 0..dk {
                for c in 0..dv {
                    let add: f32 = (0..n).map(|r| decay(last, r) * k[r][d] * u[r][c]).sum();
                    s[d * dv + c] = gam[last].exp() * s[d * dv + c] + add;
                }
            }
        }
    }
}
