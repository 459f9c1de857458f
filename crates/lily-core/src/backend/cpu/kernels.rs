//! Production CPU kernels: the same math as `reference.rs`, split over the rayon pool, weights
//! dequantized row by row inside the kernels (never materialised), f32 accumulation.
//! DeltaNet prefill uses the chunked (parallel) form; decode the step recurrence.

use std::{cell::RefCell, ops::Range};

use rayon::prelude::*;

use super::reference::{self, sigmoid, silu};
use crate::{
    backend::params::*,
    quant::{read_scalar, Format, Matrix},
    safetensors::DType,
};

/// A raw output pointer shared by tasks that write disjoint elements.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: every use writes a set of indices no other task touches, inside one parallel call.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}
impl Out {
    /// # Safety
    /// `i` is in bounds of the buffer and written by this task alone.
    #[inline]
    unsafe fn set(self, i: usize, v: f32) {
        unsafe { *self.0.add(i) = v }
    }
}

thread_local! {
    static ROW: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Run `f` with a per-thread scratch of at least `len` floats (grown once, then reused).
fn with_row<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    ROW.with(|r| {
        let mut r = r.borrow_mut();
        if r.len() < len {
            r.resize(len, 0.0);
        }
        f(&mut r[..len])
    })
}

#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

#[inline]
fn word(data: &[u8], w: usize) -> u32 {
    u32::from_le_bytes([data[4 * w], data[4 * w + 1], data[4 * w + 2], data[4 * w + 3]])
}

