//! Production CPU kernels: the same math as `reference.rs` with SIMD (runtime-dispatched, see
//! `simd.rs`), the persistent thread pool (`pool.rs`, one thread per core, created once) and in-kernel
//! dequantization: weights are read from their packed bytes, never materialised as a matrix.
//! Accumulation is f32 everywhere.
//!
//! Decode (one token) streams weights through GEMV kernels that split rows over the threads;
//! prefill runs tiled GEMM (a dequantized tile of rows against every token), MoE experts with the
//! tokens grouped by expert, tiled causal attention with online softmax, and the chunked DeltaNet
//! form. Scratch comes from per-thread buffers that grow once (`gemm::with_task`/`with_caller`),
//! so a decode step allocates nothing.

use super::{
    isa::{multiversion, Isa},
    pool, reference,
    scratch::{with_caller, with_caller_ids, with_task, Out},
    simd,
};
use crate::{
    backend::params::*,
    ops::{matmul::cpu as gemm, sigmoid, softplus},
    quant::Matrix,
};

/// Keys per attention block: scores of a block are [rows, KEY_BLOCK] in the task's scratch.
const KEY_BLOCK: usize = 32;

/// Causal GQA attention with the sigmoid output gate, tiled with online softmax.
///
/// Layout: qg [T, H, 2hd] (q | gate per head), caches [max_seq, Hkv, hd], out [T, H, hd].
/// Thread mapping: one task per (block of query tokens, KV head). The task's query rows are the
/// `group` query heads sharing that KV head for each of its tokens (GQA packing: each K/V row is
/// loaded once per task and used by all of them). Decode: one token, so the tasks are the KV
/// heads. Keys stream in blocks of KEY_BLOCK: scores by 4 x 4 register tiles, then a running max /
/// sum per row rescales the f32 output accumulator (no [T, len] score matrix, any context length).
pub fn attention(p: &AttentionParams, qg: &[f32], k_cache: &[f32], v_cache: &[f32], out: &mut [f32]) {
    attention_with(Isa::get(), p, qg, k_cache, v_cache, out)
}

pub fn attention_with(isa: Isa, p: &AttentionParams, qg: &[f32], k_cache: &[f32], v_cache: &[f32], out: &mut [f32]) {
    let (h_n, kv_n, hd, t_n) = (
        p.heads as usize,
        p.kv_heads as usize,
        p.head_dim as usize,
        p.tokens as usize,
    );
    if t_n == 0 || kv_n == 0 {
        return;
    }
    let group = h_n / kv_n;
    if t_n == 1 {
        return attention_decode(isa, p, qg, k_cache, v_cache, out);
    }
    // ~64 query rows per task so each key block in cache serves many rows.
    let bq = (64 / group.max(1)).max(1);
    let tasks = t_n.div_ceil(bq) * kv_n;
    let o = Out(out.as_mut_ptr());
    let run = |task: usize| {
        let (qb, kvh) = (task / kv_n, task % kv_n);
        let (t0, t1) = (qb * bq, ((qb + 1) * bq).min(t_n));
        let rows = (t1 - t0) * group;
        with_task(rows * (hd + 2 + KEY_BLOCK), |scr| {
            attend_block(isa, p, qg, k_cache, v_cache, t0, t1, kvh, scr, o)
        });
    };
    pool::for_each(tasks, run);
}

/// Attention scores sc[i * stride + s - keys.start] = q_i . k_s * scale for query rows i < nr and
/// keys s in `keys`, by 4 x 4 register tiles (a partial tile repeats its last row / key and drops
/// the duplicates); `first_pass(s)` runs once per key, as the first row tile reaches it.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn scores<'a>(
    isa: Isa,
    nr: usize,
    keys: std::ops::Range<usize>,
    scale: f32,
    q_of: impl Fn(usize) -> &'a [f32],
    krow: impl Fn(usize) -> &'a [f32],
    sc: &mut [f32],
    stride: usize,
    mut first_pass: impl FnMut(usize),
) {
    let (kb, kn) = (keys.start, keys.len());
    for i0 in (0..nr).step_by(4) {
        let rn = (nr - i0).min(4);
        let qs = [0, 1, 2, 3].map(|a| q_of(i0 + a.min(rn - 1)));
        for s0 in (0..kn).step_by(4) {
            let sn = (kn - s0).min(4);
            if i0 == 0 {
                (kb + s0..kb + s0 + sn).for_each(&mut first_pass);
            }
            let ks = [0, 1, 2, 3].map(|b| krow(kb + s0 + b.min(sn - 1)));
            let hd = ks[0].len();
            let d = simd::dot4x4(isa, qs, ks, hd);
            for a in 0..rn {
                for b in 0..sn {
                    sc[(i0 + a) * stride + s0 + b] = d[a][b] * scale;
                }
            }
        }
    }
}

multiversion! {
    fn attend_block(
        p: &AttentionParams, qg: &[f32], kc: &[f32], vc: &[f32], t0: usize, t1: usize, kvh: usize,
        scr: &mut [f32], o: Out
    ) = attend_block_body;
}

