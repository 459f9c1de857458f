//! Structured output: which tokens may come next under a grammar (a JSON schema, a Lark grammar or a
//! regex), computed by llguidance.
//!
//! A [`Vocab`] holds the bytes of every token of one tokenizer (built once per model: the trie takes
//! ~0.1 s for Qwen3.6's 248K tokens). [`Vocab::constrain`] compiles a grammar into a [`Constraint`],
//! which owns one llguidance matcher on its own thread: after the sampler commits token t, the
//! thread advances the matcher and computes the mask for step t + 1 while the model's forward pass
//! for t runs (the engine releases the GIL, and the mask thread needs no lock), so the mask costs
//! the token loop only what is left of its computation when the logits arrive.
//!
//! A mask is a bit set over the logits row: bit `i % 32` of word `i / 32` allows id `i`. When the
//! grammar is complete, the mask allows only the end-of-sequence ids.

use std::{
    panic::{catch_unwind, AssertUnwindSafe},
    sync::{mpsc, Arc},
    thread,
};

use llguidance::{
    api::TopLevelGrammar,
    toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie},
    Matcher, ParserFactory,
};

use crate::error::{Error, Result};

fn grammar_error(e: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("grammar: {e}"))
}

/// The token bytes of one tokenizer, ready to compile grammars against.
pub struct Vocab {
    factory: Arc<ParserFactory>,
    eos: Vec<u32>,
    rows: usize,
}

/// What a grammar is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrammarKind {
    /// A JSON schema (draft 2020-12, with llguidance's documented departures).
    JsonSchema,
    /// llguidance's Lark dialect (with `%json { schema }` and lazy lexemes).
    Lark,
    /// A regular expression (Rust `regex` syntax) the whole output must match.
    Regex,
    /// llguidance's JSON grammar list: `{"grammars": [{"lark_grammar": ...}, {"name": ..., "json_schema": ...}]}`.
    Llguidance,
}

impl GrammarKind {
    pub fn parse(name: &str) -> Result<Self> {
        Ok(match name {
            "json_schema" => GrammarKind::JsonSchema,
            "lark" => GrammarKind::Lark,
            "regex" => GrammarKind::Regex,
            "llguidance" => GrammarKind::Llguidance,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "grammar kind must be json_schema, lark, regex or llguidance, got {name:?}"
                )))
            }
        })
    }
}

impl Vocab {
    /// `tokens[i]` is the text of id `i` as UTF-8 bytes (possibly part of a character); ids in
    /// `special` are control tokens a grammar never produces as text (`<|im_end|>`, ...); `eos` ids
    /// end a generation, and the mask allows them once the grammar is complete. The logits row
    /// has `rows >= tokens.len()` entries (the rest are padding ids, never allowed).
    pub fn new(tokens: &[Vec<u8>], special: &[u32], eos: &[u32], rows: usize) -> Result<Self> {
        if tokens.is_empty() || rows < tokens.len() || rows > u32::MAX as usize {
            return Err(Error::InvalidArgument(format!(
                "vocab: {} tokens for a logits row of {rows}",
                tokens.len()
            )));
        }
        let Some(&first_eos) = eos.first() else {
            return Err(Error::InvalidArgument("vocab: no end-of-sequence id".into()));
        };
        if let Some(&bad) = eos.iter().chain(special).find(|&&id| id as usize >= tokens.len()) {
            return Err(Error::InvalidToken {
                token: bad,
                vocab: tokens.len(),
            });
        }
        let mut words: Vec<Vec<u8>> = tokens.to_vec();
        words.resize(rows, Vec::new());
        for &id in special {
            // llguidance's marker for a control token: it never matches grammar text.
            let w = &mut words[id as usize];
            w.insert(0, TokTrie::SPECIAL_TOKEN_MARKER);
        }
        // Two ids with the same bytes would share one trie node: keep the first, never allow the other.
        let mut seen = std::collections::HashSet::new();
        for w in words.iter_mut() {
            if !w.is_empty() && !seen.insert(w.clone()) {
                w.clear();
            }
        }
        let info = TokRxInfo::new(rows as u32, first_eos);
        let built = catch_unwind(AssertUnwindSafe(|| {
            let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
            let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
            ParserFactory::new_simple(&env)
        }));
        let mut factory = match built {
            Ok(Ok(f)) => f,
            Ok(Err(e)) => return Err(Error::InvalidArgument(format!("vocab: {e}"))),
            Err(_) => {
                return Err(Error::InvalidArgument(
                    "vocab: token table rejected by llguidance".into(),
                ))
            }
        };
        factory.quiet();
        Ok(Vocab {
            factory: Arc::new(factory),
            eos: eos.to_vec(),
            rows,
        })
    }