/// Dequantize one stored row into `out[..cols]`, a word at a time.
pub fn dequant_row(m: &Matrix, stored: usize, out: &mut [f32]) {
    let (data, scales, biases) = m.row_parts(stored);
    let cols = m.cols;
    match m.format {
        Format::BF16 => {
            for (o, c) in out[..cols].iter_mut().zip(data.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        Format::F16 => (0..cols).for_each(|j| out[j] = read_scalar(DType::F16, data, j)),
        Format::F32 => (0..cols).for_each(|j| out[j] = read_scalar(DType::F32, data, j)),
        Format::Affine { bits, group } => {
            let sd = m.groups.as_ref().map_or(DType::BF16, |g| g.dtype);
            let per_word = 32 / bits as usize;
            let mask = (1u32 << bits) - 1;
            let words_per_group = group / per_word;
            for g in 0..cols / group {
                let (s, b) = (read_scalar(sd, scales, g), read_scalar(sd, biases, g));
                for wi in 0..words_per_group {
                    let w = word(data, g * words_per_group + wi);
                    let o = &mut out[(g * words_per_group + wi) * per_word..][..per_word];
                    for (i, v) in o.iter_mut().enumerate() {
                        *v = s * ((w >> (i * bits as usize)) & mask) as f32 + b;
                    }
                }
            }
        }
    }
}

pub fn embed(tokens: usize, table: &Matrix, ids: &[u32], out: &mut [f32]) {
    let d = table.cols;
    out[..tokens * d]
        .par_chunks_mut(d)
        .zip(&ids[..tokens])
        .for_each(|(o, &id)| dequant_row(table, table.stored_row(0, id as usize), o));
}

fn norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let inv = 1.0 / (dot(x, x) / x.len() as f32 + eps).sqrt();
    for j in 0..x.len() {
        out[j] = x[j] * inv * w[j];
    }
}

pub fn rms_norm(p: &RmsNormParams, x: &[f32], w: &[f32], out: &mut [f32]) {
    let d = p.dim as usize;
    let n = p.rows as usize * d;
    out[..n].par_chunks_mut(d).zip(x[..n].par_chunks(d)).for_each(|(o, xr)| norm_row(xr, w, p.eps, o));
}

pub fn rms_norm_gated(p: &RmsNormParams, x: &[f32], z: &[f32], w: &[f32], out: &mut [f32]) {
    let d = p.dim as usize;
    let n = p.rows as usize * d;
    out[..n].par_chunks_mut(d).zip(x[..n].par_chunks(d).zip(z[..n].par_chunks(d))).for_each(|(o, (xr, zr))| {
        norm_row(xr, w, p.eps, o);
        o.iter_mut().zip(zr).for_each(|(v, zz)| *v *= silu(*zz));
    });
}

pub fn add(p: &RowsParams, x: &mut [f32], y: &[f32]) {
    let n = (p.tokens * p.dim) as usize;
    x[..n].par_chunks_mut(4096).zip(y[..n].par_chunks(4096)).for_each(|(a, b)| {
        a.iter_mut().zip(b).for_each(|(u, v)| *u += v);
    });
}

/// out[t * n_stride + r] = row r of expert e · x_t for the given tokens' rows of x.
fn apply_rows(m: &Matrix, e: usize, x: &[f32], xs: Range<usize>, out: Out, n_stride: usize, rows: Range<usize>) {
    with_row(m.cols, |row| {
        for r in rows {
            dequant_row(m, m.stored_row(e, r), row);
            for (i, xr) in xs.clone().enumerate() {
                let v = dot(row, &x[xr * m.cols..][..m.cols]);
                // SAFETY: (i, r) pairs are distinct across the tasks of one call.
                unsafe { out.set(i * n_stride + r, v) };
            }
        }
    });
}

pub fn matmul(p: &MatmulParams, w: &Matrix, x: &[f32], out: &mut [f32]) {
    let (n, t_n) = (w.rows, p.tokens as usize);
    assert!(out.len() >= t_n * n && x.len() >= (p.x_row0 as usize + t_n) * w.cols);
    let xs = p.x_row0 as usize..p.x_row0 as usize + t_n;
    let o = Out(out.as_mut_ptr());
    let block = 16;
    (0..n.div_ceil(block)).into_par_iter().for_each(|b| {
        apply_rows(w, 0, x, xs.clone(), o, n, b * block..((b + 1) * block).min(n));
    });
}

pub fn qk_norm_rope(p: &RopeParams, q_norm: &[f32], k_norm: &[f32], qg: &mut [f32], k: &mut [f32]) {
    let (hd, rot) = (p.head_dim as usize, p.rotary_dim as usize);
    let t_n = p.tokens as usize;
    qg[..t_n * p.heads as usize * 2 * hd].par_chunks_mut(2 * hd).enumerate().for_each(|(i, head)| {
        let pos = p.pos0 as usize + i / p.heads as usize;
        reference::norm_rope_head(&mut head[..hd], q_norm, p.eps, rot, p.theta, pos);
    });
    k[..t_n * p.kv_heads as usize * hd].par_chunks_mut(hd).enumerate().for_each(|(i, head)| {
        let pos = p.pos0 as usize + i / p.kv_heads as usize;
        reference::norm_rope_head(head, k_norm, p.eps, rot, p.theta, pos);
    });
}

pub fn kv_store(p: &KvStoreParams, x: &[f32], cache: &mut [f32]) {
    reference::kv_store(p, x, cache)
}

/// One query head against `len` cached rows (two passes: scores, then softmax-weighted V).
pub fn attention(p: &AttentionParams, qg: &[f32], k_cache: &[f32], v_cache: &[f32], out: &mut [f32]) {
    let (h_n, kv_n, hd) = (p.heads as usize, p.kv_heads as usize, p.head_dim as usize);
    let group = h_n / kv_n;
    let t_n = p.tokens as usize;
    out[..t_n * h_n * hd].par_chunks_mut(hd).enumerate().for_each(|(i, o)| {
        let (t, h) = (i / h_n, i % h_n);
        let len = p.pos0 as usize + t + 1;
        let q = &qg[(t * h_n + h) * 2 * hd..][..hd];
        let gate = &qg[(t * h_n + h) * 2 * hd + hd..][..hd];
        let kvh = h / group;
        with_row(len, |scores| {
            let mut m = f32::NEG_INFINITY;
            for (s, sc) in scores.iter_mut().enumerate() {
                *sc = dot(q, &k_cache[(s * kv_n + kvh) * hd..][..hd]) * p.scale;
                m = m.max(*sc);
            }
            let mut z = 0f32;
            scores.iter_mut().for_each(|sc| {
                *sc = (*sc - m).exp();
                z += *sc;
            });
            o.fill(0.0);
            for (s, &e) in scores.iter().enumerate() {
                let v = &v_cache[(s * kv_n + kvh) * hd..][..hd];
                let w = e / z;
                o.iter_mut().zip(v).for_each(|(a, b)| *a += w * b);
            }
        });
        o.iter_mut().zip(gate).for_each(|(a, g)| *a *= sigmoid(*g));
    });
}

pub fn delta_net_conv(p: &ConvParams, w: &[f32], state: &mut [f32], x: &[f32], out: &mut [f32]) {
    let (c_n, taps, t_n) = (p.channels as usize, p.taps as usize, p.tokens as usize);
    let hist = taps - 1;
    let o = Out(out.as_mut_ptr());
    let block = 256;
    // Channels are independent: each task owns a block of channels, its outputs and its state.
    let st = Out(state.as_mut_ptr());
    (0..c_n.div_ceil(block)).into_par_iter().for_each(|b| {
        let mut win = [0f32; 16];
        for c in b * block..((b + 1) * block).min(c_n) {
            let wc = &w[c * taps..][..taps];
            // SAFETY: channel c's state column is read and written by this task only.
            for i in 0..hist {
                win[i] = unsafe { *st.0.add(i * c_n + c) };
            }
            for t in 0..t_n {
                win[hist] = x[t * c_n + c];
                let acc: f32 = (0..taps).map(|j| wc[j] * win[j]).sum();
                unsafe { o.set(t * c_n + c, silu(acc)) };
                win.copy_within(1..taps, 0);
            }
            for i in 0..hist {
                unsafe { st.set(i * c_n + c, win[i]) };
            }
        }
    });
}

/// Chunk length of the parallel DeltaNet form (FLA / transformers use 64).
const CHUNK: usize = 64;

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
    let (hv, dk, dv, t_n) = (p.value_heads as usize, p.key_dim as usize, p.value_dim as usize, p.tokens as usize);
    let o = Out(out.as_mut_ptr());
    state[..hv * dk * dv].par_chunks_mut(dk * dv).enumerate().for_each(|(j, s)| {
        let mut t0 = 0;
        while t0 < t_n {
            let n = (t_n - t0).min(CHUNK);
            if n == 1 {
                delta_step(p, qkv, a, b, a_log, dt_bias, t0, j, s, o);
            } else {
                delta_chunk(p, qkv, a, b, a_log, dt_bias, t0, n, j, s, o);
            }
            t0 += n;
        }
    });
}

