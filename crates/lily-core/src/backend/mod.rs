//! The backend interface: buffers, a command stream, and one method per op.
//!
//! `model/` issues every operation through [`Backend`]; a backend owns its device, its buffers
//! and how commands are encoded (`cpu/`, `metal/`), and runs each op through its family's
//! kernels (`ops/<family>/{cpu,metal}.rs`). Method names are the op stems used by the shaders
//! (`shaders/metal/<family>.metal`), the kernels and the tests. Buffers hold f32 values from the
//! model's point of view (a device may store activations narrower); outputs are `&mut`. This
//! file is the only place that knows which backends exist; `params.rs` is what the host and the
//! kernels share.

pub mod cpu;
pub mod cuda;
pub mod metal;
pub mod params;
pub mod simlib;

pub use params::*;

pub use crate::ops::delta_net::DeltaNetIn;
use crate::{error::Result, quant::Matrix};

/// What the command stream opened by [`Backend::begin`] runs, as the engine states it: a GPU
/// backend labels the stream with it (GPU captures read "lily step 12" / "lily prefill chunk"),
/// the CPU profiler files the kernels' times under it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamKind {
    /// One decode step (a forward pass over one new token and its logits).
    Decode,
    /// One prefill chunk (a forward pass over a chunk of the prompt, and logits rows).
    Prefill,
    /// Anything else: state copies (snapshot, restore), single kernels in tests.
    Other,
}

/// Element type of the stored K/V rows of the attention cache. Attention kernels widen them to
/// f32 and accumulate in f32; `kv_store` rounds the f32 activations to nearest even.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvDtype {
    F32,
    /// bfloat16: f32's range, 8 significant bits; what MLX-LM keeps for a bf16 model.
    #[default]
    BF16,
    /// IEEE half: 11 significant bits, range to 65504.
    F16,
}

impl KvDtype {
    pub fn parse(name: &str) -> Result<KvDtype> {
        match name {
            "f32" | "float32" => Ok(KvDtype::F32),
            "bf16" | "bfloat16" => Ok(KvDtype::BF16),
            "f16" | "float16" => Ok(KvDtype::F16),
            _ => Err(crate::error::Error::InvalidArgument(format!(
                "unknown kv_dtype {name:?}: expected \"bf16\", \"f16\" or \"f32\""
            ))),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::BF16 => "bf16",
            KvDtype::F16 => "f16",
        }
    }
    /// Bytes per stored element.
    pub fn size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::BF16 | KvDtype::F16 => 2,
        }
    }
}

/// Host-name suffixes of the weight formats that have GPU kernels, one list for both GPU
/// backends: `FOR_EACH_WEIGHT` in shaders/metal/common.h and in shaders/cuda/common.cuh, same
/// order (a kernel family's instance for a format is named `<stem>_<suffix>`).
pub const WEIGHT_SUFFIXES: &[&str] = &[
    "f32", "f16", "bf16", "q2_bf16", "q4_bf16", "q8_bf16", "q2_f16", "q4_f16", "q8_f16", "q2_f32", "q4_f32", "q8_f32",
];

/// A weight format that has GPU kernels: its place in [`WEIGHT_SUFFIXES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Weight(u8);

impl Weight {
    pub fn from_suffix(suffix: &str) -> Option<Weight> {
        WEIGHT_SUFFIXES
            .iter()
            .position(|s| *s == suffix)
            .map(|i| Weight(i as u8))
    }
    /// Host-name suffix (`q4_bf16`, `bf16`, ...).
    pub fn suffix(self) -> &'static str {
        WEIGHT_SUFFIXES[self.0 as usize]
    }
    /// Its place in [`WEIGHT_SUFFIXES`].
    pub fn index(self) -> usize {
        self.0 as usize
    }
    pub fn all() -> impl Iterator<Item = Weight> {
        (0..WEIGHT_SUFFIXES.len()).map(|i| Weight(i as u8))
    }
}

/// Rows per KV-cache segment: the cache grows by whole segments as the sequence does, so an
/// engine holding a 2K conversation holds 2K rows (rounded up to a segment), not `max_seq`.
/// [`KV_SEGMENT_ROWS`] unless `LILY_KV_SEGMENT_ROWS` (a power of two, at least 16) says otherwise
/// (tests use small segments to cross many boundaries cheaply). Read once per process.
pub fn kv_segment_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| {
        std::env::var("LILY_KV_SEGMENT_ROWS")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|n| n.is_power_of_two() && *n >= 16)
            .unwrap_or(KV_SEGMENT_ROWS)
    })
}

/// One segment of a KV cache, as memory accounting sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvSegment {
    /// The same for every cache holding this very segment (its allocation's address), so a set
    /// of sequences can count a shared segment once.
    pub id: usize,
    pub bytes: usize,
    /// Whether another cache holds it too (a fork, a prefix-cache entry).
    pub shared: bool,
}

/// Whether `copy_rows` of `len` values from `src_off` of a buffer of `src_len` values to
/// `dst_off` of one of `dst_len` stays inside both.
/// The index of the largest value (the lowest among equal ones; NaN never wins over a number):
/// `Backend::argmax` where the values are on the host.
pub(crate) fn first_max(v: &[f32]) -> u32 {
    // The largest value first, in 16 independent lanes (a compare-select without a loop-carried
    // branch, which the compiler can turn into vector max), then the first index holding it.
    const L: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; L];
    let chunks = v.chunks_exact(L);
    for x in chunks.remainder() {
        lanes[0] = if *x > lanes[0] { *x } else { lanes[0] };
    }
    for c in chunks {
        for (m, x) in lanes.iter_mut().zip(c) {
            *m = if *x > *m { *x } else { *m };
        }
    }
    let max = lanes.iter().fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    // No number at all (empty, or only NaN): index 0.
    v.iter().position(|&x| x == max).unwrap_or(0) as u32
}

