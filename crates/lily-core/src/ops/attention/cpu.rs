//! The attention ops on the CPU: tiled causal attention with online softmax (prefill) and
//! split decode attention; `qk_norm_rope` runs the reference's per-head loop on the pool. The
//! `_batch` forms run one token of each sequence of a batched decode step (its own position and
//! caches) as one pool loop over (sequence, task of the one-token form).

use super::reference::norm_rope_head;
use crate::backend::{
    cpu::{
        isa::{multiversion, Isa},
        kv::{CpuKv, KvRows},
        pool,
        scratch::{with_caller, with_caller_ids, with_task, Out},
        simd::{self, Fetch},
    },
    params::{AttentionParams, KvStoreParams, RopeParams},
    KvDtype, KvSeq,
};

/// Rows kb..kb + kn (within one segment) of KV head kvh of a cache as f32: (values, row stride).
/// An f32 cache lends its segment (stride Hkv hd); a 16-bit one is widened into `buf` [kn, hd].
#[inline(always)]
fn kv_block<'a>(c: &'a CpuKv, kb: usize, kn: usize, kvh: usize, hd: usize, buf: &'a mut [f32]) -> (&'a [f32], usize) {
    match c.f32_rows(kb, kn) {
        Some(rows) => (&rows[kvh * hd..], c.width),
        None => {
            for s in 0..kn {
                c.row_f32(kb + s, kvh * hd, &mut buf[s * hd..][..hd]);
            }
            (&buf[..kn * hd], hd)
        }
    }
}

/// Keys in the block starting at `kb`: at most `block`, not past `end`, not past the end of
/// kb's segment (a block's rows are contiguous in memory).
#[inline(always)]
fn block_len(c: &CpuKv, kb: usize, end: usize, block: usize) -> usize {
    let seg_end = (kb | (c.seg_rows() - 1)) + 1;
    (end - kb).min(block).min(seg_end - kb)
}

/// Keys per attention block: scores of a block are [rows, KEY_BLOCK] in the task's scratch.
const KEY_BLOCK: usize = 32;

/// Causal GQA attention with the sigmoid output gate, tiled with online softmax.
///
/// Layout: qg [T, H, 2hd] (q | gate per head), caches of rows [Hkv, hd] in segments, out [T, H, hd].
/// Thread mapping: one task per (block of query tokens, KV head). The task's query rows are the
/// `group` query heads sharing that KV head for each of its tokens (GQA packing: each K/V row is
/// loaded once per task and used by all of them). Decode (one token) splits the keys instead
/// ([`attention_decode`]). Keys stream in blocks of KEY_BLOCK: scores, then a running max / sum
/// per row rescales the f32 output accumulator (no [T, len] score matrix, any context length).
/// On AVX-512 / AVX2 (hd a multiple of 32) a 16-bit cache is read in place, rows widened in
/// registers: scores by [`simd::qk8`] (8 query rows per K row load), P.V by [`simd::pv8x32`].
/// Elsewhere a 16-bit block is widened into the task's scratch; f32 rows are scored in place by
/// 4 x 4 register tiles.
pub fn attention(p: &AttentionParams, qg: &[f32], k_cache: &CpuKv, v_cache: &CpuKv, out: &mut [f32]) {
    attention_with(Isa::get(), p, qg, k_cache, v_cache, out)
}

/// The attention kernels to run: an ISA and, on AVX-512, whether decode on a bf16 cache takes its
/// rows straight into avx512_bf16's `vdpbf16ps` ([`Isa::bf16_dot`]): q and the softmax weights
/// split into bf16 hi + lo parts ([`simd::split_bf16`]), each score and output then within 2^-16
/// relative (of sum |q_j k_j|, of sum p_s |v_s|) of the f32 kernels'.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernels {
    pub isa: Isa,
    pub bf16_dot: bool,
}

impl Kernels {
    /// What production runs on `isa`.
    pub fn of(isa: Isa) -> Kernels {
        Kernels {
            isa,
            bf16_dot: isa.bf16_dot(),
        }
    }

    /// Every variant this CPU can run (the tests run each): each ISA without avx512_bf16, then
    /// AVX-512 with it where the CPU has it.
    pub fn all_available() -> Vec<Kernels> {
        let plain = Isa::all_available()
            .into_iter()
            .map(|isa| Kernels { isa, bf16_dot: false });
        let bf16 = Isa::Avx512.bf16_dot_available().then_some(Kernels {
            isa: Isa::Avx512,
            bf16_dot: true,
        });
        plain.chain(bf16).collect()
    }
}

