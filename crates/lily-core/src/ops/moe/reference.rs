//! The reference twins of the MoE ops (shapes: `ops/moe/mod.rs`).

use super::MoeSorted;
use crate::{
    backend::params::{MatmulParams, MoeParams, RouteParams},
    ops::silu,
    quant::Matrix,
};

/// Softmax over all E logits, top K by probability (ties: lower id first), optional renormalisation.
pub fn moe_route(p: &RouteParams, logits: &[f32], ids: &mut [u32], weights: &mut [f32]) {
    let (e_n, k_n) = (p.experts as usize, p.top_k as usize);
    for t in 0..p.tokens as usize {
        let l = &logits[t * e_n..][..e_n];
        let m = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let z: f32 = l.iter().map(|x| (x - m).exp()).sum();
        let probs: Vec<f32> = l.iter().map(|x| (x - m).exp() / z).collect();
        let mut order: Vec<usize> = (0..e_n).collect();
        order.sort_by(|&x, &y| probs[y].total_cmp(&probs[x]).then(x.cmp(&y)));
        let sum: f32 = order[..k_n].iter().map(|&e| probs[e]).sum();
        for k in 0..k_n {
            ids[t * k_n + k] = order[k] as u32;
            weights[t * k_n + k] = if p.renorm != 0 {
                probs[order[k]] / sum
            } else {
                probs[order[k]]
            };
        }
    }
}

/// logits = x router^T, shared = x shared_gate^T, then `moe_route` of the logits.
#[allow(clippy::too_many_arguments)]
pub fn moe_router(
    p: &RouteParams,
    x: &[f32],
    router: &Matrix,
    shared_gate: &Matrix,
    logits: &mut [f32],
    shared: &mut [f32],
    ids: &mut [u32],
    weights: &mut [f32],
) {
    let mm = MatmulParams {
        tokens: p.tokens,
        x_row0: 0,
    };
    crate::ops::matmul::reference::matmul(&mm, router, x, logits);
    crate::ops::matmul::reference::matmul(&mm, shared_gate, x, shared);
    moe_route(p, logits, ids, weights);
}

pub fn moe_experts(
    p: &MoeParams,
    x: &[f32],
    ids: &[u32],
    weights: &[f32],
    gate: &Matrix,
    up: &Matrix,
    down: &Matrix,
    out: &mut [f32],
) {
    let (d, inter, k_n) = (gate.cols, gate.rows, p.top_k as usize);
    let mut row = vec![0f32; d.max(inter)];
    for t in 0..p.tokens as usize {
        let xt = &x[t * d..][..d];
        let o = &mut out[t * d..][..d];
        o.fill(0.0);
        for k in 0..k_n {
            let e = ids[t * k_n + k] as usize;
            let mut act = vec![0f32; inter];
            for r in 0..inter {
                gate.dequant_row(e, r, &mut row[..d]);
                let g: f32 = row[..d].iter().zip(xt).map(|(a, b)| a * b).sum();
                up.dequant_row(e, r, &mut row[..d]);
                let u: f32 = row[..d].iter().zip(xt).map(|(a, b)| a * b).sum();
                act[r] = silu(g) * u;
            }
            for r in 0..d {
                down.dequant_row(e, r, &mut row[..inter]);
                let y: f32 = row[..inter].iter().zip(&act).map(|(a, b)| a * b).sum();
                o[r] += weights[t * k_n + k] * y;
            }
        }
    }
}

/// The (token, slot) pairs of ids [T, K] stably sorted by expert (pairs of one expert in
/// increasing p = t K + k), and the map of blocks of at most `block_rows` sorted rows, each within
/// one expert, in order; experts with no pair have no block.
pub fn moe_sort(ids: &[u32], experts: usize, block_rows: usize) -> MoeSorted {
    assert!(block_rows > 0, "moe_sort: blocks of 0 rows");
    let mut order: Vec<u32> = (0..ids.len() as u32).collect();
    order.sort_by_key(|&p| ids[p as usize]); // stable
    let mut pos = vec![0u32; ids.len()];
    for (row, &p) in order.iter().enumerate() {
        pos[p as usize] = row as u32;
    }
    let mut blocks = Vec::new();
    let mut row0 = 0;
    for e in 0..experts {
        let n = ids.iter().filter(|&&i| i as usize == e).count();
        for j in (0..n).step_by(block_rows) {
            blocks.push([e as u32, (row0 + j) as u32, (n - j).min(block_rows) as u32]);
        }
        row0 += n;
    }
    MoeSorted { blocks, order, pos }
}