pub(crate) fn check_rows(src_len: usize, src_off: usize, dst_len: usize, dst_off: usize, len: usize) -> Result<()> {
    let fits = |off: usize, n: usize| off.checked_add(len).is_some_and(|end| end <= n);
    if fits(src_off, src_len) && fits(dst_off, dst_len) {
        Ok(())
    } else {
        Err(crate::error::Error::InvalidArgument(format!(
            "copy_rows of {len} values from {src_off} of {src_len} to {dst_off} of {dst_len}"
        )))
    }
}

/// The `Backend` ops of a GPU backend that are their family's encoder: `encoders! { gpu;
/// family::op(args); ... }` writes `fn op(&self, args) { family::gpu::op(self, args) }` for each
/// (`gpu`: `metal` or `cuda`, the encoder's file in `ops/<family>/`; the encoder takes the trait
/// method's arguments after the device), so an impl is one line per op.
macro_rules! encoders {
    ($gpu:ident; $($family:ident::$op:ident($($arg:ident: $ty:ty),* $(,)?);)*) => {
        $(fn $op(&self, $($arg: $ty),*) { $family::$gpu::$op(self, $($arg),*) })*
    };
}
pub(crate) use encoders;

pub trait Backend: Send + Sized + 'static {
    /// f32 activations, state and scratch.
    type Buf: Send + 'static;
    /// u32 buffers: token ids, expert ids.
    type Ids: Send;
    /// A weight matrix resident on the device (quantized weights stay quantized).
    type Matrix: Send + Sync;
    /// One attention layer's K (or V) cache of one sequence: rows of `width` elements of a
    /// [`KvDtype`], in segments of [`kv_segment_rows`] rows allocated as the sequence grows.
    type Kv: Send;

    fn name(&self) -> &'static str;

    /// Tokens per forward call during prefill unless the caller chooses: scratch memory grows
    /// with it; a larger chunk spreads each expert's weight reads and dequantization over more
    /// tokens.
    fn prefill_chunk(&self) -> usize {
        256
    }

    /// Run one forward call's host work `f` (encoding, waits) where the backend's kernels start
    /// fastest. Default: on the calling thread.
    fn run<R: Send>(f: impl FnOnce() -> R + Send) -> R {
        f()
    }

    // ---- memory ----
    /// A zeroed buffer of `len` f32 values.
    fn alloc(&self, len: usize) -> Result<Self::Buf>;
    fn alloc_ids(&self, len: usize) -> Result<Self::Ids>;
    fn upload(&self, data: &[f32]) -> Result<Self::Buf>;
    fn upload_matrix(&self, m: &Matrix) -> Result<Self::Matrix>;
    fn write_ids(&self, dst: &mut Self::Ids, data: &[u32]) -> Result<()>;
    /// Copy `out.len()` values starting at `offset` back to the host (waits for pending work).
    fn read(&self, src: &Self::Buf, offset: usize, out: &mut [f32]) -> Result<()>;
    fn fill_zero(&self, buf: &mut Self::Buf) -> Result<()>;
    /// The index of the largest of the first `n` values (the lowest index among equal ones; NaN
    /// never wins), after the work encoded so far. A GPU backend computes it on the device so
    /// greedy decoding does not copy the logits to the host; by default it reads them.
    fn argmax(&self, src: &Self::Buf, n: usize) -> Result<u32> {
        self.argmax_at(src, 0, n)
    }
    /// `argmax` of the `n` values from `offset` (one row of a batch's logits); by default they
    /// are read back.
    fn argmax_at(&self, src: &Self::Buf, offset: usize, n: usize) -> Result<u32> {
        let mut v = vec![0f32; n];
        self.read(src, offset, &mut v)?;
        Ok(first_max(&v))
    }
    /// `dst[..len] = src[..len]` (state snapshots).
    fn copy(&self, src: &Self::Buf, dst: &mut Self::Buf, len: usize) -> Result<()>;
    /// The bytes the model's weights, state and KV cache must fit in on this device, and what
    /// that limit is (a GPU's recommended working set); `None`: no limit checked.
    fn memory_limit(&self) -> Option<(u64, &'static str)> {
        None
    }
    /// Bytes of checkpoint weights the backend had to copy (rather than read in place from the
    /// mapped files): memory the model takes on top of the page cache.
    fn copied_weight_bytes(&self) -> u64 {
        0
    }

    /// `dst[dst_off..dst_off + len] = src[src_off..src_off + len]`, in the command stream: a
    /// batched decode moves each sequence's rows of an activation in and out of the batch.
    fn copy_rows(
        &self,
        src: &Self::Buf,
        src_off: usize,
        dst: &mut Self::Buf,
        dst_off: usize,
        len: usize,
    ) -> Result<()> {
        let _ = (src, src_off, dst, dst_off, len);
        Err(crate::error::Error::Unsupported(format!(
            "the {} backend cannot copy activation rows yet (batched decode)",
            self.name()
        )))
    }

    // ---- KV cache memory ----
    /// An empty cache of rows of `width` elements that may grow to `max_rows` rows, in segments
    /// of `seg_rows` rows (a power of two; the engine uses [`kv_segment_rows`]).
    fn kv_new(&self, width: usize, dtype: KvDtype, max_rows: usize, seg_rows: usize) -> Result<Self::Kv>;
    /// Make room for `rows` rows (whole segments; existing rows never move).
    fn kv_reserve(&self, kv: &mut Self::Kv, rows: usize) -> Result<()>;
    /// Free the segments wholly past row `rows` (memory goes back to the system / device).
    fn kv_trim(&self, kv: &mut Self::Kv, rows: usize);
    /// Rows there is room for now (segments held x rows per segment).
    fn kv_rows(&self, kv: &Self::Kv) -> usize;
    /// Bytes the cache holds now: every segment it references, shared ones included (see
    /// [`Backend::kv_segments`] for which are shared).
    fn kv_bytes(&self, kv: &Self::Kv) -> usize;
    /// Rows row0..row0 + out.len() / width of the cache widened to f32 (waits for pending work).
    fn kv_read(&self, kv: &Self::Kv, row0: usize, out: &mut [f32]) -> Result<()>;
    /// Rows 0..rows of `src` into `dst`, bit for bit (same width and dtype; `dst` has room):
    /// forking a sequence, restoring one from a cached prefix (waits for pending work).
    fn kv_copy(&self, src: &Self::Kv, dst: &mut Self::Kv, rows: usize) -> Result<()> {
        let _ = (src, dst, rows);
        Err(crate::error::Error::Unsupported(format!(
            "the {} backend cannot copy KV rows between caches yet (sequence fork / prefix cache)",
            self.name()
        )))
    }

    /// A new cache holding rows 0..rows of `src` (same layout; waits for pending work): every
    /// whole segment below `rows` is shared with `src` (reference-counted, no copy) and the last,
    /// partly filled one is copied. Forking a sequence and keeping a prefix-cache entry cost one
    /// partial segment per cache instead of a full copy; a write into a shared segment must go
    /// through [`Backend::kv_unshare`] first (copy-on-write).
    fn kv_share(&self, src: &Self::Kv, rows: usize) -> Result<Self::Kv> {
        let _ = (src, rows);
        Err(crate::error::Error::Unsupported(format!(
            "the {} backend cannot share KV segments between caches yet (sequence fork / prefix cache)",
            self.name()
        )))
    }
    /// Before rows row0..row0 + rows are written: every segment they touch that another cache
    /// also holds is replaced by a private copy (the other caches keep the original). A no-op,
    /// allocating nothing, when those segments are this cache's alone.
    fn kv_unshare(&self, kv: &mut Self::Kv, row0: usize, rows: usize) -> Result<()> {
        let _ = (kv, row0, rows);
        Ok(())
    }
    /// The segments the cache holds, in order: what accounting of shared memory needs.
    fn kv_segments(&self, kv: &Self::Kv) -> Vec<KvSegment>;

    // ---- command stream ----
    /// Start encoding the work of `kind` (the next command stream opened runs it).
    fn begin(&self, kind: StreamKind) -> Result<()>;
    /// Submit what was encoded since `begin` and wait; device errors surface here.
    fn finish(&self) -> Result<()>;

    // ---- kernels (one op family each: ops/<family>/) ----
    // A kernel's buffers must stay alive until the `finish` of its stream: a backend may launch
    // what it encoded only there (CUDA does; Metal's command buffers retain them).
    /// out[t, :] = dequant(table row ids[t]); out [T, D].
    fn embed(&self, tokens: usize, table: &Self::Matrix, ids: &Self::Ids, out: &mut Self::Buf);
    /// out = x / sqrt(mean(x^2) + eps) * w per row (w already holds 1 + w where the model needs it).
    fn rms_norm(&self, p: &RmsNormParams, x: &Self::Buf, w: &Self::Buf, out: &mut Self::Buf);
    /// out = rms_norm(x, w) * silu(z) per row; x, z, out [rows, dim], w [dim].
    fn rms_norm_gated(&self, p: &RmsNormParams, x: &Self::Buf, z: &Self::Buf, w: &Self::Buf, out: &mut Self::Buf);
    /// x += y over [T, dim].
    fn add(&self, p: &RowsParams, x: &mut Self::Buf, y: &Self::Buf);
    /// x += y, then out = rms_norm(x, w); x, y, out [rows, dim]: a residual add and the norm
    /// after it. A backend may fuse them; by default, `add` then `rms_norm`.
    fn add_rms_norm(&self, p: &RmsNormParams, x: &mut Self::Buf, y: &Self::Buf, w: &Self::Buf, out: &mut Self::Buf) {
        self.add(&rows_of(p), x, y);
        self.rms_norm(p, x, w, out);
    }
    /// x += y + sigmoid(gate[t]) * shared[t, :] (y, shared, gate in `add`), then out =
    /// rms_norm(x, w): the MoE block's end (routed sum y, gated shared expert) folded into the
    /// residual and the next norm. A backend may fuse them; by default, `sigmoid_gate_add`, `add`,
    /// `rms_norm`.
    fn add_gated_rms_norm(
        &self,
        p: &RmsNormParams,
        x: &mut Self::Buf,
        add: &GatedAdd<'_, Self>,
        w: &Self::Buf,
        out: &mut Self::Buf,
    ) {
        self.sigmoid_gate_add(&rows_of(p), add.shared, add.gate, x);
        self.add(&rows_of(p), x, add.y);
        self.rms_norm(p, x, w, out);
    }
    /// The MoE block's end: x += moe_experts(h) + sigmoid(shared_gate[t]) * shared[t, :], then
    /// h = rms_norm(x, norm_w) (h [T, D]: the experts' input, then the next block's norm; `moe`
    /// gives T and K, `norm` the norm's rows T, width D and eps; the read-only operands in `r`;
    /// tmp is `moe_experts`' scratch, mix [T, D] scratch for the routed sum). A backend may fold
    /// the weighted sum of the K expert outputs into the residual norm's pass; by default,
    /// `moe_experts` into mix, then `add_gated_rms_norm`.
    #[allow(clippy::too_many_arguments)]
    fn moe_experts_add_rms_norm(
        &self,
        moe: &MoeParams,
        norm: &RmsNormParams,
        r: &MoeAddNorm<'_, Self>,
        tmp: &mut Self::Buf,
        mix: &mut Self::Buf,
        x: &mut Self::Buf,
        h: &mut Self::Buf,
    ) {
        moe_experts_add_rms_norm_unfused(self, moe, norm, r, tmp, mix, x, h)
    }
    /// The MoE block after its routing: x += moe_experts(h) + sigmoid(shared_logit[t]) *
    /// down_s(silu(gate_s h) * up_s h), then h = rms_norm(x, norm_w) (`moe` gives T and K, `norm`
    /// the norm's rows T, width D and eps; the read-only operands in `r`, the scratch in `s`). A
    /// backend may run the shared expert as one more (token, slot) pair of the routed experts'
    /// kernels; by default, `gate_up_swiglu` and `matmul` of the shared expert, then
    /// `moe_experts_add_rms_norm`.
    fn moe_add_rms_norm(
        &self,
        moe: &MoeParams,
        norm: &RmsNormParams,
        r: &MoeBlock<'_, Self>,
        s: &mut MoeScratch<'_, Self>,
        x: &mut Self::Buf,
        h: &mut Self::Buf,
    ) {
        moe_add_rms_norm_unfused(self, moe, norm, r, s, x, h)
    }
    /// out [T, N] = x[x_row0.., K] W^T with W [N, K] (in-kernel dequantization).
    fn matmul(&self, p: &MatmulParams, w: &Self::Matrix, x: &Self::Buf, out: &mut Self::Buf);
    /// outs[i] = x W_i^T for several matrices reading the same x (a layer's input projections).
    /// A backend may run them as one launch; by default, one `matmul` each.
    fn matmuls(&self, p: &MatmulParams, x: &Self::Buf, ws: &[&Self::Matrix], outs: &mut [&mut Self::Buf]) {
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            self.matmul(p, w, x, out);
        }
    }
    /// q/k RMSNorm + partial RoPE in place: qg [T, H, 2*hd] (q is the first hd of each head), k [T, Hkv, hd].
    fn qk_norm_rope(
        &self,
        p: &RopeParams,
        q_norm: &Self::Buf,
        k_norm: &Self::Buf,
        qg: &mut Self::Buf,
        k: &mut Self::Buf,
    );
    /// cache[pos0 + t, :] = x[t, :] in the cache's dtype; x [T, width]; rows reserved before.
    fn kv_store(&self, p: &KvStoreParams, x: &Self::Buf, cache: &mut Self::Kv);
    /// `qk_norm_rope`, then k and v appended to their caches at pos0 (`kv_store` of each; k may
    /// be left un-normed: only the cache holds the result). A backend may fuse them; by default,
    /// the three ops.
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope_store(
        &self,
        p: &RopeParams,
        q_norm: &Self::Buf,
        k_norm: &Self::Buf,
        qg: &mut Self::Buf,
        k: &mut Self::Buf,
        v: &Self::Buf,
        k_cache: &mut Self::Kv,
        v_cache: &mut Self::Kv,
    ) {
        self.qk_norm_rope(p, q_norm, k_norm, qg, k);
        let store = KvStoreParams {
            tokens: p.tokens,
            pos0: p.pos0,
            width: p.kv_heads * p.head_dim,
        };
        self.kv_store(&store, k, k_cache);
        self.kv_store(&store, v, v_cache);
    }
    /// `qk_norm_rope_store` (`rope`) then `attention` (`p`): a layer's attention core. A backend
    /// may fuse them (CUDA, for one token: one launch); afterwards qg's q halves are either normed
    /// and roped or as they were. By default, the two ops.
    #[allow(clippy::too_many_arguments)]
    fn qk_norm_rope_store_attention(
        &self,
        rope: &RopeParams,
        p: &AttentionParams,
        q_norm: &Self::Buf,
        k_norm: &Self::Buf,
        qg: &mut Self::Buf,
        k: &mut Self::Buf,
        v: &Self::Buf,
        k_cache: &mut Self::Kv,
        v_cache: &mut Self::Kv,
        out: &mut Self::Buf,
    ) {
        self.qk_norm_rope_store(rope, q_norm, k_norm, qg, k, v, k_cache, v_cache);
        self.attention(p, qg, k_cache, v_cache, out);
    }
    /// `qk_norm_rope_store_attention` for a batched decode step: row i of qg [B, H, 2hd], k, v
    /// [B, Hkv hd] is one token of sequence i, at position `seqs[i].pos` in that sequence's caches;
    /// out [B, H hd] gets each row's gated attention (`r.rope` and `r.attn` give the head shapes,
    /// their `tokens` the rows B, their `pos0` is not read). Each row's result is what the
    /// one-sequence op gives it. A backend may run all rows' norms, stores and attention as one
    /// pass per op; by default, each row alone through `one` (rows moved with `copy_rows`).
    fn qk_norm_rope_store_attention_batch(
        &self,
        r: &AttentionBatch<'_, Self>,
        seqs: &mut [KvSeq<'_, Self::Kv>],
        qg: &mut Self::Buf,
        k: &mut Self::Buf,
        one: &mut OneRow<'_, Self>,
        out: &mut Self::Buf,
    ) -> Result<()> {
        qk_norm_rope_store_attention_by_row(self, r, seqs, qg, k, one, out)
    }
    /// out [T, H*hd] = softmax(q K^T * scale, causal) V, times sigmoid(gate) from qg.
    fn attention(
        &self,
        p: &AttentionParams,
        qg: &Self::Buf,
        k_cache: &Self::Kv,
        v_cache: &Self::Kv,
        out: &mut Self::Buf,
    );
    /// out [T, C] = silu(causal depthwise conv of [state; x]); state [taps-1, C] becomes the last rows.
    fn delta_net_conv(&self, p: &ConvParams, w: &Self::Buf, state: &mut Self::Buf, x: &Self::Buf, out: &mut Self::Buf);
    /// Gated DeltaNet over T tokens (l2-norm q/k, gates, delta-rule recurrence); out [T, Hv, Dv].
    /// qkv, a, b, a_log, dt_bias in `x` (`ops::delta_net` gives their shapes).
    fn delta_net(&self, x: &DeltaNetIn<'_, Self::Buf>, state: &mut Self::Buf, out: &mut Self::Buf);
    /// A DeltaNet layer's core from its input projections to its gated output, over T tokens of
    /// one sequence (`r` gives the three ops' params and the read-only operands): mixed =
    /// delta_net_conv(r.proj) (advancing conv_state), core = delta_net(mixed) (advancing state),
    /// out = rms_norm_gated(core, r.z, r.norm_w). mixed [T, C] and core [T, Hv Dv] are scratch
    /// (their contents afterwards are the backend's). A backend may run it as one kernel for a
    /// decode step; by default, the three ops.
    fn delta_net_gated(
        &self,
        r: &DeltaNetGated<'_, Self>,
        conv_state: &mut Self::Buf,
        state: &mut Self::Buf,
        mixed: &mut Self::Buf,
        core: &mut Self::Buf,
        out: &mut Self::Buf,
    ) {
        delta_net_gated_unfused(self, r, conv_state, state, mixed, core, out)
    }
    /// `delta_net_conv` then `delta_net` for a batched decode step: row i of r.proj [B, C], r.a,
    /// r.b [B, Hv] is one token of sequence i, on that sequence's states `seqs[i]`; mixed [B, C]
    /// is scratch, core [B, Hv Dv] gets each row's output (`r.conv` and `r.delta` give the shapes,
    /// their `tokens` the rows B). Each row's result is what the one-sequence ops give it. A
    /// backend may run all rows as one pass per op; by default, each row alone through `one`
    /// (rows moved with `copy_rows`).
    fn delta_net_batch(
        &self,
        r: &DeltaNetOps<'_, Self>,
        seqs: &mut [DeltaNetSeq<'_, Self::Buf>],
        one: &mut OneRow<'_, Self>,
        mixed: &mut Self::Buf,
        core: &mut Self::Buf,
    ) -> Result<()> {
        delta_net_batch_by_row(self, r, seqs, one, mixed, core)
    }
    /// ids/weights [T, K] from router logits [T, E].
    fn moe_route(&self, p: &RouteParams, logits: &Self::Buf, ids: &mut Self::Ids, weights: &mut Self::Buf);
    /// The MoE block's routing from its input x [T, D]: logits [T, E] = x router^T and shared [T]
    /// = x shared_gate^T (the shared expert's gate logit; router [E, D], shared_gate [1, D]), then
    /// `moe_route` of the logits into ids / weights [T, K]. A backend may run it as one kernel
    /// (the logits are then its scratch: their contents afterwards are the backend's); by
    /// default, `matmuls` of the two matrices, then `moe_route`.
    fn moe_router(&self, p: &RouteParams, x: &Self::Buf, r: &Router<'_, Self>, out: &mut Routing<'_, Self>) {
        moe_router_unfused(self, p, x, r, out)
    }
    /// out [T, D] = sum over the K experts each token is routed to of weight times the expert's
    /// FFN of x [T, D]; tmp is scratch of [T*K, I + D].
    fn moe_experts(
        &self,
        p: &MoeParams,
        experts: &MoeExperts<'_, Self>,
        x: &Self::Buf,
        tmp: &mut Self::Buf,
        out: &mut Self::Buf,
    );
    /// out [T, N] = silu(x gate^T) * (x up^T) for gate, up [N, K], x [T, K] (p: T, N): an FFN's
    /// input half, the MoE block's shared expert. A backend may run it as one kernel; by default,
    /// the two matmuls into the scratch g, u [T, N], then `swiglu`.
    fn gate_up_swiglu(
        &self,
        p: &RowsParams,
        w: &GateUp<'_, Self>,
        x: &Self::Buf,
        g: &mut Self::Buf,
        u: &mut Self::Buf,
        out: &mut Self::Buf,
    ) {
        gate_up_swiglu_unfused(self, p, w, x, g, u, out)
    }
    /// out = silu(gate) * up over [T, dim].
    fn swiglu(&self, p: &RowsParams, gate: &Self::Buf, up: &Self::Buf, out: &mut Self::Buf);
    /// out[t, :] += sigmoid(gate[t]) * y[t, :] over [T, dim].
    fn sigmoid_gate_add(&self, p: &RowsParams, y: &Self::Buf, gate: &Self::Buf, out: &mut Self::Buf);
}

/// The rows of a norm as elementwise rows (`add_rms_norm`'s unfused form).
fn rows_of(p: &RmsNormParams) -> RowsParams {
    RowsParams {
        tokens: p.rows,
        dim: p.dim,
    }
}

/// A matmul of the first `tokens` rows of its input (the unfused forms' projections).
fn first_rows(tokens: u32) -> MatmulParams {
    MatmulParams { tokens, x_row0: 0 }
}

/// The matrices of an FFN's input half, `gate_up_swiglu`'s weights: gate, up [N, K].
pub struct GateUp<'a, B: Backend> {
    pub gate: &'a B::Matrix,
    pub up: &'a B::Matrix,
}

/// `gate_up_swiglu` as its parts (the trait's default; a backend's fallback where its fused
/// kernel does not apply).
pub(crate) fn gate_up_swiglu_unfused<B: Backend>(
    b: &B,
    p: &RowsParams,
    w: &GateUp<'_, B>,
    x: &B::Buf,
    g: &mut B::Buf,
    u: &mut B::Buf,
    out: &mut B::Buf,
) {
    b.matmuls(&first_rows(p.tokens), x, &[w.gate, w.up], &mut [g, u]);
    b.swiglu(p, g, u, out);
}

/// The matrices `moe_router` reads: the router [E, D] and the shared expert's gate [1, D].
pub struct Router<'a, B: Backend> {
    pub router: &'a B::Matrix,
    pub shared_gate: &'a B::Matrix,
}

