//! The attention family on CUDA (`shaders/cuda/attention.cu`): q/k norm + RoPE, the KV store into
//! the segmented cache (both fused in `qk_norm_rope_store`), and attention (`attention_prefill` on
//! the tensor cores for a prefill chunk, split-KV for one token, which also does
//! `qk_norm_rope_store`'s work when called as `qk_norm_rope_store_attention`).

use crate::backend::{
    cuda::{kernels::Fixed as F, rows_launch, shape, Args, Cuda, CudaBuf, CudaKv, DevPtr, Executor},
    params::{AttentionParams, KvStoreParams, RopeParams, ATTENTION_HEAD_DIM_MAX, ATTENTION_QUERY_ROWS},
};

pub fn qk_norm_rope<X: Executor>(
    c: &Cuda<X>,
    p: &RopeParams,
    q_norm: &CudaBuf<X>,
    k_norm: &CudaBuf<X>,
    qg: &mut CudaBuf<X>,
    k: &mut CudaBuf<X>,
) {
    let (t, hd) = (p.tokens as usize, p.head_dim as usize);
    if !rope_shape_ok(c, "qk_norm_rope", p) {
        return;
    }
    if !c.fits(
        "qk_norm_rope",
        &[
            ("qg", qg.len, t * p.heads as usize * 2 * hd),
            ("k", k.len, t * p.kv_heads as usize * hd),
            ("q_norm", q_norm.len, hd),
            ("k_norm", k_norm.len, hd),
        ],
    ) {
        return;
    }
    c.at_pos(p.pos0);
    let args = Args::new()
        .push(RopeParams { pos0: 0, ..*p })
        .ptr(c.step.ptr)
        .ptr(q_norm.ptr())
        .ptr(k_norm.ptr())
        .ptr(qg.ptr())
        .ptr(k.ptr());
    c.launch(F::QkNormRope, shape([p.heads + p.kv_heads, t as u32, 1], 128), args);
}

/// The head shapes the rope kernels take (one block of 128 threads per head, the head staged in
/// 1024 floats of shared memory); otherwise the backend's error.
fn rope_shape_ok<X: Executor>(c: &Cuda<X>, op: &str, p: &RopeParams) -> bool {
    let ok = p.head_dim <= 1024 && p.rotary_dim <= p.head_dim && p.rotary_dim % 2 == 0;
    if !ok {
        c.fail(format!(
            "{op}: head_dim {} (at most 1024) with rotary_dim {} (even, <= head_dim)",
            p.head_dim, p.rotary_dim
        ));
    }
    ok
}

/// `qk_norm_rope` and both `kv_store`s in one launch: q normed and roped in place, k normed and
/// roped into the K cache (k itself untouched), v copied into the V cache.
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope_store<X: Executor>(
    c: &Cuda<X>,
    p: &RopeParams,
    q_norm: &CudaBuf<X>,
    k_norm: &CudaBuf<X>,
    qg: &mut CudaBuf<X>,
    k: &CudaBuf<X>,
    v: &CudaBuf<X>,
    k_cache: &mut CudaKv<X>,
    v_cache: &mut CudaKv<X>,
) {
    let (t, hd) = (p.tokens as usize, p.head_dim as usize);
    let w = p.kv_heads as usize * hd;
    let rows = p.pos0 as usize + t;
    if !rope_shape_ok(c, "qk_norm_rope_store", p)
        || !c.fits(
            "qk_norm_rope_store",
            &[
                ("qg", qg.len, t * p.heads as usize * 2 * hd),
                ("k", k.len, t * w),
                ("v", v.len, t * w),
                ("q_norm", q_norm.len, hd),
                ("k_norm", k_norm.len, hd),
            ],
        )
        || !c.cache_fits("qk_norm_rope_store", "k_cache", k_cache, rows, w)
        || !c.cache_fits("qk_norm_rope_store", "v_cache", v_cache, rows, w)
    {
        return;
    }
    c.at_pos(p.pos0);
    let args = Args::new()
        .push(RopeParams { pos0: 0, ..*p })
        .ptr(c.step.ptr)
        .push(k_cache.desc())
        .push(v_cache.desc())
        .ptr(q_norm.ptr())
        .ptr(k_norm.ptr())
        .ptr(qg.ptr())
        .ptr(k.ptr())
        .ptr(v.ptr());
    let grid = [p.heads + 2 * p.kv_heads, t as u32, 1];
    c.launch(F::QkNormRopeStore, shape(grid, 128), args);
}