#[inline(always)]
fn attend_block_body(
    isa: Isa,
    p: &AttentionParams,
    qg: &[f32],
    kc: &[f32],
    vc: &[f32],
    t0: usize,
    t1: usize,
    kvh: usize,
    scr: &mut [f32],
    o: Out,
) {
    let (h_n, kv_n, hd) = (p.heads as usize, p.kv_heads as usize, p.head_dim as usize);
    let group = h_n / kv_n;
    let pos0 = p.pos0 as usize;
    let nr = (t1 - t0) * group;
    // Row i: token t0 + i / group, query head kvh * group + i % group.
    let head = |i: usize| (t0 + i / group) * h_n + kvh * group + i % group;
    let q_of = |i: usize| &qg[head(i) * 2 * hd..][..hd];
    let visible = |i: usize| pos0 + t0 + i / group + 1; // keys 0..visible (causal)
    let krow = |s: usize| &kc[(s * kv_n + kvh) * hd..][..hd];
    let vrow = |s: usize| &vc[(s * kv_n + kvh) * hd..][..hd];
    let (acc, rest) = scr.split_at_mut(nr * hd);
    let (mx, rest) = rest.split_at_mut(nr);
    let (l, sc) = rest.split_at_mut(nr);
    acc.fill(0.0);
    mx.fill(f32::NEG_INFINITY);
    l.fill(0.0);
    let kmax = pos0 + t1;
    let mut kb = 0;
    while kb < kmax {
        let kn = (kmax - kb).min(KEY_BLOCK);
        scores(isa, nr, kb..kb + kn, p.scale, q_of, krow, sc, KEY_BLOCK, |_| {});
        // Online softmax per row over its visible keys of this block.
        for i in 0..nr {
            let vis = visible(i).saturating_sub(kb).min(kn);
            if vis == 0 {
                continue;
            }
            let sr = &mut sc[i * KEY_BLOCK..][..vis];
            let m_new = sr.iter().fold(mx[i], |m, &x| m.max(x));
            let corr = (mx[i] - m_new).exp(); // 0 on the first block (mx = -inf)
            let mut sum = 0f32;
            for x in sr.iter_mut() {
                *x = simd::exp(*x - m_new);
                sum += *x;
            }
            l[i] = l[i] * corr + sum;
            mx[i] = m_new;
            let a = &mut acc[i * hd..][..hd];
            if corr != 1.0 {
                a.iter_mut().for_each(|v| *v *= corr);
            }
            for (s, &pw) in sr.iter().enumerate() {
                a.iter_mut().zip(vrow(kb + s)).for_each(|(v, x)| *v += pw * x);
            }
        }
        kb += kn;
    }
    for i in 0..nr {
        let hrow = head(i);
        let gate = &qg[hrow * 2 * hd + hd..][..hd];
        let inv = 1.0 / l[i];
        for j in 0..hd {
            // SAFETY: row (token, head) belongs to this task alone.
            unsafe { o.set(hrow * hd + j, acc[i * hd + j] * inv * simd::sigmoid(gate[j])) };
        }
    }
}

/// Keys per decode-attention task (at most).
const DECODE_SPLIT: usize = 256;

/// Decode attention (one token): the keys of each KV head are split into runs of at most
/// DECODE_SPLIT (a few per thread; a KV head alone would give 2 tasks for any number of cores),
/// each task computes its run's softmax partial for the `group` query heads of its KV head
/// (max m, sum l, unnormalized output), and one task per query head merges the partials:
/// out = sum_s e^(m_s - m) acc_s / sum_s e^(m_s - m) l_s, times the sigmoid gate.
/// Layout as `attention`; partials [kv_n, splits, group, hd + 2] in caller scratch.
fn attention_decode(isa: Isa, p: &AttentionParams, qg: &[f32], kc: &[f32], vc: &[f32], out: &mut [f32]) {
    let (h_n, kv_n, hd) = (p.heads as usize, p.kv_heads as usize, p.head_dim as usize);
    let (group, len) = (h_n / kv_n, p.pos0 as usize + 1);
    let want = (4 * pool::threads()).div_ceil(kv_n);
    let per = len.div_ceil(len.div_ceil(DECODE_SPLIT).min(want).max(1));
    let splits = len.div_ceil(per);
    let part = group * (hd + 2);
    let rows8 = group.next_multiple_of(8);
    let o = Out(out.as_mut_ptr());
    with_caller(kv_n * splits * part, |parts| {
        let po = Out(parts.as_mut_ptr());
        pool::for_each(kv_n * splits, |task| {
            let (kvh, sp) = (task / splits, task % splits);
            let keys = (sp * per, ((sp + 1) * per).min(len));
            with_task(rows8 * SPLIT_BLOCK, |sc| {
                // SAFETY: partial `task` is written by this task alone.
                let dst = unsafe { po.slice(task * part, part) };
                attend_split(isa, p, qg, kc, vc, kvh, keys, sc, dst)
            });
        });
        let parts: &[f32] = parts;
        pool::for_each(h_n, |h| {
            let (kvh, r) = (h / group, h % group);
            let part_of = |sp: usize| &parts[(kvh * splits + sp) * part..][..part];
            let m = (0..splits).fold(f32::NEG_INFINITY, |m, sp| m.max(part_of(sp)[group * hd + r]));
            // SAFETY: head h's output row is written by this task alone.
            let y = unsafe { o.slice(h * hd, hd) };
            y.fill(0.0);
            let mut l = 0f32;
            for sp in 0..splits {
                let pt = part_of(sp);
                let w = (pt[group * hd + r] - m).exp();
                l += w * pt[group * (hd + 1) + r];
                y.iter_mut().zip(&pt[r * hd..][..hd]).for_each(|(a, v)| *a += w * v);
            }
            let gate = &qg[h * 2 * hd + hd..][..hd];
            y.iter_mut().zip(gate).for_each(|(a, g)| *a *= simd::sigmoid(*g) / l);
        });
    });
}

