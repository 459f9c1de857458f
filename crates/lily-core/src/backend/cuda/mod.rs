//! The CUDA backend: the plumbing the per-op encoders (`ops/<family>/cuda.rs`: which kernel,
//! which arguments, grid and block sizes) share: buffers, the command stream, scratch growth and
//! graph reuse, generic over an [`Executor`]: the real GPU
//! (`device.rs`: driver API through cudarc, kernels compiled by NVRTC to a cubin for the
//! device's architecture), the simulator ([`sim::Sim`]: the same `.cu` sources compiled by
//! clang against tools/cuda-sim and run on the CPU, bounds-checked) and [`executor::Null`]
//! (records launches, runs nothing).
//!
//! Activations, state and scratch are f32 device buffers; weights are uploaded once in their
//! checkpoint format (f32/f16/bf16, MLX affine 2/4/8-bit with bf16/f16/f32 scales) and
//! dequantized inside the kernels; a tensor shared by two matrices (the fused HF `gate_up_proj`
//! seen as gate and up) is uploaded once.
//!
//! Command stream: kernels are recorded between `begin` and `finish` (no executor call while
//! encoding) and launched at `finish`, after the dynamic values of the call are written to a
//! small device buffer (`step`: the position of the first token; token ids live in the ids
//! buffer). Kernels read those values from device memory, never from their by-value arguments,
//! so two calls that differ only in position record identical commands. When a call records
//! exactly the commands of the previous one (a decode step after a decode step), the backend
//! captures them into a graph once and replays that graph from then on: one launch per step
//! instead of hundreds. Any other call runs its kernels one by one. `LILY_CUDA_GRAPHS=0` turns
//! graphs off. On compute capability 9.0+ the device captures those graphs with programmatic
//! dependent launch (each kernel may start while the one before it drains; eager launches stay
//! plain: `device.rs` says why); `LILY_CUDA_PDL=0` turns that off. Argument errors found while encoding (shapes a kernel does not support, buffers
//! too small) are kept and returned by `finish`: a bad shape is an error, never a fault.
//!
//! Encoding allocates nothing once warm: the command list is reused, arguments are packed inline
//! ([`Args`]), scratch is grown, never per step (`tests/cuda_alloc.rs` checks it).

pub mod args;
#[cfg(target_os = "linux")]
pub mod device;
pub mod executor;
pub mod kernels;
pub mod kv;
#[cfg(target_os = "linux")]
pub mod nvrtc;
#[cfg(unix)]
pub mod sim;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

pub use args::{Args, CudaMatrix, DevPtr, GemvMulti, KvDesc, KvElem, MoeShared, MoeSortArgs};
pub use executor::{Executor, Launch, Null};
use kernels::{Fixed as F, Kernel, Weight};
pub use kv::CudaKv;

use super::{
    check_rows, encoders, params::*, Backend, DeltaNetGated, DeltaNetIn, GateUp, GatedAdd, KvDtype, KvSegment,
    MoeAddNorm, MoeBlock, MoeExperts, MoeScratch, Router, Routing, StreamKind,
};
use crate::ops::{attention, delta_net, elementwise, embed, matmul, moe, norm};
use crate::{
    error::{Error, Result},
    quant::{Format, Matrix},
    safetensors::DType,
};

/// Tokens up to which `matmul` runs the GEMV kernel (f32; weights re-read per token from L2);
/// above, the tensor-core GEMM (bf16 inputs, f32 accumulation).
pub const GEMV_TOKENS: usize = 8;
/// Blocks a decode GEMV launch should have at least: two for each of the ~132 SMs of an H100 / H200
/// (a GEMV's time is the latency of its loads unless enough of them are in flight on every SM).
pub const GEMV_BLOCKS: usize = 264;

/// The warps per row group of the staged GEMV (`gemv_staged` in common.cuh: 1, 2, 4 or 8; a block
/// then covers 32 / ks rows) for `rows` rows of `chunks` 16-byte chunks in a grid of `grid_y`
/// block rows: doubled while the doubled grid stays within [`GEMV_BLOCKS`] blocks (one wave: a
/// grid past it runs its last blocks as a second wave, a whole block's latency more; the experts'
/// gate/up at 9 pairs went from 144 to 288 blocks that way, 14.9 us on the H200) and each warp
/// keeps at least one 32-chunk step of K.
pub(crate) fn gemv_split(rows: usize, chunks: usize, grid_y: usize) -> u32 {
    gemv_split_rows(rows, chunks, grid_y, GEMV_ROWS)
}

/// Rows a warp group of the staged GEMV owns (common.cuh's GEMV_ROWS), where the kernel does not
/// say otherwise (`matmul_gemv_multi` at 4 bits: ops/matmul/cuda.rs).
pub const GEMV_ROWS: usize = 4;

/// [`gemv_split`] for a kernel whose warp groups own `warp_rows` rows each (a block then covers
/// 8 / ks * warp_rows rows).
pub(crate) fn gemv_split_rows(rows: usize, chunks: usize, grid_y: usize, warp_rows: usize) -> u32 {
    let mut ks = 1;
    while ks < 8 && rows.div_ceil(8 / (2 * ks) * warp_rows) * grid_y <= GEMV_BLOCKS && chunks >= 64 * ks {
        ks *= 2;
    }
    ks as u32
}

