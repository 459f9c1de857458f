//! The mixture-of-experts block's routed part (architecture.md section 7):
//! - `moe_route` (`RouteParams`): per token, p = softmax(logits) over the E experts, the top K by
//!   p (ties: the lower id first), weights p / sum(top K p) when renorm != 0; logits [T, E],
//!   ids [T, K] u32, weights [T, K].
//! - `moe_router` (`RouteParams`): the routing from the block's input x [T, D]: logits [T, E] =
//!   x router^T (router [E, D]) and the shared expert's gate logit shared [T] = x shared_gate^T
//!   (shared_gate [1, D]), then `moe_route` of the logits; a fused op whose reference is its parts
//!   (on a GPU one launch for a decode step: the GEMV, then its last block routes).
//! - `moe_experts` (`MoeParams`): out[t] = sum_k w[t, k] down_e(silu(gate_e x_t) * up_e x_t),
//!   e = ids[t, k], summed in slot order; gate, up [E, I, D] and down [E, D, I] weight matrices
//!   (possibly views of one fused tensor), x, out [T, D], tmp scratch of [T K, I + D]. Only the
//!   selected experts' rows are read. Prefill groups the (token, slot) pairs p = t K + k by
//!   expert first (a stable counting sort: [`MoeSorted`], `reference::moe_sort`), so each
//!   expert's weights serve all of its tokens at once.
//! - `gate_up_swiglu` (`RowsParams` T, N): out = silu(x gate^T) * (x up^T) for one plain pair
//!   gate, up [N, K] (the shared expert's input half); a fused op whose reference is its parts
//!   (two matmuls, then swiglu): on a GPU `moe_gate_up`'s body on one expert for a decode token.

pub mod cpu;
pub mod cuda;
pub mod metal;
pub mod reference;

use crate::backend::params::{MoeParams, RouteParams, RowsParams, MOE_EXPERTS_MAX, ROUTE_TOP_K_MAX};

/// What a GPU encoder checks before a routing dispatch (`moe_route`, `moe_router`), in one place
/// for every backend: the top K of E experts the routing kernels take (`route_token`: one key per
/// expert and the K picks in on-chip memory, 1 <= E <= `MOE_EXPERTS_MAX`, 1 <= K <=
/// min(E, `ROUTE_TOP_K_MAX`)); the error names `op`.
pub fn route_supported(op: &str, p: &RouteParams) -> Result<(), String> {
    let (e, k) = (p.experts as usize, p.top_k as usize);
    if (1..=MOE_EXPERTS_MAX).contains(&e) && (1..=e.min(ROUTE_TOP_K_MAX)).contains(&k) {
        return Ok(());
    }
    Err(format!(
        "{op}: top {k} of {e} experts unsupported (1 <= E <= {MOE_EXPERTS_MAX}, 1 <= K <= min(E, {ROUTE_TOP_K_MAX}))"
    ))
}

/// [`route_supported`] for `moe_route`, then (name, have, need) per buffer for the backend's
/// `fits`. `have`: the lengths of logits, ids, weights.
pub fn route_checks(p: &RouteParams, have: [usize; 3]) -> Result<[(&'static str, usize, usize); 3], String> {
    route_supported("moe_route", p)?;
    let (t, e, k) = (p.tokens as usize, p.experts as usize, p.top_k as usize);
    let need = [t * e, t * k, t * k];
    let names = ["logits", "ids", "weights"];
    Ok(std::array::from_fn(|i| (names[i], have[i], need[i])))
}

/// The buffers `moe_experts` needs for `pairs` (token, slot) pairs (T K; more where a backend runs
/// the shared expert as extra pairs) of experts with gate [I, D] (`dims` = [I, D]), as (name,
/// have, need) for the backend's `fits`. `have`: the lengths of x, ids, weights, tmp, out.
pub fn experts_checks(
    p: &MoeParams,
    pairs: usize,
    dims: [usize; 2],
    have: [usize; 5],
) -> [(&'static str, usize, usize); 5] {
    let (t, k, [i, d]) = (p.tokens as usize, p.top_k as usize, dims);
    let need = [t * d, t * k, t * k, pairs * (i + d), t * d];
    let names = ["x", "ids", "weights", "tmp", "out"];
    std::array::from_fn(|j| (names[j], have[j], need[j]))
}

/// The most blocks of `tile` rows the expert-sorted prefill can need for `pairs` pairs over
/// `experts` experts (each expert's rows end in at most one partial block), which its grids are
/// sized for; an error where the sort (one thread per expert) does not take `experts`.
pub fn sorted_blocks(pairs: usize, experts: usize, tile: usize) -> Result<usize, String> {
    if !(1..=MOE_EXPERTS_MAX).contains(&experts) {
        return Err(format!(
            "moe_experts: {experts} experts unsupported by the sorted path (1..={MOE_EXPERTS_MAX})"
        ));
    }
    Ok(pairs.div_ceil(tile) + experts.min(pairs))
}

/// What a GPU encoder checks before a fused `gate_up_swiglu` dispatch of gate, up [N, K]
/// (`dims` = [N, K]): N is the output's width, then (name, have, need) per buffer. `have`: the
/// lengths of x, out.
pub fn gate_up_checks(
    p: &RowsParams,
    dims: [usize; 2],
    have: [usize; 2],
) -> Result<[(&'static str, usize, usize); 2], String> {
    let (t, [n, k]) = (p.tokens as usize, dims);
    if n != p.dim as usize {
        return Err(format!(
            "gate_up_swiglu: {n} matrix rows for an output of width {}",
            p.dim
        ));
    }
    Ok([("x", have[0], t * k), ("out", have[1], t * n)])
}

/// The (token, slot) pairs p = t K + k of ids [T, K] in expert order, and the blocks of that
/// order that a grouped kernel runs: what `reference::moe_sort` computes, the CPU's grouping
/// and the Metal prefill's routing kernels build.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoeSorted {
    /// (expert, first sorted row, rows) of each block, in order.
    pub blocks: Vec<[u32; 3]>,
    /// Sorted row -> pair t*K + k.
    pub order: Vec<u32>,
    /// Pair t*K + k -> sorted row.
    pub pos: Vec<u32>,
}
