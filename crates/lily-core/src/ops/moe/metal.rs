//! The MoE ops on Metal (`shaders/metal/moe.metal`): routing (for a decode token with the router
//! GEMV in one dispatch), the per-token expert GEMVs
//! (decode) and the expert-sorted prefill (routing sorted on the GPU, then expert GEMMs).

use super::MoeSorted;
use crate::{
    backend::{
        gate_up_swiglu_unfused,
        metal::{
            args::bytes_of,
            ceil_div, rows_grid,
            stream::{Scratch, Work},
            Arg, Executor, Fixed, GemmOp, GemvOp, Grid, Metal, MetalBuf, MetalMatrix,
        },
        moe_add_rms_norm_unfused, moe_router_unfused,
        params::{
            MoeParams, MoeSortDesc, RmsNormParams, RouteParams, RowsParams, MOE_EXPERTS_MAX, MOE_TILE, ROUTE_TG_WORDS,
        },
        Backend, GateUp, MoeBlock, MoeExperts, MoeScratch, Router, Routing,
    },
    error::{Error, Result},
};

/// The bindings of a gate/up kernel: its params, the gate and up matrices ([`gate_up_args`]), then
/// the rest, as one array on the stack (encoders allocate nothing). `moe_router` binds its router
/// and shared gate the same way.
macro_rules! gate_up_bindings {
    ($m:expr, $params:expr, $gate:expr, $up:expr; $($rest:expr),*) => {{
        let [g0, g1, g2, g3, g4, g5, g6, g7] = gate_up_args($m, $gate, $up);
        [$params, g0, g1, g2, g3, g4, g5, g6, g7, $($rest),*]
    }};
}

/// A one-matrix kernel's (the down projections') bindings: `$params`, the matrix's
/// [`matrix_args`], then `$rest`.
macro_rules! matrix_bindings {
    ($m:expr, $params:expr, $w:expr; $($rest:expr),*) => {{
        let [w0, w1, w2, w3] = matrix_args($m, $w);
        [$params, w0, w1, w2, w3, $($rest),*]
    }};
}

/// A matrix as the kernels bind it: its descriptor, then weights, scales, biases.
fn matrix_args<'a, X: Executor>(m: &'a Metal<X>, w: &'a MetalMatrix<X>) -> [Arg<'a, X::Buffer>; 4] {
    let [ww, ws, wb] = m.weights(w);
    [Arg::Bytes(bytes_of(&w.desc)), ww, ws, wb]
}

/// Threadgroups of 128 threads: `n` output rows, `rows` per threadgroup across, `y` down (the
/// pairs of the per-pair GEMVs, the blocks of the sorted GEMMs).
fn groups_128(n: usize, rows: usize, y: usize) -> Grid {
    Grid::Groups {
        count: [ceil_div(n, rows), y as u32, 1],
        size: [128, 1, 1],
    }
}

pub fn moe_route<X: Executor>(
    m: &Metal<X>,
    p: &RouteParams,
    logits: &MetalBuf<X>,
    ids: &mut MetalBuf<X>,
    weights: &mut MetalBuf<X>,
) {
    let checks = match super::route_checks(p, [logits.len(), ids.len(), weights.len()]) {
        Ok(checks) => checks,
        Err(e) => return m.fail(e),
    };
    if !m.fits("moe_route", &checks) {
        return;
    }
    let grid = Grid::Groups {
        count: [p.tokens, 1, 1],
        size: [256, 1, 1],
    };
    m.encode(
        Fixed::MoeRoute,
        &[Arg::Bytes(bytes_of(p)), logits.arg(), ids.arg(), weights.arg()],
        grid,
    );
}