multiversion! {
    fn attend_split(
        p: &AttentionParams, qg: &[f32], kc: &[f32], vc: &[f32], kvh: usize, keys: (usize, usize),
        sc: &mut [f32], dst: &mut [f32]
    ) = attend_split_body;
}

/// Keys per block of a decode-attention partial: the block's scores [rows8, SPLIT_BLOCK] and V
/// rows (64 KiB at hd 256) stay in L1/L2 between the score and P.V passes.
const SPLIT_BLOCK: usize = 64;

/// One decode-attention partial: keys k0..k1 of KV head kvh against its `group` query heads,
/// in blocks of SPLIT_BLOCK keys with online softmax. Per block: scores by 4 x 4 register tiles
/// into sc [rows8, SPLIT_BLOCK] (rows past `group` zero) while the block's V rows are
/// prefetched; then each row's running max / sum rescale its accumulator and acc [group, hd] +=
/// P V by register tiles (8 rows x 32 dims on AVX-512, [`simd::pv8x32`]; else [`pv_rows`]), each
/// V row loaded once per tile for all its rows. dst = acc | m [group] | l [group] (sc needs
/// rows8 * SPLIT_BLOCK floats).
#[inline(always)]
fn attend_split_body(
    isa: Isa,
    p: &AttentionParams,
    qg: &[f32],
    kc: &[f32],
    vc: &[f32],
    kvh: usize,
    (k0, k1): (usize, usize),
    sc: &mut [f32],
    dst: &mut [f32],
) {
    let (kv_n, hd) = (p.kv_heads as usize, p.head_dim as usize);
    let group = p.heads as usize / kv_n;
    let rows8 = group.next_multiple_of(8);
    let q_of = |i: usize| &qg[(kvh * group + i) * 2 * hd..][..hd];
    let krow = |s: usize| &kc[(s * kv_n + kvh) * hd..][..hd];
    let vrow = |s: usize| &vc[(s * kv_n + kvh) * hd..][..hd];
    let (acc, ml) = dst.split_at_mut(group * hd);
    let (mx, l) = ml.split_at_mut(group);
    acc.fill(0.0);
    mx.fill(f32::NEG_INFINITY);
    l.fill(0.0);
    let mut corr = [1f32; 8];
    let mut kb = k0;
    while kb < k1 {
        let kn = (k1 - kb).min(SPLIT_BLOCK);
        // V rows of the keys scored, for the P.V pass (interleaved with the K stream).
        scores(isa, group, kb..kb + kn, p.scale, q_of, krow, sc, kn, |s| {
            simd::prefetch(vrow(s))
        });
        sc[group * kn..rows8 * kn].fill(0.0);
        for i0 in (0..group).step_by(8) {
            for (r, c) in corr.iter_mut().enumerate() {
                let i = i0 + r;
                if i >= group {
                    *c = 1.0;
                    continue;
                }
                let sr = &mut sc[i * kn..][..kn];
                let m = sr.iter().fold(mx[i], |m, &x| m.max(x));
                sr.iter_mut().for_each(|x| *x = simd::exp(*x - m));
                *c = (mx[i] - m).exp(); // 0 on the first block (mx = -inf)
                (mx[i], l[i]) = (m, l[i] * *c + simd::sum(sr));
            }
            let acc = &mut acc[i0 * hd..];
            let sc = &sc[i0 * kn..];
            let v = |s: usize| vrow(kb + s);
            let rows = (group - i0).min(8);
            if isa == Isa::Avx512 && hd % 32 == 0 {
                let vb = &vc[(kb * kv_n + kvh) * hd..];
                for j0 in (0..hd).step_by(32) {
                    let mut a = [[0f32; 32]; 8];
                    for (r, ar) in a.iter_mut().enumerate().take(rows) {
                        let src = &acc[r * hd + j0..][..32];
                        ar.iter_mut().zip(src).for_each(|(x, y)| *x = y * corr[r]);
                    }
                    simd::pv8x32(isa, sc, kn, &vb[j0..], kv_n * hd, &mut a);
                    for (r, ar) in a.iter().enumerate().take(rows) {
                        acc[r * hd + j0..][..32].copy_from_slice(ar);
                    }
                }
            } else if isa != Isa::Portable || cfg!(target_arch = "aarch64") {
                pv_rows::<4, 16, true>(sc, kn, rows, hd, &corr, v, acc);
            } else {
                pv_rows::<4, 16, false>(sc, kn, rows, hd, &corr, v, acc);
            }
        }
        kb += kn;
    }
}