pub fn attention_with(isa: Isa, p: &AttentionParams, qg: &[f32], k_cache: &CpuKv, v_cache: &CpuKv, out: &mut [f32]) {
    attention_kernels(Kernels::of(isa), p, qg, k_cache, v_cache, out)
}

/// [`attention`] on the kernels `kn` (tests run every variant against the reference).
pub fn attention_kernels(
    kn: Kernels,
    p: &AttentionParams,
    qg: &[f32],
    k_cache: &CpuKv,
    v_cache: &CpuKv,
    out: &mut [f32],
) {
    let isa = kn.isa;
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
        return attention_decode(kn, p, qg, k_cache, v_cache, out);
    }
    // ~64 query rows per task so each key block in cache serves many rows.
    let bq = (64 / group.max(1)).max(1);
    let tasks = t_n.div_ceil(bq) * kv_n;
    let o = Out(out.as_mut_ptr());
    let run = |task: usize| {
        let (qb, kvh) = (task / kv_n, task % kv_n);
        let (t0, t1) = (qb * bq, ((qb + 1) * bq).min(t_n));
        let rows = (t1 - t0) * group;
        with_task(
            rows * (hd + 2) + rows.next_multiple_of(8) * KEY_BLOCK + 2 * KEY_BLOCK * hd,
            |scr| attend_block(isa, p, qg, k_cache, v_cache, t0, t1, kvh, scr, o),
        );
    };
    pool::for_each(tasks, run);
}

/// Attention scores sc[i * stride + s - keys.start] = q_i . k_s * scale for query rows i < nr and
/// keys s in `keys`, by 4 x 4 register tiles (a partial tile repeats its last row / key and drops
/// the duplicates); `first_pass(s)` runs once per key, as the first row tile reaches it.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn scores<'q, 'k>(
    isa: Isa,
    nr: usize,
    keys: std::ops::Range<usize>,
    scale: f32,
    q_of: impl Fn(usize) -> &'q [f32],
    krow: impl Fn(usize) -> &'k [f32],
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
        p: &AttentionParams, qg: &[f32], kc: &CpuKv, vc: &CpuKv, t0: usize, t1: usize, kvh: usize,
        scr: &mut [f32], o: Out
    ) = attend_block_body;
}

