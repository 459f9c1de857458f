//! The MoE on CUDA (`shaders/cuda/moe.cu`): routing (softmax + top-k per token; for a decode step
//! with the router GEMV in one launch) and the expert FFNs (GEMVs per token-expert pair for decode,
//! route-sorted tensor-core GEMMs for prefill).

use crate::backend::{
    cuda::{
        div, gemv_lanes, gemv_split,
        kernels::{Fixed as F, Kernel, WeightOp},
        rows_launch, shape, Args, Cuda, CudaBuf, CudaMat, Executor, GemvMulti, MoeShared, MoeSortArgs, GEMV_TOKENS,
    },
    gate_up_swiglu_unfused, moe_add_rms_norm_unfused, moe_router_unfused,
    params::{MoeParams, RmsNormParams, RouteParams, RowsParams},
    GateUp, MoeBlock, MoeExperts, MoeScratch, Router, Routing,
};
use crate::ops::matmul::cuda::{MMA_ROWS, MMA_THREADS, MMA_TOKENS};

pub fn moe_route<X: Executor>(
    c: &Cuda<X>,
    p: &RouteParams,
    logits: &CudaBuf<X>,
    ids: &mut CudaBuf<X>,
    weights: &mut CudaBuf<X>,
) {
    let checks = match super::route_checks(p, [logits.len, ids.len, weights.len]) {
        Ok(checks) => checks,
        Err(e) => return c.fail(e),
    };
    if !c.fits("moe_route", &checks) {
        return;
    }
    let args = Args::new().push(*p).ptr(logits.ptr()).ptr(ids.ptr()).ptr(weights.ptr());
    c.launch(F::MoeRoute, shape([p.tokens, 1, 1], 256), args);
}

/// `moe_router`: one `moe_router` launch up to `gemv_tokens` tokens (router [E, D] and shared gate
/// [1, D] of one weight format and one D: the GEMV's blocks, then the last block of each token
/// routes it, counted in the stream's `router_counts`); otherwise (prefill, other shapes,
/// `LILY_CUDA_FUSED_ROUTER=0`) its parts, `matmuls` then `moe_route`.
pub fn moe_router<X: Executor>(
    c: &Cuda<X>,
    p: &RouteParams,
    x: &CudaBuf<X>,
    r: &Router<'_, Cuda<X>>,
    out: &mut Routing<'_, Cuda<X>>,
) {
    let (router, shared_gate) = (r.router, r.shared_gate);
    let (t, e, k, d) = (
        p.tokens as usize,
        p.experts as usize,
        p.top_k as usize,
        router.desc.cols as usize,
    );
    let one_launch = c.fused_router
        && router.weight == shared_gate.weight
        && shared_gate.desc.cols as usize == d
        && shared_gate.desc.rows == 1
        && router.desc.rows as usize == e;
    if t == 0 || t > c.gemv_tokens || !one_launch {
        return moe_router_unfused(c, p, x, r, out);
    }
    if let Err(e) = super::route_supported("moe_router", p) {
        return c.fail(e);
    }
    if !c.fits(
        "moe_router",
        &[
            ("x", x.len, t * d),
            ("logits", out.logits.len, t * e),
            ("shared", out.shared.len, t),
            ("ids", out.ids.len, t * k),
            ("weights", out.weights.len, t * k),
        ],
    ) {
        return;
    }
    // Room for the default GEMV token limit at once, so decode never regrows it (a test that raises
    // `gemv_tokens` to usize::MAX grows it to its token count instead; a new buffer is zero too).
    let Some(counts) = c.scratch(t.max(GEMV_TOKENS), "router counts", |s| &mut s.router_counts) else {
        return;
    };
    let chunks = router.desc.row_bytes.min(shared_gate.desc.row_bytes) as usize / 16;
    let ks = gemv_split(e + 1, chunks, t);
    let per_block = 32 / ks as usize;
    let ends = [div(e, per_block), div(e, per_block) + div(1, per_block)];
    let g = GemvMulti {
        count: 2,
        ends: [ends[0], ends[1], ends[1], ends[1]],
        ks,
        ..Default::default()
    };
    let [rw, rs, rb] = router.ptrs();
    let [sw, ss, sb] = shared_gate.ptrs();
    let args = Args::new()
        .push(*p)
        .push(g)
        .push(router.desc)
        .push(shared_gate.desc)
        .ptr(rw)
        .ptr(rs)
        .ptr(rb)
        .ptr(sw)
        .ptr(ss)
        .ptr(sb)
        .ptr(x.ptr())
        .ptr(out.logits.ptr())
        .ptr(out.shared.ptr())
        .ptr(counts)
        .ptr(out.ids.ptr())
        .ptr(out.weights.ptr());
    c.launch(
        Kernel::weight(WeightOp::MoeRouter, router.weight),
        shape([ends[1], t as u32, 1], 256),
        args,
    );
}

