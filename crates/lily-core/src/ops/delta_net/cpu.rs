//! The DeltaNet ops on the CPU: the conv by channel blocks, the recurrence one value head per
//! task (step form for one token, chunked form for more). The `_batch` forms run one token of
//! each sequence of a batched decode step, on its own states, as one pool loop over (sequence,
//! task of the one-token form).

use crate::{
    backend::{
        cpu::{
            isa::{multiversion, Isa},
            pool,
            scratch::{with_caller_outs, with_task, Out},
            simd,
        },
        params::{ConvParams, MAX_CONV_TAPS},
        DeltaNetSeq,
    },
    ops::delta_net::DeltaNetIn,
};

/// Chunk length of the parallel DeltaNet form (FLA / transformers use 64).
pub const CHUNK: usize = 64;

/// Gated DeltaNet over T tokens (architecture.md §6).
///
/// Layout: qkv [T, 2 Hk Dk + Hv Dv], a/b [T, Hv], state [Hv, Dk, Dv] f32 (rows contiguous in the
/// value index), out [T, Hv, Dv]. Thread mapping: one task per value head (its state is private
/// to the task). One token runs the step recurrence; more run the chunked form (§6.1) in chunks
/// of CHUNK tokens, whose products are blocked matrix loops over the task's scratch.
/// Accumulation: f32; only exponentials of non-positive numbers.
pub fn delta_net(x: &DeltaNetIn, state: &mut [f32], out: &mut [f32]) {
    delta_net_with(Isa::get(), x, state, out)
}

/// [`delta_net`] on the ISA `isa` (the tests run every one).
pub fn delta_net_with(isa: Isa, x: &DeltaNetIn, state: &mut [f32], out: &mut [f32]) {
    let (t_n, _, hv, dk, dv) = x.p.dims();
    let o = Out(out.as_mut_ptr());
    let n = t_n.min(CHUNK);
    let scratch = chunk_scratch(n, dk, dv).max(3 * dv + 2 * dk);
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
                        delta_step(isa, x, t0, j, s, scr, o);
                    } else {
                        delta_chunk(isa, x, t0, n, j, s, scr, o);
                    }
                    t0 += n;
                }
            }
        })
    });
}

/// `delta_net` of one token for each sequence of a batched decode step: row i of x (p.tokens:
/// the rows B) on the recurrent state of `seqs[i]`, into row i of out [B, Hv, Dv]. Threads:
/// (sequence, run of value heads) as `delta_net` splits one token's heads, every sequence in one
/// pool loop; each head runs `delta_step` as there, so each row's output and state are bit for
/// bit what `delta_net` gives that row alone.
pub fn delta_net_batch(x: &DeltaNetIn, seqs: &mut [DeltaNetSeq<'_, Vec<f32>>], out: &mut [f32]) {
    let isa = Isa::get();
    let (b_n, _, hv, dk, dv) = x.p.dims();
    assert!(seqs.len() == b_n && out.len() >= b_n * hv * dv);
    let o = Out(out.as_mut_ptr());
    let scratch = 3 * dk + 2 * dv + 3 + 3 * dv + 2 * dk;
    let heads = hv.div_ceil(4 * pool::threads()).max(1);
    let runs = hv.div_ceil(heads);
    with_caller_outs(b_n, |states| {
        for (st, sq) in states.iter_mut().zip(seqs.iter_mut()) {
            assert!(sq.ssm.len() >= hv * dk * dv);
            *st = Out(sq.ssm.as_mut_ptr());
        }
        let states: &[Out] = states;
        pool::for_each(b_n * runs, |task| {
            let (i, j0) = (task / runs, task % runs * heads);
            // SAFETY: heads j0..j0 + n of sequence i's state belong to this task alone.
            let run = unsafe { states[i].slice(j0 * dk * dv, heads.min(hv - j0) * dk * dv) };
            with_task(scratch, |scr| {
                for (jj, s) in run.chunks_exact_mut(dk * dv).enumerate() {
                    delta_step(isa, x, i, j0 + jj, s, scr, o);
                }
            })
        });
    });
}

/// Inputs of value head j at token t: writes l2-normed q (times Dk^-1/2) and k into `q`, `k`;
/// returns (v, beta, g) with v borrowed from qkv (the twin's `heads` and `gates`, the norms in
/// SIMD).
#[inline(always)]
fn delta_inputs<'a>(
    isa: Isa,
    x: &DeltaNetIn<'a>,
    t: usize,
    j: usize,
    q: &mut [f32],
    k: &mut [f32],
) -> (&'a [f32], f32, f32) {
    let (qs, ks, v) = x.heads(t, j);
    let scale = 1.0 / (x.p.key_dim as f32).sqrt();
    let qi = scale / (simd::dot(isa, qs, qs) + 1e-6).sqrt();
    let ki = 1.0 / (simd::dot(isa, ks, ks) + 1e-6).sqrt();
    q.iter_mut().zip(qs).for_each(|(o, e)| *o = e * qi);
    k.iter_mut().zip(ks).for_each(|(o, e)| *o = e * ki);
    let (beta, g) = x.gates(t, j);
    (v, beta, g)
}