#[inline(always)]
fn attend_block_body(
    isa: Isa,
    p: &AttentionParams,
    qg: &[f32],
    kc: &CpuKv,
    vc: &CpuKv,
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
    let rows8 = nr.next_multiple_of(8);
    let (acc, rest) = scr.split_at_mut(nr * hd);
    let (mx, rest) = rest.split_at_mut(nr);
    let (l, rest) = rest.split_at_mut(nr);
    let (sc, rest) = rest.split_at_mut(rows8 * KEY_BLOCK);
    let (kbuf, vbuf) = rest.split_at_mut(KEY_BLOCK * hd);
    acc.fill(0.0);
    mx.fill(f32::NEG_INFINITY);
    l.fill(0.0);
    let kmax = pos0 + t1;
    let mut kb = 0;
    while kb < kmax {
        let kn = block_len(kc, kb, kmax, KEY_BLOCK);
        // Scores [rows8, kn] (rows past nr zero, so P.V tiles of 8 rows read zeros there).
        let vrows = if pv_in_registers(isa, hd) && kc.dtype != KvDtype::F32 {
            // A 16-bit cache read in place (rows widened in registers), as decode does. f32 rows
            // keep the 4 x 4 tiles (fewer loads per FMA than qk8's 8 q loads per K load: ~6 %
            // faster on AVX2; they are read in place there too).
            let krows = kc.block(kb, kn, kvh * hd);
            for i0 in (0..nr).step_by(8) {
                let qs = [0, 1, 2, 3, 4, 5, 6, 7].map(|a| q_of((i0 + a).min(nr - 1)));
                let out = (&mut sc[i0 * kn..], kn);
                simd::qk8(isa, qs, (krows, kc.width), kn, hd, p.scale, out, &mut Fetch::none());
            }
            (vc.block(kb, kn, kvh * hd), vc.width)
        } else {
            let (kblk, ks) = kv_block(kc, kb, kn, kvh, hd, kbuf);
            let krow = |s: usize| &kblk[(s - kb) * ks..][..hd];
            scores(isa, nr, kb..kb + kn, p.scale, q_of, krow, sc, kn, |_| {});
            let (vblk, vs) = kv_block(vc, kb, kn, kvh, hd, vbuf);
            (KvRows::F32(vblk), vs)
        };
        sc[nr * kn..rows8 * kn].fill(0.0);
        for i0 in (0..nr).step_by(8) {
            // Online softmax per row over its visible keys of this block; the causally hidden
            // keys get weight 0 (so each 8-row tile runs one P.V over the whole block).
            let mut corr = [1f32; 8];
            for (r, c) in corr.iter_mut().enumerate().take(nr - i0) {
                let i = i0 + r;
                let vis = visible(i).saturating_sub(kb).min(kn);
                let sr = &mut sc[i * kn..][..kn];
                sr[vis..].fill(0.0);
                if vis == 0 {
                    continue;
                }
                let m = sr[..vis].iter().fold(mx[i], |m, &x| m.max(x));
                sr[..vis].iter_mut().for_each(|x| *x = simd::exp(*x - m));
                *c = (mx[i] - m).exp(); // 0 on the first block (mx = -inf)
                (mx[i], l[i]) = (m, l[i] * *c + simd::sum(&sr[..vis]));
            }
            let rows = (nr - i0).min(8);
            let fetch = &mut Fetch::none();
            pv_tile(
                isa,
                &sc[i0 * kn..],
                kn,
                rows,
                hd,
                &corr,
                vrows,
                &mut acc[i0 * hd..],
                fetch,
            );
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

/// Keys per decode-attention task (at most; each task covers every KV head of its keys).
const DECODE_SPLIT: usize = 128;

/// Decode attention (one token): the keys are split into runs of at most DECODE_SPLIT (a few per
/// thread), each task computes its run's softmax partials for every KV head (max m, sum l,
/// unnormalized output of the `group` query heads of each), and one task per query head merges the
/// partials: out = sum_s e^(m_s - m) acc_s / sum_s e^(m_s - m) l_s, times the sigmoid gate.
/// A task reads whole K and V rows (every KV head) of consecutive keys: one forward stream per
/// cache, which the hardware prefetchers follow (a run per KV head reads every other run of
/// `hd` values, half of each row's lines, and the prefetchers fetch the other half too).
/// Layout as `attention`; partials [splits, kv_n, group, hd + 2] in caller scratch.
fn attention_decode(kern: Kernels, p: &AttentionParams, qg: &[f32], kc: &CpuKv, vc: &CpuKv, out: &mut [f32]) {
    let (h_n, hd) = (p.heads as usize, p.head_dim as usize);
    let d = Decode::new(kern, p, kc, vc);
    let (per, splits) = d.splits(p.pos0 as usize + 1);
    let o = Out(out.as_mut_ptr());
    with_caller(splits * d.split_len() + d.q_len(), |buf| {
        let (parts, qb) = buf.split_at_mut(splits * d.split_len());
        let qb = d.pack_q(qg, as_u16(qb));
        let po = Out(parts.as_mut_ptr());
        pool::for_each(splits, |sp| {
            // SAFETY: the partials of split `sp` are written by this task alone.
            let dst = unsafe { po.slice(sp * d.split_len(), d.split_len()) };
            d.split(
                p,
                qg,
                kc,
                vc,
                (sp * per, ((sp + 1) * per).min(p.pos0 as usize + 1)),
                qb,
                dst,
            );
        });
        let parts: &[f32] = parts;
        // SAFETY: head h's output row is written by this task alone.
        pool::for_each(h_n, |h| d.merge(qg, parts, splits, h, unsafe { o.slice(h * hd, hd) }));
    });
}

/// `attention` of one token for each sequence of a batched decode step: row i of qg [B, H, 2hd]
/// against the caches of `seqs[i]` (rows 0..=pos, the new one stored), into row i of out [B, H,
/// hd]. Each sequence's keys are split into runs as [`attention_decode`] splits them alone, the
/// runs of every sequence are one pool loop and the merges of every (sequence, query head) one
/// more, each task running the one-sequence code: each row is bit for bit what `attention` gives
/// it alone. Partials [sum of splits, kv_n, group, hd + 2] in caller scratch, each sequence's
/// first split in caller ids.
pub fn attention_batch(p: &AttentionParams, qg: &[f32], seqs: &[KvSeq<'_, CpuKv>], out: &mut [f32]) {
    attention_batch_kernels(Kernels::of(Isa::get()), p, qg, seqs, out)
}

/// [`attention_batch`] on the kernels `kn`.
pub fn attention_batch_kernels(
    kern: Kernels,
    p: &AttentionParams,
    qg: &[f32],
    seqs: &[KvSeq<'_, CpuKv>],
    out: &mut [f32],
) {
    let (b_n, h_n, hd) = (seqs.len(), p.heads as usize, p.head_dim as usize);
    let (qw, ow) = (h_n * 2 * hd, h_n * hd);
    assert!(qg.len() >= b_n * qw && out.len() >= b_n * ow);
    let Some(first) = seqs.first() else {
        return;
    };
    if p.kv_heads == 0 {
        return;
    }
    // The engine's caches share one dtype, so the kernels are chosen once.
    let same = |s: &KvSeq<'_, CpuKv>| s.k.dtype == first.k.dtype && s.v.dtype == first.v.dtype;
    assert!(seqs.iter().all(same), "attention_batch: caches of different dtypes");
    let d = Decode::new(kern, p, first.k, first.v);
    let o = Out(out.as_mut_ptr());
    with_caller_ids(b_n + 1, |first_split| {
        first_split[0] = 0;
        for (i, sq) in seqs.iter().enumerate() {
            first_split[i + 1] = first_split[i] + d.splits(sq.pos + 1).1 as u32;
        }
        let first_split: &[u32] = first_split;
        let all = first_split[b_n] as usize;
        let qlen = d.q_len();
        with_caller(all * d.split_len() + b_n * qlen, |buf| {
            let (parts, qbs) = buf.split_at_mut(all * d.split_len());
            for (i, qb) in qbs.chunks_exact_mut(qlen.max(1)).enumerate().take(b_n) {
                d.pack_q(&qg[i * qw..][..qw], as_u16(qb));
            }
            let qbs: &[f32] = qbs;
            let po = Out(parts.as_mut_ptr());
            pool::for_each(all, |sp| {
                let i = first_split.partition_point(|&f| f as usize <= sp) - 1;
                let (sq, (per, _)) = (&seqs[i], d.splits(seqs[i].pos + 1));
                let k0 = (sp - first_split[i] as usize) * per;
                let keys = (k0, (k0 + per).min(sq.pos + 1));
                let qb = d
                    .bf16_qk
                    .then(|| &as_u16_ref(&qbs[i * qlen..][..qlen])[..2 * d.packed()]);
                // SAFETY: the partials of split `sp` are written by this task alone.
                let dst = unsafe { po.slice(sp * d.split_len(), d.split_len()) };
                let p = AttentionParams {
                    pos0: sq.pos as u32,
                    ..*p
                };
                d.split(&p, &qg[i * qw..][..qw], sq.k, sq.v, keys, qb, dst);
            });
            let parts: &[f32] = parts;
            pool::for_each(b_n * h_n, |task| {
                let (i, h) = (task / h_n, task % h_n);
                let (s0, s1) = (first_split[i] as usize, first_split[i + 1] as usize);
                let parts = &parts[s0 * d.split_len()..s1 * d.split_len()];
                // SAFETY: row i's head h output is written by this task alone.
                let y = unsafe { o.slice(i * ow + h * hd, hd) };
                d.merge(&qg[i * qw..][..qw], parts, s1 - s0, h, y);
            });
        });
    });
}

/// How decode attention runs on a layer's caches: the kernels, the shapes, whether the bf16 dots
/// apply, and the parts each task shares ([`attention_decode`], [`attention_batch`]).
struct Decode {
    isa: Isa,
    kv_n: usize,
    group: usize,
    hd: usize,
    rows8: usize,
    /// avx512_bf16 on a bf16 cache: scores from q's bf16 parts (split and packed once per call per
    /// 8-row tile of each KV head, `simd::pack_q8_bf16`), P.V from the weights' parts (split per
    /// block in the task).
    bf16_qk: bool,
    bf16_pv: bool,
}

impl Decode {
    fn new(kern: Kernels, p: &AttentionParams, kc: &CpuKv, vc: &CpuKv) -> Decode {
        let (h_n, kv_n, hd) = (p.heads as usize, p.kv_heads as usize, p.head_dim as usize);
        let isa = kern.isa;
        let bf16 = |c: &CpuKv| kern.bf16_dot && c.dtype == KvDtype::BF16 && pv_in_registers(isa, hd);
        let group = h_n / kv_n;
        Decode {
            isa,
            kv_n,
            group,
            hd,
            rows8: group.next_multiple_of(8),
            bf16_qk: bf16(kc),
            bf16_pv: bf16(vc),
        }
    }

    /// (keys per run, runs) for a context of `len` keys: a few runs per thread of at most
    /// DECODE_SPLIT keys, starting on block boundaries (no block of a run is cut short before the
    /// last).
    fn splits(&self, len: usize) -> (usize, usize) {
        let want = 4 * pool::threads();
        let per = len
            .div_ceil(len.div_ceil(DECODE_SPLIT).min(want).max(1))
            .next_multiple_of(SPLIT_BLOCK);
        (per, len.div_ceil(per))
    }

    /// Floats of one run's partials: [kv_n, group, hd + 2].
    fn split_len(&self) -> usize {
        self.kv_n * self.group * (self.hd + 2)
    }

    /// u16 values of q's packed bf16 parts: per KV head and 8-row tile, 16 hd.
    fn packed(&self) -> usize {
        self.kv_n * self.rows8 * self.hd
    }

    /// Floats of q's packed parts and the room to split one row (0 without the bf16 dots).
    fn q_len(&self) -> usize {
        if self.bf16_qk {
            self.packed() + self.hd
        } else {
            0
        }
    }

    /// q's packed bf16 parts for the scores, in `qb` (`q_len` floats as u16), when the bf16 dots
    /// apply.
    fn pack_q<'a>(&self, qg: &[f32], qb: &'a mut [u16]) -> Option<&'a [u16]> {
        if !self.bf16_qk {
            return None;
        }
        let (hd, group, rows8) = (self.hd, self.group, self.rows8);
        let (qb, tmp) = qb.split_at_mut(2 * self.packed());
        for (t, tile) in qb.chunks_exact_mut(16 * hd).enumerate() {
            let (kvh, i0) = (t / (rows8 / 8), t % (rows8 / 8) * 8);
            let q_of = |a: usize| &qg[(kvh * group + (i0 + a).min(group - 1)) * 2 * hd..][..hd];
            simd::pack_q8_bf16([0, 1, 2, 3, 4, 5, 6, 7].map(q_of), hd, tmp, tile);
        }
        Some(qb)
    }

    /// One run's partials (keys k0..k1, every KV head) into dst (`split_len` floats).
    #[allow(clippy::too_many_arguments)]
    fn split(
        &self,
        p: &AttentionParams,
        qg: &[f32],
        kc: &CpuKv,
        vc: &CpuKv,
        keys: (usize, usize),
        qb: Option<&[u16]>,
        dst: &mut [f32],
    ) {
        let (rows8, hd) = (self.rows8, self.hd);
        with_task(rows8 * SPLIT_BLOCK + 8 * SPLIT_BLOCK + 2 * SPLIT_BLOCK * hd, |sc| {
            attend_split(self.isa, p, qg, kc, vc, keys, (qb, self.bf16_pv), sc, dst)
        });
    }

    /// Query head h's output y [hd] from the partials of `splits` runs: sum_s e^(m_s - m) acc_s /
    /// sum_s e^(m_s - m) l_s, times the sigmoid gate.
    fn merge(&self, qg: &[f32], parts: &[f32], splits: usize, h: usize, y: &mut [f32]) {
        let (group, hd) = (self.group, self.hd);
        let part = group * (hd + 2);
        let (kvh, r) = (h / group, h % group);
        let part_of = |sp: usize| &parts[(sp * self.kv_n + kvh) * part..][..part];
        let m = (0..splits).fold(f32::NEG_INFINITY, |m, sp| m.max(part_of(sp)[group * hd + r]));
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
    }
}

multiversion! {
    fn attend_split(
        p: &AttentionParams, qg: &[f32], kc: &CpuKv, vc: &CpuKv, keys: (usize, usize),
        bf16: (Option<&[u16]>, bool), scr: &mut [f32], dst: &mut [f32]
    ) = attend_split_body;
}

/// Keys per block of a decode-attention partial: the block's scores [rows8, SPLIT_BLOCK] stay in
/// L1, its K and V rows of every KV head (128 KiB of bf16 at 2 KV heads of 256) in L2 between the
/// KV heads' passes.
const SPLIT_BLOCK: usize = 64;

/// Keys ahead of the one being scored whose K row the avx512_bf16 decode kernels prefetch (the
/// widening kernels fetch a block ahead instead, [`Fetch`]): enough misses in flight to cover the
/// memory latency at one core's rate, few enough for its miss buffers.
const K_AHEAD: usize = 8;

/// One task's decode-attention partials: keys k0..k1 of every KV head against the `group` query
/// heads of each, in blocks of SPLIT_BLOCK keys with online softmax. Per block and KV head: scores
/// into sc [rows8, SPLIT_BLOCK] (rows past `group` zero); then each row's running max / sum
/// rescale its accumulator and acc [group, hd] += P V. On AVX-512 and AVX2 (hd a multiple of 32)
/// both read the cache in place, 16-bit rows widened in registers: scores by [`simd::qk8`] (each
/// K row loaded once for 8 query rows), P.V by [`simd::pv8x32`] (8 rows x 32 dims, each V row
/// loaded once per tile). Elsewhere the rows of a block are widened into scratch, scores by 4 x 4
/// tiles, P.V by [`pv_rows`]. With avx512_bf16 on a bf16 cache (`bf16`: q's packed parts per KV
/// head and 8-row tile, [`simd::pack_q8_bf16`], for the scores; whether P.V takes the weights' parts) the scores run [`simd::qk8_bf16`] and
/// P.V [`simd::pv8x32_bf16`]. dst [kv_n] of acc | m [group] | l [group] (sc needs rows8 *
/// SPLIT_BLOCK floats, 8 * SPLIT_BLOCK for the weights' bf16 parts, then room for a block of K and
/// of V as f32).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn attend_split_body(
    isa: Isa,
    p: &AttentionParams,
    qg: &[f32],
    kc: &CpuKv,
    vc: &CpuKv,
    (k0, k1): (usize, usize),
    (qb, bf16_pv): (Option<&[u16]>, bool),
    scr: &mut [f32],
    dst: &mut [f32],
) {
    let (kv_n, hd) = (p.kv_heads as usize, p.head_dim as usize);
    let group = p.heads as usize / kv_n;
    let part = group * (hd + 2);
    let rows8 = group.next_multiple_of(8);
    let (sc, rest) = scr.split_at_mut(rows8 * SPLIT_BLOCK);
    let (pb, rest) = rest.split_at_mut(8 * SPLIT_BLOCK);
    let pb = as_u16(pb);
    let (kbuf, vbuf) = rest.split_at_mut(SPLIT_BLOCK * hd);
    for d in dst.chunks_exact_mut(part) {
        let (acc, ml) = d.split_at_mut(group * hd);
        let (mx, l) = ml.split_at_mut(group);
        acc.fill(0.0);
        mx.fill(f32::NEG_INFINITY);
        l.fill(0.0);
    }
    let mut corr = [1f32; 8];
    let mut kb = k0;
    while kb < k1 {
        let kn = block_len(kc, kb, k1, SPLIT_BLOCK);
        // The widening kernels fetch the next block's K and V rows (every KV head) into L2 over
        // this block's passes, a line or two per inner step ([`Fetch`]).
        let in_regs = pv_in_registers(isa, hd);
        let mut fetch = match in_regs && qb.is_none() && kb + kn < k1 {
            true => {
                let nn = block_len(kc, kb + kn, k1, SPLIT_BLOCK);
                let pv = hd / 32 * simd::pv8x32_steps(isa, kn);
                let steps = kv_n * (rows8 / 8) * (simd::qk8_steps(isa, kn, hd) + pv);
                Fetch::new(kc.block(kb + kn, nn, 0), vc.block(kb + kn, nn, 0), steps)
            }
            false => Fetch::none(),
        };
        for (kvh, d) in dst.chunks_exact_mut(part).enumerate() {
            let (acc, ml) = d.split_at_mut(group * hd);
            let (mx, l) = ml.split_at_mut(group);
            let q_of = |i: usize| &qg[(kvh * group + i) * 2 * hd..][..hd];
            let vrows = if in_regs {
                // K and V read in place, 16-bit rows widened in registers; each K row loaded once
                // per 8 query rows.
                let (krows, vrows) = (kc.block(kb, kn, kvh * hd), vc.block(kb, kn, kvh * hd));
                for i0 in (0..group).step_by(8) {
                    let qs = [0, 1, 2, 3, 4, 5, 6, 7].map(|a| q_of((i0 + a).min(group - 1)));
                    let out = (&mut sc[i0 * kn..], kn);
                    match qb {
                        Some(qb) => {
                            // avx512_bf16: the first KV head's pass prefetches whole K row s +
                            // K_AHEAD and V row s as key s is scored (the later heads' passes find
                            // them in cache), the last head's the next block's first K_AHEAD rows.
                            let (kall, vall) = (kc.block(kb, kn, 0), vc.block(kb, kn, 0));
                            let ahead = match kvh == 0 && i0 == 0 && kn > K_AHEAD {
                                true => [(kall.skip(K_AHEAD * kc.width), kc.width), (vall, vc.width)],
                                // Fetched already: empty streams.
                                false => [
                                    (kall.skip(kall.values()), kc.width),
                                    (vall.skip(vall.values()), vc.width),
                                ],
                            };
                            let qs = &qb[(kvh * rows8 + i0) * 2 * hd..][..16 * hd];
                            let ahead = ahead.map(|(rows, stride)| (halves(rows), stride, stride));
                            simd::qk8_bf16(qs, (halves(krows), kc.width), kn, hd, p.scale, out, ahead);
                        }
                        None => simd::qk8(isa, qs, (krows, kc.width), kn, hd, p.scale, out, &mut fetch),
                    }
                }
                if qb.is_some() && kb + kn < k1 && kvh + 1 == kv_n {
                    let next = block_len(kc, kb + kn, k1, K_AHEAD);
                    (kb + kn..kb + kn + next).for_each(|s| kc.prefetch_row(s, 0, kc.width));
                }
                (vrows, vc.width)
            } else {
                let (kblk, ks) = kv_block(kc, kb, kn, kvh, hd, kbuf);
                let krow = |s: usize| &kblk[(s - kb) * ks..][..hd];
                // V rows of the keys scored, for the P.V pass, and K rows of the next block
                // (interleaved with the K stream; a 16-bit cache's rows are widened after the
                // scores, from cache lines fetched meanwhile).
                let prefetch = |s: usize| {
                    vc.prefetch_row(s, kvh * hd, hd);
                    if s + kn < k1 {
                        kc.prefetch_row(s + kn, kvh * hd, hd);
                    }
                };
                scores(isa, group, kb..kb + kn, p.scale, q_of, krow, sc, kn, prefetch);
                let (vblk, vstride) = kv_block(vc, kb, kn, kvh, hd, vbuf);
                (KvRows::F32(vblk), vstride)
            };
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
                let rows = (group - i0).min(8);
                let (psc, acc) = (&sc[i0 * kn..], &mut acc[i0 * hd..]);
                match bf16_pv {
                    true => pv_tile_bf16(psc, kn, rows, hd, &corr, (halves(vrows.0), vrows.1), pb, acc),
                    false => pv_tile(isa, psc, kn, rows, hd, &corr, vrows, acc, &mut fetch),
                }
            }
        }
        kb += kn;
    }
}

/// The 16-bit values of a bf16 or f16 cache's rows.
#[inline(always)]
fn halves(rows: KvRows<'_>) -> &[u16] {
    match rows {
        KvRows::Half(_, v) => v,
        KvRows::F32(_) => unreachable!("the bf16 kernels read 16-bit rows"),
    }
}

/// The u16 view of f32 scratch read back (q's packed bf16 parts).
fn as_u16_ref(v: &[f32]) -> &[u16] {
    // SAFETY: as `as_u16`.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), v.len() * 2) }
}

/// The u16 view of f32 scratch (bf16 parts of q and of the softmax weights).
fn as_u16(v: &mut [f32]) -> &mut [u16] {
    // SAFETY: same allocation, two u16 per f32, u16 has no stricter alignment and every bit
    // pattern is valid.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), v.len() * 2) }
}

/// [`pv_tile`] on a bf16 cache with avx512_bf16: the 8 rows of weights P [8, kn] split into bf16
/// hi + lo parts in `pb` (rows of hi | lo, each kn rounded up to even, a zero weight pairing an
/// odd last key), then [`simd::pv8x32_bf16`] per 32 dims.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn pv_tile_bf16(
    p: &[f32],
    kn: usize,
    rows: usize,
    hd: usize,
    corr: &[f32; 8],
    (v, stride): (&[u16], usize),
    pb: &mut [u16],
    acc: &mut [f32],
) {
    let half = kn.next_multiple_of(2);
    for (r, pr) in pb.chunks_exact_mut(2 * half).take(8).enumerate() {
        let (hi, lo) = pr.split_at_mut(half);
        simd::split_bf16(&p[r * kn..][..kn], hi, lo);
        if kn < half {
            (hi[kn], lo[kn]) = (0, 0);
        }
    }
    for j0 in (0..hd).step_by(32) {
        let mut a = [[0f32; 32]; 8];
        for (r, ar) in a.iter_mut().enumerate().take(rows) {
            let src = &acc[r * hd + j0..][..32];
            ar.iter_mut().zip(src).for_each(|(x, y)| *x = y * corr[r]);
        }
        simd::pv8x32_bf16(pb, 2 * half, kn, &v[j0..], stride, &mut a);
        for (r, ar) in a.iter().enumerate().take(rows) {
            acc[r * hd + j0..][..32].copy_from_slice(ar);
        }
    }
}

