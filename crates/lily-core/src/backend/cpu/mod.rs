//! The CPU backend: host memory, immediate execution on the CPU thread pool (`pool.rs`).
//! `Cpu::new()` runs the production kernels (`ops/<family>/cpu.rs`); `Cpu::reference()` runs the
//! plain-loop twins (`ops/<family>/reference.rs`) that every kernel is tested against, through
//! the same interface, so a whole forward pass can be compared too.
//!
//! The plumbing the kernels share lives here: the pool, the ISA choice (`isa.rs`), the SIMD
//! primitives (`simd.rs`, with the integer 4-bit dot of `int8.rs`), per-thread scratch
//! (`scratch.rs`) and the profiler (`profile.rs`). Imports run one way: int8 <- simd <- the op
//! kernels <- this file.

pub mod int8;
pub mod isa;
pub mod kv;
pub mod pool;
mod profile;
pub mod scratch;
pub mod simd;

pub use int8::Precision;

use super::{
    check_rows, delta_net_batch_by_row, moe_router_unfused, params::*, qk_norm_rope_store_attention_by_row,
    AttentionBatch, Backend, DeltaNetIn, DeltaNetOps, DeltaNetSeq, KvDtype, KvSegment, KvSeq, MoeExperts, OneRow,
    Router, Routing, StreamKind,
};
use crate::{
    error::{Error, Result},
    ops,
    quant::Matrix,
};
use kv::CpuKv;

pub struct Cpu {
    reference: bool,
    /// How the quantized matmuls round the activations ([`Precision`]); the reference twins are exact.
    precision: Precision,
}

impl Cpu {
    pub fn new() -> Self {
        Self::with_precision(Precision::Exact)
    }
    /// The production kernels with the quantized matmuls in precision `precision`.
    pub fn with_precision(precision: Precision) -> Self {
        Cpu {
            reference: false,
            precision,
        }
    }
    pub fn reference() -> Self {
        Cpu {
            reference: true,
            precision: Precision::Exact,
        }
    }
}

impl Default for Cpu {
    fn default() -> Self {
        Self::new()
    }
}

/// Element types whose all-zero bytes are the value 0.
trait Zero: Copy {}
impl Zero for f32 {}
impl Zero for u32 {}
impl Zero for u16 {}

/// A zeroed buffer straight from the allocator (calloc / fresh pages): pages never touched, like
/// the unused end of a long KV cache, cost no physical memory. A size the machine cannot give
/// is a typed error, not an abort.
fn zeroed<T: Zero>(len: usize) -> Result<Vec<T>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    let too_big = || {
        Error::Device(format!(
            "cannot allocate {len} x {} bytes of host memory",
            size_of::<T>()
        ))
    };
    let layout = std::alloc::Layout::array::<T>(len).map_err(|_| too_big())?;
    // SAFETY: the layout has a non-zero size; all-zero bytes are a valid T (`Zero`); the Vec
    // takes ownership of memory from the global allocator with exactly this layout.
    unsafe {
        let p = std::alloc::alloc_zeroed(layout) as *mut T;
        if p.is_null() {
            return Err(too_big());
        }
        Ok(Vec::from_raw_parts(p, len, len))
    }
}

/// Values per task of [`first_max_par`]: a vocabulary row (248,320 logits, ~1 MB) is 16 tasks.
const ARGMAX_CHUNK: usize = 16384;

