//! The CUDA backend. The encoding logic (which kernel, which arguments, grid and block sizes,
//! buffer plan, graph reuse) lives here once, generic over an [`Executor`]: the real GPU
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
//! graphs off. Argument errors found while encoding (shapes a kernel does not support, buffers
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

pub use args::{Args, CudaMatrix, DevPtr, GemvMulti, KvDesc, KvElem, MoeSortArgs};
pub use executor::{Executor, Launch, Null};
use kernels::{Fixed as F, Kernel, Weight, WeightOp};
pub use kv::CudaKv;

use super::{params::*, Backend, KvDtype, StreamKind};
use crate::{
    error::{Error, Result},
    quant::{Format, Matrix},
    safetensors::DType,
};

/// Tokens up to which `matmul` runs the GEMV kernel (f32; weights re-read per token from L2);
/// above, the tensor-core GEMM (bf16 inputs, f32 accumulation).
pub const GEMV_TOKENS: usize = 8;
/// Key splits of single-token attention (flash-decoding): fixed, so a decode graph does not
/// depend on the position; each split covers ceil(len / splits) rows.
pub const DECODE_SPLITS: u32 = 32;

/// Tokens per forward call during prefill: enough rows for the tensor-core GEMMs to pay.
pub const PREFILL_CHUNK: usize = 1024;

/// A device allocation, given back when the last handle drops.
pub struct Alloc<X: Executor> {
    x: Arc<X>,
    ptr: DevPtr,
}

impl<X: Executor> Drop for Alloc<X> {
    fn drop(&mut self) {
        self.x.free(self.ptr);
    }
}

/// A device buffer of `len` 4-byte elements (f32 values or u32 ids).
pub struct CudaBuf<X: Executor> {
    mem: Arc<Alloc<X>>,
    len: usize,
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
    desc: CudaMatrix,
    weight: Weight,
    experts: u32,
    data: Arc<Alloc<X>>,
    groups: Option<[Arc<Alloc<X>>; 2]>,
}

