//! The Metal backend. The encoding logic (which kernel, which bindings, grid and threadgroup
//! sizes, buffer plan) lives here once, generic over an [`Executor`]: the real device
//! (`device.rs`, Apple targets) or the simulator ([`sim::Sim`], which runs the same shaders on
//! the CPU, so the whole command stream is tested on Linux).
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

use args::bytes_of;
pub use buffers::{MetalBuf, MetalMatrix};
pub use executor::{Arg, Executor, GpuFamily, Grid, ParamBytes, StreamLabel};
use kernels::Fixed as F;
pub use kernels::{Fixed, GemmOp, GemmTile, GemvOp, GemvRows, Kernel, Variants, Weight, WeightOp};
use stream::{Scratch, Stream};

use super::{params::*, Backend};
use crate::{
    error::{Error, Result},
    ops::*,
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
            .unwrap_or(delta_net::metal::DN_CHUNK as u32);
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
            "{}; kernel variants: GEMV {} rows per simdgroup, GEMM tiles of 32 x {}",
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

    fn name(&self) -> &'static str {
        X::NAME
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
    fn begin(&self) -> Result<()> {
        Ok(())
    }
    fn finish(&self) -> Result<()> {
        self.flush()
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

    fn kv_store(&self, p: &KvStoreParams, x: &MetalBuf<X>, cache: &mut MetalBuf<X>) {
        attention::metal::kv_store(self, p, x, cache)
    }

    fn attention(
        &self,
        p: &AttentionParams,
        qg: &MetalBuf<X>,
        k_cache: &MetalBuf<X>,
        v_cache: &MetalBuf<X>,
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
        let (t, e, k) = (p.tokens as usize, p.experts as usize, p.top_k as usize);
        if e > 1024 || k > 64 || k > e {
            return self.fail(format!(
                "moe_route: top {k} of {e} experts unsupported (E <= 1024, K <= 64)"
            ));
        }
        if !self.fits(
            "moe_route",
            &[
                ("logits", logits.len(), t * e),
                ("ids", ids.len(), t * k),
                ("weights", weights.len(), t * k),
            ],
        ) {
            return;
        }
        let grid = Grid::Groups {
            count: [t as u32, 1, 1],
            size: [256, 1, 1],
        };
        self.encode(
            F::MoeRoute,
            &[Arg::Bytes(bytes_of(p)), logits.arg(), ids.arg(), weights.arg()],
            grid,
        );
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
        let (t, k) = (p.tokens as usize, p.top_k as usize);
        let (i, d) = (gate.desc.rows as usize, gate.desc.cols as usize);
        if gate.weight != up.weight || gate.weight != down.weight {
            return self.fail(format!(
                "moe_experts: gate/up/down formats differ ({}, {}, {})",
                gate.weight.suffix(),
                up.weight.suffix(),
                down.weight.suffix()
            ));
        }
        let checks = [
            ("x", x.len(), t * d),
            ("ids", ids.len(), t * k),
            ("weights", weights.len(), t * k),
            ("tmp", tmp.len(), t * k * (i + d)),
            ("out", out.len(), t * d),
        ];
        if !self.fits("moe_experts", &checks) {
            return;
        }
        if t > self.moe_gemm_tokens as usize && gate.experts <= 1024 {
            return self.moe_experts_sorted(p, x, ids, weights, gate, up, down, tmp, out);
        }
        // tmp = [act [T*K, I] | y [T*K, D]]: two disjoint bindings of one buffer.
        let (act, y) = ((0, t * k * i), (t * k * i, t * k * d));
        let part = |r: (usize, usize)| tmp.part(r.0, r.1);
        let pb = || Arg::Bytes(bytes_of(p));
        let [gw, gs, gb] = self.weights(gate);
        let [uw, us, ub] = self.weights(up);
        let args = [
            pb(),
            Arg::Bytes(bytes_of(&gate.desc)),
            Arg::Bytes(bytes_of(&up.desc)),
            gw,
            gs,
            gb,
            uw,
            us,
            ub,
            x.arg(),
            ids.arg(),
            part(act),
        ];
        let tk = (t * k) as u32;
        let v = self.variants;
        let rows_per_group = 4 * v.gemv.rows();
        self.encode(
            v.gemv_kernel(GemvOp::MoeGateUp, gate.weight),
            &args,
            Grid::Groups {
                count: [ceil_div(i, rows_per_group), tk, 1],
                size: [128, 1, 1],
            },
        );
        let [dw, ds, db] = self.weights(down);
        let args = [
            pb(),
            Arg::Bytes(bytes_of(&down.desc)),
            dw,
            ds,
            db,
            ids.arg(),
            part(act),
            part(y),
        ];
        self.encode(
            v.gemv_kernel(GemvOp::MoeDown, down.weight),
            &args,
            Grid::Groups {
                count: [ceil_div(d, rows_per_group), tk, 1],
                size: [128, 1, 1],
            },
        );
        let rows = RowsParams {
            tokens: p.tokens,
            dim: d as u32,
        };
        let args = [pb(), Arg::Bytes(bytes_of(&rows)), weights.arg(), part(y), out.arg()];
        self.encode(F::MoeCombine, &args, rows_grid(d, t));
    }

    fn swiglu(&self, p: &RowsParams, gate: &MetalBuf<X>, up: &MetalBuf<X>, out: &mut MetalBuf<X>) {
        elementwise::metal::swiglu(self, p, gate, up, out)
    }

    fn sigmoid_gate_add(&self, p: &RowsParams, y: &MetalBuf<X>, gate: &MetalBuf<X>, out: &mut MetalBuf<X>) {
        elementwise::metal::sigmoid_gate_add(self, p, y, gate, out)
    }
}

/// Rows (token pairs) of one expert block of the sorted MoE path and the K step of its GEMMs
/// (`MOE_TILE` in moe.metal; the weight-row side of the tiles is the `GemmTile` variant).
const MOE_TILE: usize = 32;
/// Tokens per sort block of `moe_histogram` / `moe_scatter`.
const MOE_SORT_TOKENS: usize = 32;

/// Where the regions of the sorted-MoE routing scratch lie: (first element, elements) in u32.
#[derive(Clone, Copy, Debug)]
struct MoeSortLayout {
    count: (usize, usize),
    blocks: (usize, usize),
    hist: (usize, usize),
    order: (usize, usize),
    pos: (usize, usize),
    max_blocks: usize,
}

/// The routing of the sorted MoE path, read back (`Metal::moe_sort`, for tests).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoeSorted {
    /// (expert, first sorted row, rows) of each 32-row block, in order.
    pub blocks: Vec<[u32; 3]>,
    /// Sorted row -> pair t*K + k.
    pub order: Vec<u32>,
    /// Pair t*K + k -> sorted row.
    pub pos: Vec<u32>,
}