/// acc [rows, hd] = corr * acc + P [rows, kn] . V [kn, hd] for up to 8 rows, in tiles of R rows x
/// W dims whose accumulators stay in registers while every key's W values are loaded once for
/// the R rows. P has 8 rows (zero past `rows`); a dims tail shorter than W goes through a
/// zero-padded copy. FMA: fused multiply-add (only where the ISA has it; a libm call otherwise).
#[inline(always)]
fn pv_rows<'v, const R: usize, const W: usize, const FMA: bool>(
    p: &[f32],
    kn: usize,
    rows: usize,
    hd: usize,
    corr: &[f32; 8],
    v: impl Fn(usize) -> &'v [f32],
    acc: &mut [f32],
) {
    for i0 in (0..rows).step_by(R) {
        for j0 in (0..hd).step_by(W) {
            let jn = (hd - j0).min(W);
            let mut a = [[0f32; W]; R];
            for (r, ar) in a.iter_mut().enumerate().take(rows - i0) {
                ar[..jn].copy_from_slice(&acc[(i0 + r) * hd + j0..][..jn]);
                ar.iter_mut().for_each(|x| *x *= corr[i0 + r]);
            }
            for s in 0..kn {
                let mut pad = [0f32; W];
                let vs: &[f32; W] = match v(s)[j0..].first_chunk::<W>() {
                    Some(c) => c,
                    None => {
                        pad[..jn].copy_from_slice(&v(s)[j0..][..jn]);
                        &pad
                    }
                };
                for (r, ar) in a.iter_mut().enumerate() {
                    let w = p[(i0 + r) * kn + s];
                    for t in 0..W {
                        ar[t] = if FMA {
                            w.mul_add(vs[t], ar[t])
                        } else {
                            ar[t] + w * vs[t]
                        };
                    }
                }
            }
            for (r, ar) in a.iter().enumerate().take(rows - i0) {
                acc[(i0 + r) * hd + j0..][..jn].copy_from_slice(&ar[..jn]);
            }
        }
    }
}

/// Chunk length of the parallel DeltaNet form (FLA / transformers use 64).
const CHUNK: usize = 64;

/// Gated DeltaNet over T tokens (architecture.md §6).
///
/// Layout: qkv [T, 2 Hk Dk + Hv Dv], a/b [T, Hv], state [Hv, Dk, Dv] f32 (rows contiguous in the
/// value index), out [T, Hv, Dv]. Thread mapping: one task per value head (its state is private
/// to the task). One token runs the step recurrence; more run the chunked form (§6.1) in chunks
/// of CHUNK tokens, whose products are blocked matrix loops over the task's scratch.
/// Accumulation: f32; only exponentials of non-positive numbers.
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
    let isa = Isa::get();
    let (hv, dk, dv, t_n) = (
        p.value_heads as usize,
        p.key_dim as usize,
        p.value_dim as usize,
        p.tokens as usize,
    );
    let o = Out(out.as_mut_ptr());
    let n = t_n.min(CHUNK);
    let scratch = n * (3 * dk + 2 * dv + 2 + n) + 3 * dv + 2 * dk;
    // Decode: runs of heads per task (~4 tasks per thread), so a thread's state reads are long
    // forward streams: 164 vs 179 us per layer on this VM with one head per task.
    let heads = if t_n == 1 {
        hv.div_ceil(4 * pool::threads()).max(1)
    } else {
        1
    };
    pool::for_chunks(&mut state[..hv * dk * dv], heads * dk * dv, |c, run| {
        with_task(scratch, |scr| {
            for (i, s) in run.chunks_exact_mut(dk * dv).enumerate() {
                let j = c * heads + i;
                let mut t0 = 0;
                while t0 < t_n {
                    let n = (t_n - t0).min(CHUNK);
                    if n == 1 {
                        delta_step(isa, p, qkv, a, b, a_log, dt_bias, t0, j, s, scr, o);
                    } else {
                        delta_chunk(isa, p, qkv, a, b, a_log, dt_bias, t0, n, j, s, scr, o);
                    }
                    t0 += n;
                }
            }
        })
    });
}

/// Inputs of value head j at token t: writes l2-normed q (times Dk^-1/2) and k into `q`, `k`;
/// returns (v, beta, g) with v borrowed from qkv.
#[inline(always)]
fn delta_inputs<'a>(
    isa: Isa,
    p: &DeltaNetParams,
    qkv: &'a [f32],
    a: &[f32],
    b: &[f32],
    a_log: &[f32],
    dt_bias: &[f32],
    t: usize,
    j: usize,
    q: &mut [f32],
    k: &mut [f32],
) -> (&'a [f32], f32, f32) {
    let (hk, hv, dk, dv) = (
        p.key_heads as usize,
        p.value_heads as usize,
        p.key_dim as usize,
        p.value_dim as usize,
    );
    let width = 2 * hk * dk + hv * dv;
    let row = &qkv[t * width..][..width];
    let kh = j / (hv / hk).max(1); // value head j reads q/k head j / (Hv/Hk)
    let (qs, ks) = (&row[kh * dk..][..dk], &row[hk * dk + kh * dk..][..dk]);
    let scale = 1.0 / (dk as f32).sqrt();
    let qi = scale / (simd::dot(isa, qs, qs) + 1e-6).sqrt();
    let ki = 1.0 / (simd::dot(isa, ks, ks) + 1e-6).sqrt();
    q.iter_mut().zip(qs).for_each(|(o, x)| *o = x * qi);
    k.iter_mut().zip(ks).for_each(|(o, x)| *o = x * ki);
    let beta = sigmoid(b[t * hv + j]);
    let g = -a_log[j].exp() * softplus(a[t * hv + j] + dt_bias[j]);
    (&row[2 * hk * dk + j * dv..][..dv], beta, g)
}

multiversion! {
    fn delta_step(
        p: &DeltaNetParams, qkv: &[f32], a: &[f32], b: &[f32], a_log: &[f32], dt_bias: &[f32],
        t: usize, j: usize, s: &mut [f32], scr: &mut [f32], o: Out
    ) = delta_step_body;
}