/// What `moe_router` writes: logits [T, E] (the router's), shared [T] (the shared expert's gate
/// logit), and the routing, ids / weights [T, K].
pub struct Routing<'a, B: Backend> {
    pub logits: &'a mut B::Buf,
    pub shared: &'a mut B::Buf,
    pub ids: &'a mut B::Ids,
    pub weights: &'a mut B::Buf,
}

/// `moe_router` as its parts (the trait's default; a backend's fallback where its fused kernel
/// does not apply).
pub(crate) fn moe_router_unfused<B: Backend>(
    b: &B,
    p: &RouteParams,
    x: &B::Buf,
    r: &Router<'_, B>,
    out: &mut Routing<'_, B>,
) {
    let mm = first_rows(p.tokens);
    b.matmuls(
        &mm,
        x,
        &[r.router, r.shared_gate],
        &mut [&mut *out.logits, &mut *out.shared],
    );
    b.moe_route(p, out.logits, out.ids, out.weights);
}

/// The routed experts of a MoE block and the routing that picks them: what `moe_experts` reads
/// besides its input.
pub struct MoeExperts<'a, B: Backend> {
    /// [E, I, D], [E, I, D], [E, D, I].
    pub gate: &'a B::Matrix,
    pub up: &'a B::Matrix,
    pub down: &'a B::Matrix,
    /// [T, K] each: token t's K experts and their weights.
    pub ids: &'a B::Ids,
    pub weights: &'a B::Buf,
}