pub fn moe_experts<X: Executor>(
    c: &Cuda<X>,
    p: &MoeParams,
    e: &MoeExperts<'_, Cuda<X>>,
    x: &CudaBuf<X>,
    tmp: &mut CudaBuf<X>,
    out: &mut CudaBuf<X>,
) {
    let (t, d, out_ptr, weights) = (p.tokens as usize, e.gate.desc.cols, out.ptr(), e.weights);
    moe_experts_then(c, p, e, x, None, tmp, out, |y| {
        let rows = RowsParams {
            tokens: p.tokens,
            dim: d,
        };
        let args = Args::new().push(*p).push(rows).ptr(weights.ptr()).ptr(y).ptr(out_ptr);
        c.launch(F::MoeCombine, rows_launch(d as usize, t), args);
    })
}

/// Whether `moe_experts` runs per (token, slot) pair (the GEMVs of a decode step) rather than
/// expert-sorted (prefill: the tensor-core GEMMs).
pub(crate) fn decodes_per_pair<X: Executor>(c: &Cuda<X>, p: &MoeParams) -> bool {
    p.tokens as usize <= c.gemv_tokens
}

/// The shared expert's gate, up and down matrices where it runs as each token's last pair of the
/// routed experts' kernels (`moe_add_rms_norm`).
pub(crate) type SharedPair<'a, X> = [&'a CudaMat<X>; 3];

/// `moe_experts` up to its sum: where [`decodes_per_pair`], the per-pair GEMVs into y [T*KP, D]
/// (in tmp, after act [T*KP, I]; KP = K, or K + 1 with `shared`: the shared expert as each token's
/// last pair, which the caller has checked to be in the experts' format and shape), then
/// `combine(y's address)` launches what sums the KP rows of each token (into `out`, or folded into
/// the residual norm: `ops::norm::cuda::moe_experts_add_rms_norm`); otherwise the expert-sorted
/// path, which writes `out` itself (`combine` is not called; `shared` must then be None).
#[allow(clippy::too_many_arguments)]
pub(crate) fn moe_experts_then<X: Executor>(
    c: &Cuda<X>,
    p: &MoeParams,
    e: &MoeExperts<'_, Cuda<X>>,
    x: &CudaBuf<X>,
    shared: Option<SharedPair<'_, X>>,
    tmp: &mut CudaBuf<X>,
    out: &mut CudaBuf<X>,
    combine: impl FnOnce(u64),
) {
    let ([gate, up, down], ids, weights) = (e.matrices(), e.ids, e.weights);
    let (t, k) = (p.tokens as usize, p.top_k as usize);
    let (i, d) = (gate.desc.rows as usize, gate.desc.cols as usize);
    let pairs = t * (k + shared.is_some() as usize);
    if pairs > 65535 || up.desc.rows != gate.desc.rows || down.desc.cols as usize != i || down.desc.rows as usize != d {
        c.fail(format!(
            "moe_experts: {pairs} token-expert pairs (at most 65535) or mismatched expert shapes"
        ));
        return;
    }
    let have = [x.len, ids.len, weights.len, tmp.len, out.len];
    if !c.fits("moe_experts", &super::experts_checks(p, pairs, [i, d], have)) || pairs == 0 {
        return;
    }
    if !decodes_per_pair(c, p) {
        if shared.is_some() {
            return c.fail("moe_experts: the shared expert as a pair past the GEMV token limit".into());
        }
        return experts_sorted(c, p, e, x, tmp, out);
    }
    let sh = match shared {
        Some([sg, su, sd]) => {
            let ([gw, gs, gb], [uw, us, ub], [dw, ds, db]) = (sg.ptrs(), su.ptrs(), sd.ptrs());
            MoeShared {
                gate: sg.desc,
                up: su.desc,
                down: sd.desc,
                shared: 1,
                pad: 0,
                ptrs: [gw, gs, gb, uw, us, ub, dw, ds, db],
            }
        }
        None => MoeShared::default(),
    };
    let act = tmp.ptr();
    let y = tmp.ptr() + (pairs * i * 4) as u64;
    let (args, ks) = gate_up_args(Args::new().push(*p), gate, up, i, pairs);
    let args = args.push(sh).ptr(x.ptr()).ptr(ids.ptr()).ptr(act);
    let launch = shape([div(i, 32 / ks as usize), pairs as u32, 1], 256);
    c.launch(Kernel::weight(WeightOp::MoeGateUp, gate.weight), launch, args);
    let [dw, ds, db] = down.ptrs();
    let chunks = down.desc.row_bytes as usize / 16;
    let ks = gemv_split(d, chunks, pairs);
    let lanes = gemv_lanes(chunks, ks);
    let args = Args::new()
        .push(*p)
        .push(down.desc)
        .ptr(dw)
        .ptr(ds)
        .ptr(db)
        .push(ks)
        .push(lanes)
        .push(sh)
        .ptr(ids.ptr())
        .ptr(act)
        .ptr(y);
    let launch = shape([div(d, 32 / ks as usize * 32 / lanes as usize), pairs as u32, 1], 256);
    c.launch(Kernel::weight(WeightOp::MoeDown, down.weight), launch, args);
    combine(y);
}