multiversion! {
    fn delta_step(x: &DeltaNetIn, t: usize, j: usize, s: &mut [f32], scr: &mut [f32], o: Out) = delta_step_body;
}

/// One token of value head j: decay, read, delta, write, read out. S is [Dk, Dv], swept twice
/// over contiguous rows: a read-only pass for the prediction alpha S^T k, then one pass that
/// writes S = alpha S + k delta^T and reads out S^T q (S is written once per token).
#[inline(always)]
fn delta_step_body(isa: Isa, x: &DeltaNetIn, t: usize, j: usize, s: &mut [f32], scr: &mut [f32], o: Out) {
    let (_, _, hv, dk, dv) = x.p.dims();
    let (q, rest) = scr.split_at_mut(dk);
    let (k, rest) = rest.split_at_mut(dk);
    let (pred, rest) = rest.split_at_mut(dv);
    let (delta, rest) = rest.split_at_mut(dv);
    let outv = &mut rest[..dv];
    let (v, beta, g) = delta_inputs(isa, x, t, j, q, k);
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
        x: &DeltaNetIn, t0: usize, n: usize, j: usize, s: &mut [f32], scr: &mut [f32], o: Out
    ) = delta_chunk_body;
}

/// Scratch floats of [`delta_chunk`] for chunks of up to n tokens.
fn chunk_scratch(n: usize, dk: usize, dv: usize) -> usize {
    n * (4 * dk + 2 * dv + 2 + n)
}

