//! The MoE ops on the CPU: routing one token per task; the routed experts by GEMV from the packed
//! rows (decode; a batched decode step groups its tokens by expert first) or grouped by expert
//! into dequantized-tile GEMMs (prefill).

use crate::{
    backend::{
        cpu::{
            int8::Precision,
            isa::Isa,
            pool,
            scratch::{with_caller, with_caller_ids, with_task, Out},
            simd::{self, XRow, ROWS_BATCH},
        },
        params::{MoeParams, RouteParams},
    },
    ops::matmul::cpu as matmul,
    quant::Matrix,
};

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
/// tokens (the matmul family's [`matmul::tile_sweep`]). Accumulation f32; the K outputs are summed in slot order.
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
    moe_experts_with(
        Isa::get(),
        Precision::Exact,
        p,
        x,
        ids,
        weights,
        gate,
        up,
        down,
        tmp,
        out,
    )
}

/// [`moe_experts`] on the ISA `isa` in the precision `prec`: in the fast one, a prefill's experts
/// also run from the packed rows (as a batched decode step) when the matmul family says so
/// ([`matmul::int8_prefill`]): no dequantized tile, x as one int8 plane.
pub fn moe_experts_with(
    isa: Isa,
    prec: Precision,
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
    let int8 = [gate, up, down]
        .iter()
        .all(|m| matmul::int8_prefill(isa, prec, m, true));
    if t_n == 1 && fused {
        moe_decode(isa, prec, k_n, x, ids, gate, up, down, act, ys);
    } else if (t_n <= matmul::GEMV_BATCH_MAX || int8) && fused {
        moe_decode_batch(isa, prec, pairs, k_n, x, ids, gate, up, down, act, ys);
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
    prec: Precision,
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
        simd::prepare(isa, prec, gate, &x[..d], buf);
        let xr = simd::view(isa, prec, gate, &x[..d], buf);
        let blocks = inter.div_ceil(MOE_DECODE_ROWS);
        pool::for_each(k_n * blocks, |task| {
            let (slot, blk) = (task / blocks, task % blocks);
            let e = ids[slot] as usize;
            let rows = blk * MOE_DECODE_ROWS..((blk + 1) * MOE_DECODE_ROWS).min(inter);
            let rn = rows.len();
            with_task(sb_len + 2 * rn, |scr| {
                let (sb, rest) = scr.split_at_mut(sb_len);
                let (g, u) = rest.split_at_mut(rn);
                matmul::gemv_rows(isa, gate, e, rows.start, xr, sb, g);
                matmul::gemv_rows(isa, up, e, rows.start, xr, sb, u);
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
            simd::prepare(
                isa,
                prec,
                down,
                &act[slot * inter..][..inter],
                &mut buf[slot * pl..][..pl],
            );
        }
        let buf: &[f32] = buf;
        let rows_per = 4 * MOE_DECODE_ROWS;
        let blocks = d.div_ceil(rows_per);
        pool::for_each(k_n * blocks, |task| {
            let (slot, blk) = (task / blocks, task % blocks);
            let e = ids[slot] as usize;
            let xr = simd::view(isa, prec, down, &act[slot * inter..][..inter], &buf[slot * pl..][..pl]);
            let rows = blk * rows_per..((blk + 1) * rows_per).min(d);
            let rn = rows.len();
            with_task(sb_len + rn, |scr| {
                let (sb, y) = scr.split_at_mut(sb_len);
                matmul::gemv_rows(isa, down, e, rows.start, xr, sb, y);
                for (i, &v) in y.iter().enumerate() {
                    // SAFETY: (slot, row) is written by this task only.
                    unsafe { ys_o.set(slot * d + rows.start + i, v) };
                }
            });
        });
    });
}

/// A batched decode step (a few tokens, one per sequence), or a prefill in the fast precision
/// ([`matmul::int8_prefill`]): the pairs grouped by expert, and each
/// task's block of one expert's rows dotted from the packed bytes (as [`moe_decode`]) with every
/// pair routed to that expert while the block is in cache, up to [`ROWS_BATCH`] pairs per pass of
/// the batched row kernel (each weight block unpacked once for all of them): an expert two
/// sequences share is read once, and each pair's result is what [`moe_decode`] gives it alone.
#[allow(clippy::too_many_arguments)]
fn moe_decode_batch(
    isa: Isa,
    prec: Precision,
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
    let t_n = pairs / k_n;
    let (act_o, ys_o) = (Out(act.as_mut_ptr()), Out(ys.as_mut_ptr()));
    let sb_len = simd::row_scratch_len(gate).max(simd::row_scratch_len(down));
    with_groups(&ids[..pairs], e_n, |groups| {
        let (ng, group) = (groups.len(), |g: usize| groups.get(g));
        let pl = simd::prep_len(gate);
        with_caller(t_n * pl, |xb| {
            for t in 0..t_n {
                simd::prepare(isa, prec, gate, &x[t * d..][..d], &mut xb[t * pl..][..pl]);
            }
            let xb: &[f32] = xb;
            let blocks = inter.div_ceil(MOE_DECODE_ROWS);
            pool::for_each(ng * blocks, |task| {
                let (g, blk) = (task / blocks, task % blocks);
                let (e, members) = group(g);
                let rows = blk * MOE_DECODE_ROWS..((blk + 1) * MOE_DECODE_ROWS).min(inter);
                let rn = rows.len();
                with_task(sb_len + 2 * ROWS_BATCH * rn, |scr| {
                    let (sb, rest) = scr.split_at_mut(sb_len);
                    let (gv, uv) = rest.split_at_mut(ROWS_BATCH * rn);
                    for tile in members.chunks(ROWS_BATCH) {
                        let xr: [XRow; ROWS_BATCH] = std::array::from_fn(|j| {
                            let t = tile[j.min(tile.len() - 1)] as usize / k_n;
                            simd::view(isa, prec, gate, &x[t * d..][..d], &xb[t * pl..][..pl])
                        });
                        let xr = &xr[..tile.len()];
                        matmul::gemv_rows_batch(isa, gate, e, rows.start, xr, rn, sb, gv);
                        matmul::gemv_rows_batch(isa, up, e, rows.start, xr, rn, sb, uv);
                        for (j, &pair) in tile.iter().enumerate() {
                            for i in 0..rn {
                                let (g, u) = (gv[j * rn + i], uv[j * rn + i]);
                                // SAFETY: (pair, row) is written by this task only.
                                unsafe { act_o.set(pair as usize * inter + rows.start + i, simd::silu(g) * u) };
                            }
                        }
                    }
                });
            });
        });
        let act: &[f32] = act;
        let pl = simd::prep_len(down);
        with_caller(pairs * pl, |ab| {
            for pair in 0..pairs {
                simd::prepare(
                    isa,
                    prec,
                    down,
                    &act[pair * inter..][..inter],
                    &mut ab[pair * pl..][..pl],
                );
            }
            let ab: &[f32] = ab;
            let rows_per = 4 * MOE_DECODE_ROWS;
            let blocks = d.div_ceil(rows_per);
            pool::for_each(ng * blocks, |task| {
                let (g, blk) = (task / blocks, task % blocks);
                let (e, members) = group(g);
                let rows = blk * rows_per..((blk + 1) * rows_per).min(d);
                let rn = rows.len();
                with_task(sb_len + ROWS_BATCH * rn, |scr| {
                    let (sb, y) = scr.split_at_mut(sb_len);
                    for tile in members.chunks(ROWS_BATCH) {
                        let xr: [XRow; ROWS_BATCH] = std::array::from_fn(|j| {
                            let pair = tile[j.min(tile.len() - 1)] as usize;
                            simd::view(isa, prec, down, &act[pair * inter..][..inter], &ab[pair * pl..][..pl])
                        });
                        matmul::gemv_rows_batch(isa, down, e, rows.start, &xr[..tile.len()], rn, sb, y);
                        for (j, &pair) in tile.iter().enumerate() {
                            for (i, &v) in y[j * rn..][..rn].iter().enumerate() {
                                // SAFETY: (pair, row) is written by this task only.
                                unsafe { ys_o.set(pair as usize * d + rows.start + i, v) };
                            }
                        }
                    }
                });
            });
        });
    });
}

/// The (token, slot) pairs of `ids` grouped by expert, in expert order.
struct Groups<'a> {
    order: &'a [u32], // pair indices in expert order
    list: &'a [u32],  // (expert, first sorted row, rows) per group
}

impl Groups<'_> {
    fn len(&self) -> usize {
        self.list.len() / 3
    }
    /// Group g's expert and its pairs.
    fn get(&self, g: usize) -> (usize, &[u32]) {
        let first = self.list[3 * g + 1] as usize;
        (
            self.list[3 * g] as usize,
            &self.order[first..first + self.list[3 * g + 2] as usize],
        )
    }
}

