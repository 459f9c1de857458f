//! The Metal backend, generic over an [`Executor`]: the real device (`device.rs`, Apple targets)
//! or the simulator ([`sim::Sim`], which runs the same shaders on the CPU, so the whole command
//! stream is tested on Linux). The encoding of each op (which kernel, which bindings, grid and
//! threadgroup sizes, scratch) is written once, in its family's `ops/<family>/metal.rs`; this
//! folder holds what they share: the command stream (`stream.rs`), buffers and weight matrices
//! (`buffers.rs`), the kernel table and the embedded shaders (`kernels.rs`), parameter bytes
//! (`args.rs`), the executors, and the `Backend` impl below (one line per op).
//!
//! Activations, state and scratch are f32 buffers; weights stay in their checkpoint format
//! (f32/f16/bf16, MLX affine 2/4/8-bit) and are dequantized inside the kernels. Kernels are
//! encoded into one command stream that is committed at `finish` (or before a CPU read), so a
//! decode step makes no CPU round-trip. Argument errors found while encoding (shapes a kernel
//! does not support) are kept and returned by `finish`.
//!
//! GPU families: the executor reports the Apple GPU family (Apple7 = M1 .. Apple10 = M5) and
//! [`kernels::Variants::for_family`], the one table of kernel variants, picks the tiling of the
//! decode GEMVs and prefill GEMMs for it ([`Metal::variants`], public so tests can run every
//! variant). Pipelines are built for what the checkpoint needs: the kernels that read no weights
//! at construction, those of a weight format (in the chosen variants) when the first matrix of
//! that format is uploaded, so a model loads with the pipelines of its formats only (a 4-bit
//! MLX checkpoint: q4 and q8 with bf16 scales, 2 of the 12 formats) and a pipeline that cannot
//! be built fails the load, not a later forward pass; any other kernel on first use.
//!
//! Encoding allocates nothing once warm (the house rule: weights, state and scratch are
//! allocated once; the decode loop does not allocate): every kernel is a [`Kernel`], a place in
//! a table of host names and pipelines made at construction; parameter structs are bound as
//! inline [`ParamBytes`]; scratch is grown, never per step (the attention split partials are
//! sized for the whole KV cache the first time a step splits). `tests/metal_alloc.rs` checks it
//! with a counting allocator over warm decode steps and prefill chunks.

pub mod args;
pub mod buffers;
#[cfg(target_os = "macos")]
pub mod device;
pub mod executor;
pub mod kernels;
#[cfg(unix)]
pub mod sim;
pub mod stream;
#[cfg(unix)]
mod traffic;

use std::sync::{
    atomic::{AtomicU16, AtomicU64, Ordering},
    Mutex, OnceLock,
};

pub use buffers::{MetalBuf, MetalKv, MetalMatrix};
pub use executor::{Arg, DeviceInfo, Executor, GpuFamily, Grid, ParamBytes, Placed, StreamLabel};
pub use kernels::{Fixed, GemmOp, GemmTile, GemvOp, GemvRows, Kernel, Variants, Weight, WeightOp};
use stream::Stream;

use super::{
    check_rows, encoders, params::*, Backend, DeltaNetGated, DeltaNetIn, GateUp, GatedAdd, KvDtype, KvSegment,
    MoeAddNorm, MoeBlock, MoeExperts, MoeScratch, Router, Routing, StreamKind,
};
use crate::{
    error::{Error, Result},
    ops::{attention, delta_net, elementwise, embed, matmul, moe, norm},
    quant::Matrix,
};

/// A pipeline, built on first use; the error message if it cannot be.
type LazyPipeline<P> = OnceLock<std::result::Result<P, String>>;