/// [`first_max`](super::first_max) of `v` on the pool, chunk by chunk: a greedy batched step
/// scans B vocabulary rows on the calling thread otherwise (~1 MB each), while the workers wait
/// for the next step. Each chunk's first largest value, then the first chunk holding the largest
/// of those (NaN never wins; no number at all: index 0): the same index as one pass. Indices in
/// caller ids scratch (the argmax runs between kernels, never inside one).
pub(crate) fn first_max_par(v: &[f32]) -> u32 {
    // One thread: one pass (the chunks' position scans cost ~30 % more than one, measured here).
    if v.len() <= ARGMAX_CHUNK || pool::threads() == 1 {
        return super::first_max(v);
    }
    let chunks = v.len().div_ceil(ARGMAX_CHUNK);
    scratch::with_caller_ids(chunks, |first| {
        pool::for_chunks(first, 1, |c, i| {
            let part = &v[c * ARGMAX_CHUNK..((c + 1) * ARGMAX_CHUNK).min(v.len())];
            i[0] = (c * ARGMAX_CHUNK) as u32 + super::first_max(part);
        });
        let mut top: Option<u32> = None;
        for &i in first.iter() {
            let x = v[i as usize];
            if !x.is_nan() && top.is_none_or(|t| x > v[t as usize]) {
                top = Some(i);
            }
        }
        top.unwrap_or(0)
    })
}

/// Call the reference twin or the production CPU kernel of an op (`ops/<family>/{reference,
/// cpu}.rs`) with the same arguments (timed under `LILY_CPU_PROFILE`).
macro_rules! dispatch {
    ($self:ident, $family:ident::$op:ident($($arg:expr),*)) => {
        profile::timed(stringify!($op), 0, || call!($self, $family::$op($($arg),*)))
    };
}
macro_rules! call {
    ($self:ident, $family:ident::$op:ident($($arg:expr),*)) => {
        if $self.reference { ops::$family::reference::$op($($arg),*) } else { ops::$family::cpu::$op($($arg),*) }
    };
}

impl Drop for Cpu {
    fn drop(&mut self) {
        if profile::on() {
            profile::report();
        }
    }
}

impl Backend for Cpu {
    type Buf = Vec<f32>;
    type Ids = Vec<u32>;
    type Matrix = Matrix;
    type Kv = CpuKv;