/// The chunked form (architecture.md §6.1) for tokens t0..t0+n of value head j: every product
/// over the [n, Dk] / [n, Dv] panels and the [Dk, Dv] state is a register-blocked outer-product
/// GEMM of row-major operands ([`simd::gemm_nn`]; K is transposed once per chunk so K K^T, Q K^T
/// and the state update read it row-major too). The forward substitution for U and W runs in
/// blocks of [`SUBST_BLOCK`] rows: the rows before a block enter it by one GEMM, the block's own
/// triangle by row updates, the same sums as row-by-row substitution in another order. The
/// decays exp(gam_i - gam_r) use the vectorizable [`simd::exp`].
#[inline(always)]
fn delta_chunk_body(isa: Isa, x: &DeltaNetIn, t0: usize, n: usize, j: usize, s: &mut [f32], scr: &mut [f32], o: Out) {
    let (_, _, hv, dk, dv) = x.p.dims();
    let (q, rest) = scr.split_at_mut(n * dk);
    let (k, rest) = rest.split_at_mut(n * dk);
    let (kt, rest) = rest.split_at_mut(dk * n); // K^T [Dk, n]
    let (w, rest) = rest.split_at_mut(n * dk);
    let (u, rest) = rest.split_at_mut(n * dv);
    let (ob, rest) = rest.split_at_mut(n * dv);
    let (beta, rest) = rest.split_at_mut(n);
    let (gam, rest) = rest.split_at_mut(n); // cumulative log-decay
    let amat = &mut rest[..n * n];
    let mut acc = 0f32;
    for i in 0..n {
        let (vi, bi, gi) = delta_inputs(isa, x, t0 + i, j, &mut q[i * dk..][..dk], &mut k[i * dk..][..dk]);
        // U starts as beta V, W as beta exp(gam) K (the substitution below subtracts from them).
        u[i * dv..][..dv].iter_mut().zip(vi).for_each(|(y, v)| *y = bi * v);
        beta[i] = bi;
        acc += gi;
        gam[i] = acc;
    }
    for i in 0..n {
        let eg = beta[i] * gam[i].exp();
        w[i * dk..][..dk]
            .iter_mut()
            .zip(&k[i * dk..][..dk])
            .for_each(|(y, kv)| *y = eg * kv);
        for (d, &kv) in k[i * dk..][..dk].iter().enumerate() {
            kt[d * n + i] = kv;
        }
    }
    let gemm = |m, nn, kk, lda, ldb, ldc, sub, lower| simd::GemmNn {
        m,
        n: nn,
        k: kk,
        lda,
        ldb,
        ldc,
        sub,
        lower,
    };
    // A[i, r] = beta_i (k_i . k_r) exp(gam_i - gam_r) for r < i, else 0 (K K^T).
    amat.fill(0.0);
    simd::gemm_nn(isa, &gemm(n, n, dk, dk, n, n, false, false), k, kt, amat);
    for i in 0..n {
        let (row, bi, gi) = (&mut amat[i * n..][..n], beta[i], gam[i]);
        row[..i]
            .iter_mut()
            .zip(&gam[..i])
            .for_each(|(a, g)| *a = bi * *a * simd::exp(gi - g));
        row[i..].fill(0.0);
    }
    // Solve (I + A) U = beta V and (I + A) W = beta exp(gam) K by forward substitution, by blocks.
    for b0 in (0..n).step_by(SUBST_BLOCK) {
        let bn = SUBST_BLOCK.min(n - b0);
        if b0 > 0 {
            let (done_u, cur_u) = u.split_at_mut(b0 * dv);
            let (done_w, cur_w) = w.split_at_mut(b0 * dk);
            let arows = &amat[b0 * n..];
            simd::gemm_nn(isa, &gemm(bn, dv, b0, n, dv, dv, true, false), arows, done_u, cur_u);
            simd::gemm_nn(isa, &gemm(bn, dk, b0, n, dk, dk, true, false), arows, done_w, cur_w);
        }
        for i in b0 + 1..b0 + bn {
            let (done_u, cur_u) = u.split_at_mut(i * dv);
            let (done_w, cur_w) = w.split_at_mut(i * dk);
            let (ui, wi) = (&mut cur_u[..dv], &mut cur_w[..dk]);
            for r in b0..i {
                let air = amat[i * n + r];
                if air != 0.0 {
                    ui.iter_mut()
                        .zip(&done_u[r * dv..][..dv])
                        .for_each(|(x, y)| *x -= air * y);
                    wi.iter_mut()
                        .zip(&done_w[r * dk..][..dk])
                        .for_each(|(x, y)| *x -= air * y);
                }
            }
        }
    }
    // V' = U - W S ([n, Dv]), in place of U.
    simd::gemm_nn(isa, &gemm(n, dv, dk, dk, dv, dv, true, false), w, s, u);
    let u: &[f32] = u;
    // O_i = exp(gam_i) q_i S + sum_{r <= i} (q_i . k_r) exp(gam_i - gam_r) V'_r: the masked Q K^T
    // into amat (A is no longer needed), then both products into ob.
    amat.fill(0.0);
    simd::gemm_nn(isa, &gemm(n, n, dk, dk, n, n, false, false), q, kt, amat);
    for i in 0..n {
        let (row, gi) = (&mut amat[i * n..][..n], gam[i]);
        row[..=i]
            .iter_mut()
            .zip(&gam[..=i])
            .for_each(|(a, g)| *a *= simd::exp(gi - g));
        row[i + 1..].fill(0.0);
        let eg = gam[i].exp();
        q[i * dk..][..dk].iter_mut().for_each(|x| *x *= eg);
    }
    ob.fill(0.0);
    simd::gemm_nn(isa, &gemm(n, dv, dk, dk, dv, dv, false, false), q, s, ob);
    simd::gemm_nn(isa, &gemm(n, dv, n, n, dv, dv, false, true), amat, u, ob);
    for i in 0..n {
        // SAFETY: value head j's outputs belong to this task.
        unsafe { o.slice(((t0 + i) * hv + j) * dv, dv) }.copy_from_slice(&ob[i * dv..][..dv]);
    }
    // S <- exp(gam_n) S + sum_r exp(gam_n - gam_r) k_r (x) V'_r, i.e. S += (K^T diag(f)) V'.
    let gn = gam[n - 1];
    let en = gn.exp();
    s.iter_mut().for_each(|x| *x *= en);
    let f = beta; // beta is no longer needed: f_r = exp(gam_n - gam_r)
    f.iter_mut().zip(gam.iter()).for_each(|(f, g)| *f = simd::exp(gn - g));
    for d in 0..dk {
        kt[d * n..][..n].iter_mut().zip(f.iter()).for_each(|(x, f)| *x *= f);
    }
    simd::gemm_nn(isa, &gemm(dk, dv, n, n, dv, dv, false, false), kt, u, s);
}