/// `moe_add_rms_norm`: for a decode step (T <= `gemv_tokens`) whose shared expert has the routed
/// experts' weight format and shapes (intermediate size, group, row layout: [`runs_as_pair`]), the
/// shared expert as each token's pair K of `moe_gate_up` and `moe_down` (T*(K+1) pairs) and
/// `moe_experts_add_rms_norm` reading its output from their y with weight sigmoid(shared_logit):
/// three launches after the routing instead of five (the shared expert's `gate_up_swiglu` and down
/// GEMV are gone). Otherwise (prefill, other shared formats) the parts.
pub fn moe_add_rms_norm<X: Executor>(
    c: &Cuda<X>,
    moe: &MoeParams,
    norm: &RmsNormParams,
    r: &MoeBlock<'_, Cuda<X>>,
    s: &mut MoeScratch<'_, Cuda<X>>,
    x: &mut CudaBuf<X>,
    h: &mut CudaBuf<X>,
) {
    if moe.tokens == 0 || !decodes_per_pair(c, moe) || !runs_as_pair(r) {
        return moe_add_rms_norm_unfused(c, moe, norm, r, s, x, h);
    }
    // `shared` is not read: the shared expert's output is the last pair's row of the experts' y.
    let end = r.end(s.y);
    let shared = [r.shared_gate, r.shared_up, r.shared_down];
    crate::ops::norm::cuda::experts_add_rms_norm(c, moe, norm, &end, Some(shared), s.tmp, s.mix, x, h);
}

/// Whether the shared expert can run as one more pair of the routed experts' kernels: each of its
/// matrices in the weight format, shape and row layout of the routed one it stands beside (the
/// kernels then differ only in where the rows are: its own row_offset, expert 0).
fn runs_as_pair<X: Executor>(r: &MoeBlock<'_, Cuda<X>>) -> bool {
    let like = |s: &CudaMat<X>, e: &CudaMat<X>| {
        let (a, b) = (&s.desc, &e.desc);
        s.weight == e.weight
            && (a.rows, a.cols, a.group, a.row_bytes, a.vec, a.group_shift)
                == (b.rows, b.cols, b.group, b.row_bytes, b.vec, b.group_shift)
    };
    let e = &r.experts;
    r.shared_inter == e.gate.desc.rows
        && like(r.shared_gate, e.gate)
        && like(r.shared_up, e.up)
        && like(r.shared_down, e.down)
}

/// The gate/up GEMV kernels' shared arguments after their params: [`gate_up_mats`], then ks
/// (warps per row group, `gemv_split` for `rows` output rows and `items` rows of x), which is also
/// returned for the grid.
fn gate_up_args<X: Executor>(args: Args, gate: &CudaMat<X>, up: &CudaMat<X>, rows: usize, items: usize) -> (Args, u32) {
    let chunks = (gate.desc.row_bytes.min(up.desc.row_bytes) / 16) as usize;
    let ks = gemv_split(rows, chunks, items);
    (gate_up_mats(args, gate, up).push(ks), ks)
}

/// The gate and up matrices as every gate/up kernel (GEMV and tensor-core GEMM) takes them: both
/// descriptors, then each one's (weights, scales, biases).
fn gate_up_mats<X: Executor>(args: Args, gate: &CudaMat<X>, up: &CudaMat<X>) -> Args {
    let [gw, gs, gb] = gate.ptrs();
    let [uw, us, ub] = up.ptrs();
    args.push(gate.desc)
        .push(up.desc)
        .ptr(gw)
        .ptr(gs)
        .ptr(gb)
        .ptr(uw)
        .ptr(us)
        .ptr(ub)
}