impl<X: Executor> Metal<X> {
    /// Encode the routing of the sorted MoE path for ids [T, K] over `experts` experts:
    /// `moe_histogram` (pairs per expert per sort block), `moe_scan` (sorted row offsets and the
    /// block map) and `moe_scatter` (order / pos). The scratch buffer and its layout.
    fn encode_moe_sort(
        &self,
        p: &MoeParams,
        ids: &MetalBuf<X>,
        experts: usize,
    ) -> Option<(MetalBuf<X>, MoeSortLayout)> {
        let (t, k, e) = (p.tokens as usize, p.top_k as usize, experts);
        let pairs = t * k;
        let token_blocks = t.div_ceil(MOE_SORT_TOKENS);
        let max_blocks = pairs.div_ceil(MOE_TILE) + e.min(pairs);
        if e == 0 || e > 1024 {
            self.fail(format!(
                "moe_experts: {e} experts unsupported by the sorted path (1..=1024)"
            ));
            return None;
        }
        if !self.fits("moe_experts", &[("ids", ids.len(), pairs)]) {
            return None;
        }
        let sd = MoeSortDesc {
            experts: e as u32,
            token_blocks: token_blocks as u32,
            sort_tokens: MOE_SORT_TOKENS as u32,
            max_blocks: max_blocks as u32,
        };
        // count [4] | blocks [max_blocks, 4] | hist [token_blocks, E] | order [T*K] | pos [T*K]
        let mut at = 0;
        let mut next = |n: usize| {
            at += n;
            (at - n, n)
        };
        let l = MoeSortLayout {
            count: next(4),
            blocks: next(4 * max_blocks),
            hist: next(token_blocks * e),
            order: next(pairs),
            pos: next(pairs),
            max_blocks,
        };
        let sc = self.scratch(Scratch::MoeSort, at)?;
        let region = |r: (usize, usize)| sc.part(r.0, r.1);
        let pb = || Arg::Bytes(bytes_of(p));
        let sb = || Arg::Bytes(bytes_of(&sd));
        let sort_grid = Grid::Threads {
            threads: [e as u32, token_blocks as u32, 1],
            size: [64, 1, 1],
        };
        self.encode(F::MoeHistogram, &[pb(), sb(), ids.arg(), region(l.hist)], sort_grid);
        let scan = Grid::Groups {
            count: [1, 1, 1],
            size: [(e.div_ceil(32) * 32) as u32, 1, 1],
        };
        let args = [pb(), sb(), region(l.hist), region(l.count), region(l.blocks)];
        self.encode(F::MoeScan, &args, scan);
        let args = [pb(), sb(), ids.arg(), region(l.hist), region(l.order), region(l.pos)];
        self.encode(F::MoeScatter, &args, sort_grid);
        Some((sc, l))
    }