fn delta_step(
    p: &DeltaNetParams,
    qkv: &[f32],
    a: &[f32],
    b: &[f32],
    a_log: &[f32],
    dt_bias: &[f32],
    t: usize,
    j: usize,
    s: &mut [f32],
    o: Out,
) {
    let (hv, dk, dv) = (p.value_heads as usize, p.key_dim as usize, p.value_dim as usize);
    let (q, k, v, beta, g) = reference::delta_net_inputs(p, qkv, a, b, a_log, dt_bias, t, j);
    let alpha = g.exp();
    // pred[c] = sum_d alpha*S[d,c]*k[d]; S stays [Dk, Dv] so rows are contiguous in c.
    let mut pred = vec![0f32; dv];
    for d in 0..dk {
        let row = &mut s[d * dv..][..dv];
        row.iter_mut().for_each(|x| *x *= alpha);
        pred.iter_mut().zip(row.iter()).for_each(|(pc, x)| *pc += x * k[d]);
    }
    let delta: Vec<f32> = (0..dv).map(|c| beta * (v[c] - pred[c])).collect();
    let mut outv = vec![0f32; dv];
    for d in 0..dk {
        let row = &mut s[d * dv..][..dv];
        row.iter_mut().zip(&delta).for_each(|(x, dc)| *x += k[d] * dc);
        outv.iter_mut().zip(row.iter()).for_each(|(oc, x)| *oc += x * q[d]);
    }
    for c in 0..dv {
        // SAFETY: value head j's outputs belong to this task.
        unsafe { o.set((t * hv + j) * dv + c, outv[c]) };
    }
}

