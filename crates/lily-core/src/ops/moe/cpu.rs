//! The MoE ops on the CPU: routing one token per task; the routed experts by GEMV from the packed
//! rows (decode; a batched decode step groups its tokens by expert first) or, in a prefill, grouped
//! by expert: dequantized-tile GEMMs for experts with many tokens, the row kernel for the others.

use crate::{
    backend::{
        cpu::{
            int8::{Dot, Precision},
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
/// Several tokens: the (token, slot) pairs are grouped by expert (counting sort), and each task
/// takes a block of one expert's rows: an expert with many tokens dequantizes a tile of them once
/// and multiplies it against all of its tokens (the matmul family's [`matmul::tile_sweep`]), one
/// with few dots the packed rows with each token ([`moe_batch`]). Accumulation f32; the K
/// outputs are summed in slot order.
///
/// On the ISA `isa` in the precision `prec` (x as three int8 planes or one where the row kernel
/// runs); a prefill's experts with few pairs ([`rows_tokens_max`]) also run from the packed rows,
/// as a batched decode step's do.
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
    let m = [gate, up, down];
    let fused = m.iter().all(|m| simd::has_row_kernel(m)) && gate.format == up.format;
    let e = Experts {
        isa,
        prec,
        k_n,
        x,
        ids,
        m,
    };
    if t_n == 1 && fused {
        moe_decode(&e, act, ys);
    } else {
        // A batched decode step runs every expert on the row kernel; a prefill, those with few pairs.
        let rows_max = match (fused, t_n <= matmul::GEMV_BATCH_MAX) {
            (false, _) => 0,
            (true, true) => usize::MAX,
            // gate and up have one format and width (`fused`).
            (true, false) => rows_tokens_max(isa, prec, gate).min(rows_tokens_max(isa, prec, down)),
        };
        moe_batch(&e, rows_max, pairs, act, ys);
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

/// What [`moe_decode`] and [`moe_batch`] run on: the ISA and precision, K, the tokens' x [T, D]
/// and expert ids [T, K], the experts' gate, up, down.
#[derive(Clone, Copy)]
struct Experts<'a> {
    isa: Isa,
    prec: Precision,
    k_n: usize,
    x: &'a [f32],
    ids: &'a [u32],
    /// gate, up, down.
    m: [&'a Matrix; 3],
}

/// One token: every slot's expert by GEMV from the packed rows.
fn moe_decode(e: &Experts, act: &mut [f32], ys: &mut [f32]) {
    let (isa, prec, k_n, x, ids, [gate, up, down]) = (e.isa, e.prec, e.k_n, e.x, e.ids, e.m);
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

/// Most pairs routed to one expert for which a prefill runs that expert on the int8 row kernel
/// (from the packed rows, x as int8 planes: [`moe_batch`]) rather than a dequantized f32 tile; 0
/// where `m` has no fused 4-bit row kernel. Dequantizing a tile costs about as much per weight as
/// ~12 tokens' FMAs on it, while the row kernel's cost per token does not depend on how many tokens
/// share the expert: so the row kernel for the ~8 tokens per expert of a 256-token prompt, the
/// tile for a long prompt's ~128. Measured on AVX2 (`pmaddubsw`, one thread, CPU time, gemv bench
/// at 8 / 16 / 32 tokens per expert): exact, the row kernel 35-39 GFLOP/s flat, the tile 27 / 39 /
/// 46 (crossover ~13); fast (one plane, a third of the byte dots), the row kernel 64-84, ahead
/// at every count measured. The VNNI dots (one instruction per byte-dot pair instead of three)
/// and the 512-bit tile (FMAs twice as wide, the same dequantization) move the exact crossover
/// later by instruction count; 16 is argued, not measured. Fast at 128 tokens per expert measured
/// slower on the Xeon's VNNI rows than the tile (the journal's 4096-token row), so 64. On Zen 5
/// (AVX-512 VNNI, one thread, CPU time; 2026-12-02) the exact row kernel ran 142-155 GFLOP/s at 8
/// and 16 tokens per expert and 137-139 at 32, the tile (16-row 512-bit dequantization, packed rows
/// prefetched) 70-77 / 102-118 / 136-148: crossover between 16 and 32, so 16 stays.
pub fn rows_tokens_max(isa: Isa, prec: Precision, m: &Matrix) -> usize {
    match (simd::int8_rows_dot(isa, m), prec) {
        (None, _) => 0,
        // arm64 (a batched row kernel since 2026-12-02, no outer-product tile): the crossover
        // is unmeasured there (no arm64 machine), so as before (exact: tiles; fast: rows).
        (Some(Dot::NeonSdot | Dot::Portable), Precision::Exact) => 0,
        (Some(Dot::NeonSdot | Dot::Portable), Precision::Fast) => usize::MAX,
        (Some(Dot::Maddubs256), Precision::Exact) => 12,
        (Some(_), Precision::Exact) => 16,
        (Some(_), Precision::Fast) => 64,
    }
}

/// Several tokens (a batched decode step, a prefill chunk): the (token, slot) pairs grouped by
/// expert (counting sort), each expert's rows cut into blocks, the blocks of every expert the
/// tasks of one pool loop (per matrix pass: gate and up, then down). An expert with at most
/// `rows_max` pairs runs the int8 row kernel from the packed bytes ([`moe_decode`]'s), with every
/// pair routed to it while the block is in cache, up to [`ROWS_BATCH`] pairs per pass of the
/// batched row kernel (each weight block unpacked once for all of them; each pair's result is what
/// [`moe_decode`] gives it alone); one with more dequantizes a tile of its rows once and sweeps
/// all its pairs over it (the matmul family's [`matmul::tile_sweep`]).
fn moe_batch(e: &Experts, rows_max: usize, pairs: usize, act: &mut [f32], ys: &mut [f32]) {
    let (isa, prec, k_n, x, ids, [gate, up, down]) = (e.isa, e.prec, e.k_n, e.x, e.ids, e.m);
    let (d, inter, e_n) = (gate.cols, gate.rows, gate.experts.max(1));
    let t_n = pairs / k_n;
    let (act_o, ys_o) = (Out(act.as_mut_ptr()), Out(ys.as_mut_ptr()));
    let sb_len = simd::row_scratch_len(gate).max(simd::row_scratch_len(down));
    let tile = matmul::sweep_rows(isa);
    with_groups(&ids[..pairs], e_n, |groups, first| {
        let ng = groups.len();
        let by_rows = |g: usize| groups.get(g).1.len() <= rows_max;
        // Tasks per group and pass: blocks of rows (the row kernel's runs are long enough for the
        // prefetcher, [`MOE_DECODE_ROWS`]; down's 4x) or of tile rows. first[p][g]: group g's first task.
        let (f_up, f_down) = first.split_at_mut(ng + 1);
        (f_up[0], f_down[0]) = (0, 0);
        for g in 0..ng {
            let (b_up, b_down) = if by_rows(g) {
                (MOE_DECODE_ROWS, 4 * MOE_DECODE_ROWS)
            } else {
                (tile, tile)
            };
            f_up[g + 1] = f_up[g] + inter.div_ceil(b_up) as u32;
            f_down[g + 1] = f_down[g] + d.div_ceil(b_down) as u32;
        }
        let (f_up, f_down): (&[u32], &[u32]) = (f_up, f_down);
        // Task -> (group, its expert and pairs, rows of the block).
        let task = |first: &[u32], task: usize, rows_n: usize, rows_block: usize| {
            let g = first.partition_point(|&s| s as usize <= task) - 1;
            let block = if by_rows(g) { rows_block } else { tile };
            let blk = task - first[g] as usize;
            let (e, members) = groups.get(g);
            (by_rows(g), e, members, blk * block..((blk + 1) * block).min(rows_n))
        };
        let any_rows = (0..ng).any(by_rows);

        let pl = simd::prep_len(gate);
        with_caller(if any_rows { t_n * pl } else { 0 }, |xb| {
            if any_rows {
                pool::for_chunks(xb, pl, |t, b| simd::prepare(isa, prec, gate, &x[t * d..][..d], b));
            }
            let xb: &[f32] = xb;
            pool::for_each(f_up[ng] as usize, |t| {
                let (rows_path, e, members, rows) = task(f_up, t, inter, MOE_DECODE_ROWS);
                let (r0, rn) = (rows.start, rows.len());
                if !rows_path {
                    let sweep = matmul::sweep_scratch_len(isa, d);
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
                    return;
                }
                with_task(sb_len + 2 * ROWS_BATCH * rn, |scr| {
                    let (sb, rest) = scr.split_at_mut(sb_len);
                    let (gv, uv) = rest.split_at_mut(ROWS_BATCH * rn);
                    for tile in members.chunks(ROWS_BATCH) {
                        let xr: [XRow; ROWS_BATCH] = std::array::from_fn(|j| {
                            let t = tile[j.min(tile.len() - 1)] as usize / k_n;
                            simd::view(isa, prec, gate, &x[t * d..][..d], &xb[t * pl..][..pl])
                        });
                        let xr = &xr[..tile.len()];
                        matmul::gemv_rows_batch(isa, gate, e, r0, xr, rn, sb, gv);
                        matmul::gemv_rows_batch(isa, up, e, r0, xr, rn, sb, uv);
                        for (j, &pair) in tile.iter().enumerate() {
                            for i in 0..rn {
                                let (g, u) = (gv[j * rn + i], uv[j * rn + i]);
                                // SAFETY: (pair, row) is written by this task only.
                                unsafe { act_o.set(pair as usize * inter + r0 + i, simd::silu(g) * u) };
                            }
                        }
                    }
                });
            });
        });
        let act: &[f32] = act;
        let pl = simd::prep_len(down);
        with_caller(if any_rows { pairs * pl } else { 0 }, |ab| {
            if any_rows {
                let ab_o = Out(ab.as_mut_ptr());
                pool::for_each(ng, |g| {
                    if by_rows(g) {
                        for &pair in groups.get(g).1 {
                            let pair = pair as usize;
                            // SAFETY: each pair belongs to one group, so its slice to this task only.
                            let b = unsafe { ab_o.slice(pair * pl, pl) };
                            simd::prepare(isa, prec, down, &act[pair * inter..][..inter], b);
                        }
                    }
                });
            }
            let ab: &[f32] = ab;
            pool::for_each(f_down[ng] as usize, |t| {
                let (rows_path, e, members, rows) = task(f_down, t, d, 4 * MOE_DECODE_ROWS);
                let (r0, rn) = (rows.start, rows.len());
                if !rows_path {
                    with_task(matmul::sweep_scratch_len(isa, inter), |scr| {
                        let xrow = |m: usize| &act[members[m] as usize * inter..][..inter];
                        matmul::tile_sweep(isa, down, e, rows, members.len(), xrow, scr, |m, i, y| {
                            // SAFETY: (pair, row) of this expert's row block is written by this task only.
                            unsafe { ys_o.set(members[m] as usize * d + r0 + i, y) };
                        });
                    });
                    return;
                }
                with_task(sb_len + ROWS_BATCH * rn, |scr| {
                    let (sb, y) = scr.split_at_mut(sb_len);
                    for tile in members.chunks(ROWS_BATCH) {
                        let xr: [XRow; ROWS_BATCH] = std::array::from_fn(|j| {
                            let pair = tile[j.min(tile.len() - 1)] as usize;
                            simd::view(isa, prec, down, &act[pair * inter..][..inter], &ab[pair * pl..][..pl])
                        });
                        matmul::gemv_rows_batch(isa, down, e, r0, &xr[..tile.len()], rn, sb, y);
                        for (j, &pair) in tile.iter().enumerate() {
                            for (i, &v) in y[j * rn..][..rn].iter().enumerate() {
                                // SAFETY: (pair, row) is written by this task only.
                                unsafe { ys_o.set(pair as usize * d + r0 + i, v) };
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

/// `f` of the pairs of `ids` grouped by expert and of 2 (groups + 1) free values ([`group_by_expert`]
/// in the calling thread's ids scratch: starts [E + 1] | order [pairs] | groups [(expert, first,
/// rows)] | free).
fn with_groups<R>(ids: &[u32], experts: usize, f: impl FnOnce(&Groups, &mut [u32]) -> R) -> R {
    let (pairs, max_groups) = (ids.len(), experts.min(ids.len()));
    with_caller_ids(experts + 1 + pairs + 5 * max_groups + 2, |buf| {
        let (starts, rest) = buf.split_at_mut(experts + 1);
        let (order, rest) = rest.split_at_mut(pairs);
        let (list, free) = rest.split_at_mut(3 * max_groups);
        let ng = group_by_expert(ids, experts, starts, order, list);
        f(
            &Groups {
                order,
                list: &list[..3 * ng],
            },
            &mut free[..2 * (ng + 1)],
        )
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