pub fn kv_store<X: Executor>(c: &Cuda<X>, p: &KvStoreParams, x: &CudaBuf<X>, cache: &mut CudaKv<X>) {
    let (t, w) = (p.tokens as usize, p.width as usize);
    if !c.fits("kv_store", &[("x", x.len, t * w)]) || !c.cache_fits("kv_store", "cache", cache, p.pos0 as usize + t, w)
    {
        return;
    }
    let d = cache.desc();
    c.at_pos(p.pos0);
    let args = Args::new()
        .push(KvStoreParams { pos0: 0, ..*p })
        .ptr(c.step.ptr)
        .push(d)
        .ptr(x.ptr());
    c.launch(F::KvStore, rows_launch(w, t), args);
}

pub fn attention<X: Executor>(
    c: &Cuda<X>,
    p: &AttentionParams,
    qg: &CudaBuf<X>,
    k: &CudaKv<X>,
    v: &CudaKv<X>,
    out: &mut CudaBuf<X>,
) {
    attention_launch(c, p, qg, k, v, out, None);
}

/// `qk_norm_rope_store` then `attention`; for one token (a decode step) in one launch: the
/// decode attention kernel norms and ropes q itself (qg is left as it was) and the block whose
/// split holds the new row stores it (attention.cu: AttRope). Otherwise the two ops.
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope_store_attention<X: Executor>(
    c: &Cuda<X>,
    rope: &RopeParams,
    p: &AttentionParams,
    q_norm: &CudaBuf<X>,
    k_norm: &CudaBuf<X>,
    qg: &mut CudaBuf<X>,
    k: &mut CudaBuf<X>,
    v: &CudaBuf<X>,
    k_cache: &mut CudaKv<X>,
    v_cache: &mut CudaKv<X>,
    out: &mut CudaBuf<X>,
) {
    let same = (rope.tokens, rope.pos0, rope.heads, rope.kv_heads, rope.head_dim)
        == (p.tokens, p.pos0, p.heads, p.kv_heads, p.head_dim);
    // The q scratch of a block: G heads of hd floats in one 16 KiB stage (attention.cu).
    let fits = p.kv_heads > 0 && (p.heads / p.kv_heads) * p.head_dim <= 4096;
    if p.tokens != 1 || !same || !fits {
        qk_norm_rope_store(c, rope, q_norm, k_norm, qg, k, v, k_cache, v_cache);
        attention(c, p, qg, k_cache, v_cache, out);
        return;
    }
    let (hd, w) = (p.head_dim as usize, (p.kv_heads * p.head_dim) as usize);
    let rows = p.pos0 as usize + 1;
    if !rope_shape_ok(c, "qk_norm_rope_store", rope)
        || !c.fits(
            "qk_norm_rope_store",
            &[
                ("k", k.len, w),
                ("v", v.len, w),
                ("q_norm", q_norm.len, hd),
                ("k_norm", k_norm.len, hd),
            ],
        )
        || !c.cache_fits("qk_norm_rope_store", "k_cache", k_cache, rows, w)
        || !c.cache_fits("qk_norm_rope_store", "v_cache", v_cache, rows, w)
    {
        return;
    }
    let fused = (
        RopeParams { pos0: 0, ..*rope },
        [q_norm.ptr(), k_norm.ptr(), k.ptr(), v.ptr()],
    );
    attention_launch(c, p, qg, k_cache, v_cache, out, Some(fused));
}