// By hand: a derive would ask `B: Copy`, while only the references are copied.
impl<B: Backend> Clone for MoeExperts<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend> Copy for MoeExperts<'_, B> {}

impl<'a, B: Backend> MoeExperts<'a, B> {
    /// gate, up, down.
    pub fn matrices(&self) -> [&'a B::Matrix; 3] {
        [self.gate, self.up, self.down]
    }
}

/// What `add_gated_rms_norm` adds to the residual: y + sigmoid(gate[t]) * shared[t, :]; y,
/// shared [rows, dim], gate [rows].
pub struct GatedAdd<'a, B: Backend> {
    pub y: &'a B::Buf,
    pub shared: &'a B::Buf,
    pub gate: &'a B::Buf,
}

/// The read-only operands of `moe_experts_add_rms_norm`: the routed experts as `moe_experts`
/// takes them, the shared expert's output and gate logit as `add_gated_rms_norm` takes them, and
/// the next norm's weight.
pub struct MoeAddNorm<'a, B: Backend> {
    pub experts: MoeExperts<'a, B>,
    /// [T, D] and [T].
    pub shared: &'a B::Buf,
    pub shared_gate: &'a B::Buf,
    /// [D].
    pub norm_w: &'a B::Buf,
}

/// The operands of a DeltaNet layer's conv and recurrence (`delta_net_conv`, then `delta_net`)
/// that they only read: the two ops' params, the layer's weights and the step's projections.
/// `delta_net_batch` reads them (`tokens`: the batch's rows), `delta_net_gated` reads them and
/// its norm's.
pub struct DeltaNetOps<'a, B: Backend> {
    /// T tokens, C channels, taps; T tokens, heads and head dims.
    pub conv: ConvParams,
    pub delta: DeltaNetParams,
    /// [C, taps], [Hv] f32, [Hv].
    pub conv1d: &'a B::Buf,
    pub a_log: &'a B::Buf,
    pub dt_bias: &'a B::Buf,
    /// [T, C] (q | k | v before the conv), [T, Hv], [T, Hv].
    pub proj: &'a B::Buf,
    pub a: &'a B::Buf,
    pub b: &'a B::Buf,
}