/// The chunked form (architecture.md §6.1) for tokens t0..t0+n of value head j.
fn delta_chunk(
    p: &DeltaNetParams,
    qkv: &[f32],
    a: &[f32],
    b: &[f32],
    a_log: &[f32],
    dt_bias: &[f32],
    t0: usize,
    n: usize,
    j: usize,
    s: &mut [f32],
    o: Out,
) {
    let (hv, dk, dv) = (p.value_heads as usize, p.key_dim as usize, p.value_dim as usize);
    let mut q = vec![0f32; n * dk];
    let mut k = vec![0f32; n * dk];
    let mut v = vec![0f32; n * dv];
    let mut beta = vec![0f32; n];
    let mut gam = vec![0f32; n]; // cumulative log-decay
    let mut acc = 0f32;
    for i in 0..n {
        let (qi, ki, vi, bi, gi) = reference::delta_net_inputs(p, qkv, a, b, a_log, dt_bias, t0 + i, j);
        q[i * dk..][..dk].copy_from_slice(&qi);
        k[i * dk..][..dk].copy_from_slice(&ki);
        v[i * dv..][..dv].copy_from_slice(&vi);
        beta[i] = bi;
        acc += gi;
        gam[i] = acc;
    }
    // A[i, j'] = beta_i (k_i . k_j') exp(gam_i - gam_j') for j' < i; solve (I + A) U = beta V and
    // (I + A) W = beta exp(gam) K by forward substitution.
    let mut u = vec![0f32; n * dv];
    let mut w = vec![0f32; n * dk];
    let mut amat = vec![0f32; n * n];
    for i in 0..n {
        for jj in 0..i {
            amat[i * n + jj] = beta[i] * dot(&k[i * dk..][..dk], &k[jj * dk..][..dk]) * (gam[i] - gam[jj]).exp();
        }
    }
    for i in 0..n {
        let eg = gam[i].exp();
        for c in 0..dv {
            u[i * dv + c] = beta[i] * v[i * dv + c];
        }
        for d in 0..dk {
            w[i * dk + d] = beta[i] * eg * k[i * dk + d];
        }
        for jj in 0..i {
            let aij = amat[i * n + jj];
            if aij != 0.0 {
                for c in 0..dv {
                    u[i * dv + c] -= aij * u[jj * dv + c];
                }
                for d in 0..dk {
                    w[i * dk + d] -= aij * w[jj * dk + d];
                }
            }
        }
    }
    // V' = U - W S  ([n, Dv]).
    for i in 0..n {
        for d in 0..dk {
            let wd = w[i * dk + d];
            let srow = &s[d * dv..][..dv];
            u[i * dv..][..dv].iter_mut().zip(srow).for_each(|(x, sv)| *x -= wd * sv);
        }
    }
    // O_i = exp(gam_i) q_i S + sum_{j' <= i} (q_i . k_j') exp(gam_i - gam_j') V'_j'.
    let mut oi = vec![0f32; dv];
    for i in 0..n {
        oi.fill(0.0);
        let eg = gam[i].exp();
        for d in 0..dk {
            let qd = q[i * dk + d] * eg;
            oi.iter_mut().zip(&s[d * dv..][..dv]).for_each(|(x, sv)| *x += qd * sv);
        }
        for jj in 0..=i {
            let c = dot(&q[i * dk..][..dk], &k[jj * dk..][..dk]) * (gam[i] - gam[jj]).exp();
            oi.iter_mut().zip(&u[jj * dv..][..dv]).for_each(|(x, vv)| *x += c * vv);
        }
        for c in 0..dv {
            // SAFETY: value head j's outputs belong to this task.
            unsafe { o.set(((t0 + i) * hv + j) * dv + c, oi[c]) };
        }
    }
    // S <- exp(gam_n) S + sum_j' exp(gam_n - gam_j') k_j' (x) V'_j'.
    let gn = gam[n - 1];
    let en = gn.exp();
    s.iter_mut().for_each(|x| *x *= en);
    for jj in 0..n {
        let f = (gn - gam[jj]).exp();
        for d in 0..dk {
            let kd = k[jj * dk + d] * f;
            s[d * dv..][..dv].iter_mut().zip(&u[jj * dv..][..dv]).for_each(|(x, vv)| *x += kd * vv);
        }
    }
}

pub fn moe_route(p: &RouteParams, logits: &[f32], ids: &mut [u32], weights: &mut [f32]) {
    let (e_n, k_n) = (p.experts as usize, p.top_k as usize);
    let t_n = p.tokens as usize;
    ids[..t_n * k_n].par_chunks_mut(k_n).zip(weights[..t_n * k_n].par_chunks_mut(k_n)).enumerate().for_each(
        |(t, (id, wt))| {
            let l = &logits[t * e_n..][..e_n];
            let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let z: f32 = l.iter().map(|x| (x - m).exp()).sum();
            // Insertion top-k over the logits (same order as the probabilities); ties keep the lower id.
            let mut n = 0;
            for (e, &x) in l.iter().enumerate() {
                if n == k_n && x <= l[id[k_n - 1] as usize] {
                    continue;
                }
                let mut pos = n.min(k_n - 1);
                if n < k_n {
                    n += 1;
                }
                while pos > 0 && l[id[pos - 1] as usize] < x {
                    id[pos] = id[pos - 1];
                    pos -= 1;
                }
                id[pos] = e as u32;
            }
            let mut sum = 0f32;
            for k in 0..k_n {
                wt[k] = (l[id[k] as usize] - m).exp() / z;
                sum += wt[k];
            }
            if p.renorm != 0 {
                wt.iter_mut().for_each(|w| *w /= sum);
            }
        },
    );
}