/// Rows per block of [`delta_chunk`]'s forward substitution.
const SUBST_BLOCK: usize = 16;

/// Causal depthwise conv + SiLU over the rows of [state; x] (x [T, C], state [taps - 1, C], w
/// [C, taps]). Threads: blocks of CONV_BLOCK channels. Within a block the loops run token-outer,
/// channel-inner, so every read and write is a contiguous run of the block's channels (a
/// channel-outer loop walks x's columns at a stride of C floats, one cache miss per value), with
/// the block's weights transposed to [taps][block] (task scratch) first so the inner loops
/// vectorize. One token (decode) reads the weights in place: the transpose would cost as much as
/// the conv.
pub fn delta_net_conv(p: &ConvParams, w: &[f32], state: &mut [f32], x: &[f32], out: &mut [f32]) {
    let (c_n, taps, t_n) = (p.channels as usize, p.taps as usize, p.tokens as usize);
    assert!((1..=MAX_CONV_TAPS).contains(&taps), "delta_net_conv: {taps} taps");
    assert!(state.len() >= (taps - 1) * c_n && x.len() >= t_n * c_n && out.len() >= t_n * c_n);
    let (o, st) = (Out(out.as_mut_ptr()), Out(state.as_mut_ptr()));
    pool::for_each(c_n.div_ceil(CONV_BLOCK), |blk| conv_block(p, blk, w, st, x, o));
}

/// `delta_net_conv` of one token for each sequence of a batched decode step: row i of x [B, C]
/// on the conv state of `seqs[i]`, into row i of out (p.tokens: the rows B). Threads: (sequence,
/// block of CONV_BLOCK channels), every sequence in one pool loop; each block runs as
/// `delta_net_conv` runs it for one token, so each row is what that op gives it alone.
pub fn delta_net_conv_batch(
    p: &ConvParams,
    w: &[f32],
    seqs: &mut [DeltaNetSeq<'_, Vec<f32>>],
    x: &[f32],
    out: &mut [f32],
) {
    let (c_n, taps, b_n) = (p.channels as usize, p.taps as usize, p.tokens as usize);
    assert!((1..=MAX_CONV_TAPS).contains(&taps), "delta_net_conv_batch: {taps} taps");
    assert!(seqs.len() == b_n && x.len() >= b_n * c_n && out.len() >= b_n * c_n);
    let one = ConvParams { tokens: 1, ..*p };
    let (o, blocks) = (Out(out.as_mut_ptr()), c_n.div_ceil(CONV_BLOCK));
    with_caller_outs(b_n, |states| {
        for (st, sq) in states.iter_mut().zip(seqs.iter_mut()) {
            assert!(sq.conv.len() >= (taps - 1) * c_n);
            *st = Out(sq.conv.as_mut_ptr());
        }
        let states: &[Out] = states;
        pool::for_each(b_n * blocks, |task| {
            let (i, blk) = (task / blocks, task % blocks);
            conv_block(&one, blk, w, states[i], &x[i * c_n..][..c_n], o.at(i * c_n));
        });
    });
}

/// Channels per conv task.
const CONV_BLOCK: usize = 1024;

/// `delta_net_conv`'s task: channels blk * CONV_BLOCK.. of every token, and of the state.
#[inline(always)]
fn conv_block(p: &ConvParams, blk: usize, w: &[f32], st: Out, x: &[f32], o: Out) {
    let (c_n, taps, t_n) = (p.channels as usize, p.taps as usize, p.tokens as usize);
    let hist = taps - 1;
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
}