/// One token of value head j: decay, read, delta, write, read out. S is [Dk, Dv], swept twice
/// over contiguous rows: a read-only pass for the prediction alpha S^T k, then one pass that
/// writes S = alpha S + k delta^T and reads out S^T q (S is written once per token).
#[inline(always)]
fn delta_step_body(
    isa: Isa,
    p: &DeltaNetParams,
    qkv: &[f32],
    a: &[f32],
    b: &[f32],
    a_log: &[f32],
    dt_bias: &[f32],
    t: usize,
    j: usize,
    s: &mut [f32],
    scr: &mut [f32],
    o: Out,
) {
    let (hv, dk, dv) = (p.value_heads as usize, p.key_dim as usize, p.value_dim as usize);
    let (q, rest) = scr.split_at_mut(dk);
    let (k, rest) = rest.split_at_mut(dk);
    let (pred, rest) = rest.split_at_mut(dv);
    let (delta, rest) = rest.split_at_mut(dv);
    let outv = &mut rest[..dv];
    let (v, beta, g) = delta_inputs(isa, p, qkv, a, b, a_log, dt_bias, t, j, q, k);
    let alpha = g.exp();
    pred.fill(0.0);
    for d in 0..dk {
        // 32 rows (16 KiB) ahead: the state is cold, the step streams ~440 MB of weights
        // between two uses of a layer's state.
        if d + 32 < dk {
            simd::prefetch(&s[(d + 32) * dv..][..dv]);
        }
        let kd = k[d];
        s[d * dv..][..dv]
            .iter()
            .zip(pred.iter_mut())
            .for_each(|(x, pc)| *pc += x * kd);
    }
    delta
        .iter_mut()
        .zip(v.iter().zip(pred.iter()))
        .for_each(|(dc, (vc, pc))| *dc = beta * (vc - alpha * pc));
    outv.fill(0.0);
    for d in 0..dk {
        let row = &mut s[d * dv..][..dv];
        let (kd, qd) = (k[d], q[d]);
        row.iter_mut()
            .zip(delta.iter())
            .zip(outv.iter_mut())
            .for_each(|((x, dc), oc)| {
                *x = alpha * *x + kd * dc;
                *oc += *x * qd;
            });
    }
    for c in 0..dv {
        // SAFETY: value head j's outputs belong to this task.
        unsafe { o.set((t * hv + j) * dv + c, outv[c]) };
    }
}

multiversion! {
    fn delta_chunk(
        p: &DeltaNetParams, qkv: &[f32], a: &[f32], b: &[f32], a_log: &[f32], dt_bias: &[f32],
        t0: usize, n: usize, j: usize, s: &mut [f32], scr: &mut [f32], o: Out
    ) = delta_chunk_body;
}

/// The chunked form (architecture.md §6.1) for tokens t0..t0+n of value head j, as blocked
/// matrix products over [n, Dk] / [n, Dv] panels and the [Dk, Dv] state.
#[inline(always)]
fn delta_chunk_body(
    isa: Isa,
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
    scr: &mut [f32],
    o: Out,
) {
    let (hv, dk, dv) = (p.value_heads as usize, p.key_dim as usize, p.value_dim as usize);
    let (q, rest) = scr.split_at_mut(n * dk);
    let (k, rest) = rest.split_at_mut(n * dk);
    let (w, rest) = rest.split_at_mut(n * dk);
    let (u, rest) = rest.split_at_mut(n * dv);
    let (v, rest) = rest.split_at_mut(n * dv);
    let (beta, rest) = rest.split_at_mut(n);
    let (gam, rest) = rest.split_at_mut(n); // cumulative log-decay
    let (amat, rest) = rest.split_at_mut(n * n);
    let oi = &mut rest[..dv];
    let mut acc = 0f32;
    for i in 0..n {
        let (vi, bi, gi) = delta_inputs(
            isa,
            p,
            qkv,
            a,
            b,
            a_log,
            dt_bias,
            t0 + i,
            j,
            &mut q[i * dk..][..dk],
            &mut k[i * dk..][..dk],
        );
        v[i * dv..][..dv].copy_from_slice(vi);
        beta[i] = bi;
        acc += gi;
        gam[i] = acc;
    }
    let (q, k): (&[f32], &[f32]) = (q, k);
    // A[i, j'] = beta_i (k_i . k_j') exp(gam_i - gam_j') for j' < i (K K^T by 4 x 4 tiles).
    amat.fill(0.0);
    gemm::tile_products(
        isa,
        k,
        n,
        dk,
        n,
        |jj| &k[jj * dk..][..dk],
        |jj, i, kk| {
            if jj < i {
                amat[i * n + jj] = beta[i] * kk * (gam[i] - gam[jj]).exp();
            }
        },
    );
    // Solve (I + A) U = beta V and (I + A) W = beta exp(gam) K by forward substitution.
    for i in 0..n {
        let eg = gam[i].exp();
        let (done_u, cur_u) = u.split_at_mut(i * dv);
        let (done_w, cur_w) = w.split_at_mut(i * dk);
        let (ui, wi) = (&mut cur_u[..dv], &mut cur_w[..dk]);
        ui.iter_mut()
            .zip(&v[i * dv..][..dv])
            .for_each(|(x, vv)| *x = beta[i] * vv);
        wi.iter_mut()
            .zip(&k[i * dk..][..dk])
            .for_each(|(x, kv)| *x = beta[i] * eg * kv);
        for jj in 0..i {
            let aij = amat[i * n + jj];
            if aij != 0.0 {
                ui.iter_mut()
                    .zip(&done_u[jj * dv..][..dv])
                    .for_each(|(x, y)| *x -= aij * y);
                wi.iter_mut()
                    .zip(&done_w[jj * dk..][..dk])
                    .for_each(|(x, y)| *x -= aij * y);
            }
        }
    }
    // V' = U - W S  ([n, Dv]).
    for i in 0..n {
        let ui = &mut u[i * dv..][..dv];
        for d in 0..dk {
            let wd = w[i * dk + d];
            ui.iter_mut().zip(&s[d * dv..][..dv]).for_each(|(x, sv)| *x -= wd * sv);
        }
    }
    // O_i = exp(gam_i) q_i S + sum_{j' <= i} (q_i . k_j') exp(gam_i - gam_j') V'_j'.
    // (q_i . k_j') for all pairs by 4 x 4 tiles into amat (A is no longer needed).
    gemm::tile_products(
        isa,
        q,
        n,
        dk,
        n,
        |jj| &k[jj * dk..][..dk],
        |jj, i, qk| {
            amat[i * n + jj] = if jj <= i { qk * (gam[i] - gam[jj]).exp() } else { 0.0 };
        },
    );
    for i in 0..n {
        oi.fill(0.0);
        let eg = gam[i].exp();
        for d in 0..dk {
            let qd = q[i * dk + d] * eg;
            oi.iter_mut().zip(&s[d * dv..][..dv]).for_each(|(x, sv)| *x += qd * sv);
        }
        for jj in 0..=i {
            let c = amat[i * n + jj];
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
            s[d * dv..][..dv]
                .iter_mut()
                .zip(&u[jj * dv..][..dv])
                .for_each(|(x, vv)| *x += kd * vv);
        }
    }
}