impl<B: Backend> DeltaNetOps<'_, B> {
    /// What `delta_net` reads besides its state, the conv's output being `mixed`.
    pub fn input<'s>(&'s self, mixed: &'s B::Buf) -> DeltaNetIn<'s, B::Buf> {
        DeltaNetIn::new(&self.delta, mixed, self.a, self.b, self.a_log, self.dt_bias)
    }
}

/// The operands of `delta_net_gated` that it only reads: its conv's and recurrence's, then its
/// norm's.
pub struct DeltaNetGated<'a, B: Backend> {
    pub ops: DeltaNetOps<'a, B>,
    /// T Hv rows of Dv, eps.
    pub norm: RmsNormParams,
    /// [Dv], [T, Hv Dv].
    pub norm_w: &'a B::Buf,
    pub z: &'a B::Buf,
}

/// `delta_net_gated` as its parts (the trait's default; a backend's fallback where its fused
/// kernel does not apply).
pub(crate) fn delta_net_gated_unfused<B: Backend>(
    b: &B,
    r: &DeltaNetGated<'_, B>,
    conv_state: &mut B::Buf,
    state: &mut B::Buf,
    mixed: &mut B::Buf,
    core: &mut B::Buf,
    out: &mut B::Buf,
) {
    let o = &r.ops;
    b.delta_net_conv(&o.conv, o.conv1d, conv_state, o.proj, mixed);
    b.delta_net(&o.input(mixed), state, core);
    b.rms_norm_gated(&r.norm, core, r.z, r.norm_w, out);
}

