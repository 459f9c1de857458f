//! The engine: one model, any number of sequences (the default one, [`DEFAULT_SEQ`], and those
//! made by [`Engine::new_sequence`] / [`Engine::fork`]); weights, backend and scratch are shared.
//! `prefill` appends tokens to a sequence in bounded chunks, `decode` appends one, `decode_batch`
//! one to each of several sequences in one pass over the weights; they return next-token
//! logits. Inputs are validated before any state changes, so an error leaves the sequence as it
//! was. Long work can be stopped by the caller: a load
//! between layers (its progress callback returns an error), a prefill between chunks
//! ([`Engine::prefill_interruptible`]); a stopped prefill keeps the chunks it completed.
//!
//! Prefix reuse: a [`Snapshot`] copies the DeltaNet states (which cannot be truncated) at the
//! current position; the KV cache is not copied, since rows below that position stay valid as
//! long as the tokens that wrote them are still there. The engine remembers the token behind every
//! cached KV row, so `restore` can check that exactly. [`Engine::fork`] / [`Engine::copy_sequence`]
//! copy a whole sequence (KV rows too): what a prefix cache keeps and resumes from.
//!
//! A device error in a forward pass (a GPU command that failed part-way) leaves the state
//! half-updated: the engine says so in the error, refuses to run on that state
//! ([`Engine::state_error`]) until `reset()` or `restore()` of a snapshot taken before, and
//! forgets the KV rows the failed call may have written.
//!
//! Memory: at load the model's footprint (weights, state, KV cache at `max_seq` in the
//! configured `kv_dtype`, activations: [`Footprint`]) is checked against the backend's limit (a Metal GPU's recommended working
//! set). The KV cache grows in segments, but the check is whether `max_seq` can be reached:
//! too large with an explicit `max_seq` is a `DeviceError` that says which `max_seq` fits;
//! without one, `max_seq` is fitted to the device ([`Engine::notes`] says so).

use std::{
    any::Any,
    collections::{BTreeMap, HashSet},
    path::Path,
    sync::atomic::{AtomicU64, Ordering},
};

#[cfg(target_os = "linux")]
use crate::backend::cuda::device::Device as CudaDevice;
#[cfg(unix)]
use crate::backend::cuda::{sim::Sim as CudaSim, Cuda};
#[cfg(target_os = "macos")]
use crate::backend::metal::device::Device as MetalDevice;
#[cfg(unix)]
use crate::backend::metal::{sim::Sim, Metal};
use crate::{
    backend::{
        cpu::{Cpu, Precision},
        params::KvStoreParams,
        Backend, KvDtype, StreamKind,
    },
    config::ModelConfig,
    error::{Error, Result},
    memory::{gb, grouped, Footprint},
    model::{
        recycle,
        state::{LayerState, Scratch, State},
        BatchLists, Model,
    },
    safetensors::FileWatch,
    weights::Loader,
};

mod transfer;
pub use transfer::{LayerData, SequenceState};

/// Rows of logits computed per lm_head call when all logits are requested.
const LOGIT_ROWS: usize = 16;

/// A sequence of an engine: [`DEFAULT_SEQ`] always exists; others come from
/// [`Engine::new_sequence`] / [`Engine::fork`] and live until [`Engine::drop_sequence`]. Ids are
/// never reused.
pub type SeqId = usize;

/// The sequence that `prefill`, `decode`, `snapshot`, ... without a sequence argument work on.
pub const DEFAULT_SEQ: SeqId = 0;

/// One sequence: its KV rows and DeltaNet states, its position and the tokens behind its rows.
struct Seq<B: Backend> {
    state: State<B>,
    pos: usize,
    /// The token behind each KV row written so far (may run past `pos` after a restore).
    cached: Vec<u32>,
    /// Why the state cannot be used: a device error interrupted a forward pass on it (cleared
    /// by `reset` or `restore`).
    error: Option<String>,
}

pub struct Runner<B: Backend> {
    b: B,
    model: Model<B>,
    cfg: ModelConfig,
    seqs: BTreeMap<SeqId, Seq<B>>,
    next_seq: SeqId,
    scratch: Scratch<B>,
    /// One row of activations: a batched decode runs each sequence's attention / DeltaNet here.
    one: Scratch<B>,
    /// The batched decode step's lists, kept between steps so that a warm step allocates nothing.
    batch: StepLists<B>,
    max_seq: usize,
    kv_dtype: KvDtype,
    /// Tells snapshots of this engine from those of another.
    id: u64,
    /// The checkpoint files whose maps the weights may still read.
    files: FileWatch,
    footprint: Footprint,
    /// What the engine chose for the caller, in words (the backend `auto` picked and why, a
    /// `max_seq` fitted to the device).
    notes: Vec<String>,
}