/// Lanes a row group of the staged GEMV (`gemv_block`'s LG; `moe_down` takes it as `lanes`): 8 for
/// rows of 16 chunks or fewer when ks = 1 (the experts' down projection, K = 512 at 4 bits: with
/// 32 lanes a row group half of each warp had no chunk, and 9 pairs took 576 blocks, 2.2 waves),
/// else 32. A block then covers `32 / ks * 32 / lanes` rows.
pub(crate) fn gemv_lanes(chunks: usize, ks: u32) -> u32 {
    if ks == 1 && chunks <= 16 {
        8
    } else {
        32
    }
}

/// Key splits of single-token attention (flash-decoding): fixed, so a decode graph does not
/// depend on the position; each split covers ceil(len / splits) rows, rounded up to a 4-row
/// sub-tile (64 splits at 4K rows: 68 rows a split, 61 splits busy; rounded to 16, as before
/// 2026-12-07, 80 rows and 52 busy), 128 blocks for 2 KV heads; the same launch combines them,
/// in two levels of 8: attention.cu.
pub const DECODE_SPLITS: u32 = 64;
/// The most key splits `LILY_CUDA_DECODE_SPLITS` may ask for.
pub const DECODE_SPLITS_MAX: u32 = 256;
/// Warps per query head of a decode-attention block (each scores every other sub-tile of a stage),
/// where the block stays within 512 threads; `LILY_CUDA_ATTENTION_WARPS` (1 or 2) for measuring.
pub const ATTENTION_WARPS: u32 = 2;

/// Tokens per forward call during prefill: enough rows for the tensor-core GEMMs to pay.
pub const PREFILL_CHUNK: usize = 1024;

/// A device allocation, given back when the last handle drops.
pub struct Alloc<X: Executor> {
    x: Arc<X>,
    pub(crate) ptr: DevPtr,
}

impl<X: Executor> Drop for Alloc<X> {
    fn drop(&mut self) {
        self.x.free(self.ptr);
    }
}

/// A device buffer of `len` 4-byte elements (f32 values or u32 ids).
pub struct CudaBuf<X: Executor> {
    mem: Arc<Alloc<X>>,
    pub(crate) len: usize,
}

impl<X: Executor> CudaBuf<X> {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn ptr(&self) -> DevPtr {
        self.mem.ptr
    }
}

/// A weight matrix on the device.
pub struct CudaMat<X: Executor> {
    pub(crate) desc: CudaMatrix,
    pub(crate) weight: Weight,
    pub(crate) experts: u32,
    data: Arc<Alloc<X>>,
    groups: Option<[Arc<Alloc<X>>; 2]>,
}

impl<X: Executor> CudaMat<X> {
    pub(crate) fn ptrs(&self) -> [DevPtr; 3] {
        match &self.groups {
            Some([s, b]) => [self.data.ptr, s.ptr, b.ptr],
            None => [self.data.ptr; 3],
        }
    }
}

/// One recorded launch.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Cmd {
    kernel: Kernel,
    shape: Launch,
    args: Args,
}

pub(crate) struct Stream<X: Executor> {
    cmds: Vec<Cmd>,
    /// The position written to `step` before the commands run (set by the ops that use it).
    pos: Option<u32>,
    error: Option<Error>,
    /// The commands of the last call run one by one (a repeat is captured into a graph).
    last: Vec<Cmd>,
    /// The captured graph and the commands it holds.
    graph: Option<(Vec<Cmd>, X::Graph)>,
    /// What the engine said this call is (`begin`): a decode step's graph is captured with
    /// programmatic dependent launch, a prefill chunk's is not (device.rs says why).
    kind: StreamKind,
    /// Split-attention partials [H, splits, 2 + hd], grown to the largest need seen.
    pub(crate) partials: Option<(Arc<Alloc<X>>, usize)>,
    /// u32 routing scratch of the expert-sorted MoE prefill, grown to the largest need seen.
    pub(crate) moe_scratch: Option<(Arc<Alloc<X>>, usize)>,
    /// u32 per-token block counters of `moe_router` (zero as allocated; the kernel leaves them 0).
    pub(crate) router_counts: Option<(Arc<Alloc<X>>, usize)>,
    /// f32 per-token q, k and gates of the DeltaNet prefill scan, grown to the largest need seen.
    pub(crate) delta_scratch: Option<(Arc<Alloc<X>>, usize)>,
    /// u32 per-key-head block counters of `delta_net_gated` (zero as allocated; the kernel leaves
    /// them 0).
    pub(crate) delta_counts: Option<(Arc<Alloc<X>>, usize)>,
}

/// Weight tensors on the device by host (address, length).
type Uploads<X> = HashMap<(usize, usize), std::sync::Weak<Alloc<X>>>;