/// `f` of the pairs of `ids` grouped by expert ([`group_by_expert`] in the calling thread's
/// ids scratch: starts [E + 1] | order [pairs] | groups [(expert, first, rows)]).
fn with_groups<R>(ids: &[u32], experts: usize, f: impl FnOnce(&Groups) -> R) -> R {
    let pairs = ids.len();
    with_caller_ids(experts + 1 + pairs + 3 * experts.min(pairs), |buf| {
        let (starts, rest) = buf.split_at_mut(experts + 1);
        let (order, list) = rest.split_at_mut(pairs);
        let ng = group_by_expert(ids, experts, starts, order, list);
        f(&Groups {
            order,
            list: &list[..3 * ng],
        })
    })
}

/// The (token, slot) pairs p of `ids` grouped by expert, a stable counting sort (the CPU's form of
/// `reference::moe_sort`, one block per expert): `order[..pairs]` gets the pairs in expert
/// order, `groups[3 g..3 g + 3]` = (expert, first sorted row, rows) of each expert that has
/// pairs, in expert order; returns the number of groups. `starts` is scratch of E + 1 values;
/// an id past the last expert counts as the last one (routing never gives one).
pub fn group_by_expert(
    ids: &[u32],
    experts: usize,
    starts: &mut [u32],
    order: &mut [u32],
    groups: &mut [u32],
) -> usize {
    let e_n = experts;
    starts[..e_n + 1].fill(0);
    for &e in ids {
        starts[(e as usize).min(e_n - 1) + 1] += 1;
    }
    for e in 0..e_n {
        starts[e + 1] += starts[e];
    }
    let mut ng = 0;
    for e in 0..e_n {
        if starts[e + 1] > starts[e] {
            groups[3 * ng..3 * ng + 3].copy_from_slice(&[e as u32, starts[e], starts[e + 1] - starts[e]]);
            ng += 1;
        }
    }
    // Scatter pair indices into expert order (starts[e] advances to the end of group e).
    for (pi, &e) in ids.iter().enumerate() {
        let e = (e as usize).min(e_n - 1);
        order[starts[e] as usize] = pi as u32;
        starts[e] += 1;
    }
    ng
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
    with_groups(&ids[..pairs], e_n, |groups| {
        let (ng, group) = (groups.len(), |g: usize| groups.get(g));

        let block = matmul::sweep_rows(isa);
        let blocks = inter.div_ceil(block);
        pool::for_each(ng * blocks, |task| {
            let (g, blk) = (task / blocks, task % blocks);
            let (e, members) = group(g);
            let rows = blk * block..((blk + 1) * block).min(inter);
            let (r0, rn, sweep) = (rows.start, rows.len(), matmul::sweep_scratch_len(isa, d));
            with_task(sweep + members.len() * rn, |scr| {
                let (scr, gv) = scr.split_at_mut(sweep);
                let xrow = |m: usize| &x[(members[m] as usize / k_n) * d..][..d];
                let n = members.len();
                matmul::tile_sweep(isa, gate, e, rows.clone(), n, xrow, scr, |m, i, v| gv[m * rn + i] = v);
                matmul::tile_sweep(isa, up, e, rows, n, xrow, scr, |m, i, u| {
                    // SAFETY: (pair, row) of this expert's row block is written by this task only.
                    unsafe { act_o.set(members[m] as usize * inter + r0 + i, simd::silu(gv[m * rn + i]) * u) };
                });
            });
        });
        let act: &[f32] = act;
        let blocks = d.div_ceil(block);
        pool::for_each(ng * blocks, |task| {
            let (g, blk) = (task / blocks, task % blocks);
            let (e, members) = group(g);
            let rows = blk * block..((blk + 1) * block).min(d);
            let r0 = rows.start;
            with_task(matmul::sweep_scratch_len(isa, inter), |scr| {
                let xrow = |m: usize| &act[members[m] as usize * inter..][..inter];
                matmul::tile_sweep(isa, down, e, rows, members.len(), xrow, scr, |m, i, y| {
                    // SAFETY: (pair, row) of this expert's row block is written by this task only.
                    unsafe { ys_o.set(members[m] as usize * d + r0 + i, y) };
                });
            });
        });
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