/// Weight rows per decode MoE task: 256 rows of gate and of up (2 x 144 KiB at 4-bit, D = 2048;
/// down tasks take 4x the rows). Long enough runs that the row kernel's four streams get past
/// the prefetcher's ramp: measured on this VM, a decode step's routed experts ran at 14-17 GB/s
/// with 64 rows, 15-19 with 128, 18-19 with 256.
const MOE_DECODE_ROWS: usize = 256;

/// out [T, D] = sum over each token's K experts of w_k down_e(silu(gate_e x) * up_e x).
///
/// Layout: gate/up [E, I, D], down [E, D, I] (possibly views of fused tensors); tmp holds
/// act [T K, I] then the per-pair outputs [T K, D]. Only the selected experts' rows are read.
/// Decode (one token): GEMV straight from the packed bytes, tasks = (expert slot, block of rows).
/// Prefill: the (token, slot) pairs are grouped by expert (counting sort), and each task
/// dequantizes a tile of one expert's rows once and multiplies it against all of that expert's
/// tokens (4 x 4 register tiles). Accumulation f32; the K outputs are summed in slot order.
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
    moe_experts_with(Isa::get(), p, x, ids, weights, gate, up, down, tmp, out)
}

pub fn moe_experts_with(
    isa: Isa,
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
    if pairs == 0 {
        return;
    }
    let (act, ys) = tmp[..pairs * (inter + d)].split_at_mut(pairs * inter);
    let fused = [gate, up, down].iter().all(|m| simd::has_row_kernel(m)) && gate.format == up.format;
    if t_n == 1 && fused {
        moe_decode(isa, k_n, x, ids, gate, up, down, act, ys);
    } else {
        moe_grouped(isa, pairs, k_n, x, ids, gate, up, down, act, ys);
    }
    let ys: &[f32] = ys;
    let combine = |t: usize, o: &mut [f32]| {
        o.fill(0.0);
        for k in 0..k_n {
            let w = weights[t * k_n + k];
            o.iter_mut()
                .zip(&ys[(t * k_n + k) * d..][..d])
                .for_each(|(a, y)| *a += w * y);
        }
    };
    pool::for_chunks(&mut out[..t_n * d], d, combine);
}