pub struct Cuda<X: Executor> {
    x: Arc<X>,
    functions: Box<[X::Function]>,
    names: Box<[String]>,
    stream: Mutex<Stream<X>>,
    /// [4 + 2 ARGMAX_BLOCKS] u32: [0] the position of the call's first token, read by qk_norm_rope,
    /// kv_store and attention; [1] the result of `argmax`, [2] its count of finished blocks (0
    /// between launches), [4..] its blocks' (value, index) pairs.
    pub(crate) step: Arc<Alloc<X>>,
    /// Weight tensors uploaded so far, by host address and length (a tensor two matrices share
    /// is uploaded once).
    uploads: Mutex<Uploads<X>>,
    /// Replay repeated command lists from a captured graph (default on; `LILY_CUDA_GRAPHS=0`).
    pub graphs: bool,
    /// `matmul` over at most this many tokens runs the f32 GEMV, above it the bf16 tensor-core
    /// GEMM (default [`GEMV_TOKENS`], or `LILY_CUDA_GEMV_TOKENS`; tests raise it to check a whole
    /// forward pass in f32).
    pub gemv_tokens: usize,
    /// `moe_router` as one kernel for a decode step (default; `LILY_CUDA_FUSED_ROUTER=0`: its
    /// parts, the router GEMV then `moe_route`, should the last-block-done kernel misbehave).
    pub fused_router: bool,
    /// `delta_net_gated` as one kernel for a decode step (default; `LILY_CUDA_FUSED_DELTA_NET=0`:
    /// its parts, `delta_net_conv`, `delta_net`, `rms_norm_gated`).
    pub fused_delta_net: bool,
    /// Key splits of decode attention (default [`DECODE_SPLITS`]; `LILY_CUDA_DECODE_SPLITS`,
    /// 1 ..= [`DECODE_SPLITS_MAX`], for measuring other splits).
    pub decode_splits: u32,
    /// Warps per query head of decode attention (default [`ATTENTION_WARPS`]).
    pub attention_warps: u32,
}

#[cfg(unix)]
impl Cuda<sim::Sim> {
    /// The simulated device (Linux CI): needs clang-19.
    pub fn sim() -> Result<Self> {
        Cuda::new(sim::Sim::new()?)
    }
}

#[cfg(target_os = "linux")]
impl Cuda<device::Device> {
    /// The first CUDA device (`LILY_CUDA_DEVICE` picks another), kernels compiled for it.
    pub fn device() -> Result<Self> {
        Cuda::new(device::Device::new()?)
    }
}

fn weight_format(m: &Matrix) -> Result<Weight> {
    let scale = |d: DType| match d {
        DType::BF16 => Ok("bf16"),
        DType::F16 => Ok("f16"),
        DType::F32 => Ok("f32"),
        _ => Err(Error::weight(&m.name, "scales must be BF16, F16 or F32")),
    };
    let suffix = match m.format {
        Format::F32 => "f32".to_string(),
        Format::F16 => "f16".to_string(),
        Format::BF16 => "bf16".to_string(),
        Format::Affine { bits, group } => {
            if group % 8 != 0 || m.cols % group != 0 {
                return Err(Error::weight(
                    &m.name,
                    format!(
                        "the CUDA kernels need cols ({}) a multiple of the group ({group}), itself a multiple of 8",
                        m.cols
                    ),
                ));
            }
            format!("q{bits}_{}", scale(m.scale_dtype())?)
        }
    };
    Weight::from_suffix(&suffix)
        .ok_or_else(|| Error::weight(&m.name, format!("no CUDA kernel for weight format {suffix}")))
}

pub(crate) fn div(a: usize, b: usize) -> u32 {
    a.div_ceil(b) as u32
}

pub(crate) fn shape(grid: [u32; 3], block: u32) -> Launch {
    Launch {
        grid,
        block: [block, 1, 1],
        shared: 0,
    }
}

/// A count from environment variable `var` (1 ..= `max`), `default` when unset; anything else is
/// an error, not a silent default.
fn env_count(var: &str, default: u32, max: u32) -> Result<u32> {
    parse_count(var, std::env::var(var).ok().as_deref(), default, max)
}

/// [`env_count`] of the value `v` (None: unset).
fn parse_count(var: &str, v: Option<&str>, default: u32, max: u32) -> Result<u32> {
    let Some(v) = v else { return Ok(default) };
    match v.parse::<u32>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(Error::InvalidArgument(format!("{var}={v}: expected 1 to {max}"))),
    }
}

/// A switch from environment variable `var`: `0` off, `1` on, `default` when unset; anything else
/// is an error (a `false` or `off` must not silently mean on).
fn env_flag(var: &str, default: bool) -> Result<bool> {
    parse_flag(var, std::env::var(var).ok().as_deref(), default)
}

/// [`env_flag`] of the value `v` (None: unset).
fn parse_flag(var: &str, v: Option<&str>, default: bool) -> Result<bool> {
    match v {
        None => Ok(default),
        Some("0") => Ok(false),
        Some("1") => Ok(true),
        Some(v) => Err(Error::InvalidArgument(format!("{var}={v}: expected 0 or 1"))),
    }
}