/// `moe_router`: one `moe_router` dispatch for a decode token (router [E, D] and shared gate
/// [1, D] of one weight format and one D: the GEMV's threadgroups hand the logits to the last one
/// through the `RouterMail` scratch, which routes); otherwise (prefill, other shapes) its parts,
/// the two matmuls then `moe_route`. The logits buffer is not written by the dispatch.
pub fn moe_router<X: Executor>(
    m: &Metal<X>,
    p: &RouteParams,
    x: &MetalBuf<X>,
    r: &Router<'_, Metal<X>>,
    out: &mut Routing<'_, Metal<X>>,
) {
    let (router, shared_gate) = (r.router, r.shared_gate);
    let (t, e, k, d) = (
        p.tokens as usize,
        p.experts as usize,
        p.top_k as usize,
        router.desc.cols as usize,
    );
    let one_dispatch = t == 1
        && router.weight == shared_gate.weight
        && shared_gate.desc.cols as usize == d
        && shared_gate.desc.rows == 1
        && router.desc.rows as usize == e;
    if !one_dispatch {
        return moe_router_unfused(m, p, x, r, out);
    }
    if let Err(e) = super::route_supported("moe_router", p) {
        return m.fail(e);
    }
    if !m.fits(
        "moe_router",
        &[
            ("x", x.len(), d),
            ("shared", out.shared.len(), 1),
            ("ids", out.ids.len(), k),
            ("weights", out.weights.len(), k),
        ],
    ) {
        return;
    }
    // The E logits in flight, then the counter (the largest E seen: a model's layers share one).
    let Some(mail) = m.scratch(Scratch::RouterMail, e + 1) else {
        return;
    };
    // The router and the shared gate bound as a gate/up pair.
    let args = gate_up_bindings!(m, Arg::Bytes(bytes_of(p)), router, shared_gate;
        x.arg(), out.shared.arg(), mail.part(0, e + 1), out.ids.arg(), out.weights.arg());
    let v = m.variants;
    let grid = Grid::Groups {
        count: [ceil_div(e, 4 * v.gemv.rows()) + 1, 1, 1],
        size: [128, 1, 1],
    };
    m.encode_tg(
        v.gemv_kernel(GemvOp::MoeRouter, router.weight),
        &args,
        grid,
        &[e * 4, ROUTE_TG_WORDS * 4],
    );
}

pub fn moe_experts<X: Executor>(
    m: &Metal<X>,
    p: &MoeParams,
    e: &MoeExperts<'_, Metal<X>>,
    x: &MetalBuf<X>,
    tmp: &mut MetalBuf<X>,
    out: &mut MetalBuf<X>,
) {
    if !experts_fit(m, p, e, x, tmp, out) {
        return;
    }
    let (t, d) = (p.tokens as usize, e.gate.desc.cols as usize);
    if !decodes_per_pair(m, p, e.gate) {
        return moe_experts_sorted(m, p, e, x, tmp, out);
    }
    let (y0, yn) = expert_gemvs(m, p, e, x, None, tmp);
    let y = tmp.part(y0, yn);
    let rows = RowsParams {
        tokens: p.tokens,
        dim: d as u32,
    };
    let args = [
        Arg::Bytes(bytes_of(p)),
        Arg::Bytes(bytes_of(&rows)),
        e.weights.arg(),
        y,
        out.arg(),
    ];
    m.encode(Fixed::MoeCombine, &args, rows_grid(d, t));
}

/// The checks of `moe_experts` (one weight format for gate, up and down; every buffer long
/// enough; `out` [T, D]), failing the stream when one does not hold.
pub(crate) fn experts_fit<X: Executor>(
    m: &Metal<X>,
    p: &MoeParams,
    e: &MoeExperts<'_, Metal<X>>,
    x: &MetalBuf<X>,
    tmp: &MetalBuf<X>,
    out: &MetalBuf<X>,
) -> bool {
    let ([gate, up, down], ids, weights) = (e.matrices(), e.ids, e.weights);
    let (t, k) = (p.tokens as usize, p.top_k as usize);
    let (i, d) = (gate.desc.rows as usize, gate.desc.cols as usize);
    if gate.weight != up.weight || gate.weight != down.weight {
        m.fail(format!(
            "moe_experts: gate/up/down formats differ ({}, {}, {})",
            gate.weight.suffix(),
            up.weight.suffix(),
            down.weight.suffix()
        ));
        return false;
    }
    let have = [x.len(), ids.len(), weights.len(), tmp.len(), out.len()];
    m.fits("moe_experts", &super::experts_checks(p, t * k, [i, d], have))
}