/// One token: every slot's expert by GEMV from the packed rows.
fn moe_decode(
    isa: Isa,
    k_n: usize,
    x: &[f32],
    ids: &[u32],
    gate: &Matrix,
    up: &Matrix,
    down: &Matrix,
    act: &mut [f32],
    ys: &mut [f32],
) {
    let (d, inter) = (gate.cols, gate.rows);
    let (act_o, ys_o) = (Out(act.as_mut_ptr()), Out(ys.as_mut_ptr()));
    let sb_len = simd::row_scratch_len(gate).max(simd::row_scratch_len(down));
    with_caller(simd::prep_len(gate), |buf| {
        simd::prepare(isa, gate, &x[..d], buf);
        let xr = simd::view(isa, gate, &x[..d], buf);
        let blocks = inter.div_ceil(MOE_DECODE_ROWS);
        pool::for_each(k_n * blocks, |task| {
            let (slot, blk) = (task / blocks, task % blocks);
            let e = ids[slot] as usize;
            let rows = blk * MOE_DECODE_ROWS..((blk + 1) * MOE_DECODE_ROWS).min(inter);
            let rn = rows.len();
            with_task(sb_len + 2 * rn, |scr| {
                let (sb, rest) = scr.split_at_mut(sb_len);
                let (g, u) = rest.split_at_mut(rn);
                gemm::gemv_rows(isa, gate, e, rows.start, xr, sb, g);
                gemm::gemv_rows(isa, up, e, rows.start, xr, sb, u);
                for i in 0..rn {
                    // SAFETY: (slot, row) is written by this task only.
                    unsafe { act_o.set(slot * inter + rows.start + i, simd::silu(g[i]) * u[i]) };
                }
            });
        });
    });
    let act: &[f32] = act;
    let pl = simd::prep_len(down);
    with_caller(k_n * pl, |buf| {
        for slot in 0..k_n {
            simd::prepare(isa, down, &act[slot * inter..][..inter], &mut buf[slot * pl..][..pl]);
        }
        let buf: &[f32] = buf;
        let rows_per = 4 * MOE_DECODE_ROWS;
        let blocks = d.div_ceil(rows_per);
        pool::for_each(k_n * blocks, |task| {
            let (slot, blk) = (task / blocks, task % blocks);
            let e = ids[slot] as usize;
            let xr = simd::view(isa, down, &act[slot * inter..][..inter], &buf[slot * pl..][..pl]);
            let rows = blk * rows_per..((blk + 1) * rows_per).min(d);
            let rn = rows.len();
            with_task(sb_len + rn, |scr| {
                let (sb, y) = scr.split_at_mut(sb_len);
                gemm::gemv_rows(isa, down, e, rows.start, xr, sb, y);
                for (i, &v) in y.iter().enumerate() {
                    // SAFETY: (slot, row) is written by this task only.
                    unsafe { ys_o.set(slot * d + rows.start + i, v) };
                }
            });
        });
    });
}

/// Many tokens: pairs grouped by expert, tiled GEMM per expert.
fn moe_grouped(
    isa: Isa,
    pairs: usize,
    k_n: usize,
    x: &[f32],
    ids: &[u32],
    gate: &Matrix,
    up: &Matrix,
    down: &Matrix,
    act: &mut [f32],
    ys: &mut [f32],
) {
    let (d, inter, e_n) = (gate.cols, gate.rows, gate.experts.max(1));
    let (act_o, ys_o) = (Out(act.as_mut_ptr()), Out(ys.as_mut_ptr()));
    // ids scratch: counts/starts [E + 1] | order [pairs] | groups [(expert, start, end)].
    let groups_max = e_n.min(pairs);
    with_caller_ids(e_n + 1 + pairs + 3 * groups_max, |buf| {
        let (starts, rest) = buf.split_at_mut(e_n + 1);
        let (order, glist) = rest.split_at_mut(pairs);
        starts.fill(0);
        for &e in &ids[..pairs] {
            starts[(e as usize).min(e_n - 1) + 1] += 1;
        }
        for e in 0..e_n {
            starts[e + 1] += starts[e];
        }
        let mut ng = 0;
        for e in 0..e_n {
            if starts[e + 1] > starts[e] {
                glist[3 * ng..3 * ng + 3].copy_from_slice(&[e as u32, starts[e], starts[e + 1]]);
                ng += 1;
            }
        }
        // Scatter pair indices into expert order (starts[e] advances to the end of group e).
        for (pi, &e) in ids[..pairs].iter().enumerate() {
            let e = (e as usize).min(e_n - 1);
            order[starts[e] as usize] = pi as u32;
            starts[e] += 1;
        }
        let (order, glist): (&[u32], &[u32]) = (order, &glist[..3 * ng]);
        let group = |g: usize| {
            (
                glist[3 * g] as usize,
                &order[glist[3 * g + 1] as usize..glist[3 * g + 2] as usize],
            )
        };

        let blocks = inter.div_ceil(gemm::TILE_ROWS);
        pool::for_each(ng * blocks, |task| {
            let (g, blk) = (task / blocks, task % blocks);
            let (e, members) = group(g);
            let rows = blk * gemm::TILE_ROWS..((blk + 1) * gemm::TILE_ROWS).min(inter);
            let rn = rows.len();
            with_task(2 * rn * d + members.len() * rn, |scr| {
                let (gt, rest) = scr.split_at_mut(rn * d);
                let (ut, gv) = rest.split_at_mut(rn * d);
                gemm::dequant_tile(isa, gate, e, rows.clone(), gt);
                gemm::dequant_tile(isa, up, e, rows.clone(), ut);
                let xrow = |m: usize| &x[(members[m] as usize / k_n) * d..][..d];
                gemm::tile_products(isa, gt, rn, d, members.len(), xrow, |m, i, v| gv[m * rn + i] = v);
                gemm::tile_products(isa, ut, rn, d, members.len(), xrow, |m, i, u| {
                    // SAFETY: (pair, row) of this expert's row block is written by this task only.
                    unsafe {
                        act_o.set(
                            members[m] as usize * inter + rows.start + i,
                            simd::silu(gv[m * rn + i]) * u,
                        )
                    };
                });
            });
        });
        let act: &[f32] = act;
        let blocks = d.div_ceil(gemm::TILE_ROWS);
        pool::for_each(ng * blocks, |task| {
            let (g, blk) = (task / blocks, task % blocks);
            let (e, members) = group(g);
            let rows = blk * gemm::TILE_ROWS..((blk + 1) * gemm::TILE_ROWS).min(d);
            let rn = rows.len();
            with_task(rn * inter, |tile| {
                gemm::dequant_tile(isa, down, e, rows.clone(), tile);
                let xrow = |m: usize| &act[members[m] as usize * inter..][..inter];
                gemm::tile_products(isa, tile, rn, inter, members.len(), xrow, |m, i, y| {
                    // SAFETY: (pair, row) of this expert's row block is written by this task only.
                    unsafe { ys_o.set(members[m] as usize * d + rows.start + i, y) };
                });
            });
        });
    });
}