impl<X: Executor> Cuda<X> {
    /// Load every kernel (so a missing one fails here) and allocate the step buffer.
    pub fn new(x: X) -> Result<Self> {
        let x = Arc::new(x);
        let names: Box<[String]> = Kernel::all().map(Kernel::name).collect();
        let functions = names.iter().map(|n| x.function(n)).collect::<Result<Vec<_>>>()?;
        let step = Arc::new(Alloc {
            ptr: x.alloc(16 + 8 * ARGMAX_BLOCKS, "step")?,
            x: x.clone(),
        });
        let graphs = env_flag("LILY_CUDA_GRAPHS", true)?;
        // LILY_CUDA_GEMV_TOKENS raises the GEMV threshold (tests: a whole forward pass in f32).
        let gemv_tokens = env_count("LILY_CUDA_GEMV_TOKENS", GEMV_TOKENS as u32, u32::MAX)? as usize;
        let fused_router = env_flag("LILY_CUDA_FUSED_ROUTER", true)?;
        let fused_delta_net = env_flag("LILY_CUDA_FUSED_DELTA_NET", true)?;
        let decode_splits = env_count("LILY_CUDA_DECODE_SPLITS", DECODE_SPLITS, DECODE_SPLITS_MAX)?;
        let attention_warps = env_count("LILY_CUDA_ATTENTION_WARPS", ATTENTION_WARPS, 2)?;
        Ok(Cuda {
            x,
            functions: functions.into_boxed_slice(),
            names,
            stream: Mutex::new(Stream {
                cmds: Vec::new(),
                pos: None,
                error: None,
                last: Vec::new(),
                graph: None,
                kind: StreamKind::Other,
                partials: None,
                moe_scratch: None,
                router_counts: None,
                delta_scratch: None,
                delta_counts: None,
            }),
            step,
            uploads: Mutex::new(HashMap::new()),
            graphs,
            gemv_tokens,
            fused_router,
            fused_delta_net,
            decode_splits,
            attention_warps,
        })
    }

    pub fn executor(&self) -> &X {
        &self.x
    }