/// One sequence's DeltaNet layer state, as `delta_net_batch` updates it: the conv history
/// [taps - 1, C] and the recurrent state [Hv, Dk, Dv].
pub struct DeltaNetSeq<'a, Buf> {
    pub conv: &'a mut Buf,
    pub ssm: &'a mut Buf,
}

/// One sequence's attention layer caches and the position its new row goes to, as
/// `qk_norm_rope_store_attention_batch` reads and appends them.
pub struct KvSeq<'a, Kv> {
    pub k: &'a mut Kv,
    pub v: &'a mut Kv,
    pub pos: usize,
}

/// One row of activations: where the batched mixer ops' defaults run a batch's sequences one at a
/// time through the one-sequence ops. proj [max(C, H 2hd)], a, b [Hv], k, v [Hkv hd], mixed [C],
/// core [max(Hv Dv, H hd)].
pub struct OneRow<'a, B: Backend> {
    pub proj: &'a mut B::Buf,
    pub a: &'a mut B::Buf,
    pub b: &'a mut B::Buf,
    pub k: &'a mut B::Buf,
    pub v: &'a mut B::Buf,
    pub mixed: &'a mut B::Buf,
    pub core: &'a mut B::Buf,
}

/// `delta_net_batch` one row at a time (the trait's default, and the reference backend's).
pub(crate) fn delta_net_batch_by_row<B: Backend>(
    b: &B,
    r: &DeltaNetOps<'_, B>,
    seqs: &mut [DeltaNetSeq<'_, B::Buf>],
    one: &mut OneRow<'_, B>,
    _mixed: &mut B::Buf,
    core: &mut B::Buf,
) -> Result<()> {
    let (c, hv) = (r.conv.channels as usize, r.delta.value_heads as usize);
    let width = hv * r.delta.value_dim as usize;
    let conv = ConvParams { tokens: 1, ..r.conv };
    let delta = DeltaNetParams { tokens: 1, ..r.delta };
    for (i, sq) in seqs.iter_mut().enumerate() {
        b.copy_rows(r.proj, i * c, one.proj, 0, c)?;
        b.copy_rows(r.a, i * hv, one.a, 0, hv)?;
        b.copy_rows(r.b, i * hv, one.b, 0, hv)?;
        b.delta_net_conv(&conv, r.conv1d, sq.conv, one.proj, one.mixed);
        let x = DeltaNetIn::new(&delta, one.mixed, one.a, one.b, r.a_log, r.dt_bias);
        b.delta_net(&x, sq.ssm, one.core);
        b.copy_rows(one.core, 0, core, i * width, width)?;
    }
    Ok(())
}

/// The operands of `qk_norm_rope_store_attention_batch` that it only reads: the ops' params
/// (`tokens`: the batch's rows; `pos0` unused), the norms' weights [hd], v [B, Hkv hd].
pub struct AttentionBatch<'a, B: Backend> {
    pub rope: RopeParams,
    pub attn: AttentionParams,
    pub q_norm: &'a B::Buf,
    pub k_norm: &'a B::Buf,
    pub v: &'a B::Buf,
}