/// Whether `moe_experts` runs per (token, slot) pair (two GEMV dispatches, `expert_gemvs`) rather
/// than expert-sorted (prefill, or experts past the sort's limit).
pub(crate) fn decodes_per_pair<X: Executor>(m: &Metal<X>, p: &MoeParams, gate: &MetalMatrix<X>) -> bool {
    p.tokens <= m.moe_gemm_tokens || gate.experts as usize > MOE_EXPERTS_MAX
}

/// The shared expert's gate, up and down matrices where it runs as T more pairs of the routed
/// experts' GEMVs (`moe_add_rms_norm`).
pub(crate) type SharedPair<'a, X> = [&'a MetalMatrix<X>; 3];

/// The per-pair path's GEMVs: `moe_gate_up` (act [P, I] = SwiGLU of each pair's expert, the
/// first part of tmp) and `moe_down` (y [P, D], the part after it), P = T*K pairs, or T*K + T
/// with `shared` (pair T*K + t: token t's shared expert, which the caller has checked to be in the
/// experts' format and shapes; its y rows are then one [T, D] block after the routed ones);
/// returns where y lies in tmp (first element, elements).
pub(crate) fn expert_gemvs<X: Executor>(
    m: &Metal<X>,
    p: &MoeParams,
    e: &MoeExperts<'_, Metal<X>>,
    x: &MetalBuf<X>,
    shared: Option<SharedPair<'_, X>>,
    tmp: &MetalBuf<X>,
) -> (usize, usize) {
    let ([gate, up, down], ids) = (e.matrices(), e.ids);
    let (t, k) = (p.tokens as usize, p.top_k as usize);
    let (i, d) = (gate.desc.rows as usize, gate.desc.cols as usize);
    let pairs = t * k + shared.map_or(0, |_| t);
    // Without shared pairs the kernels' shared bindings are the routed matrices again (never read).
    let [s_gate, s_up, s_down] = shared.unwrap_or([gate, up, down]);
    // tmp = [act [P, I] | y [P, D]]: two disjoint bindings of one buffer.
    let act = || tmp.part(0, pairs * i);
    let pb = || Arg::Bytes(bytes_of(p));
    let v = m.variants;
    let rows_per_group = 4 * v.gemv.rows();
    let [sg0, sg1, sg2, sg3, sg4, sg5, sg6, sg7] = gate_up_args(m, s_gate, s_up);
    let args = gate_up_bindings!(m, pb(), gate, up; x.arg(), ids.arg(), act(), sg0, sg1, sg2, sg3, sg4, sg5, sg6, sg7);
    let grid = |rows: usize| groups_128(rows, rows_per_group, pairs);
    m.encode(v.gemv_kernel(GemvOp::MoeGateUp, gate.weight), &args, grid(i));
    let [s0, s1, s2, s3] = matrix_args(m, s_down);
    let y = (pairs * i, pairs * d);
    let args = matrix_bindings!(m, pb(), down; ids.arg(), act(), tmp.part(y.0, y.1), s0, s1, s2, s3);
    m.encode(v.gemv_kernel(GemvOp::MoeDown, down.weight), &args, grid(d));
    y
}