    /// The device, in words.
    pub fn describe(&self) -> String {
        self.x.describe()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Stream<X>> {
        self.stream.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Remember the first encoding error; `finish` returns it.
    pub(crate) fn fail(&self, msg: String) {
        let mut s = self.lock();
        if s.error.is_none() {
            s.error = Some(Error::Device(msg));
        }
    }

    /// Record one launch of kernel `k`.
    pub(crate) fn launch(&self, k: impl Into<Kernel>, shape: Launch, args: Args) {
        let mut s = self.lock();
        if s.error.is_none() {
            s.cmds.push(Cmd {
                kernel: k.into(),
                shape,
                args,
            });
        }
    }

    /// Note the position of this call's first token (written to `step` before the launches).
    pub(crate) fn at_pos(&self, pos0: u32) {
        let mut s = self.lock();
        match s.pos {
            Some(p) if p != pos0 && s.error.is_none() => {
                s.error = Some(Error::Device(format!(
                    "one command stream holds two positions ({p} and {pos0})"
                )));
            }
            _ => s.pos = Some(pos0),
        }
    }

    /// Launch what is recorded (replaying the graph when it holds exactly these commands,
    /// capturing one when they repeat the previous call's) and wait for it.
    fn flush(&self) -> Result<()> {
        let mut s = self.lock();
        let st = &mut *s;
        let pos = st.pos.take();
        if let Some(e) = st.error.take() {
            st.cmds.clear();
            return Err(e);
        }
        let result = self.launch_recorded(st, pos);
        // Launched or not, the list is done with: a failed call leaves nothing behind.
        st.cmds.clear();
        result?;
        self.x.sync()
    }

    /// Write the position, then launch `st.cmds`: from the graph when it holds exactly these
    /// commands, into a new graph when they repeat the previous call's, else one by one.
    fn launch_recorded(&self, st: &mut Stream<X>, pos: Option<u32>) -> Result<()> {
        if let Some(p) = pos {
            self.x.write(self.step.ptr, &p.to_le_bytes())?;
        }
        if st.cmds.is_empty() {
            return Ok(());
        }
        if self.graphs {
            if let Some((cmds, g)) = &st.graph {
                if *cmds == st.cmds {
                    return self.x.graph_launch(g);
                }
            }
            if st.last == st.cmds {
                return self.capture(st);
            }
        }
        let r = self.run(&mut st.cmds);
        std::mem::swap(&mut st.last, &mut st.cmds);
        r
    }

    /// Launch `cmds` one by one.
    fn run(&self, cmds: &mut [Cmd]) -> Result<()> {
        for c in cmds.iter_mut() {
            let i = c.kernel.index();
            self.x
                .launch(&self.functions[i], &self.names[i], c.shape, &mut c.args)?;
        }
        Ok(())
    }

    /// Capture the recorded commands into a graph and launch it (eagerly when the executor has
    /// no graphs).
    fn capture(&self, st: &mut Stream<X>) -> Result<()> {
        if !self.x.capture_begin(st.kind == StreamKind::Decode)? {
            return self.run(&mut st.cmds);
        }
        let r = self.run(&mut st.cmds);
        let g = self.x.capture_end();
        r?;
        let g = g?;
        self.x.graph_launch(&g)?;
        st.graph = Some((st.cmds.clone(), g));
        st.last.clear();
        Ok(())
    }

    fn new_buf(&self, len: usize, label: &str) -> Result<CudaBuf<X>> {
        let bytes = len
            .checked_mul(4)
            .ok_or_else(|| Error::Device(format!("buffer of {len} elements")))?;
        Ok(CudaBuf {
            mem: Arc::new(Alloc {
                ptr: self.x.alloc(bytes.max(4), label)?,
                x: self.x.clone(),
            }),
            len,
        })
    }

    /// A tensor's bytes on the device, uploaded once per host tensor.
    fn upload_bytes(&self, data: &[u8], label: &str) -> Result<Arc<Alloc<X>>> {
        let key = (data.as_ptr() as usize, data.len());
        let mut map = self.uploads.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(a) = map.get(&key).and_then(|w| w.upgrade()) {
            return Ok(a);
        }
        let ptr = self.x.alloc(data.len().max(16), label)?;
        let a = Arc::new(Alloc { x: self.x.clone(), ptr });
        self.x.write(ptr, data)?;
        map.retain(|_, w| w.strong_count() > 0);
        map.insert(key, Arc::downgrade(&a));
        Ok(a)
    }

    /// Check buffers hold at least the given element counts; record an error otherwise.
    pub(crate) fn fits(&self, op: &str, checks: &[(&str, usize, usize)]) -> bool {
        crate::ops::check_sizes(op, checks).map_err(|e| self.fail(e)).is_ok()
    }

    /// Check that `cache` holds rows 0..rows of `width` values; record an error otherwise.
    pub(crate) fn cache_fits(&self, op: &str, what: &str, cache: &CudaKv<X>, rows: usize, width: usize) -> bool {
        if cache.width != width || cache.rows() < rows {
            self.fail(format!(
                "{op}: {what} holds {} rows of {} values, needs {rows} of {width}",
                cache.rows(),
                cache.width
            ));
            return false;
        }
        true
    }

    /// A scratch buffer of the stream (`slot` picks it), at least `need` 4-byte elements: grown
    /// to the largest need seen, never per step. `None` with the allocation error recorded.
    pub(crate) fn scratch(
        &self,
        need: usize,
        label: &str,
        slot: impl Fn(&mut Stream<X>) -> &mut Option<(Arc<Alloc<X>>, usize)>,
    ) -> Option<DevPtr> {
        let mut s = self.lock();
        if slot(&mut s).as_ref().is_none_or(|(_, n)| *n < need) {
            match self.x.alloc(need * 4, label) {
                Ok(ptr) => *slot(&mut s) = Some((Arc::new(Alloc { x: self.x.clone(), ptr }), need)),
                Err(e) => {
                    s.error.get_or_insert(e);
                    return None;
                }
            }
        }
        slot(&mut s).as_ref().map(|(a, _)| a.ptr)
    }

    /// Device copy bandwidth in GB/s: a device-to-device copy of `bytes` (best of 5 after a
    /// warm-up), (bytes read + bytes written) / time. The peak memory reported afterwards leaves
    /// out the measurement's buffers.
    pub fn copy_bandwidth(&self, bytes: usize) -> Result<f64> {
        self.flush()?;
        let bytes = bytes.max(1 << 20);
        let a = Alloc {
            ptr: self.x.alloc(bytes, "bandwidth source")?,
            x: self.x.clone(),
        };
        let b = Alloc {
            ptr: self.x.alloc(bytes, "bandwidth target")?,
            x: self.x.clone(),
        };
        self.x.copy(a.ptr, b.ptr, bytes)?;
        self.x.sync()?;
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let t = std::time::Instant::now();
            self.x.copy(a.ptr, b.ptr, bytes)?;
            self.x.sync()?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        drop((a, b));
        // The measurement's buffers are not the engine's memory: the peak starts over without them
        // (the engine's own allocations are all live now, so nothing of theirs is lost).
        self.x.reset_peak();
        Ok(2.0 * bytes as f64 / best / 1e9)
    }

    /// Device memory held by this backend's allocations (weights, state, scratch), and the
    /// executor's peak where it reports one.
    pub fn peak_bytes(&self) -> Option<usize> {
        self.x.peak_bytes()
    }
}

pub(crate) fn rows_launch(dim: usize, tokens: usize) -> Launch {
    shape([div(dim, 256), tokens as u32, 1], 256)
}

impl<X: Executor> Backend for Cuda<X> {
    type Buf = CudaBuf<X>;
    type Ids = CudaBuf<X>;
    type Matrix = CudaMat<X>;
    type Kv = CudaKv<X>;

    fn name(&self) -> &'static str {
        X::NAME
    }

    fn prefill_chunk(&self) -> usize {
        PREFILL_CHUNK
    }

    fn kv_new(&self, width: usize, dtype: KvDtype, max_rows: usize, seg_rows: usize) -> Result<CudaKv<X>> {
        Cuda::kv_new(self, width, dtype, max_rows, seg_rows)
    }
    fn kv_reserve(&self, kv: &mut CudaKv<X>, rows: usize) -> Result<()> {
        Cuda::kv_reserve(self, kv, rows)
    }
    fn kv_trim(&self, kv: &mut CudaKv<X>, rows: usize) {
        Cuda::kv_trim(self, kv, rows)
    }
    fn kv_rows(&self, kv: &CudaKv<X>) -> usize {
        kv.rows()
    }
    fn kv_bytes(&self, kv: &CudaKv<X>) -> usize {
        kv.bytes()
    }
    fn kv_read(&self, kv: &CudaKv<X>, row0: usize, out: &mut [f32]) -> Result<()> {
        Cuda::kv_read(self, kv, row0, out)
    }
    fn kv_copy(&self, src: &CudaKv<X>, dst: &mut CudaKv<X>, rows: usize) -> Result<()> {
        Cuda::kv_copy(self, src, dst, rows)
    }
    fn kv_share(&self, src: &CudaKv<X>, rows: usize) -> Result<CudaKv<X>> {
        Cuda::kv_share(self, src, rows)
    }
    fn kv_unshare(&self, kv: &mut CudaKv<X>, row0: usize, rows: usize) -> Result<()> {
        Cuda::kv_unshare(self, kv, row0, rows)
    }
    fn kv_segments(&self, kv: &CudaKv<X>) -> Vec<KvSegment> {
        Cuda::kv_segments(self, kv)
    }
    fn copy_rows(
        &self,
        src: &CudaBuf<X>,
        src_off: usize,
        dst: &mut CudaBuf<X>,
        dst_off: usize,
        len: usize,
    ) -> Result<()> {
        check_rows(src.len, src_off, dst.len, dst_off, len)?;
        if len > u32::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "copy_rows of {len} values: more than a grid row"
            )));
        }
        if len > 0 {
            elementwise::cuda::copy_rows(self, src, src_off, dst, dst_off, len);
        }
        Ok(())
    }
    fn alloc(&self, len: usize) -> Result<CudaBuf<X>> {
        self.new_buf(len, "buffer")
    }
    fn alloc_ids(&self, len: usize) -> Result<CudaBuf<X>> {
        self.new_buf(len, "ids")
    }
    fn upload(&self, data: &[f32]) -> Result<CudaBuf<X>> {
        let b = self.new_buf(data.len(), "buffer")?;
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.x.write(b.ptr(), &bytes)?;
        Ok(b)
    }
    fn upload_matrix(&self, m: &Matrix) -> Result<CudaMat<X>> {
        let weight = weight_format(m)?;
        let row_bytes = m.row_bytes();
        let stored = m.data.len() / row_bytes.max(1);
        let last = m.stored_row(m.experts.max(1) - 1, m.rows.max(1) - 1);
        if m.rows == 0 || m.cols == 0 || last >= stored || stored * row_bytes != m.data.len() {
            return Err(Error::weight(
                &m.name,
                format!("{} stored rows of {row_bytes} bytes cannot hold row {last}", stored),
            ));
        }
        let too_big = |v: usize| u32::try_from(v).map_err(|_| Error::weight(&m.name, "dimension over 2^32"));
        too_big(stored)?; // the decode GEMVs index stored rows in u32 (gemv_block in common.cuh)
        let group = match m.format {
            Format::Affine { group, .. } => group,
            _ => 0,
        };
        let desc = CudaMatrix {
            rows: too_big(m.rows)?,
            cols: too_big(m.cols)?,
            expert_stride: too_big(m.expert_stride)?,
            row_offset: too_big(m.row_offset)?,
            group: too_big(group)?,
            row_bytes: too_big(row_bytes)?,
            vec: (row_bytes % 16 == 0) as u32,
            group_shift: if group.is_power_of_two() {
                group.trailing_zeros()
            } else {
                0
            },
        };
        let data = self.upload_bytes(m.data.as_slice(), &m.name)?;
        let groups = match &m.groups {
            Some(g) => Some([
                self.upload_bytes(g.scales.as_slice(), &m.name)?,
                self.upload_bytes(g.biases.as_slice(), &m.name)?,
            ]),
            None => None,
        };
        Ok(CudaMat {
            desc,
            weight,
            experts: m.experts as u32,
            data,
            groups,
        })
    }
    fn write_ids(&self, dst: &mut CudaBuf<X>, data: &[u32]) -> Result<()> {
        if data.len() > dst.len {
            return Err(Error::InvalidArgument(format!(
                "{} ids into a buffer of {}",
                data.len(),
                dst.len
            )));
        }
        // Ids are written before the call's kernels run (they are launched at `finish`).
        let mut bytes = [0u8; 4096];
        for (chunk_i, chunk) in data.chunks(1024).enumerate() {
            for (i, v) in chunk.iter().enumerate() {
                bytes[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
            }
            self.x
                .write(dst.ptr() + (chunk_i * 4096) as u64, &bytes[..4 * chunk.len()])?;
        }
        Ok(())
    }
    fn read(&self, src: &CudaBuf<X>, offset: usize, out: &mut [f32]) -> Result<()> {
        if offset + out.len() > src.len {
            return Err(Error::InvalidArgument(format!(
                "read of {} values at {offset} from a buffer of {}",
                out.len(),
                src.len
            )));
        }
        self.flush()?;
        // SAFETY: f32 has no invalid bit patterns; the byte view covers exactly `out`.
        let bytes = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, out.len() * 4) };
        self.x.read(src.ptr() + (offset * 4) as u64, bytes)
    }
    fn fill_zero(&self, buf: &mut CudaBuf<X>) -> Result<()> {
        self.flush()?;
        self.x.zero(buf.ptr(), buf.len * 4)?;
        self.x.sync()
    }
    fn copy(&self, src: &CudaBuf<X>, dst: &mut CudaBuf<X>, len: usize) -> Result<()> {
        if len > src.len || len > dst.len {
            return Err(Error::InvalidArgument(format!(
                "copy of {len} values between buffers of {} and {}",
                src.len, dst.len
            )));
        }
        self.flush()?;
        self.x.copy(src.ptr(), dst.ptr(), len * 4)?;
        self.x.sync()
    }
    /// On the device: one `argmax` launch (up to ARGMAX_BLOCKS blocks of 256 threads, each
    /// scanning a stride of the values) and a 4-byte read (`step[1]` holds the result). The
    /// launch goes straight to the executor after the pending work, outside the recorded command
    /// lists, so a decode step's list still repeats and replays from its graph.
    fn argmax(&self, src: &CudaBuf<X>, n: usize) -> Result<u32> {
        if n == 0 || n > src.len {
            return Err(Error::InvalidArgument(format!(
                "argmax of {n} values in a buffer of {}",
                src.len
            )));
        }
        self.flush()?;
        let out = self.step.ptr + 4;
        let blocks = n.div_ceil(256).min(ARGMAX_BLOCKS) as u32;
        let mut args = Args::new()
            .push(n as u32)
            .ptr(src.ptr())
            .ptr(out)
            .ptr(self.step.ptr + 8)
            .ptr(self.step.ptr + 16);
        let k = Kernel::fixed(F::Argmax).index();
        self.x.launch(
            &self.functions[k],
            &self.names[k],
            shape([blocks, 1, 1], 256),
            &mut args,
        )?;
        let mut b = [0u8; 4];
        self.x.read(out, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }
    /// Nothing to open: commands are recorded and launched at `finish` (a repeated list, whatever
    /// its kind, replays its graph; the kind decides only programmatic launch in a new graph).
    fn begin(&self, kind: StreamKind) -> Result<()> {
        self.lock().kind = kind;
        Ok(())
    }
    fn finish(&self) -> Result<()> {
        self.flush()
    }

    // Each op is its family's encoder, which takes the trait method's arguments after the device.
    encoders! { cuda;
        embed::embed(tokens: usize, table: &CudaMat<X>, ids: &CudaBuf<X>, out: &mut CudaBuf<X>);
        norm::rms_norm(p: &RmsNormParams, x: &CudaBuf<X>, w: &CudaBuf<X>, out: &mut CudaBuf<X>);
        norm::rms_norm_gated(p: &RmsNormParams, x: &CudaBuf<X>, z: &CudaBuf<X>, w: &CudaBuf<X>, out: &mut CudaBuf<X>);
        elementwise::add(p: &RowsParams, x: &mut CudaBuf<X>, y: &CudaBuf<X>);
        norm::add_rms_norm(p: &RmsNormParams, x: &mut CudaBuf<X>, y: &CudaBuf<X>, w: &CudaBuf<X>, out: &mut CudaBuf<X>);
        norm::add_gated_rms_norm(p: &RmsNormParams, x: &mut CudaBuf<X>, add: &GatedAdd<'_, Self>, w: &CudaBuf<X>, out: &mut CudaBuf<X>);
        norm::moe_experts_add_rms_norm(moe: &MoeParams, norm: &RmsNormParams, r: &MoeAddNorm<'_, Self>, tmp: &mut CudaBuf<X>, mix: &mut CudaBuf<X>, x: &mut CudaBuf<X>, h: &mut CudaBuf<X>);
        moe::moe_add_rms_norm(moe: &MoeParams, norm: &RmsNormParams, r: &MoeBlock<'_, Self>, s: &mut MoeScratch<'_, Self>, x: &mut CudaBuf<X>, h: &mut CudaBuf<X>);
        matmul::matmul(p: &MatmulParams, w: &CudaMat<X>, x: &CudaBuf<X>, out: &mut CudaBuf<X>);
        matmul::matmuls(p: &MatmulParams, x: &CudaBuf<X>, ws: &[&CudaMat<X>], outs: &mut [&mut CudaBuf<X>]);
        attention::qk_norm_rope(p: &RopeParams, q_norm: &CudaBuf<X>, k_norm: &CudaBuf<X>, qg: &mut CudaBuf<X>, k: &mut CudaBuf<X>);
        attention::kv_store(p: &KvStoreParams, x: &CudaBuf<X>, cache: &mut CudaKv<X>);
        attention::qk_norm_rope_store(p: &RopeParams, q_norm: &CudaBuf<X>, k_norm: &CudaBuf<X>, qg: &mut CudaBuf<X>, k: &mut CudaBuf<X>, v: &CudaBuf<X>, k_cache: &mut CudaKv<X>, v_cache: &mut CudaKv<X>);
        attention::qk_norm_rope_store_attention(rope: &RopeParams, p: &AttentionParams, q_norm: &CudaBuf<X>, k_norm: &CudaBuf<X>, qg: &mut CudaBuf<X>, k: &mut CudaBuf<X>, v: &CudaBuf<X>, k_cache: &mut CudaKv<X>, v_cache: &mut CudaKv<X>, out: &mut CudaBuf<X>);
        attention::attention(p: &AttentionParams, qg: &CudaBuf<X>, k: &CudaKv<X>, v: &CudaKv<X>, out: &mut CudaBuf<X>);
        delta_net::delta_net_conv(p: &ConvParams, w: &CudaBuf<X>, state: &mut CudaBuf<X>, x: &CudaBuf<X>, out: &mut CudaBuf<X>);
        delta_net::delta_net(x: &DeltaNetIn<'_, CudaBuf<X>>, state: &mut CudaBuf<X>, out: &mut CudaBuf<X>);
        delta_net::delta_net_gated(r: &DeltaNetGated<'_, Self>, conv_state: &mut CudaBuf<X>, state: &mut CudaBuf<X>, mixed: &mut CudaBuf<X>, core: &mut CudaBuf<X>, out: &mut CudaBuf<X>);
        moe::moe_route(p: &RouteParams, logits: &CudaBuf<X>, ids: &mut CudaBuf<X>, weights: &mut CudaBuf<X>);
        moe::moe_router(p: &RouteParams, x: &CudaBuf<X>, r: &Router<'_, Self>, out: &mut Routing<'_, Self>);
        moe::moe_experts(p: &MoeParams, e: &MoeExperts<'_, Self>, x: &CudaBuf<X>, tmp: &mut CudaBuf<X>, out: &mut CudaBuf<X>);
        moe::gate_up_swiglu(p: &RowsParams, w: &GateUp<'_, Self>, x: &CudaBuf<X>, g: &mut CudaBuf<X>, u: &mut CudaBuf<X>, out: &mut CudaBuf<X>);
        elementwise::swiglu(p: &RowsParams, gate: &CudaBuf<X>, up: &CudaBuf<X>, out: &mut CudaBuf<X>);
        elementwise::sigmoid_gate_add(p: &RowsParams, y: &CudaBuf<X>, gate: &CudaBuf<X>, out: &mut CudaBuf<X>);
    }
}

#[cfg(test)]
mod tests {
    use super::{gemv_lanes, gemv_split, parse_count, parse_flag};

    #[test]
    fn tuning_variables_are_checked_not_defaulted() {
        assert_eq!(parse_count("V", None, 8, 64).unwrap(), 8);
        assert_eq!(parse_count("V", Some("64"), 8, 64).unwrap(), 64);
        for bad in ["0", "65", "-1", "", "eight", "8 "] {
            let e = parse_count("V", Some(bad), 8, 64).unwrap_err().to_string();
            assert!(e.contains("expected 1 to 64"), "{bad:?}: {e}");
        }
        assert!(parse_flag("F", None, true).unwrap());
        assert!(!parse_flag("F", Some("0"), true).unwrap());
        assert!(parse_flag("F", Some("1"), false).unwrap());
        for bad in ["false", "off", "", "2", "yes"] {
            let e = parse_flag("F", Some(bad), true).unwrap_err().to_string();
            assert!(e.contains("expected 0 or 1"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn gemv_lanes_split_warps_only_for_short_rows() {
        // The experts' down projection (K = 512 at 4 bits: 16 chunks): 4 lane groups a warp.
        assert_eq!(gemv_lanes(16, gemv_split(2048, 16, 9)), 8);
        // Rows of 64 chunks, or warps that split K: whole warps.
        assert_eq!(gemv_lanes(64, 1), 32);
        assert_eq!(gemv_lanes(16, 2), 32);
    }

    #[test]
    fn gemv_split_fills_the_gpu_only_when_rows_are_few() {
        // The vocabulary projection has blocks to spare: no split.
        assert_eq!(gemv_split(248_320, 64, 1), 1);
        // 2048 rows of K = 2048 at 4 bits (64 chunks): 64 blocks, split once (32 chunks a warp).
        assert_eq!(gemv_split(2048, 64, 1), 2);
        // K = 4096 at 4 bits (128 chunks): split twice.
        assert_eq!(gemv_split(2048, 128, 1), 4);
        // 20 rows of 256 chunks: all 8 warps on one group.
        assert_eq!(gemv_split(20, 256, 1), 8);
        // A short row (16 chunks) is never split, however few its rows.
        assert_eq!(gemv_split(512, 16, 1), 1);
        // Enough blocks through the token / pair dimension: no split.
        assert_eq!(gemv_split(512, 64, 32), 1);
        // 8 experts + the shared one, 512 rows each: 144 blocks; split, 288 would be two waves.
        assert_eq!(gemv_split(512, 64, 9), 1);
    }
}
