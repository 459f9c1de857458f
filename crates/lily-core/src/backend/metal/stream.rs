//! The command stream of the Metal backend: one open command buffer that every op encoder
//! appends to (opened by the first dispatch, committed by `finish` or before a CPU read), the
//! first encoding error (kept and returned by `finish`, so an op with a shape its kernel does not
//! support never panics), the stream's label, and the scratch buffers the op encoders grow.
//!
//! Long work is committed in pieces. macOS may end a command buffer that keeps the GPU busy for
//! seconds (`MTLCommandBufferError.timeout`; the GPU watchdog of a Mac that drives a display
//! stops a command buffer after about 5 s), which a prefill chunk at 128K+ tokens of context
//! would. So every dispatch carries an estimate of its GPU time on the slowest supported GPU
//! ([`Work`]), and once the open command buffer's estimate passes [`PIECE_SECONDS`] the stream
//! commits it without waiting and goes on in a new one (same label); `finish` waits for every
//! piece. The estimate is deliberately pessimistic (an M1 at a quarter of its arithmetic peak and
//! half its bandwidth), so a faster Mac commits more often than it needs to, never less. A
//! decode step stays one command buffer (tens of milliseconds even at 256K tokens). One
//! dispatch can still be long: the attention of a prefill chunk over a long context, which its
//! encoder splits into query blocks ([`Metal::blocks`]) so that each dispatch stays under the
//! budget.

use super::{buffers::MetalBuf, Arg, Executor, Grid, Kernel, Metal, StreamLabel};
use crate::{
    backend::StreamKind,
    error::{Error, Result},
};

/// Scratch buffers of the op encoders, one per use, grown to the largest need seen and never
/// shrunk (one buffer serves every layer: the stream runs the layers in order).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Scratch {
    /// f32 split ("flash-decoding") partials of single-token attention (ops/attention/metal.rs).
    AttentionSplit,
    /// u32 routing of the expert-sorted MoE prefill (ops/moe/metal.rs).
    MoeSort,
    /// f32 intra-chunk matrices of the chunked DeltaNet prefill (ops/delta_net/metal.rs).
    DeltaNetChunk,
    /// u32 router logits in flight and the threadgroup counter of `moe_router` (ops/moe/metal.rs;
    /// zero as allocated, and the kernel leaves it zero).
    RouterMail,
}

impl Scratch {
    const COUNT: usize = 4;
}

/// Estimated GPU seconds after which the stream commits the open command buffer (see the
/// module doc): a tenth of the watchdog's 5 s. `Metal::piece_seconds` (tests lower it).
pub const PIECE_SECONDS: f64 = 0.5;
/// The slowest GPU Lily supports, as the estimates see it: an 8-core M1 (2.6 TFLOPS f32,
/// 68 GB/s) at a quarter of its arithmetic peak and half its bandwidth.
const SLOW_FLOPS: f64 = 0.65e12;
const SLOW_BYTES: f64 = 34e9;

/// What one dispatch costs the GPU: arithmetic and device-memory bytes, turned into seconds on
/// the slowest supported GPU. `Work::default()`: estimated from the bytes bound.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Work {
    pub flops: f64,
    /// Bytes read and written; `None`: every byte bound.
    pub bytes: Option<f64>,
}

impl Work {
    pub(crate) fn flops(flops: f64) -> Work {
        Work { flops, bytes: None }
    }
    fn seconds(self, bound: usize) -> f64 {
        self.flops / SLOW_FLOPS + self.bytes.unwrap_or(bound as f64) / SLOW_BYTES
    }
}

pub(super) struct Stream<X: Executor> {
    enc: Option<X::Encoder>,
    /// The label of the open command buffer (its continuation pieces get the same).
    label: StreamLabel,
    /// Estimated GPU seconds encoded into the open command buffer.
    work: f64,
    /// Pieces committed and not waited for yet, oldest first.
    pending: Vec<X::Pending>,
    error: Option<Error>,
    scratch: [Option<MetalBuf<X>>; Scratch::COUNT],
    /// The label of the next command stream opened (set by `begin`); `Commands` when none.
    next_label: Option<StreamLabel>,
    /// One-token forward passes encoded so far (the N of "lily step N").
    steps: u64,
}