    /// Run the routing of the sorted MoE path alone and read it back (tests: the kernels
    /// `moe_histogram`, `moe_scan` and `moe_scatter` against a plain counting sort).
    pub fn moe_sort(&self, p: &MoeParams, ids: &MetalBuf<X>, experts: usize) -> Result<MoeSorted> {
        let enc = self.encode_moe_sort(p, ids, experts);
        self.flush()?;
        let Some((sc, l)) = enc else {
            return Err(Error::Device("moe_sort: nothing encoded".into()));
        };
        let get = |r: (usize, usize)| -> Result<Vec<u32>> {
            let mut v = vec![0f32; r.1];
            self.read(&sc, r.0, &mut v)?;
            Ok(v.iter().map(|x| x.to_bits()).collect())
        };
        let n = get(l.count)?[0] as usize;
        let blocks = get(l.blocks)?.chunks(4).take(n).map(|b| [b[0], b[1], b[2]]).collect();
        Ok(MoeSorted {
            blocks,
            order: get(l.order)?,
            pos: get(l.pos)?,
        })
    }

    /// `moe_experts` for prefill: route-sorted expert GEMMs, with no CPU round-trip. The pairs
    /// p = t*K + k are counted per expert (`moe_histogram`), scanned into per-expert row offsets
    /// and a map of 32-row blocks (`moe_scan`), scattered into expert-sorted order
    /// (`moe_scatter`); each block then runs gate/up + SwiGLU (`moe_gemm_gate_up`, into
    /// act [T*K, I] of `tmp`) and down (`moe_gemm_down`, into y [T*K, D] of `tmp`) with the
    /// weights dequantized tile by tile, and `moe_combine_sorted` sums the K rows of each token
    /// in slot order. The block grids are sized for the worst case (`max_blocks`); the
    /// threadgroups past the block count return at once.
    #[allow(clippy::too_many_arguments)]
    fn moe_experts_sorted(
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
        let (t, k) = (p.tokens as usize, p.top_k as usize);
        let (i, d) = (gate.desc.rows as usize, gate.desc.cols as usize);
        let pairs = t * k;
        let Some((sc, l)) = self.encode_moe_sort(p, ids, gate.experts as usize) else {
            return;
        };
        let region = |r: (usize, usize)| sc.part(r.0, r.1);
        let (count, blocks, order, pos) = (
            || region(l.count),
            || region(l.blocks),
            || region(l.order),
            || region(l.pos),
        );
        let max_blocks = l.max_blocks;
        let pb = || Arg::Bytes(bytes_of(p));
        // tmp = [act [T*K, I] | y [T*K, D]], both in sorted row order.
        let act = || tmp.part(0, pairs * i);
        let y = || tmp.part(pairs * i, pairs * d);
        let v = self.variants;
        let tn = v.gemm.rows();
        let (x_tile, w_tile) = (MOE_TILE * MOE_TILE * 4, tn * MOE_TILE * 4);
        let [gw, gs, gb] = self.weights(gate);
        let [uw, us, ub] = self.weights(up);
        let args = [
            pb(),
            Arg::Bytes(bytes_of(&gate.desc)),
            Arg::Bytes(bytes_of(&up.desc)),
            gw,
            gs,
            gb,
            uw,
            us,
            ub,
            x.arg(),
            count(),
            blocks(),
            order(),
            act(),
        ];
        let grid = Grid::Groups {
            count: [ceil_div(i, tn), max_blocks as u32, 1],
            size: [128, 1, 1],
        };
        self.encode_tg(
            v.gemm_kernel(GemmOp::MoeGemmGateUp, gate.weight),
            &args,
            grid,
            &[x_tile, w_tile, w_tile],
        );
        let [dw, ds, db] = self.weights(down);
        let args = [
            pb(),
            Arg::Bytes(bytes_of(&down.desc)),
            dw,
            ds,
            db,
            count(),
            blocks(),
            act(),
            y(),
        ];
        let grid = Grid::Groups {
            count: [ceil_div(d, tn), max_blocks as u32, 1],
            size: [128, 1, 1],
        };
        self.encode_tg(
            v.gemm_kernel(GemmOp::MoeGemmDown, down.weight),
            &args,
            grid,
            &[x_tile, w_tile],
        );
        let rows = RowsParams {
            tokens: p.tokens,
            dim: d as u32,
        };
        let args = [pb(), Arg::Bytes(bytes_of(&rows)), weights.arg(), pos(), y(), out.arg()];
        self.encode(F::MoeCombineSorted, &args, rows_grid(d, t));
    }
}