/// What a batched decode step lists, kept empty between steps (their allocations reused: a warm
/// step allocates nothing; `'static` only while empty, [`recycle`] lends them at the step's
/// lifetimes): the tokens, the batch's sequences in batch order, their states and positions, and
/// the model's own lists.
struct StepLists<B: Backend> {
    tokens: Vec<u32>,
    seqs: Vec<Option<&'static mut Seq<B>>>,
    states: Vec<(&'static mut State<B>, usize)>,
    model: BatchLists<B>,
}

impl<B: Backend> Default for StepLists<B> {
    fn default() -> Self {
        StepLists {
            tokens: Vec::new(),
            seqs: Vec::new(),
            states: Vec::new(),
            model: BatchLists::default(),
        }
    }
}

/// The sequence state at one position: DeltaNet conv + recurrent states and the token prefix.
pub struct Snapshot {
    engine: u64,
    tokens: Vec<u32>,
    states: Box<dyn Any + Send>, // Vec<B::Buf> of the runner that took it
}

impl Snapshot {
    /// Tokens in the sequence when the snapshot was taken.
    pub fn position(&self) -> usize {
        self.tokens.len()
    }
    /// The sequence's tokens when the snapshot was taken.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

/// The logits of rows 0..t of the last forward call into `out` [t, vocab], `logit_rows` rows
/// per lm_head call (ends the command stream).
/// A sequence by id, borrowed apart from the runner's other fields.
fn seq_mut<B: Backend>(seqs: &mut BTreeMap<SeqId, Seq<B>>, id: SeqId) -> Result<&mut Seq<B>> {
    seqs.get_mut(&id).ok_or(Error::NoSequence(id))
}

fn read_logits<B: Backend>(b: &B, model: &Model<B>, s: &mut Scratch<B>, t: usize, out: &mut [f32]) -> Result<()> {
    let vocab = model.vocab();
    let mut row = 0;
    while row < t {
        let rows = (t - row).min(s.logit_rows);
        model.logits(b, row, rows, s);
        b.finish()?;
        b.read(&s.logits, 0, &mut out[row * vocab..][..rows * vocab])?;
        row += rows;
    }
    Ok(())
}

/// What a batched decode step hands back: each row's logits [rows, vocab], or only the id of
/// each row's largest logit (greedy decoding: no rows x vocab copy to the host).
enum BatchOut<'a> {
    Logits(&'a mut [f32]),
    Greedy(&'a mut [u32]),
}

/// The greedy next token of rows 0..out.len() of the last forward call (`argmax` of each row's
/// logits where they are), `logit_rows` rows of logits at a time.
fn greedy_ids<B: Backend>(b: &B, model: &Model<B>, s: &mut Scratch<B>, out: &mut [u32]) -> Result<()> {
    let vocab = model.vocab();
    for (chunk, ids) in out.chunks_mut(s.logit_rows).enumerate() {
        model.logits(b, chunk * s.logit_rows, ids.len(), s);
        b.finish()?;
        for (i, id) in ids.iter_mut().enumerate() {
            *id = b.argmax_at(&s.logits, i * vocab, vocab)?;
        }
    }
    Ok(())
}

static NEXT_ENGINE_ID: AtomicU64 = AtomicU64::new(1);

/// `max_seq` for a backend with `limit` bytes of memory: the one asked for if the footprint at
/// it fits (a `DeviceError` naming the `max_seq` that would fit otherwise), else the longest
/// that fits up to the config's maximum (and a note saying so); with the footprint at it.
pub(crate) fn fit_max_seq(
    cfg: &ModelConfig,
    weights: u64,
    opts: &Options,
    chunk: usize,
    limit: Option<(u64, &'static str)>,
    device: &str,
) -> Result<(usize, Footprint, Option<String>)> {
    let asked = opts.max_seq;
    let want = asked.unwrap_or(cfg.max_position_embeddings);
    let at = |n: usize| Footprint::new(cfg, weights, n, opts.kv_dtype, chunk, LOGIT_ROWS);
    let Some((limit, what)) = limit else {
        return Ok((want, at(want), None));
    };
    if at(want).total() <= limit {
        return Ok((want, at(want), None));
    }
    let fits = Footprint::longest_within(cfg, weights, limit, want, opts.kv_dtype, chunk, LOGIT_ROWS);
    let over = format!(
        "the model needs {} at max_seq {}, more than the {} of {what} ({device})",
        at(want).describe(),
        grouped(want as u64),
        gb(limit)
    );
    match (fits, asked) {
        (None, _) => Err(Error::Device(format!(
            "{over}: not even one token of context fits; a smaller (more quantized) checkpoint is needed"
        ))),
        (Some(n), Some(_)) => Err(Error::Device(format!(
            "{over}: max_seq {} or less fits (or close other GPU work)",
            grouped(n as u64)
        ))),
        (Some(n), None) => Ok((
            n,
            at(n),
            Some(format!(
                "max_seq fitted to the device: {} tokens ({}); the model's {} tokens would need {}, more than the {} of {what}",
                grouped(n as u64),
                at(n).describe(),
                grouped(want as u64),
                gb(at(want).total()),
                gb(limit)
            )),
        )),
    }
}

impl<B: Backend> Runner<B> {
    /// `max_seq`: as asked, or fitted to the backend's memory; `notes`: what was chosen so far.
    fn new(
        b: B,
        dir: &Path,
        cfg: &ModelConfig,
        opts: &Options,
        progress: &mut dyn FnMut(usize, usize) -> Result<()>,
        mut notes: Vec<String>,
    ) -> Result<Self> {
        let loader = Loader::open(dir, cfg)?;
        let files = loader.watch();
        // Tokens per forward call during prefill: bounds scratch memory whatever the prompt length.
        let chunk = opts.prefill_chunk.unwrap_or_else(|| b.prefill_chunk());
        let limit = b.memory_limit();
        let (max_seq, footprint, fitted) = fit_max_seq(cfg, loader.weight_bytes(), opts, chunk, limit, b.name())?;
        notes.extend(fitted);
        let model = Model::load(&b, &loader, cfg, progress)?;
        let copied = b.copied_weight_bytes();
        if copied > 0 {
            notes.push(format!(
                "{} of weights copied to the device: tensors the kernels cannot read in place in the mapped checkpoint (not 4-byte aligned in their file)",
                gb(copied)
            ));
        }
        let mut state = State::new(&b, cfg, max_seq, opts.kv_dtype)?;
        // The first KV segment now: allocation failures show at load, and reset keeps it.
        state.reserve(&b, 1)?;
        let chunk = chunk.min(max_seq);
        let scratch = Scratch::new(&b, cfg, chunk, LOGIT_ROWS)?;
        let one = Scratch::new(&b, cfg, 1, 1)?;
        let id = NEXT_ENGINE_ID.fetch_add(1, Ordering::Relaxed);
        let first = Seq {
            state,
            pos: 0,
            cached: Vec::new(),
            error: None,
        };
        Ok(Runner {
            b,
            model,
            cfg: cfg.clone(),
            seqs: BTreeMap::from([(DEFAULT_SEQ, first)]),
            next_seq: DEFAULT_SEQ + 1,
            scratch,
            one,
            batch: StepLists::default(),
            max_seq,
            kv_dtype: opts.kv_dtype,
            id,
            files,
            footprint,
            notes,
        })
    }

    fn seq(&self, id: SeqId) -> Result<&Seq<B>> {
        self.seqs.get(&id).ok_or(Error::NoSequence(id))
    }

    /// Refuse to run on a state a device error left half-updated.
    fn trusted(&self, id: SeqId) -> Result<()> {
        match &self.seq(id)?.error {
            Some(why) => Err(Error::Device(format!(
                "the sequence state is not trusted since a device error interrupted a forward pass ({why}): call reset(), or restore() a snapshot taken before it"
            ))),
            None => Ok(()),
        }
    }

    /// The result of a call that changes the states of `ids`: a device error marks them
    /// untrusted (and the KV rows past their positions, which the call may have written,
    /// forgotten).
    fn guard<T>(&mut self, ids: impl IntoIterator<Item = SeqId>, r: Result<T>) -> Result<T> {
        match r {
            Err(Error::Device(msg)) => {
                for id in ids {
                    if let Some(seq) = self.seqs.get_mut(&id) {
                        seq.cached.truncate(seq.pos);
                        seq.error = Some(msg.clone());
                    }
                }
                Err(Error::Device(format!(
                    "{msg}; the sequence state may be half-updated and will not be used: call reset(), or restore() a snapshot"
                )))
            }
            r => r,
        }
    }

    fn check(&self, id: SeqId, tokens: &[u32]) -> Result<()> {
        let pos = self.seq(id)?.pos;
        if tokens.is_empty() {
            return Err(Error::InvalidArgument("no tokens given".into()));
        }
        let vocab = self.model.vocab();
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::InvalidToken { token: bad, vocab });
        }
        self.files.check()?;
        if pos + tokens.len() > self.max_seq {
            return Err(Error::ContextFull {
                used: pos,
                requested: tokens.len(),
                max: self.max_seq,
            });
        }
        Ok(())
    }

    /// `proceed` is asked between chunks; its error stops the prefill there, with the tokens of
    /// the completed chunks in the sequence.
    fn prefill(
        &mut self,
        id: SeqId,
        tokens: &[u32],
        all_logits: bool,
        proceed: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Vec<f32>> {
        self.trusted(id)?;
        self.check(id, tokens)?;
        // KV rows for the whole prompt before any state changes (an allocation failure leaves
        // the sequence as it was).
        let seq = seq_mut(&mut self.seqs, id)?;
        seq.state.writable(&self.b, seq.pos, tokens.len())?;
        let vocab = self.model.vocab();
        let mut out = vec![0f32; if all_logits { tokens.len() * vocab } else { vocab }];
        let mut done = 0;
        for chunk in tokens.chunks(self.scratch.chunk) {
            if done > 0 {
                proceed()?;
            }
            let t = chunk.len();
            let logits: &mut [f32] = if all_logits {
                &mut out[done * vocab..][..t * vocab]
            } else if done + t == tokens.len() {
                &mut out
            } else {
                &mut []
            };
            // One backend session per chunk, so that `proceed` runs outside it.
            let r = B::run(|| self.forward_chunk(id, chunk, all_logits, logits));
            self.guard([id], r)?;
            done += t;
        }
        Ok(out)
    }

    /// Run `chunk` at the sequence's position. `logits` receives the logits of every row (`all`)
    /// or of the last one, unless it is empty.
    fn forward_chunk(&mut self, id: SeqId, chunk: &[u32], all: bool, logits: &mut [f32]) -> Result<()> {
        let t = chunk.len();
        let seq = seq_mut(&mut self.seqs, id)?;
        self.b.begin(StreamKind::Prefill)?;
        self.b.write_ids(&mut self.scratch.ids, chunk)?;
        self.model
            .forward(&self.b, t, seq.pos, &mut seq.state, &mut self.scratch);
        if logits.is_empty() {
            self.b.finish()?;
        } else if all {
            read_logits(&self.b, &self.model, &mut self.scratch, t, logits)?;
        } else {
            self.model.logits(&self.b, t - 1, 1, &mut self.scratch);
            self.b.finish()?;
            self.b.read(&self.scratch.logits, 0, logits)?;
        }
        seq.cached.truncate(seq.pos);
        seq.cached.extend_from_slice(chunk);
        seq.pos += t;
        Ok(())
    }

    fn decode_into(&mut self, id: SeqId, token: u32, out: &mut [f32]) -> Result<()> {
        self.before_decode(id, token)?;
        let r = B::run(|| {
            self.decode_step(id, token)?;
            self.b.read(&self.scratch.logits, 0, out)
        });
        self.guard([id], r)?;
        self.advance(id, token)
    }

    /// A decode step whose next token (the largest logit) is chosen where the logits are.
    fn decode_greedy(&mut self, id: SeqId, token: u32) -> Result<u32> {
        self.before_decode(id, token)?;
        let r = B::run(|| {
            self.decode_step(id, token)?;
            self.b.argmax(&self.scratch.logits, self.model.vocab())
        });
        let next = self.guard([id], r)?;
        self.advance(id, token)?;
        Ok(next)
    }

    /// What a decode step of `token` needs before the state changes: a trusted state, a valid
    /// token, and a new KV segment once per segment's rows, or a private copy of a shared one
    /// (failing to allocate it leaves the sequence as it was).
    fn before_decode(&mut self, id: SeqId, token: u32) -> Result<()> {
        self.trusted(id)?;
        self.check(id, &[token])?;
        let seq = seq_mut(&mut self.seqs, id)?;
        seq.state.writable(&self.b, seq.pos, 1)
    }

    /// One decode step of `token` on sequence `id` up to its logits (on the device).
    fn decode_step(&mut self, id: SeqId, token: u32) -> Result<()> {
        let seq = seq_mut(&mut self.seqs, id)?;
        self.b.begin(StreamKind::Decode)?;
        self.b.write_ids(&mut self.scratch.ids, &[token])?;
        self.model
            .forward(&self.b, 1, seq.pos, &mut seq.state, &mut self.scratch);
        self.model.logits(&self.b, 0, 1, &mut self.scratch);
        self.b.finish()
    }

    /// `token` is in sequence `id`'s cache now.
    fn advance(&mut self, id: SeqId, token: u32) -> Result<()> {
        let seq = seq_mut(&mut self.seqs, id)?;
        seq.cached.truncate(seq.pos);
        seq.cached.push(token);
        seq.pos += 1;
        Ok(())
    }

    /// Append `n` positions of synthetic context: random K/V rows in every attention layer, the
    /// DeltaNet states untouched (their cost does not depend on the position). Decode at depth
    /// `n` then reads and computes exactly what it would after a real prompt of `n` tokens, which
    /// lets a benchmark measure long-context decode without paying for the prefill.
    fn fill_context(&mut self, id: SeqId, n: usize, seed: u64) -> Result<()> {
        self.trusted(id)?;
        let seq = seq_mut(&mut self.seqs, id)?;
        if seq.pos.checked_add(n).is_none_or(|end| end > self.max_seq) {
            return Err(Error::ContextFull {
                used: seq.pos,
                requested: n,
                max: self.max_seq,
            });
        }
        seq.state.writable(&self.b, seq.pos, n)?;
        let width = seq.state.kv_width;
        let mut done = 0;
        while done < n {
            let t = self.scratch.chunk.min(n - done);
            let row0 = seq.pos + done;
            // Small values (|x| < 0.1) that depend on the seed, the row and the column only: scores
            // stay tame, no two rows coincide, and filling in one call or several writes the same.
            let block: Vec<f32> = (0..t * width)
                .map(|i| {
                    let (r, c) = ((row0 + i / width) as u64, (i % width) as u64);
                    let h = splitmix64(seed ^ splitmix64(r.wrapping_mul(0x1_0000_0001) ^ c));
                    ((h >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
                })
                .collect();
            let block = self.b.upload(&block)?;
            let p = KvStoreParams {
                tokens: t as u32,
                pos0: row0 as u32,
                width: width as u32,
            };
            self.b.begin(StreamKind::Other)?;
            for layer in &mut seq.state.layers {
                if let LayerState::Attention(kv) = layer {
                    self.b.kv_store(&p, &block, &mut kv.k);
                    self.b.kv_store(&p, &block, &mut kv.v);
                }
            }
            self.b.finish()?;
            done += t;
        }
        // No token wrote these rows: u32::MAX matches no id, so no prefix reuse reaches past them.
        seq.cached.truncate(seq.pos);
        seq.cached.resize(seq.pos + n, u32::MAX);
        seq.pos += n;
        Ok(())
    }

    /// One decode step of several sequences: `out` gets each one's next-token logits
    /// [batch.len(), vocab] or greedy id, in the order given. Everything is checked before any
    /// state changes.
    fn decode_batch(&mut self, batch: &[(SeqId, u32)], out: BatchOut<'_>) -> Result<()> {
        if batch.is_empty() {
            return Err(Error::InvalidArgument("decode_batch: no sequences given".into()));
        }
        if batch.len() > self.scratch.chunk {
            return Err(Error::InvalidArgument(format!(
                "decode_batch of {} sequences: at most {} (the prefill chunk) per step",
                batch.len(),
                self.scratch.chunk
            )));
        }
        for (i, &(id, token)) in batch.iter().enumerate() {
            if batch[..i].iter().any(|&(other, _)| other == id) {
                return Err(Error::InvalidArgument(format!(
                    "decode_batch: sequence {id} given twice (one token per sequence per step)"
                )));
            }
            self.trusted(id)?;
            self.check(id, &[token])?;
        }
        for &(id, _) in batch {
            let seq = seq_mut(&mut self.seqs, id)?;
            seq.state.writable(&self.b, seq.pos, 1)?;
        }
        let r = B::run(|| self.decode_batch_here(batch, out));
        self.guard(batch.iter().map(|&(id, _)| id), r)
    }

    fn decode_batch_here(&mut self, batch: &[(SeqId, u32)], out: BatchOut<'_>) -> Result<()> {
        let t = batch.len();
        let mut tokens = std::mem::take(&mut self.batch.tokens);
        tokens.clear();
        tokens.extend(batch.iter().map(|&(_, token)| token));
        // The batch's sequences in batch order (each found once: ids are distinct, checked).
        let mut seqs = recycle(std::mem::take(&mut self.batch.seqs));
        seqs.resize_with(t, || None);
        for (id, seq) in self.seqs.iter_mut() {
            if let Some(i) = batch.iter().position(|(b, _)| b == id) {
                seqs[i] = Some(seq);
            }
        }
        self.b.begin(StreamKind::Decode)?;
        self.b.write_ids(&mut self.scratch.ids, &tokens)?;
        let mut states = recycle(std::mem::take(&mut self.batch.states));
        states.extend(seqs.iter_mut().map(|s| {
            let s = s.as_mut().expect("checked");
            (&mut s.state, s.pos)
        }));
        self.model.forward_batch(
            &self.b,
            &mut states,
            &mut self.scratch,
            &mut self.one,
            &mut self.batch.model,
        )?;
        self.batch.states = recycle(states);
        for (seq, &token) in seqs.iter_mut().zip(&tokens) {
            let seq = seq.as_mut().expect("checked");
            seq.cached.truncate(seq.pos);
            seq.cached.push(token);
            seq.pos += 1;
        }
        (self.batch.seqs, self.batch.tokens) = (recycle(seqs), tokens);
        match out {
            BatchOut::Logits(out) => read_logits(&self.b, &self.model, &mut self.scratch, t, out),
            BatchOut::Greedy(out) => greedy_ids(&self.b, &self.model, &mut self.scratch, out),
        }
    }

    fn snapshot(&self, id: SeqId) -> Result<Snapshot> {
        self.trusted(id)?;
        let seq = self.seq(id)?;
        let mut bufs = Vec::new();
        self.b.begin(StreamKind::Other)?;
        for layer in &seq.state.layers {
            if let LayerState::DeltaNet(s) = layer {
                for (src, len) in [(&s.conv, s.conv_len), (&s.ssm, s.ssm_len)] {
                    let mut dst = self.b.alloc(len)?;
                    self.b.copy(src, &mut dst, len)?;
                    bufs.push(dst);
                }
            }
        }
        self.b.finish()?;
        Ok(Snapshot {
            engine: self.id,
            tokens: seq.cached[..seq.pos].to_vec(),
            states: Box::new(bufs),
        })
    }

    fn restore(&mut self, id: SeqId, snap: &Snapshot) -> Result<()> {
        let stale = || {
            Error::InvalidArgument("snapshot does not match this engine's cache: it was taken by another engine, or the tokens it covers have been overwritten since".into())
        };
        let n = snap.tokens.len();
        let seq = self.seq(id)?;
        if snap.engine != self.id || seq.cached.len() < n || seq.cached[..n] != snap.tokens[..] {
            return Err(stale());
        }
        let bufs = snap.states.downcast_ref::<Vec<B::Buf>>().ok_or_else(stale)?;
        let deltas = seq
            .state
            .layers
            .iter()
            .filter(|l| matches!(l, LayerState::DeltaNet(_)))
            .count();
        if bufs.len() != deltas * 2 {
            return Err(stale());
        }
        let r = self.copy_states(id, bufs);
        self.guard([id], r)?;
        let seq = seq_mut(&mut self.seqs, id)?;
        // Rows below `n` were written by calls that completed: the state is whole again.
        seq.error = None;
        seq.pos = n;
        Ok(())
    }

    fn copy_states(&mut self, id: SeqId, bufs: &[B::Buf]) -> Result<()> {
        let seq = seq_mut(&mut self.seqs, id)?;
        let mut it = bufs.iter();
        self.b.begin(StreamKind::Other)?;
        for layer in &mut seq.state.layers {
            if let LayerState::DeltaNet(s) = layer {
                for (dst, len) in [(&mut s.conv, s.conv_len), (&mut s.ssm, s.ssm_len)] {
                    if let Some(src) = it.next() {
                        self.b.copy(src, dst, len)?;
                    }
                }
            }
        }
        self.b.finish()
    }

    fn reset(&mut self, id: SeqId) -> Result<()> {
        let seq = seq_mut(&mut self.seqs, id)?;
        let r = seq.state.reset(&self.b);
        self.guard([id], r)?;
        let seq = seq_mut(&mut self.seqs, id)?;
        seq.error = None;
        // The KV rows past the retained first segment are gone: so is what they could be reused for.
        let kept = seq.state.kv_rows(&self.b);
        seq.cached.truncate(kept);
        seq.pos = 0;
        Ok(())
    }

    /// Longest common prefix of `tokens` and the sequence's cached tokens (KV rows that could be reused).
    fn cached_prefix(&self, id: SeqId, tokens: &[u32]) -> Result<usize> {
        Ok(self
            .seq(id)?
            .cached
            .iter()
            .zip(tokens)
            .take_while(|(a, b)| a == b)
            .count())
    }

    /// A new empty sequence (its KV memory comes with its first tokens).
    fn new_sequence(&mut self) -> Result<SeqId> {
        let state = State::new(&self.b, &self.cfg, self.max_seq, self.kv_dtype)?;
        let id = self.next_seq;
        self.next_seq += 1;
        self.seqs.insert(
            id,
            Seq {
                state,
                pos: 0,
                cached: Vec::new(),
                error: None,
            },
        );
        Ok(id)
    }

    /// `dst` becomes a copy of `src` at its position: KV rows 0..pos, DeltaNet states, tokens.
    /// On error `dst` is as it was, unless the copy itself failed on the device.
    fn copy_sequence(&mut self, src: SeqId, dst: SeqId) -> Result<()> {
        if src == dst {
            return self.seq(src).map(|_| ());
        }
        self.trusted(src)?;
        self.seq(dst)?;
        // Both borrowed at once: take dst out of the map for the copy.
        let mut to = self.seqs.remove(&dst).ok_or(Error::NoSequence(dst))?;
        let done = self.copy_state(src, &mut to);
        self.seqs.insert(dst, to);
        self.guard([dst], done)
    }

    /// The KV rows are shared, not copied: `dst`'s caches become new ones holding `src`'s whole
    /// segments and a copy of each partial last one (what `dst` held before is given back); a
    /// later write into a shared segment copies it first (`State::writable`). The DeltaNet
    /// states, small and rewritten by every token, are plain copies.
    fn copy_state(&self, src: SeqId, to: &mut Seq<B>) -> Result<()> {
        let from = self.seq(src)?;
        let pos = from.pos;
        // Every new cache before anything in `to` changes: an allocation failure leaves it as it was.
        let mut shared = Vec::new();
        for l in &from.state.layers {
            if let LayerState::Attention(f) = l {
                shared.push((self.b.kv_share(&f.k, pos)?, self.b.kv_share(&f.v, pos)?));
            }
        }
        self.b.begin(StreamKind::Other)?;
        for (f, t) in from.state.layers.iter().zip(to.state.layers.iter_mut()) {
            match (f, t) {
                (LayerState::Attention(_), LayerState::Attention(_)) => {}
                (LayerState::DeltaNet(f), LayerState::DeltaNet(t)) => {
                    self.b.copy(&f.conv, &mut t.conv, f.conv_len)?;
                    self.b.copy(&f.ssm, &mut t.ssm, f.ssm_len)?;
                }
                _ => unreachable!("every state is built from the same layer kinds"),
            }
        }
        self.b.finish()?;
        let caches = to.state.layers.iter_mut().filter_map(|l| match l {
            LayerState::Attention(kv) => Some(kv),
            LayerState::DeltaNet(_) => None,
        });
        for (kv, (k, v)) in caches.zip(shared) {
            (kv.k, kv.v) = (k, v);
        }
        to.pos = pos;
        to.error = None;
        to.cached.clear();
        to.cached.extend_from_slice(&from.cached[..pos]);
        Ok(())
    }

    /// A new sequence holding a copy of `src`.
    fn fork(&mut self, src: SeqId) -> Result<SeqId> {
        self.seq(src)?;
        let id = self.new_sequence()?;
        if let Err(e) = self.copy_sequence(src, id) {
            self.seqs.remove(&id);
            return Err(e);
        }
        Ok(id)
    }

    fn drop_sequence(&mut self, id: SeqId) -> Result<()> {
        if id == DEFAULT_SEQ {
            return Err(Error::InvalidArgument(
                "the default sequence cannot be dropped (reset it instead)".into(),
            ));
        }
        self.seqs.remove(&id).map(|_| ()).ok_or(Error::NoSequence(id))
    }

    /// Bytes of a sequence's state: its KV segments (those it shares with forks included) and
    /// DeltaNet states.
    fn sequence_bytes(&self, id: SeqId) -> Result<usize> {
        let seq = self.seq(id)?;
        Ok(seq.state.kv_bytes(&self.b) + delta_bytes(&seq.state))
    }

    /// Bytes the sequences `ids` hold together, each KV segment counted once however many of
    /// them share it (a repeated id counts once too): the memory they keep alive.
    fn sequences_bytes(&self, ids: &[SeqId]) -> Result<usize> {
        let (mut seqs, mut segments) = (HashSet::new(), HashSet::new());
        let mut total = 0;
        for &id in ids {
            if !seqs.insert(id) {
                continue;
            }
            let seq = self.seq(id)?;
            total += delta_bytes(&seq.state);
            for s in seq.state.kv_segments(&self.b) {
                if segments.insert(s.id) {
                    total += s.bytes;
                }
            }
        }
        Ok(total)
    }

    /// Bytes only this sequence holds: what dropping it gives back (its DeltaNet states and the
    /// KV segments no fork or prefix-cache entry shares).
    fn sequence_unique_bytes(&self, id: SeqId) -> Result<usize> {
        let seq = self.seq(id)?;
        let kv: usize = seq
            .state
            .kv_segments(&self.b)
            .iter()
            .filter(|s| !s.shared)
            .map(|s| s.bytes)
            .sum();
        Ok(kv + delta_bytes(&seq.state))
    }
}

/// Bytes of a state's DeltaNet layers (conv history and recurrent state, f32).
fn delta_bytes<B: Backend>(state: &State<B>) -> usize {
    state
        .layers
        .iter()
        .map(|l| match l {
            LayerState::DeltaNet(s) => 4 * (s.conv_len + s.ssm_len),
            LayerState::Attention(_) => 0,
        })
        .sum()
}

/// A 64-bit mix (SplitMix64's finalizer): a well-spread value from each input.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Which backend runs the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// The best available: Metal on Apple Silicon, CUDA where built and present, else CPU.
    Auto,
    Cpu,
    /// The plain-loop reference kernels (slow; for checking).
    CpuReference,
    Metal,
    /// The Metal backend's command stream run by the CPU simulator (tools/metal-sim; needs clang-19).
    MetalSim,
    Cuda,
    /// The CUDA backend's command stream run by the CPU simulator (tools/cuda-sim; needs clang-19).
    CudaSim,
}

impl BackendKind {
    /// The name `parse` reads.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Auto => "auto",
            BackendKind::Cpu => "cpu",
            BackendKind::CpuReference => "cpu-reference",
            BackendKind::Metal => "metal",
            BackendKind::MetalSim => "metal-sim",
            BackendKind::Cuda => "cuda",
            BackendKind::CudaSim => "cuda-sim",
        }
    }

    pub fn parse(name: &str) -> Result<Self> {
        Ok(match name {
            "auto" => BackendKind::Auto,
            "cpu" => BackendKind::Cpu,
            "cpu-reference" => BackendKind::CpuReference,
            "metal" => BackendKind::Metal,
            "metal-sim" => BackendKind::MetalSim,
            "cuda" => BackendKind::Cuda,
            "cuda-sim" => BackendKind::CudaSim,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "unknown backend {name:?}: expected \"auto\", \"cpu\", \"cpu-reference\", \"metal\", \"metal-sim\", \"cuda\" or \"cuda-sim\""
                )))
            }
        })
    }
}

