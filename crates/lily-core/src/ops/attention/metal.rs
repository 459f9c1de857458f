//! The attention ops on Metal (`shaders/metal/attention.metal`).

use crate::backend::{
    metal::{
        args::bytes_of,
        norm_threads, rows_grid,
        stream::{Scratch, Work},
        Arg, Executor, Fixed, Grid, Metal, MetalBuf, MetalKv,
    },
    params::{
        AttentionParams, AttentionSplit, KvStoreParams, RopeParams, ATTENTION_HEAD_DIM_MAX, ATTENTION_TILE,
        ROPE_HEAD_DIM_MAX,
    },
    KvDtype,
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

/// The kernels of a cache dtype: (kv_store, attention, qk_norm_rope_store).
fn kernels(dtype: KvDtype) -> (Fixed, Fixed, Fixed) {
    match dtype {
        KvDtype::F32 => (Fixed::KvStoreF32, Fixed::AttentionF32, Fixed::QkNormRopeStoreF32),
        KvDtype::BF16 => (Fixed::KvStoreBf16, Fixed::AttentionBf16, Fixed::QkNormRopeStoreBf16),
        KvDtype::F16 => (Fixed::KvStoreF16, Fixed::AttentionF16, Fixed::QkNormRopeStoreF16),
    }
}

/// `qk_norm_rope` + both `kv_store`s in one dispatch: k is normed and roped straight into its
/// cache (the buffer k is left as it was), v copied into its cache.
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope_store<X: Executor>(
    m: &Metal<X>,
    p: &RopeParams,
    q_norm: &MetalBuf<X>,
    k_norm: &MetalBuf<X>,
    qg: &mut MetalBuf<X>,
    k: &MetalBuf<X>,
    v: &MetalBuf<X>,
    [k_cache, v_cache]: [&mut MetalKv<X>; 2],
) {
    let (t, hd) = (p.tokens as usize, p.head_dim as usize);
    if hd > ROPE_HEAD_DIM_MAX || p.rotary_dim as usize > hd || p.rotary_dim % 2 != 0 {
        return m.fail(format!(
            "qk_norm_rope_store: head_dim {hd} / rotary_dim {} unsupported (hd <= {ROPE_HEAD_DIM_MAX}, even rotary_dim <= hd)",
            p.rotary_dim
        ));
    }
    let kvw = p.kv_heads as usize * hd;
    let checks = [
        ("q_norm", q_norm.len(), hd),
        ("k_norm", k_norm.len(), hd),
        ("qg", qg.len(), t * p.heads as usize * 2 * hd),
        ("k", k.len(), t * kvw),
        ("v", v.len(), t * kvw),
    ];
    let rows = p.pos0 as usize + t;
    if !m.fits("qk_norm_rope_store", &checks)
        || !cache_fits(m, "qk_norm_rope_store", "k_cache", k_cache, rows, kvw)
        || !cache_fits(m, "qk_norm_rope_store", "v_cache", v_cache, rows, kvw)
    {
        return;
    }
    if k_cache.dtype != v_cache.dtype || k_cache.shift != v_cache.shift {
        return m.fail("qk_norm_rope_store: the K and V caches differ in dtype or segment size".into());
    }
    let layout = k_cache.layout();
    let grid = Grid::Groups {
        count: [p.heads + 2 * p.kv_heads, p.tokens, 1],
        size: [norm_threads(hd), 1, 1],
    };
    m.encode_resident(
        kernels(k_cache.dtype).2,
        &[
            Arg::Bytes(bytes_of(p)),
            Arg::Bytes(bytes_of(&layout)),
            q_norm.arg(),
            k_norm.arg(),
            qg.arg(),
            k.arg(),
            v.arg(),
            k_cache.arg(),
            v_cache.arg(),
        ],
        grid,
        &[32 * 4, hd * 4],
        &[&k_cache.segs, &v_cache.segs],
        Work::default(),
    );
}

/// Check that `cache` holds rows 0..rows of `width` values.
fn cache_fits<X: Executor>(m: &Metal<X>, op: &str, what: &str, cache: &MetalKv<X>, rows: usize, width: usize) -> bool {
    if cache.width != width || cache.rows() < rows {
        m.fail(format!(
            "{op}: {what} holds {} rows of {} values, needs {rows} of {width}",
            cache.rows(),
            cache.width
        ));
        return false;
    }
    true
}

pub fn kv_store<X: Executor>(m: &Metal<X>, p: &KvStoreParams, x: &MetalBuf<X>, cache: &mut MetalKv<X>) {
    let (t, w) = (p.tokens as usize, p.width as usize);
    if !m.fits("kv_store", &[("x", x.len(), t * w)])
        || !cache_fits(m, "kv_store", "cache", cache, p.pos0 as usize + t, w)
    {
        return;
    }
    let layout = cache.layout();
    m.encode_resident(
        kernels(cache.dtype).0,
        &[
            Arg::Bytes(bytes_of(p)),
            Arg::Bytes(bytes_of(&layout)),
            x.arg(),
            cache.arg(),
        ],
        rows_grid(w, t),
        &[],
        &[&cache.segs],
        Work::default(),
    );
}

pub fn attention<X: Executor>(
    m: &Metal<X>,
    p: &AttentionParams,
    qg: &MetalBuf<X>,
    k_cache: &MetalKv<X>,
    v_cache: &MetalKv<X>,
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
    let checks = [("qg", qg.len(), t * h * 2 * hd), ("out", out.len(), t * h * hd)];
    if !m.fits("attention", &checks)
        || !cache_fits(m, "attention", "k_cache", k_cache, len, kv * hd)
        || !cache_fits(m, "attention", "v_cache", v_cache, len, kv * hd)
    {
        return;
    }
    if k_cache.dtype != v_cache.dtype || k_cache.shift != v_cache.shift {
        return m.fail("attention: the K and V caches differ in dtype or segment size".into());
    }
    // Rows per split: split_rows, or more where that would make more than max_splits splits
    // (params.rs, ATTENTION_MAX_SPLITS, says why).
    let max_splits = m.max_splits.max(1) as usize;
    let split_rows = (m.split_rows.max(1) as usize).max(len.div_ceil(max_splits));
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
    let layout = k_cache.layout();
    let lb = || Arg::Bytes(bytes_of(&layout));
    let kernel = kernels(k_cache.dtype).1;
    if splits == 1 {
        // One dispatch per block of query tokens (the stream commits between them), each over
        // the cache rows its tokens see: a prefill chunk over a long context stays under the
        // stream's per-command-buffer budget (stream.rs). The kernel reads token t's rows
        // 0..pos0 + t, so a block is the same kernel at pos0 + first with its rows of qg / out.
        let row_work = |rows: usize| Work {
            flops: 4.0 * (rows * h * hd) as f64,
            bytes: Some((2 * rows * kv * hd * k_cache.dtype.size()) as f64),
        };
        for r in m.blocks(t, row_work(len)) {
            let bp = AttentionParams {
                tokens: r.len() as u32,
                pos0: p.pos0 + r.start as u32,
                ..*p
            };
            let bsp = AttentionSplit {
                splits: 1,
                split_rows: p.pos0 + r.end as u32,
            };
            let (q_row, o_row) = (h * 2 * hd, h * hd);
            let args = [
                Arg::Bytes(bytes_of(&bp)),
                Arg::Bytes(bytes_of(&bsp)),
                lb(),
                qg.part(r.start * q_row, r.len() * q_row),
                k_cache.arg(),
                v_cache.arg(),
                out.part(r.start * o_row, r.len() * o_row),
            ];
            let grid = Grid::Groups {
                count: [kv as u32, r.len() as u32, 1],
                size: [(h / kv * 32) as u32, 1, 1],
            };
            let rows = p.pos0 as usize + r.end;
            let work = Work {
                flops: row_work(rows).flops * r.len() as f64,
                ..row_work(rows)
            };
            encode_attention(m, kernel, &args, grid, hd, [k_cache, v_cache], work);
        }
        return;
    }
    // Sized for the most splits this cache can need (its capacity in rows), not for this
    // step's: grown once, the first time a step splits, so later steps allocate nothing
    // as the context grows.
    let cache_rows = k_cache.max_rows.max(len);
    let most = cache_rows.div_ceil(m.split_rows.max(1) as usize).min(max_splits);
    let need = t * h * most * (hd + 2);
    let Some(part) = m.scratch(Scratch::AttentionSplit, need) else {
        return;
    };
    let args = [pb(), sb(), lb(), qg.arg(), k_cache.arg(), v_cache.arg(), part.arg()];
    encode_attention(m, kernel, &args, grid, hd, [k_cache, v_cache], Work::default());
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

/// One attention dispatch with both caches' segments resident (the kernel reads them through
/// the segment tables).
fn encode_attention<X: Executor>(
    m: &Metal<X>,
    kernel: Fixed,
    args: &[Arg<'_, X::Buffer>],
    grid: Grid,
    hd: usize,
    [k_cache, v_cache]: [&MetalKv<X>; 2],
    work: Work,
) {
    // Threadgroup memory: the staged K and V tiles of ATTENTION_TILE rows of one head.
    let tg = ATTENTION_TILE * hd * 4;
    m.encode_resident(kernel, args, grid, &[tg, tg], &[&k_cache.segs, &v_cache.segs], work);
}
