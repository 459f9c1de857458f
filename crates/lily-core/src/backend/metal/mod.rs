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
//! variant). Pipelines of the common kernels and of the chosen variants are built at
//! construction; the other variants on first use.
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
pub(crate) mod stream;

use std::sync::{Mutex, OnceLock};

pub use buffers::{MetalBuf, MetalKv, MetalMatrix};
pub use executor::{Arg, Executor, GpuFamily, Grid, ParamBytes, StreamLabel};
pub use kernels::{Fixed, GemmOp, GemmTile, GemvOp, GemvRows, Kernel, Variants, Weight, WeightOp};
use stream::Stream;

use super::{check_rows, params::*, Backend, KvDtype, StreamKind};
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
    /// Single-token attention over more cache rows than this uses the split layout
    /// (default 256; `LILY_METAL_SPLIT_ROWS` overrides it).
    pub split_rows: u32,
    /// `moe_experts` over more tokens than this runs the expert-sorted GEMM path (histogram,
    /// scan, scatter, block map and expert GEMMs, all on the GPU); otherwise the per-token
    /// kernels (decode). Default 8; `LILY_METAL_MOE_GEMM_TOKENS` overrides it.
    pub moe_gemm_tokens: u32,
    /// `delta_net` over at least this many tokens runs the chunked prefill kernels
    /// (`delta_net_chunk_prep` + `delta_net_chunk`); fewer run the step recurrence
    /// (`delta_net`). Default one chunk (32); `LILY_METAL_DELTA_CHUNK_TOKENS` overrides it.
    pub delta_net_chunk_tokens: u32,
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
    /// The real Metal device (Apple silicon, GPU family Apple7+); every pipeline built here.
    pub fn device() -> Result<Self> {
        Metal::new(device::Device::new()?)
    }
}

/// `a / b` rounded up, as a grid dimension.
pub(crate) fn ceil_div(a: usize, b: usize) -> u32 {
    a.div_ceil(b) as u32
}

impl<X: Executor> Metal<X> {
    /// Build the pipelines of every kernel this device dispatches (the common kernels and the
    /// variants of its GPU family) up front, so a missing kernel fails here.
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
            .unwrap_or(256);
        let moe_gemm_tokens = std::env::var("LILY_METAL_MOE_GEMM_TOKENS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(8);
        let delta_net_chunk_tokens = std::env::var("LILY_METAL_DELTA_CHUNK_TOKENS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&v| v > 0)
            .unwrap_or(DELTA_NET_CHUNK as u32);
        let m = Metal {
            x,
            kernels,
            family,
            variants,
            stream: Mutex::new(Stream::new()),
            dummy,
            split_rows,
            moe_gemm_tokens,
            delta_net_chunk_tokens,
        };
        for k in kernels::common_kernels().chain(variants.kernels()) {
            m.pipeline(k)?;
        }
        Ok(m)
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
        self.matrix(m)
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

    fn embed(&self, tokens: usize, table: &MetalMatrix<X>, ids: &MetalBuf<X>, out: &mut MetalBuf<X>) {
        embed::metal::embed(self, tokens, table, ids, out)
    }

    fn rms_norm(&self, p: &RmsNormParams, x: &MetalBuf<X>, w: &MetalBuf<X>, out: &mut MetalBuf<X>) {
        norm::metal::rms_norm(self, p, x, w, out)
    }

    fn rms_norm_gated(
        &self,
        p: &RmsNormParams,
        x: &MetalBuf<X>,
        z: &MetalBuf<X>,
        w: &MetalBuf<X>,
        out: &mut MetalBuf<X>,
    ) {
        norm::metal::rms_norm_gated(self, p, x, z, w, out)
    }

    fn add(&self, p: &RowsParams, x: &mut MetalBuf<X>, y: &MetalBuf<X>) {
        elementwise::metal::add(self, p, x, y)
    }

    fn matmul(&self, p: &MatmulParams, w: &MetalMatrix<X>, x: &MetalBuf<X>, out: &mut MetalBuf<X>) {
        matmul::metal::matmul(self, p, w, x, out)
    }

    fn qk_norm_rope(
        &self,
        p: &RopeParams,
        q_norm: &MetalBuf<X>,
        k_norm: &MetalBuf<X>,
        qg: &mut MetalBuf<X>,
        k: &mut MetalBuf<X>,
    ) {
        attention::metal::qk_norm_rope(self, p, q_norm, k_norm, qg, k)
    }

    fn kv_store(&self, p: &KvStoreParams, x: &MetalBuf<X>, cache: &mut MetalKv<X>) {
        attention::metal::kv_store(self, p, x, cache)
    }

    fn attention(
        &self,
        p: &AttentionParams,
        qg: &MetalBuf<X>,
        k_cache: &MetalKv<X>,
        v_cache: &MetalKv<X>,
        out: &mut MetalBuf<X>,
    ) {
        attention::metal::attention(self, p, qg, k_cache, v_cache, out)
    }

    fn delta_net_conv(
        &self,
        p: &ConvParams,
        w: &MetalBuf<X>,
        state: &mut MetalBuf<X>,
        x: &MetalBuf<X>,
        out: &mut MetalBuf<X>,
    ) {
        delta_net::metal::delta_net_conv(self, p, w, state, x, out)
    }

    fn delta_net(
        &self,
        p: &DeltaNetParams,
        qkv: &MetalBuf<X>,
        a: &MetalBuf<X>,
        b: &MetalBuf<X>,
        a_log: &MetalBuf<X>,
        dt_bias: &MetalBuf<X>,
        state: &mut MetalBuf<X>,
        out: &mut MetalBuf<X>,
    ) {
        delta_net::metal::delta_net(self, p, qkv, a, b, a_log, dt_bias, state, out)
    }

    fn moe_route(&self, p: &RouteParams, logits: &MetalBuf<X>, ids: &mut MetalBuf<X>, weights: &mut MetalBuf<X>) {
        moe::metal::moe_route(self, p, logits, ids, weights)
    }

    fn moe_experts(
        &self,
        p: &MoeParams,
        x: &MetalBuf<X>,
        ids: &MetalBuf<X>,
        weights: &MetalBuf<X>,
        gate: &MetalMatrix<X>,
        up: &MetalMatrix<X>,
        down: &MetalMatrix<X>,
        tmp: &mut MetalBuf<X>,
        out: &mut MetalBuf<X>,
    ) {
        moe::metal::moe_experts(self, p, x, ids, weights, gate, up, down, tmp, out)
    }

    fn swiglu(&self, p: &RowsParams, gate: &MetalBuf<X>, up: &MetalBuf<X>, out: &mut MetalBuf<X>) {
        elementwise::metal::swiglu(self, p, gate, up, out)
    }

    fn sigmoid_gate_add(&self, p: &RowsParams, y: &MetalBuf<X>, gate: &MetalBuf<X>, out: &mut MetalBuf<X>) {
        elementwise::metal::sigmoid_gate_add(self, p, y, gate, out)
    }
}