/// What `backend="auto"` picks on this machine, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AutoChoice {
    pub backend: BackendKind,
    pub reason: String,
    /// The CPU was chosen although this build has a GPU backend for the platform (no usable
    /// GPU was found): the user should hear about it (the Python layer warns once).
    pub fallback: bool,
}

/// The backend `auto` picks: on a Mac with Apple silicon the Metal GPU if there is one (any
/// failure of that GPU afterwards is an error, never a reason to fall back), else the CPU with
/// the reason. Opens no device beyond asking what exists.
pub fn auto_choice() -> AutoChoice {
    #[cfg(all(target_os = "macos", target_arch = "aarch64"))]
    {
        match crate::backend::metal::probe() {
            Ok(d) => AutoChoice {
                backend: BackendKind::Metal,
                reason: format!("Metal GPU {} (GPU family {})", d.name, d.family),
                fallback: false,
            },
            Err(why) => AutoChoice {
                backend: BackendKind::Cpu,
                reason: format!("CPU: {why}"),
                fallback: true,
            },
        }
    }
    #[cfg(all(target_os = "macos", not(target_arch = "aarch64")))]
    {
        AutoChoice {
            backend: BackendKind::Cpu,
            reason: "CPU: an Intel Mac (the Metal backend runs on Apple silicon only)".into(),
            fallback: false,
        }
    }
    #[cfg(target_os = "linux")]
    {
        // The NVIDIA driver is there: CUDA (a GPU that then fails to open is an error, not a
        // silent switch to the CPU).
        if ["/proc/driver/nvidia", "/dev/nvidiactl"]
            .iter()
            .any(|p| std::path::Path::new(p).exists())
        {
            return AutoChoice {
                backend: BackendKind::Cuda,
                reason: "CUDA: an NVIDIA GPU driver is loaded".into(),
                fallback: false,
            };
        }
        AutoChoice {
            backend: BackendKind::Cpu,
            reason: format!(
                "CPU: no NVIDIA GPU driver is loaded on this {} machine (the CUDA backend needs one)",
                std::env::consts::OS
            ),
            fallback: false,
        }
    }
    #[cfg(not(any(target_os = "macos", target_os = "linux")))]
    {
        AutoChoice {
            backend: BackendKind::Cpu,
            reason: format!(
                "CPU: no GPU backend for {} in this build (Metal runs on macOS on Apple silicon, CUDA on Linux)",
                std::env::consts::OS
            ),
            fallback: false,
        }
    }
}