    fn name(&self) -> &'static str {
        if self.reference {
            "cpu-reference"
        } else {
            "cpu"
        }
    }

    /// 1024 tokens (about 270 KB of scratch per token at the real shapes): each of the 256
    /// experts then sees ~32 tokens per dequantized tile. Measured on `lily synth --layers 4`,
    /// 1024-token prompt, this machine: 114 / 132 / 149 tok/s with chunks of 256 / 512 / 1024.
    fn prefill_chunk(&self) -> usize {
        1024
    }
    /// One pool session: the workers busy-wait between the call's kernels instead of sleeping
    /// (a wake-up per kernel, ~40 us each on virtual cores, hundreds per decode step).
    fn run<R: Send>(f: impl FnOnce() -> R + Send) -> R {
        pool::run(f)
    }
    fn kv_new(&self, width: usize, dtype: KvDtype, max_rows: usize, seg_rows: usize) -> Result<CpuKv> {
        CpuKv::new(width, dtype, max_rows, seg_rows)
    }
    fn kv_reserve(&self, kv: &mut CpuKv, rows: usize) -> Result<()> {
        kv.reserve(rows)
    }
    fn kv_trim(&self, kv: &mut CpuKv, rows: usize) {
        kv.trim(rows)
    }
    fn kv_rows(&self, kv: &CpuKv) -> usize {
        kv.rows()
    }
    fn kv_bytes(&self, kv: &CpuKv) -> usize {
        kv.bytes()
    }
    fn kv_read(&self, kv: &CpuKv, row0: usize, out: &mut [f32]) -> Result<()> {
        kv.read(row0, out)
    }
    fn kv_copy(&self, src: &CpuKv, dst: &mut CpuKv, rows: usize) -> Result<()> {
        dst.copy_from(src, rows)
    }
    fn kv_share(&self, src: &CpuKv, rows: usize) -> Result<CpuKv> {
        src.share(rows)
    }
    fn kv_unshare(&self, kv: &mut CpuKv, row0: usize, rows: usize) -> Result<()> {
        kv.unshare(row0, rows)
    }
    fn kv_segments(&self, kv: &CpuKv) -> Vec<KvSegment> {
        kv.segments()
    }
    fn alloc(&self, len: usize) -> Result<Vec<f32>> {
        zeroed(len)
    }
    fn alloc_ids(&self, len: usize) -> Result<Vec<u32>> {
        zeroed(len)
    }
    fn upload(&self, data: &[f32]) -> Result<Vec<f32>> {
        Ok(data.to_vec())
    }
    fn upload_matrix(&self, m: &Matrix) -> Result<Matrix> {
        Ok(m.clone()) // zero-copy: the matrix points into the mapped checkpoint
    }
    fn write_ids(&self, dst: &mut Vec<u32>, data: &[u32]) -> Result<()> {
        dst[..data.len()].copy_from_slice(data);
        Ok(())
    }
    fn read(&self, src: &Vec<f32>, offset: usize, out: &mut [f32]) -> Result<()> {
        out.copy_from_slice(&src[offset..offset + out.len()]);
        Ok(())
    }
    fn argmax_at(&self, src: &Vec<f32>, offset: usize, n: usize) -> Result<u32> {
        Ok(first_max_par(&src[offset..offset + n]))
    }
    fn fill_zero(&self, buf: &mut Vec<f32>) -> Result<()> {
        buf.fill(0.0);
        Ok(())
    }
    fn copy(&self, src: &Vec<f32>, dst: &mut Vec<f32>, len: usize) -> Result<()> {
        dst[..len].copy_from_slice(&src[..len]);
        Ok(())
    }
    fn copy_rows(&self, src: &Vec<f32>, src_off: usize, dst: &mut Vec<f32>, dst_off: usize, len: usize) -> Result<()> {
        check_rows(src.len(), src_off, dst.len(), dst_off, len)?;
        dst[dst_off..dst_off + len].copy_from_slice(&src[src_off..src_off + len]);
        Ok(())
    }
    fn begin(&self, kind: StreamKind) -> Result<()> {
        profile::phase(kind);
        Ok(())
    }
    fn finish(&self) -> Result<()> {
        Ok(())
    }

    fn embed(&self, tokens: usize, table: &Matrix, ids: &Vec<u32>, out: &mut Vec<f32>) {
        dispatch!(self, embed::embed(tokens, table, ids, out))
    }
    fn rms_norm(&self, p: &RmsNormParams, x: &Vec<f32>, w: &Vec<f32>, out: &mut Vec<f32>) {
        dispatch!(self, norm::rms_norm(p, x, w, out))
    }
    fn rms_norm_gated(&self, p: &RmsNormParams, x: &Vec<f32>, z: &Vec<f32>, w: &Vec<f32>, out: &mut Vec<f32>) {
        dispatch!(self, norm::rms_norm_gated(p, x, z, w, out))
    }
    fn add(&self, p: &RowsParams, x: &mut Vec<f32>, y: &Vec<f32>) {
        dispatch!(self, elementwise::add(p, x, y))
    }
    fn matmul(&self, p: &MatmulParams, w: &Matrix, x: &Vec<f32>, out: &mut Vec<f32>) {
        profile::timed_matrices(&[w], || {
            if self.reference {
                ops::matmul::reference::matmul(p, w, x, out)
            } else {
                ops::matmul::cpu::matmul_with(isa::Isa::get(), self.precision, p, w, x, out)
            }
        })
    }
    fn matmuls(&self, p: &MatmulParams, x: &Vec<f32>, ws: &[&Matrix], outs: &mut [&mut Vec<f32>]) {
        if self.reference || !ops::matmul::cpu::fuses(p, ws) {
            for (w, out) in ws.iter().zip(outs.iter_mut()) {
                self.matmul(p, w, x, out);
            }
            return;
        }
        profile::timed_matrices(ws, || ops::matmul::cpu::matmuls(self.precision, p, x, ws, outs))
    }
    fn qk_norm_rope(&self, p: &RopeParams, q_norm: &Vec<f32>, k_norm: &Vec<f32>, qg: &mut Vec<f32>, k: &mut Vec<f32>) {
        dispatch!(self, attention::qk_norm_rope(p, q_norm, k_norm, qg, k))
    }
    fn kv_store(&self, p: &KvStoreParams, x: &Vec<f32>, cache: &mut CpuKv) {
        dispatch!(self, attention::kv_store(p, x, cache))
    }
    fn attention(&self, p: &AttentionParams, qg: &Vec<f32>, k: &CpuKv, v: &CpuKv, out: &mut Vec<f32>) {
        dispatch!(self, attention::attention(p, qg, k, v, out))
    }
    /// Every sequence's norms in one pool loop, the stores on the calling thread (a row each), the
    /// attention of every sequence in two more (its key runs, then the merges).
    fn qk_norm_rope_store_attention_batch(
        &self,
        r: &AttentionBatch<'_, Self>,
        seqs: &mut [KvSeq<'_, CpuKv>],
        qg: &mut Vec<f32>,
        k: &mut Vec<f32>,
        one: &mut OneRow<'_, Self>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        if self.reference {
            return qk_norm_rope_store_attention_by_row(self, r, seqs, qg, k, one, out);
        }
        let pos = |i: usize| seqs[i].pos;
        profile::timed("qk_norm_rope_batch", 0, || {
            ops::attention::cpu::qk_norm_rope_batch(&r.rope, pos, r.q_norm, r.k_norm, qg, k)
        });
        let width = (r.rope.kv_heads * r.rope.head_dim) as usize;
        profile::timed("kv_store", 0, || {
            for (i, sq) in seqs.iter_mut().enumerate() {
                let store = KvStoreParams {
                    tokens: 1,
                    pos0: sq.pos as u32,
                    width: width as u32,
                };
                ops::attention::cpu::kv_store(&store, &k[i * width..][..width], sq.k);
                ops::attention::cpu::kv_store(&store, &r.v[i * width..][..width], sq.v);
            }
        });
        profile::timed("attention_batch", 0, || {
            ops::attention::cpu::attention_batch(&r.attn, qg, seqs, out)
        });
        Ok(())
    }
    /// Every sequence's conv in one pool loop, every sequence's recurrence in one more.
    fn delta_net_batch(
        &self,
        r: &DeltaNetOps<'_, Self>,
        seqs: &mut [DeltaNetSeq<'_, Vec<f32>>],
        one: &mut OneRow<'_, Self>,
        mixed: &mut Vec<f32>,
        core: &mut Vec<f32>,
    ) -> Result<()> {
        if self.reference {
            return delta_net_batch_by_row(self, r, seqs, one, mixed, core);
        }
        profile::timed("delta_net_conv_batch", 0, || {
            ops::delta_net::cpu::delta_net_conv_batch(&r.conv, r.conv1d, seqs, r.proj, mixed)
        });
        let x = r.input(mixed);
        profile::timed("delta_net_batch", 0, || {
            ops::delta_net::cpu::delta_net_batch(&x.slices(), seqs, core)
        });
        Ok(())
    }
    fn delta_net_conv(&self, p: &ConvParams, w: &Vec<f32>, state: &mut Vec<f32>, x: &Vec<f32>, out: &mut Vec<f32>) {
        dispatch!(self, delta_net::delta_net_conv(p, w, state, x, out))
    }
    fn delta_net(&self, x: &DeltaNetIn<'_, Vec<f32>>, state: &mut Vec<f32>, out: &mut Vec<f32>) {
        dispatch!(self, delta_net::delta_net(&x.slices(), state, out))
    }
    fn moe_route(&self, p: &RouteParams, logits: &Vec<f32>, ids: &mut Vec<u32>, weights: &mut Vec<f32>) {
        dispatch!(self, moe::moe_route(p, logits, ids, weights))
    }
    fn moe_router(&self, p: &RouteParams, x: &Vec<f32>, r: &Router<'_, Self>, out: &mut Routing<'_, Self>) {
        if self.reference {
            ops::moe::reference::moe_router(
                p,
                x,
                r.router,
                r.shared_gate,
                out.logits,
                out.shared,
                out.ids,
                out.weights,
            )
        } else {
            moe_router_unfused(self, p, x, r, out)
        }
    }
    fn moe_experts(
        &self,
        p: &MoeParams,
        e: &MoeExperts<'_, Self>,
        x: &Vec<f32>,
        tmp: &mut Vec<f32>,
        out: &mut Vec<f32>,
    ) {
        let ([gate, up, down], ids, weights) = (e.matrices(), e.ids, e.weights);
        // Weight bytes read (the profiler counts them for decode): the rows of every distinct
        // expert the step's tokens route to (a batched step of B tokens reads ~E (1 - (1 - K/E)^B)
        // experts, not K: counting K made B = 4's routed experts look 3.8x slower per byte).
        let bytes = if profile::on() {
            let per_expert = [gate, up, down]
                .map(|m| m.rows * m.bytes_per_row())
                .iter()
                .sum::<usize>();
            let e_n = gate.experts.max(1);
            let mut seen = vec![false; e_n];
            let pairs = &ids[..p.tokens as usize * p.top_k as usize];
            pairs.iter().for_each(|&i| seen[(i as usize).min(e_n - 1)] = true);
            (seen.iter().filter(|&&s| s).count() * per_expert) as u64
        } else {
            0
        };
        profile::timed("moe_experts", bytes, || {
            if self.reference {
                ops::moe::reference::moe_experts(p, x, ids, weights, gate, up, down, out)
            } else {
                let isa = isa::Isa::get();
                ops::moe::cpu::moe_experts_with(isa, self.precision, p, x, ids, weights, gate, up, down, tmp, out)
            }
        })
    }
    fn swiglu(&self, p: &RowsParams, gate: &Vec<f32>, up: &Vec<f32>, out: &mut Vec<f32>) {
        dispatch!(self, elementwise::swiglu(p, gate, up, out))
    }
    fn sigmoid_gate_add(&self, p: &RowsParams, y: &Vec<f32>, gate: &Vec<f32>, out: &mut Vec<f32>) {
        dispatch!(self, elementwise::sigmoid_gate_add(p, y, gate, out))
    }
}