/// acc [rows, hd] = corr * acc + P [rows, kn] . V [kn, hd] for up to 8 query rows: P has 8 rows
/// of kn scores (zero past `rows`), V rows `stride` floats apart. Register tiles of 8 rows x 32
/// dims where the ISA has them ([`simd::pv8x32`]), else [`pv_rows`].
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn pv_tile(
    isa: Isa,
    p: &[f32],
    kn: usize,
    rows: usize,
    hd: usize,
    corr: &[f32; 8],
    (v, stride): (KvRows, usize),
    acc: &mut [f32],
    fetch: &mut Fetch,
) {
    if pv_in_registers(isa, hd) {
        for j0 in (0..hd).step_by(32) {
            let mut a = [[0f32; 32]; 8];
            for (r, ar) in a.iter_mut().enumerate().take(rows) {
                let src = &acc[r * hd + j0..][..32];
                ar.iter_mut().zip(src).for_each(|(x, y)| *x = y * corr[r]);
            }
            simd::pv8x32(isa, p, kn, v.skip(j0), stride, &mut a, fetch);
            for (r, ar) in a.iter().enumerate().take(rows) {
                acc[r * hd + j0..][..32].copy_from_slice(ar);
            }
        }
        return;
    }
    let KvRows::F32(v) = v else {
        unreachable!("16-bit rows are read in place only by the register tiles")
    };
    if isa != Isa::Portable || cfg!(target_arch = "aarch64") {
        pv_rows::<4, 16, true>(p, kn, rows, hd, corr, |s| &v[s * stride..][..hd], acc);
    } else {
        pv_rows::<4, 16, false>(p, kn, rows, hd, corr, |s| &v[s * stride..][..hd], acc);
    }
}

