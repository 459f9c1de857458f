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