pub struct Metal<X: Executor> {
    x: X,
    /// Every kernel, by `Kernel::index`: its host name and its pipeline. Made at construction,
    /// so a dispatch finds both without building a string (encoding allocates nothing).
    kernels: Box<[(String, LazyPipeline<X::Pipeline>)]>,
    /// The GPU family reported by the executor.
    family: GpuFamily,
    /// The kernel variants dispatched: `Variants::for_family(family)` unless changed (tests).
    pub variants: Variants,
    stream: Mutex<Stream<X>>,
    /// Bound in place of the scales and biases of dense weights.
    dummy: X::Buffer,
    /// The weight formats whose pipelines are built (a bit per `Weight`).
    formats: AtomicU16,
    /// Bytes of weight tensors that could not be wrapped in place and were copied.
    copied: AtomicU64,
    /// Single-token attention over more cache rows than this uses the split layout, this many
    /// rows per split (default `ATTENTION_SPLIT_ROWS`; `LILY_METAL_SPLIT_ROWS` overrides it).
    pub split_rows: u32,
    /// At most this many splits per KV head: longer contexts get longer splits (default
    /// `ATTENTION_MAX_SPLITS`; tests lower it to reach that case).
    pub max_splits: u32,
    /// `moe_experts` over more tokens than this runs the expert-sorted GEMM path (histogram,
    /// scan, scatter, block map and expert GEMMs, all on the GPU); otherwise the per-token
    /// kernels (decode). Default 8; `LILY_METAL_MOE_GEMM_TOKENS` overrides it.
    pub moe_gemm_tokens: u32,
    /// Estimated GPU seconds (on the slowest supported GPU) after which the command stream is
    /// committed in a new piece ([`stream::PIECE_SECONDS`]; stream.rs says why).
    pub piece_seconds: f64,
    /// `delta_net` over at least this many tokens runs the chunked prefill kernels
    /// (`delta_net_chunk_prep` + `delta_net_chunk`); fewer run the step recurrence
    /// (`delta_net`). Default one chunk (32); `LILY_METAL_DELTA_CHUNK_TOKENS` overrides it.
    pub delta_net_chunk_tokens: u32,
    /// `delta_net_gated` as one dispatch for a decode step (default; `LILY_METAL_FUSED_DELTA_NET=0`:
    /// its parts, to compare on a Mac).
    pub fused_delta_net: bool,
}

#[cfg(unix)]
impl Metal<sim::Sim> {
    /// The simulated device (Linux CI): needs clang-19. GPU family: `LILY_METAL_FAMILY`, else
    /// the newest.
    pub fn sim() -> Result<Self> {
        Metal::new(sim::Sim::new()?)
    }

    /// The simulated device reporting GPU family `family` (its kernel variants).
    pub fn sim_family(family: GpuFamily) -> Result<Self> {
        Metal::new(sim::Sim::with_family(family)?)
    }
}

#[cfg(target_os = "macos")]
impl Metal<device::Device> {
    /// The real Metal device (Apple silicon, GPU family Apple7+): shaders compiled, the pipelines
    /// of the kernels that read no weights built.
    pub fn device() -> Result<Self> {
        Self::device_with_progress(&mut |_, _| Ok(()))
    }

    /// [`Metal::device`], calling `progress(done, total)` as the shader files compile.
    pub fn device_with_progress(progress: &mut dyn FnMut(usize, usize) -> Result<()>) -> Result<Self> {
        Metal::new(device::Device::new(progress)?)
    }
}

/// The Metal GPU this machine would run Lily on ([`DeviceInfo`]), or why there is none (not
/// macOS; no Metal device; only devices below GPU family Apple7, such as a virtual machine's
/// paravirtual GPU). Builds nothing.
pub fn probe() -> std::result::Result<DeviceInfo, String> {
    #[cfg(target_os = "macos")]
    {
        device::probe()
    }
    #[cfg(not(target_os = "macos"))]
    {
        Err(format!(
            "no Metal on {}: the Metal backend runs on macOS on Apple silicon",
            std::env::consts::OS
        ))
    }
}

/// What the memory limit of a Metal backend is, in the engine's and `lily info`'s messages.
pub const WORKING_SET: &str = "the GPU's recommendedMaxWorkingSetSize";