impl<X: Executor> Stream<X> {
    pub(super) fn new() -> Self {
        Stream {
            enc: None,
            label: StreamLabel::Commands,
            work: 0.0,
            pending: Vec::new(),
            error: None,
            scratch: [const { None }; Scratch::COUNT],
            next_label: None,
            steps: 0,
        }
    }
}

impl<X: Executor> Metal<X> {
    fn lock(&self) -> std::sync::MutexGuard<'_, Stream<X>> {
        self.stream.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Label the next command stream by what it runs ("lily step N" for the Nth decode step,
    /// "lily prefill chunk"; none for `Other`), if no stream is open yet.
    pub(super) fn label_next(&self, kind: StreamKind) {
        let mut s = self.lock();
        if s.enc.is_none() && s.pending.is_empty() && s.error.is_none() {
            s.next_label = match kind {
                StreamKind::Decode => {
                    s.steps += 1;
                    Some(StreamLabel::Step(s.steps))
                }
                StreamKind::Prefill => Some(StreamLabel::PrefillChunk),
                StreamKind::Other => None,
            };
        }
    }

    /// Remember the first encoding error; `finish` returns it.
    pub(crate) fn fail(&self, msg: String) {
        let mut s = self.lock();
        if s.error.is_none() {
            s.error = Some(Error::Device(msg));
        }
    }

    /// Check `bufs` hold at least the given element counts; record an error otherwise.
    pub(crate) fn fits(&self, op: &str, checks: &[(&str, usize, usize)]) -> bool {
        crate::ops::check_sizes(op, checks).map_err(|e| self.fail(e)).is_ok()
    }

    /// Encode one dispatch of kernel `k` into the open command stream (opened here if none is).
    /// Allocates nothing: the name and pipeline come from the table, the bindings and their
    /// parameter bytes live on the caller's stack.
    pub(crate) fn encode(&self, k: impl Into<Kernel>, args: &[Arg<'_, X::Buffer>], grid: Grid) {
        self.encode_tg(k, args, grid, &[])
    }

    /// `encode` for a kernel with `[[threadgroup(i)]]` arguments of `tg_mem[i]` bytes.
    pub(crate) fn encode_tg(&self, k: impl Into<Kernel>, args: &[Arg<'_, X::Buffer>], grid: Grid, tg_mem: &[usize]) {
        self.encode_with(k.into(), args, grid, tg_mem, &[], Work::default())
    }

    /// `encode_tg` with the dispatch's cost (`Work`), for the kernels whose arithmetic, not the
    /// bytes they bind, bounds their time (GEMMs, attention over a long context).
    pub(crate) fn encode_work(
        &self,
        k: impl Into<Kernel>,
        args: &[Arg<'_, X::Buffer>],
        grid: Grid,
        tg_mem: &[usize],
        work: Work,
    ) {
        self.encode_with(k.into(), args, grid, tg_mem, &[], work)
    }

    /// `encode_work` for a kernel that also reads or writes `resident` through GPU addresses held
    /// in a bound buffer (the KV-cache segments behind a segment table): they are made resident
    /// for the dispatch.
    pub(crate) fn encode_resident(
        &self,
        k: impl Into<Kernel>,
        args: &[Arg<'_, X::Buffer>],
        grid: Grid,
        tg_mem: &[usize],
        resident: &[&[X::Buffer]],
        work: Work,
    ) {
        self.encode_with(k.into(), args, grid, tg_mem, resident, work)
    }

    fn encode_with(
        &self,
        k: Kernel,
        args: &[Arg<'_, X::Buffer>],
        grid: Grid,
        tg_mem: &[usize],
        resident: &[&[X::Buffer]],
        work: Work,
    ) {
        let (name, p) = match self.pipeline(k) {
            Ok(p) => p,
            Err(e) => {
                let mut s = self.lock();
                s.error.get_or_insert(e);
                return;
            }
        };
        let mut s = self.lock();
        if s.error.is_some() {
            return;
        }
        if s.enc.is_none() {
            // A new stream takes the label `begin` set; a continuation piece keeps its stream's.
            if s.pending.is_empty() {
                s.label = s.next_label.take().unwrap_or(StreamLabel::Commands);
            }
            match self.x.encoder(s.label) {
                Ok(e) => s.enc = Some(e),
                Err(e) => {
                    s.error = Some(e);
                    return;
                }
            }
        }
        if let Some(enc) = s.enc.as_mut() {
            for bufs in resident {
                self.x.use_resources(enc, bufs);
            }
            self.x.dispatch(enc, name, p, args, grid, tg_mem);
        }
        let bound = args
            .iter()
            .map(|a| match a {
                Arg::Buf(_, _, len) => *len,
                Arg::Bytes(_) => 0,
            })
            .sum();
        s.work += work.seconds(bound);
        if s.work > self.piece_seconds {
            // Commit this piece and go on in a new command buffer; `flush` waits for it.
            s.work = 0.0;
            if let Some(enc) = s.enc.take() {
                match self.x.commit(enc) {
                    Ok(p) => s.pending.push(p),
                    Err(e) => s.error = Some(e),
                }
            }
        }
    }

    /// Commit what is encoded and wait for every piece (a host read or write inside the work
    /// `begin` announced: a label not used yet stays for the stream opened next). The first
    /// error is returned, after every committed piece has completed (none is left running).
    pub(crate) fn flush(&self) -> Result<()> {
        let (enc, err, pending) = {
            let mut s = self.lock();
            s.work = 0.0;
            (s.enc.take(), s.error.take(), std::mem::take(&mut s.pending))
        };
        let mut first = err;
        let last = match (enc, &first) {
            (Some(enc), None) => match self.x.commit(enc) {
                Ok(p) => Some(p),
                Err(e) => {
                    first = Some(e);
                    None
                }
            },
            _ => None, // an encoding error: the open command buffer is dropped, never run
        };
        for p in pending.into_iter().chain(last) {
            if let Err(e) = self.x.wait(p) {
                first.get_or_insert(e);
            }
        }
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Blocks of a dispatch over `rows` rows (query tokens) costing `per_row` each: blocks of
    /// at most `piece_seconds` on the slowest GPU (at least one row), so the stream can commit
    /// between them. One block when the whole dispatch fits.
    pub(crate) fn blocks(&self, rows: usize, per_row: Work) -> impl Iterator<Item = std::ops::Range<usize>> {
        let seconds_per_row = Work {
            bytes: Some(0.0),
            ..per_row
        }
        .seconds(0);
        let per = if seconds_per_row > 0.0 {
            ((self.piece_seconds / seconds_per_row) as usize).clamp(1, rows.max(1))
        } else {
            rows.max(1)
        };
        (0..rows).step_by(per).map(move |r| r..(r + per).min(rows))
    }

    /// Scratch buffer `which`, at least `need` elements (grown, never shrunk); a handle to it, or
    /// `None` with the allocation error recorded.
    pub(crate) fn scratch(&self, which: Scratch, need: usize) -> Option<MetalBuf<X>> {
        let (mut s, i) = (self.lock(), which as usize);
        if s.scratch[i].as_ref().is_none_or(|b| b.len() < need) {
            match self.new_buf(need) {
                Ok(buf) => s.scratch[i] = Some(buf),
                Err(e) => {
                    s.error.get_or_insert(e);
                    return None;
                }
            }
        }
        s.scratch[i].as_ref().map(MetalBuf::handle)
    }
}