    /// Entries of the logits row a mask covers.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Compiles `source` and starts computing the first mask. A grammar that does not compile is an
    /// `InvalidArgument` naming the problem.
    pub fn constrain(&self, kind: GrammarKind, source: &str) -> Result<Constraint> {
        let grammar = match kind {
            GrammarKind::JsonSchema => {
                TopLevelGrammar::from_json_schema(serde_json::from_str(source).map_err(grammar_error)?)
            }
            GrammarKind::Lark => TopLevelGrammar::from_lark(source.to_string()),
            GrammarKind::Regex => TopLevelGrammar::from_regex(source),
            GrammarKind::Llguidance => serde_json::from_str(source).map_err(grammar_error)?,
        };
        let parser = self.factory.create_parser(grammar).map_err(grammar_error)?;
        let matcher = Matcher::new(Ok(parser));
        Constraint::start(matcher, self.eos.clone(), self.rows)
    }
}

/// A grammar being followed by one generation: the mask for the next token, computed ahead on its
/// own thread.
pub struct Constraint {
    tokens: Option<mpsc::Sender<u32>>,
    masks: mpsc::Receiver<Result<Vec<u32>>>,
    /// The mask for the next token, once received.
    ready: Option<Vec<u32>>, // [rows / 32] bit words
    worker: Option<thread::JoinHandle<()>>,
}

impl Constraint {
    fn start(mut matcher: Matcher, eos: Vec<u32>, rows: usize) -> Result<Self> {
        // A grammar that failed to compile lazily reports it on the first mask: check now.
        let first = mask_of(&mut matcher, &eos, rows)?;
        let (token_tx, token_rx) = mpsc::channel::<u32>();
        let (mask_tx, mask_rx) = mpsc::channel();
        let worker = thread::Builder::new()
            .name("lily-constraint".into())
            .spawn(move || {
                // Each committed token: advance, then compute the next mask. Ends when the
                // Constraint is dropped (the sender closes) or after the first error.
                while let Ok(token) = token_rx.recv() {
                    let next = matcher
                        .consume_token(token)
                        .map_err(|e| Error::InvalidArgument(format!("constraint: {e}")))
                        .and_then(|()| mask_of(&mut matcher, &eos, rows));
                    let failed = next.is_err();
                    if mask_tx.send(next).is_err() || failed {
                        return;
                    }
                }
            })
            .map_err(|e| Error::Device(format!("constraint thread: {e}")))?;
        Ok(Constraint {
            tokens: Some(token_tx),
            masks: mask_rx,
            ready: Some(first),
            worker: Some(worker),
        })
    }

    /// The allowed ids for the next token (waits for the mask thread if it is still computing).
    pub fn mask(&mut self) -> Result<&[u32]> {
        if self.ready.is_none() {
            let next = self
                .masks
                .recv()
                .map_err(|_| Error::InvalidArgument("constraint: no mask after the last token".into()))?;
            self.ready = Some(next?);
        }
        Ok(self.ready.as_deref().unwrap_or_default())
    }

    /// Accepts `token` as the next one (it must be allowed by [`Constraint::mask`]) and starts
    /// computing the mask after it.
    pub fn commit(&mut self, token: u32) -> Result<()> {
        let mask = self.mask()?;
        if !allowed(mask, token) {
            return Err(Error::InvalidArgument(format!(
                "constraint: token {token} is not allowed by the grammar here"
            )));
        }
        self.ready = None;
        let sent = self.tokens.as_ref().is_some_and(|tx| tx.send(token).is_ok());
        if !sent {
            return Err(Error::InvalidArgument("constraint: the mask thread has stopped".into()));
        }
        Ok(())
    }
}

impl Drop for Constraint {
    fn drop(&mut self) {
        self.tokens = None; // closes the channel: the thread ends after its current mask
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// Whether `mask` allows `token`.
pub fn allowed(mask: &[u32], token: u32) -> bool {
    mask.get(token as usize / 32)
        .is_some_and(|w| w >> (token % 32) & 1 == 1)
}

/// The matcher's mask for the next token as bit words over `rows` ids; once the grammar is done,
/// the eos ids alone. Any eos id allowed means all of them are (the tokenizer has several).
fn mask_of(matcher: &mut Matcher, eos: &[u32], rows: usize) -> Result<Vec<u32>> {
    let vob = matcher
        .compute_mask_or_eos()
        .map_err(|e| Error::InvalidArgument(format!("constraint: {e}")))?;
    let mut words = vob.as_slice().to_vec();
    words.resize(rows.div_ceil(32), 0);
    if eos.iter().any(|&t| allowed(&words, t)) {
        for &t in eos {
            words[t as usize / 32] |= 1 << (t % 32);
        }
    }
    Ok(words)
}