#[cfg(test)]
mod tests {
    use super::{first_max_par, ARGMAX_CHUNK};
    use crate::backend::first_max;

    #[test]
    fn first_max_par_is_first_max() {
        let mut seed = 11u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) as u32
        };
        let specials = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY, 0.0, -0.0, 1.0];
        let c = ARGMAX_CHUNK;
        for n in [0, 1, c - 1, c, c + 1, 3 * c + 17, 248_320] {
            for case in 0..12 {
                let mut v: Vec<f32> = (0..n)
                    .map(|_| match next() % 64 {
                        0 => specials[next() as usize % specials.len()],
                        // Few distinct values: the largest recurs in many chunks.
                        _ => (next() % 7) as f32 - 3.0,
                    })
                    .collect();
                match case {
                    // Only NaN, only -inf, NaN everywhere but one chunk's tail, signed zeros.
                    0 => v.fill(f32::NAN),
                    1 => v.fill(f32::NEG_INFINITY),
                    2 if n > 0 => {
                        v.fill(f32::NAN);
                        v[n - 1] = -5.0;
                    }
                    3 => v
                        .iter_mut()
                        .enumerate()
                        .for_each(|(i, x)| *x = if i % 2 == 0 { -0.0 } else { 0.0 }),
                    _ => {}
                }
                assert_eq!(first_max_par(&v), first_max(&v), "{n} values, case {case}");
            }
        }
    }
}