/// `qk_norm_rope_store_attention_batch` one row at a time (the trait's default, and the reference
/// backend's).
pub(crate) fn qk_norm_rope_store_attention_by_row<B: Backend>(
    b: &B,
    r: &AttentionBatch<'_, B>,
    seqs: &mut [KvSeq<'_, B::Kv>],
    qg: &mut B::Buf,
    k: &mut B::Buf,
    one: &mut OneRow<'_, B>,
    out: &mut B::Buf,
) -> Result<()> {
    let (h, hd) = (r.rope.heads as usize, r.rope.head_dim as usize);
    let (qw, kw, ow) = (h * 2 * hd, r.rope.kv_heads as usize * hd, h * hd);
    for (i, sq) in seqs.iter_mut().enumerate() {
        b.copy_rows(qg, i * qw, one.proj, 0, qw)?;
        b.copy_rows(k, i * kw, one.k, 0, kw)?;
        b.copy_rows(r.v, i * kw, one.v, 0, kw)?;
        let pos0 = sq.pos as u32;
        let rope = RopeParams {
            tokens: 1,
            pos0,
            ..r.rope
        };
        let attn = AttentionParams {
            tokens: 1,
            pos0,
            ..r.attn
        };
        b.qk_norm_rope_store_attention(
            &rope, &attn, r.q_norm, r.k_norm, one.proj, one.k, one.v, sq.k, sq.v, one.core,
        );
        b.copy_rows(one.core, 0, out, i * ow, ow)?;
    }
    Ok(())
}

/// The read-only operands of `moe_add_rms_norm`: the routed experts and their routing, the shared
/// expert and its gate logit, the next norm's weight.
pub struct MoeBlock<'a, B: Backend> {
    pub experts: MoeExperts<'a, B>,
    /// The shared expert: [Is, D], [Is, D], [D, Is] (Is = `shared_inter`).
    pub shared_gate: &'a B::Matrix,
    pub shared_up: &'a B::Matrix,
    pub shared_down: &'a B::Matrix,
    pub shared_inter: u32,
    /// [T]: the shared expert's gate logit (`moe_router`'s `shared`).
    pub shared_logit: &'a B::Buf,
    /// [D].
    pub norm_w: &'a B::Buf,
}