/// `moe_add_rms_norm`: for a decode step (the per-pair path) whose shared expert has the routed
/// experts' weight format and shapes ([`runs_as_pair`]), the shared expert as T more pairs of
/// `moe_gate_up` and `moe_down` (T*K + T pairs) and `moe_experts_add_rms_norm` reading its output
/// from their y with weight sigmoid(shared_logit): three dispatches after the routing instead of
/// five (the shared expert's `gate_up_swiglu` and down GEMV are gone). Otherwise (prefill, other
/// shared formats) the parts.
pub fn moe_add_rms_norm<X: Executor>(
    m: &Metal<X>,
    moe: &MoeParams,
    norm: &RmsNormParams,
    r: &MoeBlock<'_, Metal<X>>,
    s: &mut MoeScratch<'_, Metal<X>>,
    x: &mut MetalBuf<X>,
    h: &mut MetalBuf<X>,
) {
    if moe.tokens == 0 || !decodes_per_pair(m, moe, r.experts.gate) || !runs_as_pair(r) {
        return moe_add_rms_norm_unfused(m, moe, norm, r, s, x, h);
    }
    // `s.y` is not read: the shared expert's output is its pairs' rows of the experts' y.
    let end = r.end(s.y);
    let shared = [r.shared_gate, r.shared_up, r.shared_down];
    crate::ops::norm::metal::experts_add_rms_norm(m, moe, norm, &end, Some(shared), s.tmp, s.mix, x, h);
}

/// Whether the shared expert can run as more pairs of the routed experts' kernels: its matrices
/// in the routed ones' weight format, gate and up [I, D], down [D, I] (the kernels read it as
/// expert 0 through its own descriptor, so its row layout and groups may differ).
fn runs_as_pair<X: Executor>(r: &MoeBlock<'_, Metal<X>>) -> bool {
    let like = |s: &MetalMatrix<X>, e: &MetalMatrix<X>| {
        s.weight == e.weight && (s.desc.rows, s.desc.cols) == (e.desc.rows, e.desc.cols)
    };
    let e = &r.experts;
    r.shared_inter == e.gate.desc.rows
        && like(r.shared_gate, e.gate)
        && like(r.shared_up, e.up)
        && like(r.shared_down, e.down)
}

/// The gate and up matrices as every gate/up kernel (`moe_gate_up`, `gate_up_swiglu`,
/// `moe_gemm_gate_up`) binds them after its params (`gate_up_bindings!`): both descriptors, then each one's
/// (weights, scales, biases).
fn gate_up_args<'a, X: Executor>(
    m: &'a Metal<X>,
    gate: &'a MetalMatrix<X>,
    up: &'a MetalMatrix<X>,
) -> [Arg<'a, X::Buffer>; 8] {
    let [gw, gs, gb] = m.weights(gate);
    let [uw, us, ub] = m.weights(up);
    [
        Arg::Bytes(bytes_of(&gate.desc)),
        Arg::Bytes(bytes_of(&up.desc)),
        gw,
        gs,
        gb,
        uw,
        us,
        ub,
    ]
}

/// `gate_up_swiglu`: one `gate_up_swiglu` GEMV dispatch for a decode token (gate and up of one
/// weight format and shape); otherwise (prefill: the GEMMs read each weight once per tile of
/// tokens) its unfused parts, into the scratch g, u.
pub fn gate_up_swiglu<X: Executor>(
    m: &Metal<X>,
    p: &RowsParams,
    w: &GateUp<'_, Metal<X>>,
    x: &MetalBuf<X>,
    g: &mut MetalBuf<X>,
    u: &mut MetalBuf<X>,
    out: &mut MetalBuf<X>,
) {
    let (gate, up) = (w.gate, w.up);
    let (t, n, k) = (p.tokens as usize, gate.desc.rows as usize, gate.desc.cols as usize);
    let fused = t == 1 && gate.weight == up.weight && (up.desc.rows, up.desc.cols) == (gate.desc.rows, gate.desc.cols);
    if !fused {
        return gate_up_swiglu_unfused(m, p, w, x, g, u, out);
    }
    let checks = match super::gate_up_checks(p, [n, k], [x.len(), out.len()]) {
        Ok(checks) => checks,
        Err(e) => return m.fail(e),
    };
    if !m.fits("gate_up_swiglu", &checks) {
        return;
    }
    let args = gate_up_bindings!(m, Arg::Bytes(bytes_of(p)), gate, up; x.arg(), out.arg());
    let v = m.variants;
    m.encode(
        v.gemv_kernel(GemvOp::GateUpSwiglu, gate.weight),
        &args,
        Grid::Groups {
            count: [ceil_div(n, 4 * v.gemv.rows()), t as u32, 1],
            size: [128, 1, 1],
        },
    );
}

