//! The engine: one model, one sequence. `prefill` appends tokens in bounded chunks, `decode`
//! appends one; both return next-token logits. Inputs are validated before any state changes,
//! so an error leaves the sequence as it was.

use std::path::Path;

use crate::{
    backend::{cpu::Cpu, Backend},
    config::ModelConfig,
    error::{Error, Result},
    model::{
        state::{Scratch, State},
        Model,
    },
    weights::Loader,
};

/// Tokens per forward call during prefill: bounds scratch memory whatever the prompt length.
pub const PREFILL_CHUNK: usize = 256;
/// Rows of logits computed per lm_head call when all logits are requested.
const LOGIT_ROWS: usize = 16;

pub struct Runner<B: Backend> {
    b: B,
    model: Model<B>,
    state: State<B>,
    scratch: Scratch<B>,
    pos: usize,
    max_seq: usize,
}

impl<B: Backend> Runner<B> {
    fn new(b: B, dir: &Path, cfg: &ModelConfig, max_seq: usize, progress: &mut dyn FnMut(usize, usize)) -> Result<Self> {
        let loader = Loader::open(dir, cfg)?;
        let model = Model::load(&b, &loader, cfg, progress)?;
        let state = State::new(&b, cfg, max_seq)?;
        let scratch = Scratch::new(&b, cfg, PREFILL_CHUNK.min(max_seq), LOGIT_ROWS)?;
        Ok(Runner { b, model, state, scratch, pos: 0, max_seq })
    }

    fn check(&self, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            return Err(Error::InvalidArgument("no tokens given".into()));
        }
        let vocab = self.model.vocab();
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::InvalidToken { token: bad, vocab });
        }
        if self.pos + tokens.len() > self.max_seq {
            return Err(Error::ContextFull { used: self.pos, requested: tokens.len(), max: self.max_seq });
        }
        Ok(())
    }

    fn prefill(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        self.check(tokens)?;
        let vocab = self.model.vocab();
        let mut out = vec![0f32; if all_logits { tokens.len() * vocab } else { vocab }];
        let mut done = 0;
        for chunk in tokens.chunks(self.scratch.chunk) {
            let t = chunk.len();
            self.b.begin()?;
            self.b.write_ids(&mut self.scratch.ids, chunk)?;
            self.model.forward(&self.b, t, self.pos, &mut self.state, &mut self.scratch);
            if all_logits {
                let mut row = 0;
                while row < t {
                    let rows = (t - row).min(self.scratch.logit_rows);
                    self.model.logits(&self.b, row, rows, &mut self.scratch);
                    self.b.finish()?;
                    self.b.read(&self.scratch.logits, 0, &mut out[(done + row) * vocab..][..rows * vocab])?;
                    row += rows;
                }
            } else if done + t == tokens.len() {
                self.model.logits(&self.b, t - 1, 1, &mut self.scratch);
                self.b.finish()?;
                self.b.read(&self.scratch.logits, 0, &mut out)?;
            } else {
                self.b.finish()?;
            }
            self.pos += t;
            done += t;
        }
        Ok(out)
    }

    fn decode_into(&mut self, token: u32, out: &mut [f32]) -> Result<()> {
        self.check(&[token])?;
        self.b.begin()?;
        self.b.write_ids(&mut self.scratch.ids, &[token])?;
        self.model.forward(&self.b, 1, self.pos, &mut self.state, &mut self.scratch);
        self.model.logits(&self.b, 0, 1, &mut self.scratch);
        self.b.finish()?;
        self.b.read(&self.scratch.logits, 0, out)?;
        self.pos += 1;
        Ok(())
    }

    fn reset(&mut self) -> Result<()> {
        self.state.reset(&self.b)?;
        self.pos = 0;
        Ok(())
    }
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
    Cuda,
}

impl BackendKind {
    pub fn parse(name: &str) -> Result<Self> {
        Ok(match name {
            "auto" => BackendKind::Auto,
            "cpu" => BackendKind::Cpu,
            "cpu-reference" => BackendKind::CpuReference,
            "metal" => BackendKind::Metal,
            "cuda" => BackendKind::Cuda,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "unknown backend {name:?}: expected \"auto\", \"cpu\", \"cpu-reference\", \"metal\" or \"cuda\""
                )))
            }
        })
    }
}

/// The type-erased engine: one variant per compiled backend.
pub enum Engine {
    Cpu(Runner<Cpu>, ModelConfig),
}

macro_rules! each {
    ($self:expr, $r:ident => $body:expr) => {
        match $self {
            Engine::Cpu($r, _) => $body,
        }
    };
}

impl Engine {
    /// Load the checkpoint in `dir`. `max_seq` defaults to the config's `max_position_embeddings`.
    pub fn new(dir: &Path, backend: BackendKind, max_seq: Option<usize>) -> Result<Self> {
        Self::with_progress(dir, backend, max_seq, &mut |_, _| {})
    }

    pub fn with_progress(
        dir: &Path,
        backend: BackendKind,
        max_seq: Option<usize>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        if !dir.is_dir() {
            return Err(Error::file(dir, "checkpoint folder not found"));
        }
        let cfg = ModelConfig::from_file(&dir.join("config.json"))?;
        let max_seq = match max_seq {
            Some(0) => return Err(Error::InvalidArgument("max_seq must be at least 1".into())),
            Some(n) => n,
            None => cfg.max_position_embeddings,
        };
        match backend {
            BackendKind::Auto | BackendKind::Cpu => {
                Ok(Engine::Cpu(Runner::new(Cpu::new(), dir, &cfg, max_seq, progress)?, cfg))
            }
            BackendKind::CpuReference => {
                Ok(Engine::Cpu(Runner::new(Cpu::reference(), dir, &cfg, max_seq, progress)?, cfg))
            }
            BackendKind::Metal => Err(Error::Device("the Metal backend is not built into this package yet".into())),
            BackendKind::Cuda => Err(Error::Device("the CUDA backend is not built into this package yet".into())),
        }
    }

    /// Append `tokens`; logits of the last one ([vocab]) or of every one ([len, vocab] flattened).
    pub fn prefill(&mut self, tokens: &[u32], all_logits: bool) -> Result<Vec<f32>> {
        each!(self, r => r.prefill(tokens, all_logits))
    }

    /// Append one token; its next-token logits.
    pub fn decode(&mut self, token: u32) -> Result<Vec<f32>> {
        let mut out = vec![0f32; self.vocab_size()];
        self.decode_into(token, &mut out)?;
        Ok(out)
    }

    /// `decode` writing into a caller's buffer of `vocab_size` floats (no allocation).
    pub fn decode_into(&mut self, token: u32, out: &mut [f32]) -> Result<()> {
        if out.len() != self.vocab_size() {
            return Err(Error::InvalidArgument(format!("logits buffer has {} entries, vocab is {}", out.len(), self.vocab_size())));
        }
        each!(self, r => r.decode_into(token, out))
    }

    pub fn reset(&mut self) -> Result<()> {
        each!(self, r => r.reset())
    }

    /// Tokens in the current sequence.
    pub fn position(&self) -> usize {
        each!(self, r => r.pos)
    }

    pub fn max_seq(&self) -> usize {
        each!(self, r => r.max_seq)
    }

    pub fn vocab_size(&self) -> usize {
        each!(self, r => r.model.vocab())
    }

    pub fn backend_name(&self) -> &'static str {
        each!(self, r => r.b.name())
    }

    pub fn config(&self) -> &ModelConfig {
        match self {
            Engine::Cpu(_, c) => c,
        }
    }
}