/// Whether decode attention reads the cache in place (scores by [`simd::qk8`], P.V by
/// [`simd::pv8x32`], 16-bit rows widened in registers), else through f32 blocks.
#[inline(always)]
fn pv_in_registers(isa: Isa, hd: usize) -> bool {
    matches!(isa, Isa::Avx512 | Isa::Avx2) && hd % 32 == 0
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

pub fn qk_norm_rope(p: &RopeParams, q_norm: &[f32], k_norm: &[f32], qg: &mut [f32], k: &mut [f32]) {
    let (hd, rot) = (p.head_dim as usize, p.rotary_dim as usize);
    let t_n = p.tokens as usize;
    pool::for_chunks(&mut qg[..t_n * p.heads as usize * 2 * hd], 2 * hd, |i, head| {
        let pos = p.pos0 as usize + i / p.heads as usize;
        norm_rope_head(&mut head[..hd], q_norm, p.eps, rot, p.theta, pos);
    });
    pool::for_chunks(&mut k[..t_n * p.kv_heads as usize * hd], hd, |i, head| {
        let pos = p.pos0 as usize + i / p.kv_heads as usize;
        norm_rope_head(head, k_norm, p.eps, rot, p.theta, pos);
    });
}

/// `qk_norm_rope` of one token for each sequence of a batched decode step: row i of qg [B, H,
/// 2hd] and k [B, Hkv, hd] at position `pos(i)` (p.tokens: the rows B; p.pos0 is not read).
/// Threads: one task per (row, q or k head), every row's heads in one pool loop; each head runs
/// the one-sequence op's code, so each row is bit for bit what `qk_norm_rope` gives it alone.
pub fn qk_norm_rope_batch(
    p: &RopeParams,
    pos: impl Fn(usize) -> usize + Sync,
    q_norm: &[f32],
    k_norm: &[f32],
    qg: &mut [f32],
    k: &mut [f32],
) {
    let (b_n, h_n, kv_n) = (p.tokens as usize, p.heads as usize, p.kv_heads as usize);
    let (hd, rot) = (p.head_dim as usize, p.rotary_dim as usize);
    assert!(qg.len() >= b_n * h_n * 2 * hd && k.len() >= b_n * kv_n * hd);
    let (q, kp) = (Out(qg.as_mut_ptr()), Out(k.as_mut_ptr()));
    pool::for_each(b_n * (h_n + kv_n), |task| {
        // SAFETY: each (row, head) vector is normed by this task alone.
        let (i, head, w) = match task < b_n * h_n {
            true => (task / h_n, unsafe { q.slice(task * 2 * hd, hd) }, q_norm),
            false => {
                let t = task - b_n * h_n;
                (t / kv_n, unsafe { kp.slice(t * hd, hd) }, k_norm)
            }
        };
        norm_rope_head(head, w, p.eps, rot, p.theta, pos(i));
    });
}

pub fn kv_store(p: &KvStoreParams, x: &[f32], cache: &mut CpuKv) {
    super::reference::kv_store(p, x, cache)
}