impl<X: Executor> CudaMat<X> {
    fn ptrs(&self) -> [DevPtr; 3] {
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

struct Stream<X: Executor> {
    cmds: Vec<Cmd>,
    /// The position written to `step` before the commands run (set by the ops that use it).
    pos: Option<u32>,
    error: Option<Error>,
    /// The commands of the last call run one by one (a repeat is captured into a graph).
    last: Vec<Cmd>,
    /// The captured graph and the commands it holds.
    graph: Option<(Vec<Cmd>, X::Graph)>,
    /// Split-attention partials [H, splits, 2 + hd], grown to the largest need seen.
    partials: Option<(Arc<Alloc<X>>, usize)>,
    /// u32 routing scratch of the expert-sorted MoE prefill, grown to the largest need seen.
    moe_scratch: Option<(Arc<Alloc<X>>, usize)>,
    /// f32 per-token q, k and gates of the DeltaNet prefill scan, grown to the largest need seen.
    delta_scratch: Option<(Arc<Alloc<X>>, usize)>,
}

/// Weight tensors on the device by host (address, length).
type Uploads<X> = HashMap<(usize, usize), std::sync::Weak<Alloc<X>>>;

pub struct Cuda<X: Executor> {
    x: Arc<X>,
    functions: Box<[X::Function]>,
    names: Box<[String]>,
    stream: Mutex<Stream<X>>,
    /// [4] u32: [0] the position of the call's first token, read by qk_norm_rope, kv_store and
    /// attention; [1] the result of `argmax`.
    step: Arc<Alloc<X>>,
    /// Weight tensors uploaded so far, by host address and length (a tensor two matrices share
    /// is uploaded once).
    uploads: Mutex<Uploads<X>>,
    /// Replay repeated command lists from a captured graph (default on; `LILY_CUDA_GRAPHS=0`).
    pub graphs: bool,
    /// `matmul` over at most this many tokens runs the f32 GEMV, above it the bf16 tensor-core
    /// GEMM (default [`GEMV_TOKENS`], or `LILY_CUDA_GEMV_TOKENS`; tests raise it to check a whole
    /// forward pass in f32).
    pub gemv_tokens: usize,
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

fn div(a: usize, b: usize) -> u32 {
    a.div_ceil(b) as u32
}

fn shape(grid: [u32; 3], block: u32) -> Launch {
    Launch {
        grid,
        block: [block, 1, 1],
        shared: 0,
    }
}

impl<X: Executor> Cuda<X> {
    /// Load every kernel (so a missing one fails here) and allocate the step buffer.
    pub fn new(x: X) -> Result<Self> {
        let x = Arc::new(x);
        let names: Box<[String]> = Kernel::all().map(Kernel::name).collect();
        let functions = names.iter().map(|n| x.function(n)).collect::<Result<Vec<_>>>()?;
        let step = Arc::new(Alloc {
            ptr: x.alloc(16, "step")?,
            x: x.clone(),
        });
        let graphs = std::env::var("LILY_CUDA_GRAPHS").map_or(true, |v| v != "0");
        // LILY_CUDA_GEMV_TOKENS raises the GEMV threshold (tests: a whole forward pass in f32).
        let gemv_tokens = std::env::var("LILY_CUDA_GEMV_TOKENS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(GEMV_TOKENS);
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
                partials: None,
                moe_scratch: None,
                delta_scratch: None,
            }),
            step,
            uploads: Mutex::new(HashMap::new()),
            graphs,
            gemv_tokens,
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
    fn fail(&self, msg: String) {
        let mut s = self.lock();
        if s.error.is_none() {
            s.error = Some(Error::Device(msg));
        }
    }

    /// Record one launch of kernel `k`.
    fn launch(&self, k: impl Into<Kernel>, shape: Launch, args: Args) {
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
    fn at_pos(&self, pos0: u32) {
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
        if !self.x.capture_begin()? {
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
    fn fits(&self, op: &str, checks: &[(&str, usize, usize)]) -> bool {
        for &(what, have, need) in checks {
            if have < need {
                self.fail(format!("{op}: {what} has {have} elements, needs {need}"));
                return false;
            }
        }
        true
    }

    /// Check that `cache` holds rows 0..rows of `width` values; record an error otherwise.
    fn cache_fits(&self, op: &str, what: &str, cache: &CudaKv<X>, rows: usize, width: usize) -> bool {
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
    fn scratch(
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

impl<X: Executor> Cuda<X> {
    /// `moe_experts` for prefill: route-sorted expert GEMMs on the tensor cores, with no host
    /// round trip. `moe_sort` groups the pairs t*K + k by expert into 64-row tiles (u32 scratch:
    /// count | tiles | order | pos); `moe_gemm_gate_up` (act = SwiGLU over each tile's gathered
    /// token rows, into tmp [T*K, I] in sorted order) and `moe_gemm_down` (y, tmp [T*K, D] after
    /// act) run one block row per tile, the grid sized for the most tiles there can be
    /// (`max_tiles`; blocks past the count return at once); `moe_combine_sorted` sums each token's
    /// K rows in slot order. The caller has checked shapes and sizes.
    #[allow(clippy::too_many_arguments)]
    fn moe_experts_sorted(
        &self,
        p: &MoeParams,
        x: &CudaBuf<X>,
        ids: &CudaBuf<X>,
        weights: &CudaBuf<X>,
        gate: &CudaMat<X>,
        up: &CudaMat<X>,
        down: &CudaMat<X>,
        tmp: &mut CudaBuf<X>,
        out: &mut CudaBuf<X>,
    ) {
        let (t, k) = (p.tokens as usize, p.top_k as usize);
        let (i, d, e) = (gate.desc.rows as usize, gate.desc.cols as usize, gate.experts as usize);
        let pairs = t * k;
        if e == 0 || e > 1024 {
            self.fail(format!(
                "moe_experts: {e} experts unsupported by the sorted path (1..=1024)"
            ));
            return;
        }
        let max_tiles = pairs.div_ceil(64) + e.min(pairs);
        let Some(sc) = self.scratch(4 + 4 * max_tiles + 2 * pairs, "moe sort", |s| &mut s.moe_scratch) else {
            return;
        };
        let sort = MoeSortArgs {
            experts: e as u32,
            max_tiles: max_tiles as u32,
        };
        self.launch(
            F::MoeSort,
            shape([1, 1, 1], 1024),
            Args::new().push(*p).push(sort).ptr(ids.ptr()).ptr(sc),
        );
        let act = tmp.ptr();
        let y = tmp.ptr() + (pairs * i * 4) as u64;
        let [gw, gs, gb] = gate.ptrs();
        let [uw, us, ub] = up.ptrs();
        let args = Args::new()
            .push(*p)
            .push(gate.desc)
            .push(up.desc)
            .ptr(gw)
            .ptr(gs)
            .ptr(gb)
            .ptr(uw)
            .ptr(us)
            .ptr(ub)
            .ptr(x.ptr())
            .ptr(sc)
            .push(max_tiles as u32)
            .ptr(act);
        let launch = shape([div(i, 64), max_tiles as u32, 1], 128);
        self.launch(Kernel::weight(WeightOp::MoeGemmGateUp, gate.weight), launch, args);
        let [dw, ds, db] = down.ptrs();
        let args = Args::new()
            .push(*p)
            .push(down.desc)
            .ptr(dw)
            .ptr(ds)
            .ptr(db)
            .ptr(sc)
            .push(max_tiles as u32)
            .ptr(act)
            .ptr(y);
        let launch = shape([div(d, 64), max_tiles as u32, 1], 128);
        self.launch(Kernel::weight(WeightOp::MoeGemmDown, down.weight), launch, args);
        let rows = RowsParams {
            tokens: p.tokens,
            dim: d as u32,
        };
        let args = Args::new()
            .push(*p)
            .push(rows)
            .ptr(weights.ptr())
            .ptr(sc)
            .push(max_tiles as u32)
            .ptr(y)
            .ptr(out.ptr());
        self.launch(F::MoeCombineSorted, rows_launch(d, t), args);
    }
}

fn rows_launch(dim: usize, tokens: usize) -> Launch {
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
    /// On the device: one `argmax` launch and a 4-byte read (`step[1]` holds the result). The
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
        let mut args = Args::new().push(n as u32).ptr(src.ptr()).ptr(out);
        let k = Kernel::fixed(F::Argmax).index();
        self.x
            .launch(&self.functions[k], &self.names[k], shape([1, 1, 1], 1024), &mut args)?;
        let mut b = [0u8; 4];
        self.x.read(out, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }
    /// Nothing to open: commands are recorded and launched at `finish` (a repeated list, whatever
    /// its kind, replays its graph).
    fn begin(&self, _kind: StreamKind) -> Result<()> {
        Ok(())
    }
    fn finish(&self) -> Result<()> {
        self.flush()
    }

    fn embed(&self, tokens: usize, table: &CudaMat<X>, ids: &CudaBuf<X>, out: &mut CudaBuf<X>) {
        let d = table.desc.cols as usize;
        if !self.fits("embed", &[("ids", ids.len, tokens), ("out", out.len, tokens * d)]) {
            return;
        }
        let [w, s, b] = table.ptrs();
        let args = Args::new()
            .push(tokens as u32)
            .push(table.desc)
            .ptr(w)
            .ptr(s)
            .ptr(b)
            .ptr(ids.ptr())
            .ptr(out.ptr());
        self.launch(
            Kernel::weight(WeightOp::Embed, table.weight),
            rows_launch(d, tokens),
            args,
        );
    }

    fn rms_norm(&self, p: &RmsNormParams, x: &CudaBuf<X>, w: &CudaBuf<X>, out: &mut CudaBuf<X>) {
        let n = (p.rows * p.dim) as usize;
        if !self.fits(
            "rms_norm",
            &[("x", x.len, n), ("w", w.len, p.dim as usize), ("out", out.len, n)],
        ) {
            return;
        }
        let args = Args::new().push(*p).ptr(x.ptr()).ptr(w.ptr()).ptr(out.ptr());
        self.launch(F::RmsNorm, shape([p.rows, 1, 1], 256), args);
    }

    fn rms_norm_gated(&self, p: &RmsNormParams, x: &CudaBuf<X>, z: &CudaBuf<X>, w: &CudaBuf<X>, out: &mut CudaBuf<X>) {
        let n = (p.rows * p.dim) as usize;
        if !self.fits(
            "rms_norm_gated",
            &[
                ("x", x.len, n),
                ("z", z.len, n),
                ("w", w.len, p.dim as usize),
                ("out", out.len, n),
            ],
        ) {
            return;
        }
        let args = Args::new()
            .push(*p)
            .ptr(x.ptr())
            .ptr(z.ptr())
            .ptr(w.ptr())
            .ptr(out.ptr());
        self.launch(F::RmsNormGated, shape([p.rows, 1, 1], 256), args);
    }

    fn add(&self, p: &RowsParams, x: &mut CudaBuf<X>, y: &CudaBuf<X>) {
        let n = (p.tokens * p.dim) as usize;
        if !self.fits("add", &[("x", x.len, n), ("y", y.len, n)]) {
            return;
        }
        let args = Args::new().push(*p).ptr(x.ptr()).ptr(y.ptr());
        self.launch(F::Add, rows_launch(p.dim as usize, p.tokens as usize), args);
    }

    fn matmul(&self, p: &MatmulParams, w: &CudaMat<X>, x: &CudaBuf<X>, out: &mut CudaBuf<X>) {
        let (t, n, k) = (p.tokens as usize, w.desc.rows as usize, w.desc.cols as usize);
        if !self.fits(
            "matmul",
            &[("x", x.len, (p.x_row0 as usize + t) * k), ("out", out.len, t * n)],
        ) || t == 0
        {
            return;
        }
        let [wp, s, b] = w.ptrs();
        let args = Args::new()
            .push(*p)
            .push(w.desc)
            .ptr(wp)
            .ptr(s)
            .ptr(b)
            .ptr(x.ptr())
            .ptr(out.ptr());
        if t <= self.gemv_tokens {
            let launch = shape([div(n, 32), t as u32, 1], 256);
            self.launch(Kernel::weight(WeightOp::MatmulGemv, w.weight), launch, args);
        } else {
            let launch = shape([div(n, 64), div(t, 64), 1], 128);
            self.launch(Kernel::weight(WeightOp::MatmulMma, w.weight), launch, args);
        }
    }

    /// Several matrices reading the same x: at most `gemv_tokens` tokens, consecutive matrices of
    /// one weight format and one K share a launch (up to 4: `matmul_gemv_multi`); otherwise, and
    /// for a matrix alone, one `matmul` each.
    fn matmuls(&self, p: &MatmulParams, x: &CudaBuf<X>, ws: &[&CudaMat<X>], outs: &mut [&mut CudaBuf<X>]) {
        let t = p.tokens as usize;
        let mut i = 0;
        while i < ws.len().min(outs.len()) {
            let w0 = ws[i];
            let mut n = 1;
            while n < 4
                && i + n < ws.len().min(outs.len())
                && ws[i + n].weight == w0.weight
                && ws[i + n].desc.cols == w0.desc.cols
            {
                n += 1;
            }
            if n == 1 || t == 0 || t > self.gemv_tokens {
                for j in i..i + n {
                    self.matmul(p, ws[j], x, outs[j]);
                }
                i += n;
                continue;
            }
            let k = w0.desc.cols as usize;
            let mut checks = [("x", x.len, (p.x_row0 as usize + t) * k); 5];
            for j in 0..n {
                checks[j + 1] = ("out", outs[i + j].len, t * ws[i + j].desc.rows as usize);
            }
            if !self.fits("matmuls", &checks[..n + 1]) {
                return;
            }
            let mut g = GemvMulti {
                count: n as u32,
                ..Default::default()
            };
            let mut end = 0;
            for j in 0..n {
                end += div(ws[i + j].desc.rows as usize, 32);
                g.ends[j] = end;
            }
            let pick = |j: usize| ws[i + j.min(n - 1)];
            let mut args = Args::new().push(*p).push(g);
            for j in 0..4 {
                args = args.push(pick(j).desc);
            }
            for j in 0..4 {
                let [w, s, b] = pick(j).ptrs();
                args = args.ptr(w).ptr(s).ptr(b);
            }
            args = args.ptr(x.ptr());
            for j in 0..4 {
                args = args.ptr(outs[i + j.min(n - 1)].ptr());
            }
            let launch = shape([end, t as u32, 1], 256);
            self.launch(Kernel::weight(WeightOp::MatmulGemvMulti, w0.weight), launch, args);
            i += n;
        }
    }

    fn qk_norm_rope(
        &self,
        p: &RopeParams,
        q_norm: &CudaBuf<X>,
        k_norm: &CudaBuf<X>,
        qg: &mut CudaBuf<X>,
        k: &mut CudaBuf<X>,
    ) {
        let (t, hd) = (p.tokens as usize, p.head_dim as usize);
        if hd > 1024 || p.rotary_dim > p.head_dim || p.rotary_dim % 2 != 0 {
            self.fail(format!(
                "qk_norm_rope: head_dim {hd} (at most 1024) with rotary_dim {} (even, <= head_dim)",
                p.rotary_dim
            ));
            return;
        }
        if !self.fits(
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
        self.at_pos(p.pos0);
        let args = Args::new()
            .push(RopeParams { pos0: 0, ..*p })
            .ptr(self.step.ptr)
            .ptr(q_norm.ptr())
            .ptr(k_norm.ptr())
            .ptr(qg.ptr())
            .ptr(k.ptr());
        self.launch(F::QkNormRope, shape([p.heads + p.kv_heads, t as u32, 1], 128), args);
    }

    fn kv_store(&self, p: &KvStoreParams, x: &CudaBuf<X>, cache: &mut CudaKv<X>) {
        let (t, w) = (p.tokens as usize, p.width as usize);
        if !self.fits("kv_store", &[("x", x.len, t * w)])
            || !self.cache_fits("kv_store", "cache", cache, p.pos0 as usize + t, w)
        {
            return;
        }
        let d = cache.desc();
        self.at_pos(p.pos0);
        let args = Args::new()
            .push(KvStoreParams { pos0: 0, ..*p })
            .ptr(self.step.ptr)
            .push(d)
            .ptr(x.ptr());
        self.launch(F::KvStore, rows_launch(w, t), args);
    }

    fn attention(&self, p: &AttentionParams, qg: &CudaBuf<X>, k: &CudaKv<X>, v: &CudaKv<X>, out: &mut CudaBuf<X>) {
        let (t, h, kvh, hd) = (
            p.tokens as usize,
            p.heads as usize,
            p.kv_heads as usize,
            p.head_dim as usize,
        );
        if kvh == 0 || h % kvh != 0 || h / kvh > 32 || hd % 32 != 0 || hd == 0 || hd > 256 {
            self.fail(format!(
                "attention: {h} heads over {kvh} KV heads (at most 32 per KV head) of dim {hd} (a multiple of 32, at most 256) unsupported"
            ));
            return;
        }
        let width = kvh * hd;
        let rows = p.pos0 as usize + t;
        if !self.fits(
            "attention",
            &[("qg", qg.len, t * h * 2 * hd), ("out", out.len, t * h * hd)],
        ) || !self.cache_fits("attention", "k_cache", k, rows, width)
            || !self.cache_fits("attention", "v_cache", v, rows, width)
        {
            return;
        }
        let (kd, vd) = (k.desc(), v.desc());
        self.at_pos(p.pos0);
        let splits = if t == 1 { DECODE_SPLITS } else { 1 };
        let target = if splits > 1 {
            match self.scratch(h * splits as usize * (hd + 2), "attention partials", |s| {
                &mut s.partials
            }) {
                Some(ptr) => ptr,
                None => return,
            }
        } else {
            out.ptr()
        };
        let pp = AttentionParams { pos0: 0, ..*p };
        let args = Args::new()
            .push(pp)
            .push(splits)
            .ptr(self.step.ptr)
            .push(kd)
            .push(vd)
            .ptr(qg.ptr())
            .ptr(target);
        let launch = shape([kvh as u32, t as u32, splits], (h / kvh * 32) as u32);
        self.launch(F::Attention, launch, args);
        if splits > 1 {
            let args = Args::new()
                .push(pp)
                .push(splits)
                .ptr(target)
                .ptr(qg.ptr())
                .ptr(out.ptr());
            self.launch(F::AttentionReduce, shape([h as u32, t as u32, 1], 256), args);
        }
    }

    fn delta_net_conv(
        &self,
        p: &ConvParams,
        w: &CudaBuf<X>,
        state: &mut CudaBuf<X>,
        x: &CudaBuf<X>,
        out: &mut CudaBuf<X>,
    ) {
        let (t, c, taps) = (p.tokens as usize, p.channels as usize, p.taps as usize);
        if taps == 0 || taps > MAX_CONV_TAPS {
            self.fail(format!("delta_net_conv: {taps} taps (1..={MAX_CONV_TAPS})"));
            return;
        }
        if !self.fits(
            "delta_net_conv",
            &[
                ("w", w.len, c * taps),
                ("state", state.len, (taps - 1) * c),
                ("x", x.len, t * c),
                ("out", out.len, t * c),
            ],
        ) {
            return;
        }
        let args = Args::new()
            .push(*p)
            .ptr(w.ptr())
            .ptr(state.ptr())
            .ptr(x.ptr())
            .ptr(out.ptr());
        self.launch(F::DeltaNetConv, shape([div(c, 256), 1, 1], 256), args);
    }

    fn delta_net(
        &self,
        p: &DeltaNetParams,
        qkv: &CudaBuf<X>,
        a: &CudaBuf<X>,
        b: &CudaBuf<X>,
        a_log: &CudaBuf<X>,
        dt_bias: &CudaBuf<X>,
        state: &mut CudaBuf<X>,
        out: &mut CudaBuf<X>,
    ) {
        let (t, hk, hv, dk, dv) = (
            p.tokens as usize,
            p.key_heads as usize,
            p.value_heads as usize,
            p.key_dim as usize,
            p.value_dim as usize,
        );
        if hk == 0 || hv % hk != 0 || dk == 0 || dk > 256 || dv == 0 {
            self.fail(format!(
                "delta_net: {hv} value heads over {hk} key heads with key dim {dk} (at most 256) unsupported"
            ));
            return;
        }
        let width = 2 * hk * dk + hv * dv;
        if !self.fits(
            "delta_net",
            &[
                ("qkv", qkv.len, t * width),
                ("a", a.len, t * hv),
                ("b", b.len, t * hv),
                ("a_log", a_log.len, hv),
                ("dt_bias", dt_bias.len, hv),
                ("state", state.len, hv * dk * dv),
                ("out", out.len, t * hv * dv),
            ],
        ) {
            return;
        }
        // Prefill (Dk <= 128): the per-token normalisation and gates in parallel, then the scan
        // with each value column of S in one lane's registers. Decode: the one-kernel step.
        if t > self.gemv_tokens && dk <= 128 {
            let need = t * (2 * hk * dk + 2 * hv);
            let Some(sc) = self.scratch(need, "delta_net scratch", |s| &mut s.delta_scratch) else {
                return;
            };
            let args = Args::new()
                .push(*p)
                .ptr(qkv.ptr())
                .ptr(a.ptr())
                .ptr(b.ptr())
                .ptr(a_log.ptr())
                .ptr(dt_bias.ptr())
                .ptr(sc);
            self.launch(F::DeltaNetPrep, shape([t as u32, 1, 1], 256), args);
            let args = Args::new()
                .push(*p)
                .ptr(qkv.ptr())
                .ptr(sc)
                .ptr(state.ptr())
                .ptr(out.ptr());
            self.launch(F::DeltaNetScan, shape([div(dv, 32), hv as u32, 1], 32), args);
            return;
        }
        let args = Args::new()
            .push(*p)
            .ptr(qkv.ptr())
            .ptr(a.ptr())
            .ptr(b.ptr())
            .ptr(a_log.ptr())
            .ptr(dt_bias.ptr())
            .ptr(state.ptr())
            .ptr(out.ptr());
        self.launch(F::DeltaNet, shape([div(dv, 32), hv as u32, 1], 128), args);
    }

    fn moe_route(&self, p: &RouteParams, logits: &CudaBuf<X>, ids: &mut CudaBuf<X>, weights: &mut CudaBuf<X>) {
        let (t, e, k) = (p.tokens as usize, p.experts as usize, p.top_k as usize);
        if e == 0 || e > 1024 || k == 0 || k > e.min(64) {
            self.fail(format!(
                "moe_route: top {k} of {e} experts unsupported (E <= 1024, K <= min(E, 64))"
            ));
            return;
        }
        if !self.fits(
            "moe_route",
            &[
                ("logits", logits.len, t * e),
                ("ids", ids.len, t * k),
                ("weights", weights.len, t * k),
            ],
        ) {
            return;
        }
        let args = Args::new().push(*p).ptr(logits.ptr()).ptr(ids.ptr()).ptr(weights.ptr());
        self.launch(F::MoeRoute, shape([t as u32, 1, 1], 256), args);
    }

    fn moe_experts(
        &self,
        p: &MoeParams,
        x: &CudaBuf<X>,
        ids: &CudaBuf<X>,
        weights: &CudaBuf<X>,
        gate: &CudaMat<X>,
        up: &CudaMat<X>,
        down: &CudaMat<X>,
        tmp: &mut CudaBuf<X>,
        out: &mut CudaBuf<X>,
    ) {
        let (t, k) = (p.tokens as usize, p.top_k as usize);
        let (i, d) = (gate.desc.rows as usize, gate.desc.cols as usize);
        let pairs = t * k;
        if pairs > 65535
            || up.desc.rows != gate.desc.rows
            || down.desc.cols as usize != i
            || down.desc.rows as usize != d
        {
            self.fail(format!(
                "moe_experts: {pairs} token-expert pairs (at most 65535) or mismatched expert shapes"
            ));
            return;
        }
        if !self.fits(
            "moe_experts",
            &[
                ("x", x.len, t * d),
                ("ids", ids.len, pairs),
                ("weights", weights.len, pairs),
                ("tmp", tmp.len, pairs * (i + d)),
                ("out", out.len, t * d),
            ],
        ) || pairs == 0
        {
            return;
        }
        if t > self.gemv_tokens {
            return self.moe_experts_sorted(p, x, ids, weights, gate, up, down, tmp, out);
        }
        let act = tmp.ptr();
        let y = tmp.ptr() + (pairs * i * 4) as u64;
        let [gw, gs, gb] = gate.ptrs();
        let [uw, us, ub] = up.ptrs();
        let args = Args::new()
            .push(*p)
            .push(gate.desc)
            .push(up.desc)
            .ptr(gw)
            .ptr(gs)
            .ptr(gb)
            .ptr(uw)
            .ptr(us)
            .ptr(ub)
            .ptr(x.ptr())
            .ptr(ids.ptr())
            .ptr(act);
        let launch = shape([div(i, 32), pairs as u32, 1], 256);
        self.launch(Kernel::weight(WeightOp::MoeGateUp, gate.weight), launch, args);
        let [dw, ds, db] = down.ptrs();
        let args = Args::new()
            .push(*p)
            .push(down.desc)
            .ptr(dw)
            .ptr(ds)
            .ptr(db)
            .ptr(ids.ptr())
            .ptr(act)
            .ptr(y);
        let launch = shape([div(d, 32), pairs as u32, 1], 256);
        self.launch(Kernel::weight(WeightOp::MoeDown, down.weight), launch, args);
        let rows = RowsParams {
            tokens: p.tokens,
            dim: d as u32,
        };
        let args = Args::new().push(*p).push(rows).ptr(weights.ptr()).ptr(y).ptr(out.ptr());
        self.launch(F::MoeCombine, rows_launch(d, t), args);
    }

    fn swiglu(&self, p: &RowsParams, gate: &CudaBuf<X>, up: &CudaBuf<X>, out: &mut CudaBuf<X>) {
        let n = (p.tokens * p.dim) as usize;
        if !self.fits(
            "swiglu",
            &[("gate", gate.len, n), ("up", up.len, n), ("out", out.len, n)],
        ) {
            return;
        }
        let args = Args::new().push(*p).ptr(gate.ptr()).ptr(up.ptr()).ptr(out.ptr());
        self.launch(F::Swiglu, rows_launch(p.dim as usize, p.tokens as usize), args);
    }

    fn sigmoid_gate_add(&self, p: &RowsParams, y: &CudaBuf<X>, gate: &CudaBuf<X>, out: &mut CudaBuf<X>) {
        let n = (p.tokens * p.dim) as usize;
        if !self.fits(
            "sigmoid_gate_add",
            &[
                ("y", y.len, n),
                ("gate", gate.len, p.tokens as usize),
                ("out", out.len, n),
            ],
        ) {
            return;
        }
        let args = Args::new().push(*p).ptr(y.ptr()).ptr(gate.ptr()).ptr(out.ptr());
        self.launch(F::SigmoidGateAdd, rows_launch(p.dim as usize, p.tokens as usize), args);
    }
}