impl<'a, B: Backend> MoeBlock<'a, B> {
    /// The operands of `moe_experts_add_rms_norm` for this block, the shared expert's output in
    /// `shared` [T, D].
    pub fn end<'s>(&'s self, shared: &'s B::Buf) -> MoeAddNorm<'s, B> {
        MoeAddNorm {
            experts: self.experts,
            shared,
            shared_gate: self.shared_logit,
            norm_w: self.norm_w,
        }
    }
}

/// The scratch of `moe_add_rms_norm`: tmp [T*(K+1), I + D] (`moe_experts`' scratch, room for the
/// shared expert as one more pair), mix [T, D]; the shared expert's g, u, act [T, Is] and y [T, D]
/// (its parts).
pub struct MoeScratch<'a, B: Backend> {
    pub tmp: &'a mut B::Buf,
    pub mix: &'a mut B::Buf,
    pub g: &'a mut B::Buf,
    pub u: &'a mut B::Buf,
    pub act: &'a mut B::Buf,
    pub y: &'a mut B::Buf,
}

/// `moe_add_rms_norm` as its parts (the trait's default; a backend's fallback where its fused
/// kernels do not apply): the shared expert's `gate_up_swiglu` and down `matmul`, then
/// `moe_experts_add_rms_norm`.
pub(crate) fn moe_add_rms_norm_unfused<B: Backend>(
    b: &B,
    moe: &MoeParams,
    norm: &RmsNormParams,
    r: &MoeBlock<'_, B>,
    s: &mut MoeScratch<'_, B>,
    x: &mut B::Buf,
    h: &mut B::Buf,
) {
    let shared = RowsParams {
        tokens: moe.tokens,
        dim: r.shared_inter,
    };
    let w = GateUp {
        gate: r.shared_gate,
        up: r.shared_up,
    };
    b.gate_up_swiglu(&shared, &w, h, s.g, s.u, s.act);
    b.matmul(&first_rows(moe.tokens), r.shared_down, s.act, s.y);
    b.moe_experts_add_rms_norm(moe, norm, &r.end(s.y), s.tmp, s.mix, x, h);
}

/// `moe_experts_add_rms_norm` as its parts (the trait's default; a backend's fallback where its
/// fused kernel does not apply).
#[allow(clippy::too_many_arguments)]
pub(crate) fn moe_experts_add_rms_norm_unfused<B: Backend>(
    b: &B,
    moe: &MoeParams,
    norm: &RmsNormParams,
    r: &MoeAddNorm<'_, B>,
    tmp: &mut B::Buf,
    mix: &mut B::Buf,
    x: &mut B::Buf,
    h: &mut B::Buf,
) {
    b.moe_experts(moe, &r.experts, h, tmp, mix);
    let add = GatedAdd {
        y: mix,
        shared: r.shared,
        gate: r.shared_gate,
    };
    b.add_gated_rms_norm(norm, x, &add, r.norm_w, h);
}

#[cfg(test)]
mod tests {
    use super::first_max;

    #[test]
    fn first_max_is_the_lowest_index_of_the_largest_and_nan_never_wins() {
        // What it must equal: one pass keeping the first strictly larger value, NaN losing.
        let reference = |v: &[f32]| {
            let mut best = 0;
            for (i, x) in v.iter().enumerate() {
                if *x > v[best] || v[best].is_nan() && !x.is_nan() {
                    best = i;
                }
            }
            best as u32
        };
        let mut seed = 7u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) as u32
        };
        let specials = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY, 0.0, -0.0, 1.0];
        for n in [0usize, 1, 2, 15, 16, 17, 33, 1000] {
            for _ in 0..200 {
                let v: Vec<f32> = (0..n)
                    .map(|_| match next() % 8 {
                        0 => specials[next() as usize % specials.len()],
                        // Few distinct values, so ties are common.
                        _ => (next() % 5) as f32 - 2.0,
                    })
                    .collect();
                assert_eq!(first_max(&v), reference(&v), "{v:?}");
            }
        }
        assert_eq!(first_max(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(first_max(&[f32::NAN, f32::NEG_INFINITY, f32::NEG_INFINITY]), 1);
        assert_eq!(first_max(&[-0.0, 0.0, 1.0, 1.0]), 2);
    }
}
