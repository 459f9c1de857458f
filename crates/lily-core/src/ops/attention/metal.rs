//! The attention ops on Metal (`shaders/metal/attention.metal`).

use crate::backend::{
    metal::{args::bytes_of, norm_threads, rows_grid, stream::Scratch, Arg, Executor, Fixed, Grid, Metal, MetalBuf},
    params::{AttentionParams, AttentionSplit, KvStoreParams, RopeParams, ATTENTION_HEAD_DIM_MAX, ROPE_HEAD_DIM_MAX},
};

pub fn qk_norm_rope<X: Executor>(
    m: &Metal<X>,
    p: &RopeParams,
    q_norm: &MetalBuf<X>,
    k_norm: &MetalBuf<X>,
    qg: &mut MetalBuf<X>,
    k: &mut MetalBuf<X>,
) {
    let (t, hd) = (p.tokens as usize, p.head_dim as usize);
    if hd > ROPE_HEAD_DIM_MAX || p.rotary_dim as usize > hd || p.rotary_dim % 2 != 0 {
        return m.fail(format!(
            "qk_norm_rope: head_dim {hd} / rotary_dim {} unsupported (hd <= {ROPE_HEAD_DIM_MAX}, even rotary_dim <= hd)",
            p.rotary_dim
        ));
    }
    let checks = [
        ("q_norm", q_norm.len(), hd),
        ("k_norm", k_norm.len(), hd),
        ("qg", qg.len(), t * p.heads as usize * 2 * hd),
        ("k", k.len(), t * p.kv_heads as usize * hd),
    ];
    if !m.fits("qk_norm_rope", &checks) {
        return;
    }
    let grid = Grid::Groups {
        count: [p.heads + p.kv_heads, p.tokens, 1],
        size: [norm_threads(hd), 1, 1],
    };
    m.encode(
        Fixed::QkNormRope,
        &[Arg::Bytes(bytes_of(p)), q_norm.arg(), k_norm.arg(), qg.arg(), k.arg()],
        grid,
    );
}

pub fn kv_store<X: Executor>(m: &Metal<X>, p: &KvStoreParams, x: &MetalBuf<X>, cache: &mut MetalBuf<X>) {
    let (t, w) = (p.tokens as usize, p.width as usize);
    if !m.fits(
        "kv_store",
        &[("x", x.len(), t * w), ("cache", cache.len(), (p.pos0 as usize + t) * w)],
    ) {
        return;
    }
    m.encode(
        Fixed::KvStore,
        &[Arg::Bytes(bytes_of(p)), x.arg(), cache.arg()],
        rows_grid(w, t),
    );
}

pub fn attention<X: Executor>(
    m: &Metal<X>,
    p: &AttentionParams,
    qg: &MetalBuf<X>,
    k_cache: &MetalBuf<X>,
    v_cache: &MetalBuf<X>,
    out: &mut MetalBuf<X>,
) {
    let (t, h, kv, hd) = (
        p.tokens as usize,
        p.heads as usize,
        p.kv_heads as usize,
        p.head_dim as usize,
    );
    if kv == 0 || h % kv != 0 || h / kv > 32 || hd % 32 != 0 || hd > ATTENTION_HEAD_DIM_MAX {
        return m.fail(format!(
            "attention: {h} heads on {kv} KV heads of dim {hd} unsupported (at most 32 heads per KV head, head_dim a multiple of 32 up to {ATTENTION_HEAD_DIM_MAX})"
        ));
    }
    let len = p.pos0 as usize + t;
    let checks = [
        ("qg", qg.len(), t * h * 2 * hd),
        ("k_cache", k_cache.len(), len * kv * hd),
        ("v_cache", v_cache.len(), len * kv * hd),
        ("out", out.len(), t * h * hd),
    ];
    if !m.fits("attention", &checks) {
        return;
    }
    let split_rows = m.split_rows.max(1) as usize;
    let splits = if t == 1 && len > split_rows {
        len.div_ceil(split_rows)
    } else {
        1
    };
    let sp = AttentionSplit {
        splits: splits as u32,
        split_rows: if splits == 1 { len as u32 } else { split_rows as u32 },
    };
    let grid = Grid::Groups {
        count: [kv as u32, t as u32, splits as u32],
        size: [(h / kv * 32) as u32, 1, 1],
    };
    let pb = || Arg::Bytes(bytes_of(p));
    let sb = || Arg::Bytes(bytes_of(&sp));
    if splits == 1 {
        let args = [pb(), sb(), qg.arg(), k_cache.arg(), v_cache.arg(), out.arg()];
        return m.encode(Fixed::Attention, &args, grid);
    }
    // Sized for the most splits this cache can need (its capacity in rows), not for this
    // step's: grown once, the first time a step splits, so later steps allocate nothing
    // as the context grows.
    let cache_rows = (k_cache.len() / (kv * hd).max(1)).max(len);
    let need = t * h * cache_rows.div_ceil(split_rows) * (hd + 2);
    let Some(part) = m.scratch(Scratch::AttentionSplit, need) else {
        return;
    };
    let args = [pb(), sb(), qg.arg(), k_cache.arg(), v_cache.arg(), part.arg()];
    m.encode(Fixed::Attention, &args, grid);
    let args = [pb(), sb(), part.arg(), qg.arg(), out.arg()];
    m.encode(
        Fixed::AttentionReduce,
        &args,
        Grid::Groups {
            count: [h as u32, t as u32, 1],
            size: [32, 1, 1],
        },
    );
}