/// The type-erased engine: one variant per compiled backend.
pub enum Engine {
    Cpu(Runner<Cpu>, ModelConfig),
    #[cfg(unix)]
    MetalSim(Runner<Metal<Sim>>, ModelConfig),
    #[cfg(target_os = "macos")]
    Metal(Runner<Metal<MetalDevice>>, ModelConfig),
    #[cfg(unix)]
    CudaSim(Runner<Cuda<CudaSim>>, ModelConfig),
    #[cfg(target_os = "linux")]
    Cuda(Runner<Cuda<CudaDevice>>, ModelConfig),
}

macro_rules! each {
    ($self:expr, $r:ident => $body:expr) => {
        match $self {
            Engine::Cpu($r, _) => $body,
            #[cfg(unix)]
            Engine::MetalSim($r, _) => $body,
            #[cfg(target_os = "macos")]
            Engine::Metal($r, _) => $body,
            #[cfg(unix)]
            Engine::CudaSim($r, _) => $body,
            #[cfg(target_os = "linux")]
            Engine::Cuda($r, _) => $body,
        }
    };
}

/// How to build an engine. `Options::default()`: the best backend, the model's context length,
/// the backend's prefill chunk, a bf16 KV cache.
#[derive(Clone, Debug)]
pub struct Options {
    pub backend: BackendKind,
    /// Longest sequence (prompt + generated tokens); default the config's
    /// `max_position_embeddings`. The KV cache grows with the sequence, so a large value costs
    /// no memory until it is used.
    pub max_seq: Option<usize>,
    /// Tokens per forward call during prefill (default: the backend's choice); larger chunks
    /// prefill faster and take more scratch memory.
    pub prefill_chunk: Option<usize>,
    /// Element type of the stored K/V rows (f32 for fp32-exact checks).
    pub kv_dtype: KvDtype,
    /// How the CPU backend's 4-bit matmuls round the activations ([`Precision`]: exact to f32, or
    /// fast with one int8 plane, a little below bf16 accuracy); the GPU backends ignore it.
    pub precision: Precision,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            backend: BackendKind::Auto,
            max_seq: None,
            prefill_chunk: None,
            kv_dtype: KvDtype::default(),
            precision: Precision::default(),
        }
    }
}