pub fn qk_norm_rope(p: &RopeParams, q_norm: &[f32], k_norm: &[f32], qg: &mut [f32], k: &mut [f32]) {
    let (hd, rot) = (p.head_dim as usize, p.rotary_dim as usize);
    let t_n = p.tokens as usize;
    pool::for_chunks(&mut qg[..t_n * p.heads as usize * 2 * hd], 2 * hd, |i, head| {
        let pos = p.pos0 as usize + i / p.heads as usize;
        reference::norm_rope_head(&mut head[..hd], q_norm, p.eps, rot, p.theta, pos);
    });
    pool::for_chunks(&mut k[..t_n * p.kv_heads as usize * hd], hd, |i, head| {
        let pos = p.pos0 as usize + i / p.kv_heads as usize;
        reference::norm_rope_head(head, k_norm, p.eps, rot, p.theta, pos);
    });
}

pub fn kv_store(p: &KvStoreParams, x: &[f32], cache: &mut [f32]) {
    reference::kv_store(p, x, cache)
}

/// Causal depthwise conv + SiLU over the rows of [state; x] (x [T, C], state [taps - 1, C], w
/// [C, taps]). Threads: blocks of CONV_BLOCK channels. Within a block the loops run token-outer,
/// channel-inner, so every read and write is a contiguous run of the block's channels (a
/// channel-outer loop walks x's columns at a stride of C floats, one cache miss per value), with
/// the block's weights transposed to [taps][block] (task scratch) first so the inner loops
/// vectorize. One token (decode) reads the weights in place: the transpose would cost as much as
/// the conv.
pub fn delta_net_conv(p: &ConvParams, w: &[f32], state: &mut [f32], x: &[f32], out: &mut [f32]) {
    const CONV_BLOCK: usize = 1024;
    let (c_n, taps, t_n) = (p.channels as usize, p.taps as usize, p.tokens as usize);
    assert!((1..=MAX_CONV_TAPS).contains(&taps), "delta_net_conv: {taps} taps");
    let hist = taps - 1;
    let (o, st) = (Out(out.as_mut_ptr()), Out(state.as_mut_ptr()));
    pool::for_each(c_n.div_ceil(CONV_BLOCK), |blk| {
        with_task((taps + 1) * CONV_BLOCK, |scr| {
            let c0 = blk * CONV_BLOCK;
            let n = CONV_BLOCK.min(c_n - c0);
            let wb = &w[c0 * taps..(c0 + n) * taps];
            let (wt, acc) = scr.split_at_mut(taps * CONV_BLOCK);
            if t_n > 1 {
                for (i, wc) in wb.chunks_exact(taps).enumerate() {
                    for j in 0..taps {
                        wt[j * CONV_BLOCK + i] = wc[j];
                    }
                }
            }
            // SAFETY: this task alone reads and writes channels c0..c0 + n of the state and out.
            let state_row = |i: usize| unsafe { &*st.slice(i * c_n + c0, n) };
            // Row i of [state; x], this block's channels.
            let row = |i: usize| {
                if i < hist {
                    state_row(i)
                } else {
                    &x[(i - hist) * c_n + c0..][..n]
                }
            };
            for t in 0..t_n {
                let acc = &mut acc[..n];
                if t_n == 1 {
                    acc.fill(0.0);
                    for j in 0..taps {
                        let r = row(j);
                        for (i, a) in acc.iter_mut().enumerate() {
                            *a += wb[i * taps + j] * r[i];
                        }
                    }
                } else {
                    acc.fill(0.0);
                    for (j, wj) in wt.chunks_exact(CONV_BLOCK).enumerate() {
                        for ((a, &wv), &v) in acc.iter_mut().zip(&wj[..n]).zip(row(t + j)) {
                            *a += wv * v;
                        }
                    }
                }
                // SAFETY: as above.
                let ot = unsafe { o.slice(t * c_n + c0, n) };
                for (y, &a) in ot.iter_mut().zip(acc.iter()) {
                    *y = simd::silu(a);
                }
            }
            // New state: the last `hist` rows of [state; x]. Rows still coming from the old state
            // (T < hist) move up, so go in increasing order (a row only reads from a later one).
            for i in 0..hist {
                let src = t_n + i;
                if src < hist {
                    // SAFETY: as above; src > i, distinct rows.
                    let (from, to) = unsafe { (st.slice(src * c_n + c0, n), st.slice(i * c_n + c0, n)) };
                    to.copy_from_slice(from);
                } else {
                    // SAFETY: as above.
                    unsafe { st.slice(i * c_n + c0, n) }.copy_from_slice(&x[(src - hist) * c_n + c0..][..n]);
                }
            }
        })
    });
}

pub fn moe_route(p: &RouteParams, logits: &[f32], ids: &mut [u32], weights: &mut [f32]) {
    let (e_n, k_n) = (p.experts as usize, p.top_k as usize);
    let t_n = p.tokens as usize;
    let wts = Out(weights[..t_n * k_n].as_mut_ptr());
    pool::for_chunks(&mut ids[..t_n * k_n], k_n, |t, id| {
        // SAFETY: token t's weights are written by this task only.
        let wt = unsafe { wts.slice(t * k_n, k_n) };
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
    });
}