/// Tokens per prefill forward call unless the caller chooses.
pub const PREFILL_CHUNK: usize = 256;

/// The working set the simulator reports (`LILY_METAL_SIM_WORKING_SET`, bytes; `None`: no
/// limit): tests play a small GPU with it.
pub fn sim_working_set() -> Result<Option<u64>> {
    env_number("LILY_METAL_SIM_WORKING_SET")
}

/// A whole number from environment variable `var`; `None` when unset or empty.
pub(crate) fn env_number(var: &str) -> Result<Option<u64>> {
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => v
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| Error::InvalidArgument(format!("{var} must be a whole number, found {v:?}"))),
        _ => Ok(None),
    }
}

/// `a / b` rounded up, as a grid dimension.
pub(crate) fn ceil_div(a: usize, b: usize) -> u32 {
    a.div_ceil(b) as u32
}

impl<X: Executor> Metal<X> {
    /// The backend on executor `x`, with the pipelines of the kernels that read no weights built
    /// (those of a weight format are built when its first matrix is uploaded).
    pub fn new(x: X) -> Result<Self> {
        let kernels = Kernel::all().map(|k| (k.name(), OnceLock::new())).collect();
        let family = x.family();
        let variants = Variants::for_family(family);
        let dummy = x.new_buffer(16)?;
        // LILY_METAL_SPLIT_ROWS lowers the split threshold so tests reach the split layout.
        let split_rows = std::env::var("LILY_METAL_SPLIT_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&v| v > 0)
            .unwrap_or(ATTENTION_SPLIT_ROWS as u32);
        let moe_gemm_tokens = std::env::var("LILY_METAL_MOE_GEMM_TOKENS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(8);
        let delta_net_chunk_tokens = std::env::var("LILY_METAL_DELTA_CHUNK_TOKENS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&v| v > 0)
            .unwrap_or(DELTA_NET_CHUNK as u32);
        let fused_delta_net = std::env::var("LILY_METAL_FUSED_DELTA_NET").map_or(true, |v| v != "0");
        let m = Metal {
            x,
            kernels,
            family,
            variants,
            stream: Mutex::new(Stream::new()),
            dummy,
            formats: AtomicU16::new(0),
            copied: AtomicU64::new(0),
            split_rows,
            max_splits: ATTENTION_MAX_SPLITS as u32,
            moe_gemm_tokens,
            piece_seconds: stream::PIECE_SECONDS,
            delta_net_chunk_tokens,
            fused_delta_net,
        };
        for &f in Fixed::ALL {
            m.pipeline(f.into())?;
        }
        Ok(m)
    }

    /// Build the pipelines of the kernels that read weights of format `w`, in this backend's
    /// variants (once per format).
    pub(super) fn prepare_format(&self, w: Weight) -> Result<()> {
        let bit = 1u16 << w.index();
        if self.formats.load(Ordering::Acquire) & bit != 0 {
            return Ok(());
        }
        for k in self.variants.kernels_for(w) {
            self.pipeline(k)?;
        }
        self.formats.fetch_or(bit, Ordering::AcqRel);
        Ok(())
    }

    /// Count `bytes` of weights copied because they could not be wrapped in place.
    pub(super) fn count_copy(&self, bytes: usize) {
        self.copied.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub fn executor(&self) -> &X {
        &self.x
    }

    /// The GPU family the executor reports (whose variants `Metal::new` chose).
    pub fn family(&self) -> GpuFamily {
        self.family
    }

    /// The device, its GPU family and the kernel variants in use, in words.
    pub fn describe(&self) -> String {
        format!(
            "{}; kernel variants: GEMV {} rows per simdgroup, GEMM tiles of {MMA_TILE} x {}",
            self.x.describe(),
            self.variants.gemv.rows(),
            self.variants.gemm.rows()
        )
    }

    /// The host name and the pipeline of kernel `k`, the pipeline built on first use.
    fn pipeline(&self, k: Kernel) -> Result<(&str, &X::Pipeline)> {
        let (name, cell) = &self.kernels[k.index()];
        let p = cell
            .get_or_init(|| {
                self.x.pipeline(name).map_err(|e| match e {
                    Error::Device(m) => m,
                    e => e.to_string(),
                })
            })
            .as_ref()
            .map_err(|m| Error::Device(m.clone()))?;
        Ok((name, p))
    }

    /// Build the pipeline of every kernel and every variant (tests: every host name exists).
    pub fn build_all_pipelines(&self) -> Result<()> {
        for k in Kernel::all() {
            self.pipeline(k)?;
        }
        Ok(())
    }
}

/// One thread per element of [tokens, dim]: threadgroups of 64 along dim.
pub(crate) fn rows_grid(dim: usize, tokens: usize) -> Grid {
    Grid::Threads {
        threads: [dim as u32, tokens as u32, 1],
        size: [64, 1, 1],
    }
}

/// Threads of a threadgroup that reduces one row of `dim` values: dim rounded up to whole
/// simdgroups, 32 to 256.
pub(crate) fn norm_threads(dim: usize) -> u32 {
    (dim.div_ceil(32) * 32).clamp(32, 256) as u32
}

impl<X: Executor> Backend for Metal<X> {
    type Buf = MetalBuf<X>;
    type Ids = MetalBuf<X>;
    type Matrix = MetalMatrix<X>;
    type Kv = MetalKv<X>;

    fn name(&self) -> &'static str {
        X::NAME
    }

    fn kv_new(&self, width: usize, dtype: KvDtype, max_rows: usize, seg_rows: usize) -> Result<MetalKv<X>> {
        Metal::kv_new(self, width, dtype, max_rows, seg_rows)
    }
    fn kv_reserve(&self, kv: &mut MetalKv<X>, rows: usize) -> Result<()> {
        Metal::kv_reserve(self, kv, rows)
    }
    fn kv_trim(&self, kv: &mut MetalKv<X>, rows: usize) {
        Metal::kv_trim(self, kv, rows)
    }
    fn kv_rows(&self, kv: &MetalKv<X>) -> usize {
        kv.rows()
    }
    fn kv_bytes(&self, kv: &MetalKv<X>) -> usize {
        kv.bytes()
    }
    fn kv_read(&self, kv: &MetalKv<X>, row0: usize, out: &mut [f32]) -> Result<()> {
        Metal::kv_read(self, kv, row0, out)
    }
    fn kv_copy(&self, src: &MetalKv<X>, dst: &mut MetalKv<X>, rows: usize) -> Result<()> {
        Metal::kv_copy(self, src, dst, rows)
    }
    fn kv_share(&self, src: &MetalKv<X>, rows: usize) -> Result<MetalKv<X>> {
        Metal::kv_share(self, src, rows)
    }
    fn kv_unshare(&self, kv: &mut MetalKv<X>, row0: usize, rows: usize) -> Result<()> {
        Metal::kv_unshare(self, kv, row0, rows)
    }
    fn kv_segments(&self, kv: &MetalKv<X>) -> Vec<KvSegment> {
        Metal::kv_segments(self, kv)
    }
    fn alloc(&self, len: usize) -> Result<MetalBuf<X>> {
        self.new_buf(len)
    }
    fn alloc_ids(&self, len: usize) -> Result<MetalBuf<X>> {
        self.new_buf(len)
    }
    fn upload(&self, data: &[f32]) -> Result<MetalBuf<X>> {
        self.upload_f32(data)
    }
    fn upload_matrix(&self, m: &Matrix) -> Result<MetalMatrix<X>> {
        let mm = self.matrix(m)?;
        self.prepare_format(mm.weight)?;
        Ok(mm)
    }
    fn prefill_chunk(&self) -> usize {
        PREFILL_CHUNK
    }
    fn memory_limit(&self) -> Option<(u64, &'static str)> {
        self.x.working_set().map(|b| (b, WORKING_SET))
    }
    fn copied_weight_bytes(&self) -> u64 {
        self.copied.load(Ordering::Relaxed)
    }
    fn write_ids(&self, dst: &mut MetalBuf<X>, data: &[u32]) -> Result<()> {
        if data.len() > dst.len() {
            return Err(Error::InvalidArgument(format!(
                "{} ids into a buffer of {}",
                data.len(),
                dst.len()
            )));
        }
        self.flush()?;
        // SAFETY: in bounds (checked above); no GPU work is pending after flush.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr() as *const u8, self.x.contents(&dst.buf), data.len() * 4) };
        Ok(())
    }
    fn read(&self, src: &MetalBuf<X>, offset: usize, out: &mut [f32]) -> Result<()> {
        if offset + out.len() > src.len() {
            return Err(Error::InvalidArgument(format!(
                "read of {} values at {offset} from a buffer of {}",
                out.len(),
                src.len()
            )));
        }
        self.flush()?;
        // SAFETY: in bounds (checked above); no GPU work is pending after flush.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.x.contents(&src.buf).add(offset * 4),
                out.as_mut_ptr() as *mut u8,
                out.len() * 4,
            )
        };
        Ok(())
    }
    fn fill_zero(&self, buf: &mut MetalBuf<X>) -> Result<()> {
        self.flush()?;
        // SAFETY: the buffer holds len * 4 bytes; no GPU work is pending after flush.
        unsafe { std::ptr::write_bytes(self.x.contents(&buf.buf), 0, buf.len() * 4) };
        Ok(())
    }
    fn copy(&self, src: &MetalBuf<X>, dst: &mut MetalBuf<X>, len: usize) -> Result<()> {
        if len > src.len() || len > dst.len() {
            return Err(Error::InvalidArgument(format!(
                "copy of {len} values between buffers of {} and {}",
                src.len(),
                dst.len()
            )));
        }
        self.flush()?;
        // SAFETY: in bounds (checked above); distinct buffers (&/&mut); no GPU work pending.
        unsafe { std::ptr::copy_nonoverlapping(self.x.contents(&src.buf), self.x.contents(&dst.buf), len * 4) };
        Ok(())
    }
    /// A copy kernel in the command stream (a batched decode step moves rows per sequence and layer).
    fn copy_rows(
        &self,
        src: &MetalBuf<X>,
        src_off: usize,
        dst: &mut MetalBuf<X>,
        dst_off: usize,
        len: usize,
    ) -> Result<()> {
        check_rows(src.len(), src_off, dst.len(), dst_off, len)?;
        if len > u32::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "copy_rows of {len} values: more than a grid row"
            )));
        }
        if len > 0 {
            elementwise::metal::copy_rows(self, src, src_off, dst, dst_off, len);
        }
        Ok(())
    }
    fn begin(&self, kind: StreamKind) -> Result<()> {
        self.label_next(kind);
        Ok(())
    }
    fn finish(&self) -> Result<()> {
        let done = self.flush();
        self.label_next(StreamKind::Other); // what `begin` announced is over
        done
    }

    // Each op is its family's encoder, which takes the trait method's arguments after the device.
    encoders! { metal;
        embed::embed(tokens: usize, table: &MetalMatrix<X>, ids: &MetalBuf<X>, out: &mut MetalBuf<X>);
        norm::rms_norm(p: &RmsNormParams, x: &MetalBuf<X>, w: &MetalBuf<X>, out: &mut MetalBuf<X>);
        norm::rms_norm_gated(p: &RmsNormParams, x: &MetalBuf<X>, z: &MetalBuf<X>, w: &MetalBuf<X>, out: &mut MetalBuf<X>);
        elementwise::add(p: &RowsParams, x: &mut MetalBuf<X>, y: &MetalBuf<X>);
        norm::add_rms_norm(p: &RmsNormParams, x: &mut MetalBuf<X>, y: &MetalBuf<X>, w: &MetalBuf<X>, out: &mut MetalBuf<X>);
        norm::add_gated_rms_norm(p: &RmsNormParams, x: &mut MetalBuf<X>, add: &GatedAdd<'_, Self>, w: &MetalBuf<X>, out: &mut MetalBuf<X>);
        norm::moe_experts_add_rms_norm(moe: &MoeParams, norm: &RmsNormParams, r: &MoeAddNorm<'_, Self>, tmp: &mut MetalBuf<X>, mix: &mut MetalBuf<X>, x: &mut MetalBuf<X>, h: &mut MetalBuf<X>);
        moe::moe_add_rms_norm(moe: &MoeParams, norm: &RmsNormParams, r: &MoeBlock<'_, Self>, s: &mut MoeScratch<'_, Self>, x: &mut MetalBuf<X>, h: &mut MetalBuf<X>);
        matmul::matmul(p: &MatmulParams, w: &MetalMatrix<X>, x: &MetalBuf<X>, out: &mut MetalBuf<X>);
        attention::qk_norm_rope(p: &RopeParams, q_norm: &MetalBuf<X>, k_norm: &MetalBuf<X>, qg: &mut MetalBuf<X>, k: &mut MetalBuf<X>);
        attention::kv_store(p: &KvStoreParams, x: &MetalBuf<X>, cache: &mut MetalKv<X>);
        attention::attention(p: &AttentionParams, qg: &MetalBuf<X>, k_cache: &MetalKv<X>, v_cache: &MetalKv<X>, out: &mut MetalBuf<X>);
        delta_net::delta_net_conv(p: &ConvParams, w: &MetalBuf<X>, state: &mut MetalBuf<X>, x: &MetalBuf<X>, out: &mut MetalBuf<X>);
        delta_net::delta_net(x: &DeltaNetIn<'_, MetalBuf<X>>, state: &mut MetalBuf<X>, out: &mut MetalBuf<X>);
        delta_net::delta_net_gated(r: &DeltaNetGated<'_, Self>, conv_state: &mut MetalBuf<X>, state: &mut MetalBuf<X>, mixed: &mut MetalBuf<X>, core: &mut MetalBuf<X>, out: &mut MetalBuf<X>);
        moe::moe_route(p: &RouteParams, logits: &MetalBuf<X>, ids: &mut MetalBuf<X>, weights: &mut MetalBuf<X>);
        moe::moe_experts(p: &MoeParams, e: &MoeExperts<'_, Self>, x: &MetalBuf<X>, tmp: &mut MetalBuf<X>, out: &mut MetalBuf<X>);
        moe::moe_router(p: &RouteParams, x: &MetalBuf<X>, r: &Router<'_, Self>, out: &mut Routing<'_, Self>);
        moe::gate_up_swiglu(p: &RowsParams, w: &GateUp<'_, Self>, x: &MetalBuf<X>, g: &mut MetalBuf<X>, u: &mut MetalBuf<X>, out: &mut MetalBuf<X>);
        elementwise::swiglu(p: &RowsParams, gate: &MetalBuf<X>, up: &MetalBuf<X>, out: &mut MetalBuf<X>);
        elementwise::sigmoid_gate_add(p: &RowsParams, y: &MetalBuf<X>, gate: &MetalBuf<X>, out: &mut MetalBuf<X>);
    }

    fn qk_norm_rope_store(
        &self,
        p: &RopeParams,
        q_norm: &MetalBuf<X>,
        k_norm: &MetalBuf<X>,
        qg: &mut MetalBuf<X>,
        k: &mut MetalBuf<X>,
        v: &MetalBuf<X>,
        k_cache: &mut MetalKv<X>,
        v_cache: &mut MetalKv<X>,
    ) {
        attention::metal::qk_norm_rope_store(self, p, q_norm, k_norm, qg, k, v, [k_cache, v_cache])
    }
}
