//! Token sampling over one row of logits: logit bias, repetition / presence / frequency penalties,
//! temperature, top-k, top-p, min-p, then a seeded draw (or greedy argmax).
//!
//! The order follows transformers' `generate` (processors, then warpers): bias and penalties change
//! the logits; temperature scales them; top-k, top-p and min-p cut the candidate set, in that order,
//! each on the distribution left by the one before. Ids at or past `vocab_limit` (the padding rows of
//! the embedding matrix) are never candidates.
//!
//! The work on a full row (248,320 entries for Qwen3.6) is kept to one or two passes: top-k uses a
//! running threshold and skips 64-entry blocks whose maximum is below it; the passes that need the
//! whole softmax use a branch-free `exp` that the compiler vectorises.

use std::collections::HashMap;

use crate::{
    backend::cpu::simd,
    error::{Error, Result},
};

/// Entries per block in the block-skipping scans.
const BLOCK: usize = 128;
/// Entries per block in the argmax scan.
const ARGMAX_BLOCK: usize = 512;
/// Entries per block of partial sums when drawing from the full distribution.
const SUM_BLOCK: usize = 1024;

/// The sampling policy. Defaults turn every filter off (plain sampling at temperature 1).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 turns it off.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`; 1 turns it off.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 turns it off.
    pub min_p: f32,
    /// transformers' repetition penalty over the prompt and the generated tokens: a positive logit
    /// is divided by it, a negative one multiplied. 1 turns it off.
    pub repetition_penalty: f32,
    /// OpenAI presence penalty: subtracted once from the logit of every generated token.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty: subtracted once per occurrence of a generated token.
    pub frequency_penalty: f32,
    /// Added to the logits of the given ids before anything else.
    pub logit_bias: Vec<(u32, f32)>,
    /// Ids `>= vocab_limit` are never sampled (padding rows). `None`: every entry of the row is valid.
    pub vocab_limit: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            vocab_limit: None,
        }
    }
}

impl SamplingParams {
    /// Checks every value; the message names the parameter, the allowed range and the value found.
    pub fn validate(&self) -> Result<()> {
        let bad = |name: &str, want: &str, got: String| {
            Err(Error::InvalidArgument(format!(
                "sampling: {name} must be {want}, got {got}"
            )))
        };
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad("temperature", "a finite number >= 0", self.temperature.to_string());
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", "in (0, 1]", self.top_p.to_string());
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", "in [0, 1]", self.min_p.to_string());
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad(
                "repetition_penalty",
                "a finite number > 0",
                self.repetition_penalty.to_string(),
            );
        }
        if !self.presence_penalty.is_finite() {
            return bad("presence_penalty", "finite", self.presence_penalty.to_string());
        }
        if !self.frequency_penalty.is_finite() {
            return bad("frequency_penalty", "finite", self.frequency_penalty.to_string());
        }
        if let Some((id, b)) = self.logit_bias.iter().find(|(_, b)| b.is_nan()) {
            return bad("logit_bias", "a number (or +-inf)", format!("{b} for token {id}"));
        }
        if self.vocab_limit == Some(0) {
            return bad("vocab_limit", "> 0", "0".to_string());
        }
        Ok(())
    }

    fn penalties_on(&self) -> bool {
        self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
}

/// One draw: the token and, when asked for, its log-probability under the model's own distribution
/// (log-softmax of the raw logits over the valid ids, before any bias, penalty or filter).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    pub token: u32,
    pub logprob: Option<f32>,
}

/// xoshiro256** seeded through splitmix64: small, fast, and the same stream on every platform.
#[derive(Debug, Clone)]
struct Rng([u64; 4]);

impl Rng {
    fn new(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Rng([next(), next(), next(), next()])
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let out = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
    }

    /// Uniform in [0, 1).
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// How often a token has been seen, for the penalties.
#[derive(Debug, Clone, Copy, Default)]
struct Seen {
    in_prompt: bool,
    generated: u32,
}

/// A sampler: the policy, the random stream and the token counts the penalties need.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    seen: HashMap<u32, Seen>,
    /// Logits after bias and penalties, when there are any.
    work: Vec<f32>, // [n] f32
    /// exp((x - max) / T) over the whole row, for the paths that need the full distribution.
    exps: Vec<f32>, // [n] f32
    block_sums: Vec<f32>, // [n / SUM_BLOCK] f32
    cand: Vec<(f32, u32)>,
    /// Entries of the sub-bucket the top-p cut falls in: (weight, id).
    edge: Vec<(f32, u32)>,
    /// Ids of the entries tied at the top-p cut that are in the nucleus.
    ties: Vec<u32>,
    /// Ids of the entries in the top-p edge bucket.
    idx: Vec<u32>,
}