/// `gate_up_swiglu`: one `gate_up_swiglu` launch up to `gemv_tokens` tokens (gate and up of one
/// weight format and shape); otherwise (prefill: the tensor-core GEMMs) its unfused parts, into
/// the scratch g, u.
pub fn gate_up_swiglu<X: Executor>(
    c: &Cuda<X>,
    p: &RowsParams,
    w: &GateUp<'_, Cuda<X>>,
    x: &CudaBuf<X>,
    g: &mut CudaBuf<X>,
    u: &mut CudaBuf<X>,
    out: &mut CudaBuf<X>,
) {
    let (gate, up) = (w.gate, w.up);
    let (t, n, k) = (p.tokens as usize, gate.desc.rows as usize, gate.desc.cols as usize);
    let same = gate.weight == up.weight && (up.desc.rows, up.desc.cols) == (gate.desc.rows, gate.desc.cols);
    if t == 0 || t > c.gemv_tokens || !same {
        return gate_up_swiglu_unfused(c, p, w, x, g, u, out);
    }
    let checks = match super::gate_up_checks(p, [n, k], [x.len, out.len]) {
        Ok(checks) => checks,
        Err(e) => return c.fail(e),
    };
    if !c.fits("gate_up_swiglu", &checks) {
        return;
    }
    let (args, ks) = gate_up_args(Args::new().push(*p), gate, up, n, t);
    let args = args.ptr(x.ptr()).ptr(out.ptr());
    let launch = shape([div(n, 32 / ks as usize), t as u32, 1], 256);
    c.launch(Kernel::weight(WeightOp::GateUpSwiglu, gate.weight), launch, args);
}

/// `moe_experts` for prefill: route-sorted expert GEMMs on the tensor cores, with no host
/// round trip. `moe_sort` groups the pairs t*K + k by expert into `MMA_TOKENS`-row tiles (u32 scratch:
/// count | tiles | order | pos); `moe_gemm_gate_up` (act = SwiGLU over each tile's gathered
/// token rows, into tmp [T*K, I] in sorted order) and `moe_gemm_down` (y, tmp [T*K, D] after
/// act) run one block row per tile, the grid sized for the most tiles there can be
/// (`max_tiles`; blocks past the count return at once); `moe_combine_sorted` sums each token's
/// K rows in slot order. The caller has checked shapes and sizes.
fn experts_sorted<X: Executor>(
    c: &Cuda<X>,
    p: &MoeParams,
    e: &MoeExperts<'_, Cuda<X>>,
    x: &CudaBuf<X>,
    tmp: &mut CudaBuf<X>,
    out: &mut CudaBuf<X>,
) {
    let ([gate, up, down], ids, weights) = (e.matrices(), e.ids, e.weights);
    let (t, k) = (p.tokens as usize, p.top_k as usize);
    let (i, d, e) = (gate.desc.rows as usize, gate.desc.cols as usize, gate.experts as usize);
    let pairs = t * k;
    let max_tiles = match super::sorted_blocks(pairs, e, MMA_TOKENS) {
        Ok(n) => n,
        Err(e) => return c.fail(e),
    };
    let Some(sc) = c.scratch(4 + 4 * max_tiles + 2 * pairs, "moe sort", |s| &mut s.moe_scratch) else {
        return;
    };
    let sort = MoeSortArgs {
        experts: e as u32,
        max_tiles: max_tiles as u32,
    };
    c.launch(
        F::MoeSort,
        shape([1, 1, 1], 1024),
        Args::new().push(*p).push(sort).ptr(ids.ptr()).ptr(sc),
    );
    let act = tmp.ptr();
    let y = tmp.ptr() + (pairs * i * 4) as u64;
    let args = gate_up_mats(Args::new().push(*p), gate, up)
        .ptr(x.ptr())
        .ptr(sc)
        .push(max_tiles as u32)
        .ptr(act);
    // Gate rows beside the same up rows: MMA_ROWS / 2 of each per block.
    let launch = shape([div(i, MMA_ROWS / 2), max_tiles as u32, 1], MMA_THREADS);
    c.launch(Kernel::weight(WeightOp::MoeGemmGateUp, gate.weight), launch, args);
    let [dw, ds, db] = down.ptrs();
    let args = Args::new()
        .push(*p)
        .push(down.desc)
        .ptr(dw)
        .ptr(ds)
        .ptr(db)
        .ptr(sc)
        .push(max_tiles as u32)
        .ptr(act)
        .ptr(y);
    let launch = shape([div(d, MMA_ROWS), max_tiles as u32, 1], MMA_THREADS);
    c.launch(Kernel::weight(WeightOp::MoeGemmDown, down.weight), launch, args);
    let rows = RowsParams {
        tokens: p.tokens,
        dim: d as u32,
    };
    let args = Args::new()
        .push(*p)
        .push(rows)
        .ptr(weights.ptr())
        .ptr(sc)
        .push(max_tiles as u32)
        .ptr(y)
        .ptr(out.ptr());
    c.launch(F::MoeCombineSorted, rows_launch(d, t), args);
}