/// Tokens per sort block of `moe_histogram` / `moe_scatter`.
const MOE_SORT_TOKENS: usize = 32;

/// Where the regions of the sorted-MoE routing scratch lie: (first element, elements) in u32.
#[derive(Clone, Copy, Debug)]
struct MoeSortLayout {
    count: (usize, usize),
    blocks: (usize, usize),
    hist: (usize, usize),
    order: (usize, usize),
    pos: (usize, usize),
    max_blocks: usize,
}

/// Encode the routing of the sorted MoE path for ids [T, K] over `experts` experts:
/// `moe_histogram` (pairs per expert per sort block), `moe_scan` (sorted row offsets and the
/// block map) and `moe_scatter` (order / pos). The scratch buffer and its layout.
fn encode_moe_sort<X: Executor>(
    m: &Metal<X>,
    p: &MoeParams,
    ids: &MetalBuf<X>,
    experts: usize,
) -> Option<(MetalBuf<X>, MoeSortLayout)> {
    let (t, k, e) = (p.tokens as usize, p.top_k as usize, experts);
    let pairs = t * k;
    let token_blocks = t.div_ceil(MOE_SORT_TOKENS);
    let max_blocks = match super::sorted_blocks(pairs, e, MOE_TILE) {
        Ok(n) => n,
        Err(e) => {
            m.fail(e);
            return None;
        }
    };
    if !m.fits("moe_experts", &[("ids", ids.len(), pairs)]) {
        return None;
    }
    let sd = MoeSortDesc {
        experts: e as u32,
        token_blocks: token_blocks as u32,
        sort_tokens: MOE_SORT_TOKENS as u32,
        max_blocks: max_blocks as u32,
    };
    // count [4] | blocks [max_blocks, 4] | hist [token_blocks, E] | order [T*K] | pos [T*K]
    let mut at = 0;
    let mut next = |n: usize| {
        at += n;
        (at - n, n)
    };
    let l = MoeSortLayout {
        count: next(4),
        blocks: next(4 * max_blocks),
        hist: next(token_blocks * e),
        order: next(pairs),
        pos: next(pairs),
        max_blocks,
    };
    let sc = m.scratch(Scratch::MoeSort, at)?;
    let region = |r: (usize, usize)| sc.part(r.0, r.1);
    let pb = || Arg::Bytes(bytes_of(p));
    let sb = || Arg::Bytes(bytes_of(&sd));
    let sort_grid = Grid::Threads {
        threads: [e as u32, token_blocks as u32, 1],
        size: [64, 1, 1],
    };
    m.encode(Fixed::MoeHistogram, &[pb(), sb(), ids.arg(), region(l.hist)], sort_grid);
    let scan = Grid::Groups {
        count: [1, 1, 1],
        size: [(e.div_ceil(32) * 32) as u32, 1, 1],
    };
    let args = [pb(), sb(), region(l.hist), region(l.count), region(l.blocks)];
    m.encode(Fixed::MoeScan, &args, scan);
    let args = [pb(), sb(), ids.arg(), region(l.hist), region(l.order), region(l.pos)];
    m.encode(Fixed::MoeScatter, &args, sort_grid);
    Some((sc, l))
}