impl Sampler {
    pub fn new(params: SamplingParams, seed: u64) -> Result<Self> {
        params.validate()?;
        Ok(Sampler {
            params,
            rng: Rng::new(seed),
            seen: HashMap::new(),
            work: Vec::new(),
            exps: Vec::new(),
            block_sums: Vec::new(),
            cand: Vec::new(),
            edge: Vec::new(),
            ties: Vec::new(),
            idx: Vec::new(),
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Starts a new sequence: re-seeds the random stream and forgets the counts; the prompt tokens
    /// count for the repetition penalty (not for presence / frequency, which see generated tokens only).
    pub fn reset(&mut self, prompt: &[u32], seed: u64) {
        self.rng = Rng::new(seed);
        self.seen.clear();
        if self.params.repetition_penalty != 1.0 {
            for &t in prompt {
                self.seen.entry(t).or_default().in_prompt = true;
            }
        }
    }

    /// Records a token as generated (for the penalties). `sample` does this itself for its own draws.
    pub fn accept(&mut self, token: u32) {
        if self.params.penalties_on() {
            self.seen.entry(token).or_default().generated += 1;
        }
    }

    /// Draws one token from `logits` (one row, f32) and records it for the penalties.
    pub fn sample(&mut self, logits: &[f32], want_logprob: bool) -> Result<Sample> {
        self.sample_allowed(logits, None, want_logprob)
    }

    /// [`Sampler::sample`] among the ids `allowed` permits (a bit set: bit `i % 32` of word `i / 32`
    /// allows id `i`; see [`crate::constraint`]). The other ids are never drawn, whatever the
    /// policy; the logprob is still the model's own (raw logits, no mask).
    pub fn sample_allowed(&mut self, logits: &[f32], allowed: Option<&[u32]>, want_logprob: bool) -> Result<Sample> {
        let n = self.params.vocab_limit.map_or(logits.len(), |v| v.min(logits.len()));
        if n == 0 {
            return Err(Error::InvalidArgument("sampling: empty logits".to_string()));
        }
        let raw = &logits[..n];
        if let Some(mask) = allowed {
            let live = |w: usize| {
                let bits = mask.get(w).copied().unwrap_or(0);
                let valid = n - w * 32; // ids of this word below n
                if valid >= 32 {
                    bits
                } else {
                    bits & ((1u32 << valid) - 1)
                }
            };
            if !(0..n.div_ceil(32)).any(|w| live(w) != 0) {
                return Err(Error::InvalidArgument(
                    "constraint: the grammar allows no token of the vocabulary here".to_string(),
                ));
            }
        }
        let patched = self.patch(raw, allowed);
        let mut work = std::mem::take(&mut self.work);
        let row: &[f32] = if patched { &work } else { raw };
        let token = self.draw(row);
        // The fast exp gives masked (-inf) entries a weight of ~1e-38 rather than 0: should the
        // draw land on one, take the most likely allowed id instead.
        let token = match (token, allowed) {
            (Ok(t), Some(mask)) if !crate::constraint::allowed(mask, t) => max_and_argmax(&work)
                .1
                .ok_or_else(|| Error::InvalidArgument("sampling: no finite logit among the allowed ids".to_string())),
            (t, _) => t,
        };
        if patched {
            std::mem::swap(&mut self.work, &mut work);
        }
        let token = token?;
        self.accept(token);
        let logprob = if want_logprob {
            Some(log_softmax_at(raw, token as usize))
        } else {
            None
        };
        Ok(Sample { token, logprob })
    }

    /// The `k` most likely ids of the model's distribution over `logits` (raw: no bias, penalty or
    /// filter), with their log-probabilities, most likely first (OpenAI's `top_logprobs`).
    pub fn top_logprobs(&mut self, logits: &[f32], k: usize) -> Vec<(u32, f32)> {
        let n = self.params.vocab_limit.map_or(logits.len(), |v| v.min(logits.len()));
        let raw = &logits[..n];
        if k == 0 || n == 0 {
            return Vec::new();
        }
        top_k_into(raw, k.min(n), &mut self.cand);
        let Some(&(max, _)) = self.cand.first() else {
            return Vec::new();
        };
        if max == f32::INFINITY {
            return self
                .cand
                .iter()
                .map(|&(x, id)| (id, if x == max { 0.0 } else { f32::NEG_INFINITY }))
                .collect();
        }
        let log_z = max as f64 + exp_sum(raw, max, 1.0).ln();
        self.cand
            .iter()
            .map(|&(x, id)| (id, (x as f64 - log_z) as f32))
            .collect()
    }

    /// Copies the row into `self.work` and applies the mask, bias and penalties, when there are any
    /// to apply.
    fn patch(&mut self, raw: &[f32], allowed: Option<&[u32]>) -> bool {
        let p = &self.params;
        let penalties = p.penalties_on() && !self.seen.is_empty();
        if p.logit_bias.is_empty() && !penalties && allowed.is_none() {
            return false;
        }
        self.work.clear();
        self.work.extend_from_slice(raw);
        let n = raw.len();
        if let Some(mask) = allowed {
            for (w, chunk) in self.work.chunks_mut(32).enumerate() {
                let bits = mask.get(w).copied().unwrap_or(0);
                if bits == u32::MAX {
                    continue;
                }
                for (j, x) in chunk.iter_mut().enumerate() {
                    if bits >> j & 1 == 0 {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
        }
        for &(id, b) in &p.logit_bias {
            if let Some(x) = self.work.get_mut(id as usize) {
                *x += b;
            }
        }
        if penalties {
            for (&id, s) in &self.seen {
                let i = id as usize;
                if i >= n {
                    continue;
                }
                let x = &mut self.work[i];
                if p.repetition_penalty != 1.0 && (s.in_prompt || s.generated > 0) {
                    *x = if *x > 0.0 {
                        *x / p.repetition_penalty
                    } else {
                        *x * p.repetition_penalty
                    };
                }
                if s.generated > 0 {
                    *x -= p.presence_penalty + p.frequency_penalty * s.generated as f32;
                }
            }
        }
        true
    }

    fn draw(&mut self, row: &[f32]) -> Result<u32> {
        let p = &self.params;
        // Greedy: T = 0, or a T so small that 1 / T overflows (below ~2.9e-39): its weights are 1 for the maximum and
        // 0 for the rest, where an infinite 1 / T would make them NaN (0 * inf) and the draw arbitrary.
        let inv_t = 1.0 / p.temperature;
        let greedy = p.top_k == 1 || !inv_t.is_finite();
        let (top_k, top_p) = (p.top_k, p.top_p);
        let inv_t = if greedy { 1.0 } else { inv_t };
        let no_finite = || {
            Error::InvalidArgument(format!(
                "sampling: no finite logit among the {} valid entries (all -inf or NaN)",
                row.len()
            ))
        };
        if !greedy && top_k > 0 && top_k < row.len() {
            // The top-k scan finds the maximum too: its first candidate.
            top_k_into(row, top_k, &mut self.cand);
            let &(max, argmax) = self.cand.first().ok_or_else(no_finite)?;
            if max == f32::INFINITY {
                return Ok(argmax);
            }
            if top_p < 1.0 {
                let z = cand_weights(&self.cand, max, inv_t);
                truncate_nucleus(&mut self.cand, max, inv_t, z, top_p);
            }
            let min_cut = min_p_cut(p, max);
            self.cand.retain(|&(x, _)| x >= min_cut);
            return self.draw_cand(max, inv_t);
        }
        let (max, argmax) = max_and_argmax(row);
        let argmax = argmax.ok_or_else(no_finite)?;
        if greedy || max == f32::INFINITY {
            return Ok(argmax);
        }
        let min_cut = min_p_cut(p, max);
        if top_p < 1.0 {
            // min-p in weight terms: exp((x - max) / T) >= min_p.
            let min_w = if p.min_p > 0.0 { p.min_p } else { 0.0 };
            return self.draw_top_p(row, max, inv_t, top_p, min_w);
        }
        if self.params.min_p > 0.0 {
            collect_above(row, min_cut, &mut self.cand);
            return self.draw_cand(max, inv_t);
        }
        Ok(self.draw_full(row, max, inv_t))
    }

    /// The top-p cut of the whole row: fills `self.exps` with the tempered weights and returns
    /// `(c, ties)`, meaning the nucleus is every entry with weight > c plus `self.ties` (`ties` ids
    /// with weight == c, the lowest ids first): the smallest top set whose mass reaches `top_p`, as
    /// a sort would give. No sort of the row: weights are bucketed by binary exponent, the bucket
    /// the cut falls in by its top 8 mantissa bits, and only that sub-bucket (a few entries) is
    /// sorted. The full-row passes are branch-free: a flat row would make any data-dependent
    /// branch mispredict on every other entry.
    fn nucleus_cut(&mut self, row: &[f32], max: f32, inv_t: f32, top_p: f32) -> (f32, usize) {
        let n = row.len();
        self.exps.resize(n, 0.0);
        self.ties.clear();
        // Pass 1: weights and their histogram by binary exponent, chunk by chunk while in L1.
        let (hist, z) = exp_hist(row, &mut self.exps, max, inv_t);
        let limit = top_p as f64 * z;
        let mut before = 0.0f64;
        let Some(edge_exp) = (0..256u32).rev().find(|&b| {
            let m = hist[b as usize];
            if before + m >= limit {
                return true;
            }
            before += m;
            false
        }) else {
            return (-1.0, 0); // rounding left the mass short of the limit: everything is in
        };
        // Pass 2: the ids in the edge bucket, 8 entries at a time: a bit mask per group of 8 (a
        // vectorised compare), then only the set bits are visited.
        self.idx.clear();
        for (c, group) in self.exps.chunks(8).enumerate() {
            let mut mask = 0u32;
            for (j, &w) in group.iter().enumerate() {
                mask |= ((w.to_bits() >> 23 == edge_exp) as u32) << j;
            }
            while mask != 0 {
                self.idx.push((c * 8) as u32 + mask.trailing_zeros());
                mask &= mask - 1;
            }
        }
        let cnt = self.idx.len();
        // The edge bucket again by its top 8 mantissa bits; only the sub-bucket of the cut is sorted.
        let key = |w: f32| ((w.to_bits() >> 15) & 0xFF) as usize;
        let mut sub = [0.0f64; 256];
        for &i in &self.idx[..cnt] {
            let w = self.exps[i as usize];
            sub[key(w)] += w as f64;
        }
        let mut cut_key = 0usize;
        for k in (0..256).rev() {
            if before + sub[k] >= limit {
                cut_key = k;
                break;
            }
            before += sub[k];
        }
        self.edge.clear();
        for &i in &self.idx[..cnt] {
            let w = self.exps[i as usize];
            if key(w) == cut_key {
                self.edge.push((w, i));
            }
        }
        self.edge
            .sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        // Everything above this sub-bucket is in; walk it until the mass reaches the limit (at
        // least one entry overall: the argmax is never cut).
        let mut cut = (f32::INFINITY, 0usize);
        for (k, &(w, _)) in self.edge.iter().enumerate() {
            if (k > 0 || before > 0.0) && before >= limit {
                break;
            }
            before += w as f64;
            cut = if w == cut.0 { (w, cut.1 + 1) } else { (w, 1) };
        }
        if cut.0 == f32::INFINITY {
            // The sub-bucket was empty (the limit was met above it): cut just below its floor.
            return (
                f32::from_bits(((edge_exp << 23) + ((cut_key as u32 + 1) << 15)).saturating_sub(1)),
                0,
            );
        }
        let first_tie = self.edge.iter().position(|&(w, _)| w == cut.0).unwrap_or(0);
        self.ties
            .extend(self.edge[first_tie..first_tie + cut.1].iter().map(|&(_, i)| i));
        cut
    }

    /// Draws from the top-p nucleus of the whole row (weights >= `min_w` only, for min-p) by inverse
    /// CDF over per-block sums of the included weights, without materialising the candidate set.
    fn draw_nucleus(&mut self, row: &[f32], max: f32, inv_t: f32, top_p: f32, min_w: f32) -> Result<u32> {
        let (mut c, mut ties) = self.nucleus_cut(row, max, inv_t, top_p);
        if min_w > c {
            // min-p cuts deeper than top-p: keep w >= min_w, i.e. w > the float just below it.
            c = f32::from_bits(min_w.to_bits().saturating_sub(1));
            ties = 0;
        }
        let kept = |w: f32| if w > c { w } else { 0.0 };
        self.block_sums.clear();
        for block in self.exps.chunks(SUM_BLOCK) {
            let mut acc = [0f32; 8];
            let mut lanes = block.chunks_exact(8);
            for l in &mut lanes {
                for j in 0..8 {
                    acc[j] += kept(l[j]);
                }
            }
            let tail: f32 = lanes.remainder().iter().map(|&w| kept(w)).sum();
            self.block_sums.push(acc.iter().sum::<f32>() + tail);
        }
        let tie_mass = ties as f64 * c as f64;
        let total: f64 = self.block_sums.iter().map(|&s| s as f64).sum::<f64>() + tie_mass;
        if total <= 0.0 || !total.is_finite() {
            return Err(Error::InvalidArgument(
                "sampling: every token was filtered out".to_string(),
            ));
        }
        let mut u = self.rng.next_f64() * total;
        for (b, &s) in self.block_sums.iter().enumerate() {
            if u >= s as f64 {
                u -= s as f64;
                continue;
            }
            let block = &self.exps[b * SUM_BLOCK..((b + 1) * SUM_BLOCK).min(self.exps.len())];
            let mut last = None;
            for (j, &w) in block.iter().enumerate() {
                if w > c {
                    last = Some(j);
                    u -= w as f64;
                    if u < 0.0 {
                        break;
                    }
                }
            }
            if let Some(j) = last {
                return Ok((b * SUM_BLOCK + j) as u32);
            }
        }
        // The tied entries at the cut, each of weight c (or rounding ran past the end).
        let k = if c > 0.0 { (u / c as f64) as usize } else { 0 };
        match self.ties.get(k.min(self.ties.len().saturating_sub(1))) {
            Some(&id) if ties > 0 => Ok(id),
            _ => self
                .exps
                .iter()
                .rposition(|&w| w > c)
                .map(|i| i as u32)
                .ok_or_else(|| Error::InvalidArgument("sampling: every token was filtered out".to_string())),
        }
    }

    /// The nucleus as a candidate list (for tests against a sort-based reference).
    #[cfg(test)]
    fn nucleus_full(&mut self, row: &[f32], max: f32, inv_t: f32, top_p: f32) {
        let (c, _) = self.nucleus_cut(row, max, inv_t, top_p);
        self.cand.clear();
        for (i, &w) in self.exps.iter().enumerate() {
            if w > c || self.ties.contains(&(i as u32)) {
                self.cand.push((row[i], i as u32));
            }
        }
    }

    /// Draws among `self.cand` (logit, id), weights exp((x - max) / T). Never empty after the
    /// filters (the argmax survives each of them), but an empty set is an error, not a panic.
    fn draw_cand(&mut self, max: f32, inv_t: f32) -> Result<u32> {
        let Some(&(_, last)) = self.cand.last() else {
            return Err(Error::InvalidArgument(
                "sampling: every token was filtered out".to_string(),
            ));
        };
        self.exps.clear();
        self.exps
            .extend(self.cand.iter().map(|&(x, _)| fast_exp((x - max) * inv_t)));
        let total: f64 = self.exps.iter().map(|&e| e as f64).sum();
        let mut u = self.rng.next_f64() * total;
        for (&(_, id), &e) in self.cand.iter().zip(&self.exps) {
            u -= e as f64;
            if u < 0.0 {
                return Ok(id);
            }
        }
        Ok(last)
    }

    /// Draws from the whole (tempered) distribution by inverse CDF over block sums.
    fn draw_full(&mut self, row: &[f32], max: f32, inv_t: f32) -> u32 {
        self.fill_exps(row, max, inv_t);
        self.draw_from_exps()
    }

    /// `self.exps` = tempered weights of `row`, `self.block_sums` their sums per block.
    fn fill_exps(&mut self, row: &[f32], max: f32, inv_t: f32) {
        let n = row.len();
        self.exps.resize(n, 0.0);
        self.block_sums.resize(n.div_ceil(SUM_BLOCK), 0.0);
        let fill = |src: &[f32], dst: &mut [f32], sums: &mut [f32]| {
            for ((s, d), b) in src
                .chunks(SUM_BLOCK)
                .zip(dst.chunks_mut(SUM_BLOCK))
                .zip(sums.iter_mut())
            {
                *b = exp_into(s, d, max, inv_t);
            }
        };
        // One thread: splitting the row over the pool measured slower (waking a pool thread and
        // moving half the row between cores cost more than the half pass saves).
        fill(row, &mut self.exps, &mut self.block_sums);
    }

    /// One draw from the distribution in `self.exps` by inverse CDF over `self.block_sums`.
    fn draw_from_exps(&mut self) -> u32 {
        let n = self.exps.len();
        let total: f64 = self.block_sums.iter().map(|&s| s as f64).sum();
        let mut u = self.rng.next_f64() * total;
        let mut last_nonzero = 0usize;
        for (b, &s) in self.block_sums.iter().enumerate() {
            if s <= 0.0 {
                continue;
            }
            if u >= s as f64 {
                u -= s as f64;
                last_nonzero = b;
                continue;
            }
            let base = b * SUM_BLOCK;
            let block = &self.exps[base..(base + SUM_BLOCK).min(n)];
            let mut last = 0usize;
            for (i, &e) in block.iter().enumerate() {
                if e > 0.0 {
                    last = i;
                    u -= e as f64;
                    if u < 0.0 {
                        return (base + i) as u32;
                    }
                }
            }
            return (base + last) as u32;
        }
        // Rounding ran past the end: the last token with any weight.
        let base = last_nonzero * SUM_BLOCK;
        let block = &self.exps[base..(base + SUM_BLOCK).min(n)];
        let i = block.iter().rposition(|&e| e > 0.0).unwrap_or(0);
        (base + i) as u32
    }

    /// Top-p (with min-p) over the whole row by rejection: draw from the full distribution and keep
    /// the draw if it lies in the nucleus, i.e. if the mass sorted before it (every heavier entry,
    /// and equal ones with a lower id) is below `top_p` of the total. The kept draws follow the
    /// renormalised nucleus exactly, and one vectorised pass per try replaces any sort or
    /// histogram. A draw is kept with probability >= the nucleus mass (>= top_p), so a few tries
    /// suffice; when they do not (a small top_p, a harsh min-p), the exact histogram cut takes over.
    fn draw_top_p(&mut self, row: &[f32], max: f32, inv_t: f32, top_p: f32, min_w: f32) -> Result<u32> {
        self.fill_exps(row, max, inv_t);
        let z: f64 = self.block_sums.iter().map(|&s| s as f64).sum();
        let limit = top_p as f64 * z;
        for _ in 0..16 {
            let i = self.draw_from_exps() as usize;
            let w = self.exps[i];
            if w < min_w {
                continue;
            }
            let (heavier, ties_before) = mass_before(&self.exps, w, i);
            let before = heavier + ties_before as f64 * w as f64;
            if before < limit || (heavier == 0.0 && ties_before == 0) {
                return Ok(i as u32);
            }
        }
        self.draw_nucleus(row, max, inv_t, top_p, min_w)
    }
}

/// The largest entry (NaN and -inf never win) and its index, the first one on ties; `None` when no
/// entry is above -inf. One vectorised pass over blocks, then a scan of the winning block.
pub fn max_and_argmax(row: &[f32]) -> (f32, Option<u32>) {
    let mut max = f32::NEG_INFINITY;
    let mut best = None;
    for (b, block) in row.chunks(ARGMAX_BLOCK).enumerate() {
        let m = block_max(block);
        if m > max {
            max = m;
            best = Some(b);
        }
    }
    let Some(b) = best else { return (max, None) };
    let base = b * ARGMAX_BLOCK;
    let i = row[base..].iter().position(|&x| x == max).map(|i| (base + i) as u32);
    (max, i)
}

/// Maximum over a row, ignoring NaN (-inf for an empty or all-NaN row). Eight lanes so it vectorises.
fn block_max(row: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for j in 0..8 {
            // `x > m` is false for NaN, so NaN never becomes the maximum.
            lanes[j] = if c[j] > lanes[j] { c[j] } else { lanes[j] };
        }
    }
    let mut m = f32::NEG_INFINITY;
    for &x in lanes.iter().chain(tail) {
        if x > m {
            m = x;
        }
    }
    m
}

/// The `k` largest entries as (logit, id), largest first, lower id first on ties; NaN and -inf skipped.
fn top_k_into(row: &[f32], k: usize, out: &mut Vec<(f32, u32)>) {
    out.clear();
    let cap = (4 * k).max(256);
    let mut thr = f32::NEG_INFINITY;
    for (b, block) in row.chunks(BLOCK).enumerate() {
        if block_max(block) <= thr {
            continue;
        }
        let base = b * BLOCK;
        for (j, &x) in block.iter().enumerate() {
            if x > thr {
                out.push((x, (base + j) as u32));
                if out.len() >= cap {
                    out.select_nth_unstable_by(k - 1, cmp_desc);
                    out.truncate(k);
                    // The k-th largest so far: later entries must beat it to matter.
                    thr = out.iter().fold(f32::INFINITY, |m, &(v, _)| m.min(v));
                }
            }
        }
    }
    sort_desc(out);
    out.truncate(k);
}

/// Every entry with logit >= `cut` (and > -inf), in id order.
fn collect_above(row: &[f32], cut: f32, out: &mut Vec<(f32, u32)>) {
    out.clear();
    for (b, block) in row.chunks(BLOCK).enumerate() {
        let m = block_max(block);
        if !(m >= cut && m > f32::NEG_INFINITY) {
            continue;
        }
        let base = b * BLOCK;
        for (j, &x) in block.iter().enumerate() {
            if x >= cut && x > f32::NEG_INFINITY {
                out.push((x, (base + j) as u32));
            }
        }
    }
}

fn cmp_desc(a: &(f32, u32), b: &(f32, u32)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

fn sort_desc(v: &mut [(f32, u32)]) {
    v.sort_unstable_by(cmp_desc);
}

/// Logits below this (in logit units) are rarer than min_p times the most likely token.
fn min_p_cut(p: &SamplingParams, max: f32) -> f32 {
    if p.min_p > 0.0 {
        max + p.min_p.ln() * p.temperature
    } else {
        f32::NEG_INFINITY
    }
}

/// Sum of the tempered weights exp((x - max) / T) of the candidates (their softmax normaliser).
fn cand_weights(cand: &[(f32, u32)], max: f32, inv_t: f32) -> f64 {
    cand.iter().map(|&(x, _)| fast_exp((x - max) * inv_t) as f64).sum()
}

/// Keeps the smallest prefix of the candidates (sorted, largest first) whose mass reaches `top_p` of
/// `z`: a token stays while the mass before it is below top_p (transformers' rule); one always stays.
fn truncate_nucleus(cand: &mut Vec<(f32, u32)>, max: f32, inv_t: f32, z: f64, top_p: f32) {
    let limit = top_p as f64 * z;
    let mut before = 0.0f64;
    let mut keep = 0usize;
    for &(x, _) in cand.iter() {
        if keep > 0 && before >= limit {
            break;
        }
        before += fast_exp((x - max) * inv_t) as f64;
        keep += 1;
    }
    cand.truncate(keep);
}

/// Sum over the row of exp((x - max) / T), vectorised (AVX2 when the CPU has it).
/// The mass of the entries heavier than `w`, and how many entries before index `i` weigh exactly
/// `w`: where entry `i` falls in a (weight desc, id asc) order. One branch-free pass in f32 lanes
/// (about 1e-5 relative error on the mass: it only decides draws within that of the cut); the
/// tie count needs a second pass only when another entry has exactly the same weight.
fn mass_before(exps: &[f32], w: f32, i: usize) -> (f64, usize) {
    let mut acc = [0f32; 16];
    let mut equal = [0u32; 16];
    let mut lanes = exps.chunks_exact(16);
    for l in &mut lanes {
        for j in 0..16 {
            acc[j] += if l[j] > w { l[j] } else { 0.0 };
            equal[j] += (l[j] == w) as u32;
        }
    }
    let mut heavier: f64 = acc.iter().map(|&a| a as f64).sum();
    let mut equal: u32 = equal.iter().sum();
    for &x in lanes.remainder() {
        heavier += if x > w { x as f64 } else { 0.0 };
        equal += (x == w) as u32;
    }
    let ties = if equal > 1 {
        exps[..i].iter().filter(|&&x| x == w).count()
    } else {
        0
    };
    (heavier, ties)
}

/// Tempered weights of `src` into `dst` and their histogram by binary exponent (sum of weights
/// per exponent), with the total. Four interleaved histograms keep the adds to one bucket from
/// waiting on each other.
fn exp_hist(src: &[f32], dst: &mut [f32], max: f32, inv_t: f32) -> ([f64; 256], f64) {
    let mut hist = [[0.0f64; 256]; 4];
    let mut z = 0.0f64;
    for (s, d) in src.chunks(SUM_BLOCK).zip(dst.chunks_mut(SUM_BLOCK)) {
        z += exp_into(s, d, max, inv_t) as f64;
        let mut quads = d.chunks_exact(4);
        for q in &mut quads {
            for j in 0..4 {
                hist[j][(q[j].to_bits() >> 23) as usize & 0xFF] += q[j] as f64;
            }
        }
        for &e in quads.remainder() {
            hist[0][(e.to_bits() >> 23) as usize & 0xFF] += e as f64;
        }
    }
    let mut out = hist[0];
    for h in &hist[1..] {
        out.iter_mut().zip(h.iter()).for_each(|(a, b)| *a += b);
    }
    (out, z)
}

fn exp_sum(row: &[f32], max: f32, inv_t: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { exp_sum_avx2(row, max, inv_t) };
    }
    exp_sum_generic(row, max, inv_t)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn exp_sum_avx2(row: &[f32], max: f32, inv_t: f32) -> f64 {
    exp_sum_generic(row, max, inv_t)
}

#[inline(always)]
fn exp_sum_generic(row: &[f32], max: f32, inv_t: f32) -> f64 {
    let mut total = 0.0f64;
    let mut lanes = [0.0f32; 8];
    for block in row.chunks(SUM_BLOCK) {
        lanes.fill(0.0);
        let chunks = block.chunks_exact(8);
        let tail = chunks.remainder();
        for c in chunks {
            for j in 0..8 {
                lanes[j] += fast_exp((c[j] - max) * inv_t);
            }
        }
        let mut s: f32 = lanes.iter().sum();
        for &x in tail {
            s += fast_exp((x - max) * inv_t);
        }
        total += s as f64;
    }
    total
}

/// Writes exp((x - max) / T) into `dst` and returns its sum (AVX2 when the CPU has it).
fn exp_into(src: &[f32], dst: &mut [f32], max: f32, inv_t: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { exp_into_avx2(src, dst, max, inv_t) };
    }
    exp_into_generic(src, dst, max, inv_t)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn exp_into_avx2(src: &[f32], dst: &mut [f32], max: f32, inv_t: f32) -> f32 {
    exp_into_generic(src, dst, max, inv_t)
}

#[inline(always)]
fn exp_into_generic(src: &[f32], dst: &mut [f32], max: f32, inv_t: f32) -> f32 {
    let mut lanes = [0.0f32; 8];
    let mut sc = src.chunks_exact(8);
    let mut dc = dst.chunks_exact_mut(8);
    for (s, d) in (&mut sc).zip(&mut dc) {
        for j in 0..8 {
            let e = fast_exp((s[j] - max) * inv_t);
            d[j] = e;
            lanes[j] += e;
        }
    }
    let mut total: f32 = lanes.iter().sum();
    for (&x, d) in sc.remainder().iter().zip(dc.into_remainder()) {
        let e = fast_exp((x - max) * inv_t);
        *d = e;
        total += e;
    }
    total
}

/// log_softmax(row)[i], computed in f64 over a vectorised exp pass.
pub fn log_softmax_at(row: &[f32], i: usize) -> f32 {
    let (max, _) = max_and_argmax(row);
    let Some(&x) = row.get(i) else { return f32::NEG_INFINITY };
    if max == f32::NEG_INFINITY || !x.is_finite() {
        return f32::NEG_INFINITY;
    }
    if max == f32::INFINITY {
        return if x == max { 0.0 } else { f32::NEG_INFINITY };
    }
    let z = exp_sum(row, max, 1.0);
    ((x - max) as f64 - z.ln()) as f32
}

/// exp(x) for x <= 0 to about 2 ulp, branch-free so that loops over it vectorise ([`simd::exp`]
/// on x clamped to [-87, 0]); NaN and anything below -87 give about 1.6e-38, which is what a
/// masked logit needs (`x > -87` is false for NaN, so NaN takes the floor like -inf does).
#[inline(always)]
fn fast_exp(x: f32) -> f32 {
    simd::exp(if x > -87.0 { x.min(0.0) } else { -87.0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn patterned(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        (0..n).map(|_| (rng.next_f64() as f32 - 0.5) * 20.0).collect()
    }

    fn sampler(params: SamplingParams) -> Sampler {
        Sampler::new(params, 7).unwrap()
    }

    fn freqs(s: &mut Sampler, logits: &[f32], draws: usize) -> Vec<f64> {
        let mut f = vec![0.0; logits.len()];
        for _ in 0..draws {
            f[s.sample(logits, false).unwrap().token as usize] += 1.0 / draws as f64;
        }
        f
    }

    fn softmax(x: &[f32], t: f32) -> Vec<f64> {
        let m = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f64> = x.iter().map(|&v| (((v - m) / t) as f64).exp()).collect();
        let z: f64 = e.iter().sum();
        e.iter().map(|v| v / z).collect()
    }

    #[test]
    fn a_mask_is_never_crossed_and_keeps_the_distribution_among_allowed_ids() {
        let logits = patterned(3000, 11);
        // Every 7th id, plus the id of the largest logit's neighbour: a sparse, irregular set.
        let mut mask = vec![0u32; 3000usize.div_ceil(32)];
        let allow = |m: &mut Vec<u32>, i: usize| m[i / 32] |= 1 << (i % 32);
        for i in (3..3000).step_by(7) {
            allow(&mut mask, i);
        }
        let policies = [
            SamplingParams {
                temperature: 0.0,
                ..Default::default()
            },
            SamplingParams::default(),
            SamplingParams {
                top_k: 20,
                ..Default::default()
            },
            SamplingParams {
                top_p: 0.5,
                ..Default::default()
            },
            SamplingParams {
                min_p: 0.1,
                temperature: 0.7,
                ..Default::default()
            },
            SamplingParams {
                logit_bias: vec![(0, 1e9)],
                repetition_penalty: 1.3,
                ..Default::default()
            },
        ];
        for params in policies {
            let mut s = sampler(params.clone());
            for _ in 0..500 {
                let t = s.sample_allowed(&logits, Some(&mask), false).unwrap().token as usize;
                assert!(
                    t >= 3 && (t - 3) % 7 == 0,
                    "{params:?} drew {t}, which the mask forbids"
                );
            }
        }
        // Among allowed ids the draw follows the softmax of their logits.
        let mut s = sampler(SamplingParams::default());
        let small: Vec<f32> = vec![1.0, 5.0, 2.0, 0.0, 3.0];
        let m = [0b10101u32]; // ids 0, 2, 4
        let mut f = [0.0f64; 5];
        for _ in 0..20000 {
            f[s.sample_allowed(&small, Some(&m), false).unwrap().token as usize] += 1.0 / 20000.0;
        }
        let want = softmax(&[1.0, 2.0, 3.0], 1.0);
        for (k, &id) in [0usize, 2, 4].iter().enumerate() {
            assert!((f[id] - want[k]).abs() < 0.015, "id {id}: {} vs {}", f[id], want[k]);
        }
        assert_eq!(f[1] + f[3], 0.0);
    }

    #[test]
    fn an_empty_mask_is_an_error_not_a_draw() {
        let mut s = sampler(SamplingParams::default());
        let logits = patterned(100, 1);
        let err = s.sample_allowed(&logits, Some(&[0, 0, 0, 0]), false).unwrap_err();
        assert!(err.to_string().contains("allows no token"), "{err}");
        // Bits past the valid ids (vocab_limit) do not count.
        let mut s = sampler(SamplingParams {
            vocab_limit: Some(40),
            ..Default::default()
        });
        assert!(s.sample_allowed(&logits, Some(&[0, 1 << 10, 0, 0]), false).is_err());
    }

    #[test]
    fn top_logprobs_are_the_largest_log_softmax_entries() {
        let logits = patterned(5000, 3);
        let mut s = sampler(SamplingParams {
            vocab_limit: Some(4000),
            ..Default::default()
        });
        let top = s.top_logprobs(&logits, 5);
        let mut order: Vec<usize> = (0..4000).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        for (k, &(id, lp)) in top.iter().enumerate() {
            assert_eq!(id as usize, order[k]);
            let want = log_softmax_at(&logits[..4000], order[k]);
            assert!((lp - want).abs() < 1e-4, "{lp} vs {want}");
        }
    }

    #[test]
    fn fast_exp_matches_std() {
        let mut worst = 0.0f32;
        for i in 0..200_000 {
            let x = -87.0 * i as f32 / 200_000.0;
            let rel = (fast_exp(x) - x.exp()).abs() / x.exp();
            worst = worst.max(rel);
        }
        assert!(worst < 1e-6, "worst relative error {worst}");
        assert!(fast_exp(f32::NAN) < 1e-37);
        assert!(fast_exp(f32::NEG_INFINITY) < 1e-37);
    }

    #[test]
    fn top_k_matches_a_full_sort() {
        for (n, k) in [(1000, 1), (248_320, 20), (248_320, 1000), (100, 99), (5000, 3000)] {
            let row = patterned(n, n as u64 + k as u64);
            let mut got = Vec::new();
            top_k_into(&row, k, &mut got);
            let mut want: Vec<(f32, u32)> = row.iter().enumerate().map(|(i, &x)| (x, i as u32)).collect();
            sort_desc(&mut want);
            want.truncate(k);
            assert_eq!(got, want, "n={n} k={k}");
        }
    }

    #[test]
    fn a_temperature_whose_inverse_overflows_is_greedy() {
        let mut row = patterned(1000, 2);
        row[17] = 50.0;
        for temperature in [2e-39, 1e-40, 1e-45] {
            for (top_k, top_p, min_p) in [
                (0, 1.0, 0.0),
                (20, 1.0, 0.0),
                (0, 0.9, 0.0),
                (0, 1.0, 0.1),
                (20, 0.9, 0.1),
            ] {
                let p = SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    min_p,
                    ..Default::default()
                };
                let mut s = sampler(p);
                for _ in 0..20 {
                    assert_eq!(
                        s.sample(&row, false).unwrap().token,
                        17,
                        "T={temperature} k={top_k} p={top_p}"
                    );
                }
            }
        }
    }

    #[test]
    fn greedy_picks_argmax_and_skips_padding() {
        let mut row = patterned(1000, 1);
        row[990] = 100.0; // padding row: must never win
        row[17] = 50.0;
        row[3] = f32::NAN;
        let p = SamplingParams {
            temperature: 0.0,
            vocab_limit: Some(900),
            ..Default::default()
        };
        assert_eq!(sampler(p).sample(&row, false).unwrap().token, 17);
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 5,
            vocab_limit: Some(900),
            ..Default::default()
        };
        below(p, &row, 900, 200);
    }

    /// `draws` tokens sampled from `row` under `p` all lie below `limit` (padding is never drawn).
    fn below(p: SamplingParams, row: &[f32], limit: u32, draws: usize) {
        let mut s = sampler(p);
        for _ in 0..draws {
            assert!(s.sample(row, false).unwrap().token < limit);
        }
    }

    #[test]
    fn padding_never_sampled_on_every_path() {
        let mut row = vec![0.0f32; 2000];
        row[1500..].fill(5.0);
        for p in [
            SamplingParams {
                vocab_limit: Some(1000),
                ..Default::default()
            },
            SamplingParams {
                vocab_limit: Some(1000),
                top_p: 0.5,
                ..Default::default()
            },
            SamplingParams {
                vocab_limit: Some(1000),
                min_p: 0.5,
                ..Default::default()
            },
            SamplingParams {
                vocab_limit: Some(1000),
                top_k: 50,
                ..Default::default()
            },
            SamplingParams {
                vocab_limit: Some(1000),
                logit_bias: vec![(1999, 100.0)],
                ..Default::default()
            },
        ] {
            below(p, &row, 1000, 500);
        }
    }

    #[test]
    fn same_seed_same_tokens() {
        let row = patterned(248_320, 3);
        let p = SamplingParams {
            top_k: 0,
            ..Default::default()
        };
        let mut a = Sampler::new(p.clone(), 42).unwrap();
        let mut b = Sampler::new(p, 42).unwrap();
        let ta: Vec<u32> = (0..50).map(|_| a.sample(&row, false).unwrap().token).collect();
        let tb: Vec<u32> = (0..50).map(|_| b.sample(&row, false).unwrap().token).collect();
        assert_eq!(ta, tb);
        a.reset(&[], 42);
        let tc: Vec<u32> = (0..50).map(|_| a.sample(&row, false).unwrap().token).collect();
        assert_eq!(ta, tc);
    }

    #[test]
    fn full_distribution_frequencies() {
        let row: Vec<f32> = vec![1.0, 2.0, 0.5, -1.0, 3.0, f32::NEG_INFINITY, 0.0, 1.5];
        for t in [0.5f32, 1.0, 2.0] {
            let mut s = sampler(SamplingParams {
                temperature: t,
                ..Default::default()
            });
            let f = freqs(&mut s, &row, 100_000);
            let want = softmax(&row, t);
            for (i, (a, b)) in f.iter().zip(&want).enumerate() {
                assert!((a - b).abs() < 0.01, "t={t} token {i}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        // probabilities 0.5, 0.25, 0.125, 0.125 -> top_p 0.7 keeps the first two
        let row: Vec<f32> = [0.5f32, 0.25, 0.125, 0.125].iter().map(|p| p.ln()).collect();
        for top_k in [0, 3] {
            let mut s = sampler(SamplingParams {
                top_p: 0.7,
                top_k,
                ..Default::default()
            });
            let f = freqs(&mut s, &row, 60_000);
            assert!((f[0] - 2.0 / 3.0).abs() < 0.01 && f[2] == 0.0 && f[3] == 0.0, "{f:?}");
        }
        // exactly reaching the mass: 0.75 keeps two as well (the third has 0.75 before it)
        let mut s = sampler(SamplingParams {
            top_p: 0.75,
            ..Default::default()
        });
        let f = freqs(&mut s, &row, 20_000);
        assert!(f[2] == 0.0 && f[3] == 0.0, "{f:?}");
    }

    #[test]
    fn rejection_top_p_follows_the_renormalised_nucleus() {
        // 40 entries with ties; the draw by rejection and the exact histogram cut must both give
        // the nucleus distribution of a sort (weight desc, id asc), renormalised.
        let row: Vec<f32> = (0..40).map(|i| ((i * 7) % 13) as f32 * 0.3).collect();
        for (top_p, min_p) in [(0.6f32, 0.0f32), (0.9, 0.0), (0.3, 0.0), (0.9, 0.2)] {
            let probs = softmax(&row, 1.0);
            let mut order: Vec<usize> = (0..row.len()).collect();
            order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
            let (mut want, mut mass) = (vec![0.0; row.len()], 0.0);
            let top = probs[order[0]];
            for &i in &order {
                if mass >= top_p as f64 {
                    break;
                }
                mass += probs[i];
                if probs[i] >= min_p as f64 * top {
                    want[i] = probs[i];
                }
            }
            let z: f64 = want.iter().sum();
            want.iter_mut().for_each(|p| *p /= z);
            let mut s = sampler(SamplingParams {
                top_p,
                min_p,
                ..Default::default()
            });
            let f = freqs(&mut s, &row, 80_000);
            for i in 0..row.len() {
                assert!(
                    (f[i] - want[i]).abs() < 0.01 && (want[i] > 0.0 || f[i] == 0.0),
                    "p={top_p} i={i}: {f:?} vs {want:?}"
                );
            }
            // The exact fallback (histogram cut) draws from the same set.
            let (max, _) = max_and_argmax(&row);
            let mut hits = vec![0usize; row.len()];
            for _ in 0..20_000 {
                hits[s
                    .draw_nucleus(&row, max, 1.0, top_p, if min_p > 0.0 { min_p } else { 0.0 })
                    .unwrap() as usize] += 1;
            }
            for i in 0..row.len() {
                assert!(
                    (hits[i] as f64 / 20_000.0 - want[i]).abs() < 0.015,
                    "fallback p={top_p} i={i}"
                );
            }
        }
    }

    #[test]
    fn bucketed_nucleus_equals_sorted_nucleus() {
        for (n, seed, top_p, t) in [
            (5000, 1, 0.9f32, 1.0f32),
            (248_320, 2, 0.95, 1.0),
            (3000, 3, 0.5, 0.3),
            (800, 4, 0.99, 2.0),
        ] {
            let row = patterned(n, seed);
            let (max, _) = max_and_argmax(&row);
            let inv_t = 1.0 / t;
            let z = exp_sum(&row, max, inv_t);
            let mut want: Vec<(f32, u32)> = row.iter().enumerate().map(|(i, &x)| (x, i as u32)).collect();
            sort_desc(&mut want);
            truncate_nucleus(&mut want, max, inv_t, z, top_p);
            let mut s = sampler(SamplingParams {
                top_p,
                temperature: t,
                ..Default::default()
            });
            s.nucleus_full(&row, max, inv_t, top_p);
            let mut got = s.cand.clone();
            sort_desc(&mut got);
            // the float sums may differ in the last place at the boundary: allow one token of slack
            assert!(
                (got.len() as i64 - want.len() as i64).abs() <= 1,
                "n={n}: {} vs {}",
                got.len(),
                want.len()
            );
            let common = got.len().min(want.len());
            assert_eq!(got[..common], want[..common]);
        }
    }

    #[test]
    fn min_p_cuts_relative_to_the_top() {
        let row: Vec<f32> = [0.4f32, 0.3, 0.2, 0.1].iter().map(|p| p.ln()).collect();
        let mut s = sampler(SamplingParams {
            min_p: 0.4,
            ..Default::default()
        });
        let f = freqs(&mut s, &row, 60_000);
        assert!(f[3] == 0.0 && (f[0] - 4.0 / 9.0).abs() < 0.01, "{f:?}");
    }

    #[test]
    fn penalties_and_bias() {
        let row = vec![2.0f32, 1.0, -1.0, 0.0];
        let p = SamplingParams {
            temperature: 0.0,
            repetition_penalty: 4.0,
            ..Default::default()
        };
        let mut s = sampler(p);
        s.reset(&[0], 1);
        // token 0: 2/4 = 0.5 < 1.0 -> token 1 wins
        assert_eq!(s.sample(&row, false).unwrap().token, 1);
        // token 1 now generated: 1/4 = 0.25; token 0 is 0.5 -> 0 wins
        assert_eq!(s.sample(&row, false).unwrap().token, 0);

        let p = SamplingParams {
            temperature: 0.0,
            frequency_penalty: 0.6,
            ..Default::default()
        };
        let mut s = sampler(p);
        let toks: Vec<u32> = (0..4).map(|_| s.sample(&row, false).unwrap().token).collect();
        // token 0: 2.0 -> 1.4 -> 0.8 (< 1.0, token 1) -> token 1 at 0.4 loses to 0.8
        assert_eq!(toks, vec![0, 0, 1, 0]);

        let p = SamplingParams {
            temperature: 0.0,
            presence_penalty: 1.5,
            ..Default::default()
        };
        let mut s = sampler(p);
        let toks: Vec<u32> = (0..3).map(|_| s.sample(&row, false).unwrap().token).collect();
        assert_eq!(toks, vec![0, 1, 0]); // 2.0 -> 0.5 after one use; 1.0 -> -0.5

        let p = SamplingParams {
            temperature: 0.0,
            logit_bias: vec![(2, 10.0)],
            ..Default::default()
        };
        assert_eq!(sampler(p).sample(&row, false).unwrap().token, 2);
        let p = SamplingParams {
            temperature: 0.0,
            logit_bias: vec![(0, f32::NEG_INFINITY)],
            ..Default::default()
        };
        assert_eq!(sampler(p).sample(&row, false).unwrap().token, 1);
    }

    #[test]
    fn logprob_is_raw_log_softmax() {
        let row = patterned(5000, 9);
        let p = SamplingParams {
            temperature: 0.0,
            ..Default::default()
        };
        let got = sampler(p).sample(&row, true).unwrap();
        let want = softmax(&row, 1.0)[got.token as usize].ln();
        assert!((got.logprob.unwrap() as f64 - want).abs() < 1e-4);
    }

    #[test]
    fn errors_not_panics() {
        let p = SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        assert!(sampler(p.clone()).sample(&[], false).is_err());
        assert!(sampler(p.clone())
            .sample(&[f32::NEG_INFINITY, f32::NAN], false)
            .is_err());
        assert!(Sampler::new(
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            0
        )
        .is_err());
        assert!(Sampler::new(
            SamplingParams {
                temperature: -1.0,
                ..Default::default()
            },
            0
        )
        .is_err());
        assert!(Sampler::new(
            SamplingParams {
                min_p: 2.0,
                ..Default::default()
            },
            0
        )
        .is_err());
        let mut s = sampler(SamplingParams {
            logit_bias: vec![(u32::MAX, 1.0)],
            ..Default::default()
        });
        assert!(s.sample(&[0.0, 1.0], false).is_ok());
        // +inf logit: that token, deterministically
        assert_eq!(sampler(p).sample(&[0.0, f32::INFINITY, 1.0], true).unwrap().token, 1);
    }
}