impl Options {
    /// Refuse values no engine can be built with, before anything is loaded.
    pub(crate) fn check(&self, cfg: &ModelConfig) -> Result<()> {
        match self.max_seq {
            Some(0) => return Err(Error::InvalidArgument("max_seq must be at least 1".into())),
            // Positions reach the kernels as u32.
            Some(n) if n > u32::MAX as usize => {
                return Err(Error::InvalidArgument(format!(
                    "max_seq {n} is more than the {} positions the kernels address (the model is trained for {})",
                    u32::MAX,
                    cfg.max_position_embeddings
                )))
            }
            _ => {}
        }
        if self.prefill_chunk == Some(0) {
            return Err(Error::InvalidArgument("prefill_chunk must be at least 1".into()));
        }
        Ok(())
    }
}

impl Engine {
    /// Load the checkpoint in `dir`. `max_seq` defaults to the config's `max_position_embeddings`.
    pub fn new(dir: &Path, backend: BackendKind, max_seq: Option<usize>) -> Result<Self> {
        let opts = Options {
            backend,
            max_seq,
            ..Options::default()
        };
        Self::load(dir, &opts, &mut |_, _| Ok(()))
    }

    /// [`Engine::load`] with a bf16 KV cache.
    pub fn with_progress(
        dir: &Path,
        backend: BackendKind,
        max_seq: Option<usize>,
        prefill_chunk: Option<usize>,
        progress: &mut dyn FnMut(usize, usize) -> Result<()>,
    ) -> Result<Self> {
        let opts = Options {
            backend,
            max_seq,
            prefill_chunk,
            ..Options::default()
        };
        Self::load(dir, &opts, progress)
    }