/// Run the routing of the sorted MoE path alone and read it back (tests: the kernels
/// `moe_histogram`, `moe_scan` and `moe_scatter` against a plain counting sort).
pub fn moe_sort<X: Executor>(m: &Metal<X>, p: &MoeParams, ids: &MetalBuf<X>, experts: usize) -> Result<MoeSorted> {
    let enc = encode_moe_sort(m, p, ids, experts);
    m.flush()?;
    let Some((sc, l)) = enc else {
        return Err(Error::Device("moe_sort: nothing encoded".into()));
    };
    let get = |r: (usize, usize)| -> Result<Vec<u32>> {
        let mut v = vec![0f32; r.1];
        m.read(&sc, r.0, &mut v)?;
        Ok(v.iter().map(|x| x.to_bits()).collect())
    };
    let n = get(l.count)?[0] as usize;
    let blocks = get(l.blocks)?.chunks(4).take(n).map(|b| [b[0], b[1], b[2]]).collect();
    Ok(MoeSorted {
        blocks,
        order: get(l.order)?,
        pos: get(l.pos)?,
    })
}

/// `moe_experts` for prefill: route-sorted expert GEMMs, with no CPU round-trip. The pairs
/// p = t*K + k are counted per expert (`moe_histogram`), scanned into per-expert row offsets
/// and a map of [`MOE_TILE`]-row blocks (`moe_scan`), scattered into expert-sorted order
/// (`moe_scatter`); each block then runs gate/up + SwiGLU (`moe_gemm_gate_up`, into
/// act [T*K, I] of `tmp`) and down (`moe_gemm_down`, into y [T*K, D] of `tmp`) with the
/// weights dequantized tile by tile, and `moe_combine_sorted` sums the K rows of each token
/// in slot order. The block grids are sized for the worst case (`max_blocks`); the
/// threadgroups past the block count return at once.
fn moe_experts_sorted<X: Executor>(
    m: &Metal<X>,
    p: &MoeParams,
    e: &MoeExperts<'_, Metal<X>>,
    x: &MetalBuf<X>,
    tmp: &mut MetalBuf<X>,
    out: &mut MetalBuf<X>,
) {
    let ([gate, up, down], ids, weights) = (e.matrices(), e.ids, e.weights);
    let (t, k) = (p.tokens as usize, p.top_k as usize);
    let (i, d) = (gate.desc.rows as usize, gate.desc.cols as usize);
    let pairs = t * k;
    let Some((sc, l)) = encode_moe_sort(m, p, ids, gate.experts as usize) else {
        return;
    };
    let region = |r: (usize, usize)| sc.part(r.0, r.1);
    let (count, blocks, order, pos) = (
        || region(l.count),
        || region(l.blocks),
        || region(l.order),
        || region(l.pos),
    );
    let max_blocks = l.max_blocks;
    let pb = || Arg::Bytes(bytes_of(p));
    // tmp = [act [T*K, I] | y [T*K, D]], both in sorted row order.
    let act = || tmp.part(0, pairs * i);
    let y = || tmp.part(pairs * i, pairs * d);
    let v = m.variants;
    let tn = v.gemm.rows();
    let (x_tile, w_tile) = (MOE_TILE * MOE_TILE * 4, tn * MOE_TILE * 4);
    let (grid, flops) = (|rows: usize| groups_128(rows, tn, max_blocks), (pairs * i * d) as f64);
    let args = gate_up_bindings!(m, pb(), gate, up; x.arg(), count(), blocks(), order(), act());
    m.encode_work(
        v.gemm_kernel(GemmOp::MoeGemmGateUp, gate.weight),
        &args,
        grid(i),
        &[x_tile, w_tile, w_tile],
        Work::flops(4.0 * flops),
    );
    let args = matrix_bindings!(m, pb(), down; count(), blocks(), act(), y());
    m.encode_work(
        v.gemm_kernel(GemmOp::MoeGemmDown, down.weight),
        &args,
        grid(d),
        &[x_tile, w_tile],
        Work::flops(2.0 * flops),
    );
    let rows = RowsParams {
        tokens: p.tokens,
        dim: d as u32,
    };
    let args = [pb(), Arg::Bytes(bytes_of(&rows)), weights.arg(), pos(), y(), out.arg()];
    m.encode(Fixed::MoeCombineSorted, &args, rows_grid(d, t));
}