pub fn moe_experts(
    p: &MoeParams,
    x: &[f32],
    ids: &[u32],
    weights: &[f32],
    gate: &Matrix,
    up: &Matrix,
    down: &Matrix,
    tmp: &mut [f32],
    out: &mut [f32],
) {
    let (d, inter, k_n, t_n) = (gate.cols, gate.rows, p.top_k as usize, p.tokens as usize);
    let pairs = t_n * k_n;
    // tmp rows: [pairs, I] activations, then [pairs, D] expert outputs.
    let (act, ys) = tmp[..pairs * (inter + d)].split_at_mut(pairs * inter);
    let (act_o, ys_o) = (Out(act.as_mut_ptr()), Out(ys.as_mut_ptr()));
    // Group the (token, slot) pairs by expert so each expert row is dequantized once per call.
    let mut order: Vec<u32> = (0..pairs as u32).collect();
    order.sort_by_key(|&i| ids[i as usize]);
    let mut groups: Vec<(usize, usize)> = Vec::new(); // ranges of `order`
    let mut s = 0;
    for i in 1..=pairs {
        if i == pairs || ids[order[i] as usize] != ids[order[s] as usize] {
            groups.push((s, i));
            s = i;
        }
    }
    // Split each expert's rows in blocks so a few experts still use every core.
    let block = 32;
    let gate_up_tasks: Vec<(usize, usize)> =
        groups.iter().enumerate().flat_map(|(g, _)| (0..inter.div_ceil(block)).map(move |b| (g, b))).collect();
    gate_up_tasks.par_iter().for_each(|&(g, b)| {
        let (lo, hi) = groups[g];
        let e = ids[order[lo] as usize] as usize;
        with_row(2 * d, |rows| {
            let (gr, ur) = rows.split_at_mut(d);
            for r in b * block..((b + 1) * block).min(inter) {
                dequant_row(gate, gate.stored_row(e, r), gr);
                dequant_row(up, up.stored_row(e, r), ur);
                for &pi in &order[lo..hi] {
                    let t = pi as usize / k_n;
                    let xt = &x[t * d..][..d];
                    // SAFETY: (pair, r) is written by this task only.
                    unsafe { act_o.set(pi as usize * inter + r, silu(dot(gr, xt)) * dot(ur, xt)) };
                }
            }
        });
    });
    let act: &[f32] = act;
    let down_tasks: Vec<(usize, usize)> =
        groups.iter().enumerate().flat_map(|(g, _)| (0..d.div_ceil(block)).map(move |b| (g, b))).collect();
    down_tasks.par_iter().for_each(|&(g, b)| {
        let (lo, hi) = groups[g];
        let e = ids[order[lo] as usize] as usize;
        with_row(inter, |row| {
            for r in b * block..((b + 1) * block).min(d) {
                dequant_row(down, down.stored_row(e, r), row);
                for &pi in &order[lo..hi] {
                    let pi = pi as usize;
                    // SAFETY: (pair, r) is written by this task only.
                    unsafe { ys_o.set(pi * d + r, dot(row, &act[pi * inter..][..inter])) };
                }
            }
        });
    });
    let ys: &[f32] = ys;
    out[..t_n * d].par_chunks_mut(d).enumerate().for_each(|(t, o)| {
        o.fill(0.0);
        for k in 0..k_n {
            let w = weights[t * k_n + k];
            o.iter_mut().zip(&ys[(t * k_n + k) * d..][..d]).for_each(|(a, y)| *a += w * y);
        }
    });
}

pub fn swiglu(p: &RowsParams, gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = (p.tokens * p.dim) as usize;
    out[..n].par_chunks_mut(4096).zip(gate[..n].par_chunks(4096).zip(up[..n].par_chunks(4096))).for_each(
        |(o, (g, u))| {
            for i in 0..o.len() {
                o[i] = silu(g[i]) * u[i];
            }
        },
    );
}

pub fn sigmoid_gate_add(p: &RowsParams, y: &[f32], gate: &[f32], out: &mut [f32]) {
    let d = p.dim as usize;
    out[..p.tokens as usize * d].par_chunks_mut(d).enumerate().for_each(|(t, o)| {
        let s = sigmoid(gate[t]);
        o.iter_mut().zip(&y[t * d..][..d]).for_each(|(a, b)| *a += s * b);
    });
}