    /// Load the checkpoint in `dir` as `opts` say. `progress(done, total)` is called after each
    /// layer is loaded; an error from it stops the load and is returned.
    pub fn load(dir: &Path, opts: &Options, progress: &mut dyn FnMut(usize, usize) -> Result<()>) -> Result<Self> {
        let backend = opts.backend;
        if !dir.is_dir() {
            return Err(Error::file(dir, "checkpoint folder not found"));
        }
        let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
        opts.check(&cfg)?;
        let (backend, notes) = match backend {
            BackendKind::Auto => {
                let choice = auto_choice();
                (
                    choice.backend,
                    vec![format!("backend \"auto\" chose {}", choice.reason)],
                )
            }
            other => (other, Vec::new()),
        };
        match backend {
            BackendKind::Cpu | BackendKind::Auto => Ok(Engine::Cpu(
                Runner::new(Cpu::with_precision(opts.precision), dir, &cfg, opts, progress, notes)?,
                cfg,
            )),
            BackendKind::CpuReference => Ok(Engine::Cpu(
                Runner::new(Cpu::reference(), dir, &cfg, opts, progress, notes)?,
                cfg,
            )),
            #[cfg(unix)]
            BackendKind::MetalSim => Ok(Engine::MetalSim(
                Runner::new(Metal::sim()?, dir, &cfg, opts, progress, notes)?,
                cfg,
            )),
            #[cfg(not(unix))]
            BackendKind::MetalSim => Err(Error::Device(
                "the Metal simulator needs a Unix host with clang-19".into(),
            )),
            #[cfg(target_os = "macos")]
            BackendKind::Metal => {
                // Loading reports the shader files compiled, then each layer, as steps of one total.
                let (files, layers) = (crate::backend::metal::kernels::metal_files().count(), cfg.num_hidden_layers);
                let m = Metal::device_with_progress(&mut |done, _| progress(done, files + layers))?;
                let mut layer_progress = |done: usize, total: usize| progress(files + done, files + total);
                Ok(Engine::Metal(
                    Runner::new(m, dir, &cfg, opts, &mut layer_progress, notes)?,
                    cfg,
                ))
            }
            #[cfg(not(target_os = "macos"))]
            BackendKind::Metal => Err(Error::Device(
                "the Metal backend needs macOS on Apple silicon (on Linux, backend=\"metal-sim\" runs its kernels on the CPU)".into(),
            )),
            #[cfg(target_os = "linux")]
            BackendKind::Cuda => Ok(Engine::Cuda(
                Runner::new(Cuda::device()?, dir, &cfg, opts, progress, notes)?,
                cfg,
            )),
            #[cfg(not(target_os = "linux"))]
            BackendKind::Cuda => Err(Error::Device("the CUDA backend needs Linux with an NVIDIA GPU".into())),
            #[cfg(unix)]
            BackendKind::CudaSim => Ok(Engine::CudaSim(
                Runner::new(Cuda::sim()?, dir, &cfg, opts, progress, notes)?,
                cfg,
            )),
            #[cfg(not(unix))]
            BackendKind::CudaSim => Err(Error::Device(
                "the CUDA simulator needs a Unix host with clang-19".into(),
            )),
        }
    }

