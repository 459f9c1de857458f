//! The command stream of the Metal backend: one open command buffer that every op encoder
//! appends to (opened by the first dispatch, committed by `finish` or before a CPU read), the
//! first encoding error (kept and returned by `finish`, so an op with a shape its kernel does not
//! support never panics), the stream's label, and the scratch buffers the op encoders grow.

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
}

impl Scratch {
    const COUNT: usize = 3;
}

pub(super) struct Stream<X: Executor> {
    enc: Option<X::Encoder>,
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
        if s.enc.is_none() && s.error.is_none() {
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
        for &(what, have, need) in checks {
            if have < need {
                self.fail(format!("{op}: {what} has {have} elements, needs {need}"));
                return false;
            }
        }
        true
    }

    /// Encode one dispatch of kernel `k` into the open command stream (opened here if none is).
    /// Allocates nothing: the name and pipeline come from the table, the bindings and their
    /// parameter bytes live on the caller's stack.
    pub(crate) fn encode(&self, k: impl Into<Kernel>, args: &[Arg<'_, X::Buffer>], grid: Grid) {
        self.encode_tg(k, args, grid, &[])
    }

    /// `encode` for a kernel with `[[threadgroup(i)]]` arguments of `tg_mem[i]` bytes.
    pub(crate) fn encode_tg(&self, k: impl Into<Kernel>, args: &[Arg<'_, X::Buffer>], grid: Grid, tg_mem: &[usize]) {
        self.encode_with(k.into(), args, grid, tg_mem, &[])
    }

    /// `encode` for a kernel that also reads or writes `resident` through GPU addresses held in
    /// a bound buffer (the KV-cache segments behind a segment table): they are made resident
    /// for the dispatch.
    pub(crate) fn encode_resident(
        &self,
        k: impl Into<Kernel>,
        args: &[Arg<'_, X::Buffer>],
        grid: Grid,
        tg_mem: &[usize],
        resident: &[&[X::Buffer]],
    ) {
        self.encode_with(k.into(), args, grid, tg_mem, resident)
    }

    fn encode_with(
        &self,
        k: Kernel,
        args: &[Arg<'_, X::Buffer>],
        grid: Grid,
        tg_mem: &[usize],
        resident: &[&[X::Buffer]],
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
            let label = s.next_label.take().unwrap_or(StreamLabel::Commands);
            match self.x.encoder(label) {
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
    }

    /// Commit what is encoded and wait for it (a host read or write inside the work `begin`
    /// announced: a label not used yet stays for the stream opened next).
    pub(crate) fn flush(&self) -> Result<()> {
        let (enc, err) = {
            let mut s = self.lock();
            (s.enc.take(), s.error.take())
        };
        if let Some(e) = err {
            return Err(e);
        }
        match enc {
            Some(enc) => self.x.commit_wait(enc),
            None => Ok(()),
        }
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