/// `attention`, with `rope` (its parameters and q_norm, k_norm, k, v) the decode kernel's fused
/// qk_norm_rope_store (one token only: the caller checked).
fn attention_launch<X: Executor>(
    c: &Cuda<X>,
    p: &AttentionParams,
    qg: &CudaBuf<X>,
    k: &CudaKv<X>,
    v: &CudaKv<X>,
    out: &mut CudaBuf<X>,
    rope: Option<(RopeParams, [DevPtr; 4])>,
) {
    let (t, h, kvh, hd) = (
        p.tokens as usize,
        p.heads as usize,
        p.kv_heads as usize,
        p.head_dim as usize,
    );
    // Decode: one or two warps per query head of a KV head in one block of at most 512 threads
    // (two heads a warp score together: attention.cu), a lane per 32nd dim; prefill: hd / 8 m16n8
    // output tiles per warp, the heads of a KV head inside one block's ATTENTION_QUERY_ROWS.
    if kvh == 0 || h % kvh != 0 || h / kvh > 32 || hd % 32 != 0 || hd == 0 || hd > ATTENTION_HEAD_DIM_MAX {
        c.fail(format!(
            "attention: {h} heads over {kvh} KV heads (at most 32 per KV head) of dim {hd} (a multiple of 32, at most {ATTENTION_HEAD_DIM_MAX}) unsupported"
        ));
        return;
    }
    let width = kvh * hd;
    let rows = p.pos0 as usize + t;
    if !c.fits(
        "attention",
        &[("qg", qg.len, t * h * 2 * hd), ("out", out.len, t * h * hd)],
    ) || !c.cache_fits("attention", "k_cache", k, rows, width)
        || !c.cache_fits("attention", "v_cache", v, rows, width)
    {
        return;
    }
    let (kd, vd) = (k.desc(), v.desc());
    // The kernel stages K and V rows with one offset computation (attention.cu: kv_stage).
    if (kd.dtype, kd.seg_shift) != (vd.dtype, vd.seg_shift) {
        c.fail("attention: the K and V caches differ in dtype or segment size".into());
        return;
    }
    c.at_pos(p.pos0);
    let pp = AttentionParams { pos0: 0, ..*p };
    if t > 1 {
        // Prefill: blocks of ATTENTION_QUERY_ROWS query rows (tokens x the heads of a KV head).
        let tokens_per_block = ATTENTION_QUERY_ROWS / (h / kvh);
        let args = Args::new()
            .push(pp)
            .ptr(c.step.ptr)
            .push(kd)
            .push(vd)
            .ptr(qg.ptr())
            .ptr(out.ptr());
        let grid = [t.div_ceil(tokens_per_block) as u32, kvh as u32, 1];
        c.launch(F::AttentionPrefill, shape(grid, 128), args);
        return;
    }
    // Decode: a KV head's query heads share one block of at most 512 threads (16 warps).
    if h / kvh > 16 {
        c.fail(format!(
            "attention: decoding {} query heads per KV head unsupported (at most 16: a block of 512 threads)",
            h / kvh
        ));
        return;
    }
    // Decode: split over the keys, combined in the same launch (attention.cu: last-block-done in
    // two levels of ATT_GROUP). Scratch: the counters (u32, zero as allocated, left 0 by the
    // kernel) in a fixed room at the front, so that a call of another shape never finds its
    // counters where an earlier call stored partials; then part1 [H, splits, 2 + hd] and part2
    // [H, groups, 2 + hd].
    let splits = c.decode_splits;
    let groups = splits.div_ceil(ATT_GROUP) as usize;
    if kvh * (groups + 1) > ATT_COUNTERS {
        c.fail(format!(
            "attention: {kvh} KV heads need {} split counters (room for {ATT_COUNTERS})",
            kvh * (groups + 1)
        ));
        return;
    }
    let size = ATT_COUNTERS + h * (splits as usize + groups) * (hd + 2);
    let Some(scratch) = c.scratch(size, "attention partials", |s| &mut s.partials) else {
        return;
    };
    let args = Args::new()
        .push(pp)
        .push(splits)
        .ptr(c.step.ptr)
        .push(kd)
        .push(vd)
        .ptr(qg.ptr())
        .ptr(scratch)
        .ptr(scratch + 4 * ATT_COUNTERS as u64)
        .ptr(out.ptr());
    let fused = rope.is_some();
    let (rp, [qn, kn, kr, vr]) = rope.unwrap_or_default();
    let args = args.push(rp).ptr(qn).ptr(kn).ptr(kr).ptr(vr);
    // Warps: attention_warps per query head where they fit the kernel's 512 threads and, fused,
    // the q scratch (one stage of 4096 floats: a warp's hd each); else one.
    let (heads, per_head) = (h / kvh, c.attention_warps as usize);
    let fits = heads * per_head <= 16 && (!fused || heads * per_head * hd <= 4096);
    let warps = if fits { heads * per_head } else { heads };
    let grid = [kvh as u32, 1, splits];
    c.launch(F::Attention, shape(grid, warps as u32 * 32), args);
}

/// Splits (then groups) one last block of decode attention combines (ATT_GROUP in attention.cu).
const ATT_GROUP: u32 = 8;
/// u32 counters at the front of the decode scratch: [Hkv, groups + 1] for one token.
const ATT_COUNTERS: usize = 256;