    /// Append `tokens`; logits of the last one ([vocab]) or of every one ([len, vocab] flattened).
    pub fn prefill(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        self.prefill_interruptible(tokens, all_logits, &mut || Ok(()))
    }

    /// `prefill` that asks `proceed` between chunks (e.g. whether Ctrl-C was pressed). An error
    /// from it is returned at once and leaves the sequence holding the tokens of the chunks
    /// completed so far (`position` says how many): a consistent state to continue from.
    pub fn prefill_interruptible(
        &mut self,
        tokens: &[u32],
        all_logits: bool,
        proceed: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Vec<f32>> {
        self.prefill_in(DEFAULT_SEQ, tokens, all_logits, proceed)
    }

    /// `prefill_interruptible` on sequence `seq`.
    pub fn prefill_in(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        all_logits: bool,
        proceed: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Vec<f32>> {
        each!(self, r => r.prefill(seq, tokens, all_logits, proceed))
    }

    /// Append one token; its next-token logits.
    pub fn decode(&mut self, token: u32) -> Result<Vec<f32>> {
        let mut out = vec![0f32; self.vocab_size()];
        self.decode_into(token, &mut out)?;
        Ok(out)
    }

    /// `decode` writing into a caller's buffer of `vocab_size` floats (no allocation).
    pub fn decode_into(&mut self, token: u32, out: &mut [f32]) -> Result<()> {
        self.decode_in(DEFAULT_SEQ, token, out)
    }

    /// `decode_into` on sequence `seq`.
    pub fn decode_in(&mut self, seq: SeqId, token: u32, out: &mut [f32]) -> Result<()> {
        if out.len() != self.vocab_size() {
            return Err(Error::InvalidArgument(format!(
                "logits buffer has {} entries, vocab is {}",
                out.len(),
                self.vocab_size()
            )));
        }
        each!(self, r => r.decode_into(seq, token, out))
    }

    /// Append one token; the id of its largest next-token logit (greedy decoding), computed
    /// where the logits are (on a GPU, only the id is copied back).
    pub fn decode_greedy(&mut self, token: u32) -> Result<u32> {
        self.decode_greedy_in(DEFAULT_SEQ, token)
    }

    /// `decode_greedy` on sequence `seq`.
    pub fn decode_greedy_in(&mut self, seq: SeqId, token: u32) -> Result<u32> {
        each!(self, r => r.decode_greedy(seq, token))
    }

    /// One decode step of several sequences at once, each at its own position: the weights are
    /// read once for the whole batch (matmuls over `batch.len()` rows, the MoE grouped by expert
    /// across the batch), attention and DeltaNet run on each sequence's own state. `out`
    /// [batch.len(), vocab] receives each sequence's next-token logits in the order given.
    /// Each sequence at most once; at most `prefill_chunk` of them. On error nothing changes.
    pub fn decode_batch(&mut self, batch: &[(SeqId, u32)], out: &mut [f32]) -> Result<()> {
        if out.len() != batch.len() * self.vocab_size() {
            return Err(Error::InvalidArgument(format!(
                "logits buffer has {} entries, {} sequences x vocab {} expected",
                out.len(),
                batch.len(),
                self.vocab_size()
            )));
        }
        each!(self, r => r.decode_batch(batch, BatchOut::Logits(out)))
    }

    /// `decode_batch` for greedy decoding: `out` [batch.len()] receives the id of each
    /// sequence's largest next-token logit (the lowest among equal ones), computed where the
    /// logits are, so no [batch.len(), vocab] block is copied out.
    pub fn decode_batch_greedy(&mut self, batch: &[(SeqId, u32)], out: &mut [u32]) -> Result<()> {
        if out.len() != batch.len() {
            return Err(Error::InvalidArgument(format!(
                "id buffer has {} entries, {} sequences given",
                out.len(),
                batch.len()
            )));
        }
        each!(self, r => r.decode_batch(batch, BatchOut::Greedy(out)))
    }

    pub fn reset(&mut self) -> Result<()> {
        self.reset_in(DEFAULT_SEQ)
    }

    /// Empty sequence `seq` (its first KV segment is kept).
    pub fn reset_in(&mut self, seq: SeqId) -> Result<()> {
        each!(self, r => r.reset(seq))
    }

    /// Append `n` positions of synthetic context (random K/V rows; DeltaNet state as it is), for
    /// measuring decode at depth `n` without a prefill. Those rows match no token.
    pub fn fill_context(&mut self, n: usize, seed: u64) -> Result<()> {
        each!(self, r => r.fill_context(DEFAULT_SEQ, n, seed))
    }

    /// Copy the state at the current position, to come back to with [`Engine::restore`].
    pub fn snapshot(&self) -> Result<Snapshot> {
        self.snapshot_in(DEFAULT_SEQ)
    }

    /// `snapshot` of sequence `seq`.
    pub fn snapshot_in(&self, seq: SeqId) -> Result<Snapshot> {
        each!(self, r => r.snapshot(seq))
    }

    /// Go back (or forward) to a snapshot of this engine whose tokens are still in the KV cache.
    /// On error nothing changes.
    pub fn restore(&mut self, snap: &Snapshot) -> Result<()> {
        self.restore_in(DEFAULT_SEQ, snap)
    }

    /// `restore` on sequence `seq` (whose KV rows must hold the snapshot's tokens).
    pub fn restore_in(&mut self, seq: SeqId, snap: &Snapshot) -> Result<()> {
        each!(self, r => r.restore(seq, snap))
    }

    /// How many leading `tokens` match the tokens whose KV rows are cached.
    pub fn cached_prefix(&self, tokens: &[u32]) -> usize {
        self.cached_prefix_in(DEFAULT_SEQ, tokens).unwrap_or(0)
    }

    /// `cached_prefix` of sequence `seq`.
    pub fn cached_prefix_in(&self, seq: SeqId, tokens: &[u32]) -> Result<usize> {
        each!(self, r => r.cached_prefix(seq, tokens))
    }

    /// A new, empty sequence. Its KV memory grows with its tokens; drop it when done.
    pub fn new_sequence(&mut self) -> Result<SeqId> {
        each!(self, r => r.new_sequence())
    }

    /// A new sequence holding a copy of `seq` (KV rows, DeltaNet states, position, tokens):
    /// both continue independently.
    pub fn fork(&mut self, seq: SeqId) -> Result<SeqId> {
        each!(self, r => r.fork(seq))
    }

    /// Sequence `dst` becomes a copy of `src` (what it held before is gone): resuming a cached
    /// prefix in a working sequence.
    pub fn copy_sequence(&mut self, src: SeqId, dst: SeqId) -> Result<()> {
        each!(self, r => r.copy_sequence(src, dst))
    }

    /// Free a sequence's memory; its id is not used again. The default sequence stays.
    pub fn drop_sequence(&mut self, seq: SeqId) -> Result<()> {
        each!(self, r => r.drop_sequence(seq))
    }

    /// Sequence `seq`'s state at its position in host memory (tokens, K/V rows in the cache
    /// dtype from `first_row` on, DeltaNet states): with `first_row` 0, to be written back with
    /// [`Engine::import_sequence`] here or in an engine of the same model in another process.
    pub fn export_sequence(&self, seq: SeqId, first_row: usize) -> Result<SequenceState> {
        each!(self, r => r.export(seq, first_row))
    }

    /// Sequence `seq` becomes `state` (what it held before is gone; its KV memory is that of the
    /// state's rows). A state that does not fit this model or cache is an `InvalidArgument` error
    /// that changes nothing.
    pub fn import_sequence(&mut self, seq: SeqId, state: &SequenceState) -> Result<()> {
        each!(self, r => r.import(seq, state))
    }

    /// The live sequences' ids, in creation order.
    pub fn sequences(&self) -> Vec<SeqId> {
        each!(self, r => r.seqs.keys().copied().collect())
    }

    /// Bytes a sequence holds (KV segments + DeltaNet states), the KV segments it shares with
    /// forks and prefix-cache entries included.
    pub fn sequence_bytes(&self, seq: SeqId) -> Result<usize> {
        each!(self, r => r.sequence_bytes(seq))
    }

    /// Bytes the sequences hold together, a KV segment shared between them counted once.
    pub fn sequences_bytes(&self, seqs: &[SeqId]) -> Result<usize> {
        each!(self, r => r.sequences_bytes(seqs))
    }

    /// Bytes only this sequence holds (what dropping it frees): the segments it shares excluded.
    pub fn sequence_unique_bytes(&self, seq: SeqId) -> Result<usize> {
        each!(self, r => r.sequence_unique_bytes(seq))
    }

    /// Tokens in sequence `seq`.
    pub fn position_in(&self, seq: SeqId) -> Result<usize> {
        each!(self, r => r.seq(seq).map(|s| s.pos))
    }

    /// The tokens of sequence `seq` (those behind its KV rows 0..position).
    pub fn tokens_in(&self, seq: SeqId) -> Result<Vec<u32>> {
        each!(self, r => r.seq(seq).map(|s| s.cached[..s.pos].to_vec()))
    }

    /// Tokens in the default sequence.
    pub fn position(&self) -> usize {
        self.position_in(DEFAULT_SEQ).unwrap_or(0)
    }

    /// Element type of the stored K/V rows.
    pub fn kv_dtype(&self) -> KvDtype {
        each!(self, r => r.kv_dtype)
    }

    /// Bytes the default sequence's KV cache holds now (it grows in segments with the sequence).
    pub fn kv_bytes(&self) -> usize {
        each!(self, r => r.seq(DEFAULT_SEQ).map_or(0, |s| s.state.kv_bytes(&r.b)))
    }

    pub fn max_seq(&self) -> usize {
        each!(self, r => r.max_seq)
    }

    /// Tokens per forward call during prefill.
    pub fn prefill_chunk(&self) -> usize {
        each!(self, r => r.scratch.chunk)
    }

    pub fn vocab_size(&self) -> usize {
        each!(self, r => r.model.vocab())
    }

    pub fn backend_name(&self) -> &'static str {
        each!(self, r => r.b.name())
    }

    /// What the engine chose for the caller, in words: the backend `auto` picked and why, a
    /// `max_seq` fitted to the device's memory.
    pub fn notes(&self) -> &[String] {
        each!(self, r => &r.notes)
    }

    /// Why the sequence state cannot be used (a device error interrupted a forward pass), until
    /// `reset()` or `restore()`; `None` when it can.
    pub fn state_error(&self) -> Option<&str> {
        self.state_error_in(DEFAULT_SEQ)
    }

    /// `state_error` of sequence `seq` (`None` also for an unknown sequence).
    pub fn state_error_in(&self, seq: SeqId) -> Option<&str> {
        each!(self, r => r.seqs.get(&seq).and_then(|s| s.error.as_deref()))
    }

    /// The model's memory at this engine's `max_seq` (weights, state, KV cache, activations).
    pub fn footprint(&self) -> Footprint {
        each!(self, r => r.footprint)
    }

    /// Bytes of weights the backend copied because it could not read them in place from the
    /// mapped checkpoint (Metal: a tensor not 4-byte aligned in its file).
    pub fn copied_weight_bytes(&self) -> u64 {
        each!(self, r => r.b.copied_weight_bytes())
    }

    pub fn config(&self) -> &ModelConfig {
        match self {
            Engine::Cpu(_, c) => c,
            #[cfg(unix)]
            Engine::MetalSim(_, c) => c,
            #[cfg(target_os = "macos")]
            Engine::Metal(_, c) => c,
            #[cfg(unix)]
            Engine::CudaSim(_, c) => c,
            #[cfg(target_os = "linux")]
            Engine::Cuda(_, c) => c,
        }
    }

    /// The device the engine runs on, in words (the CPU backends: "CPU").
    pub fn device_description(&self) -> String {
        match self {
            #[cfg(unix)]
            Engine::CudaSim(r, _) => r.b.describe(),
            #[cfg(target_os = "linux")]
            Engine::Cuda(r, _) => r.b.describe(),
            _ => self.backend_name().to_string(),
        }
    }

    /// Device memory bandwidth in GB/s (a device-to-device copy of `bytes`, best of 5, counting
    /// bytes read and written) on a GPU backend; `None` on the CPU backends.
    #[cfg_attr(not(target_os = "linux"), allow(unused_variables))] // `bytes`: CUDA only (Linux)
    pub fn measure_device_bandwidth(&self, bytes: usize) -> Result<Option<f64>> {
        match self {
            #[cfg(target_os = "linux")]
            Engine::Cuda(r, _) => r.b.copy_bandwidth(bytes).map(Some),
            _ => Ok(None),
        }
    }

    /// Peak device memory allocated by the engine (weights, state, scratch), where the backend
    /// tracks it (CUDA).
    pub fn device_peak_bytes(&self) -> Option<usize> {
        match self {
            #[cfg(target_os = "linux")]
            Engine::Cuda(r, _) => r.b.peak_bytes(),
            _ => None,
        }
    }
}
