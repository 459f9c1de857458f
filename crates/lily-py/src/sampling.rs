//! `lily._lily.Sampler`: the native half of `lily.Sampler`. Python holds the policy and its
//! defaults; this class does the per-token work on the full logits row, with the GIL released.
//! `Vocab` and `Constraint` bring structured output: the sampler draws only ids a grammar allows.

use std::{collections::HashMap, sync::Mutex};

use lily_core::{
    constraint::{Constraint as CoreConstraint, GrammarKind, Vocab as CoreVocab},
    sampling::{Sampler as CoreSampler, SamplingParams},
};
use numpy::PyReadonlyArray1;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// Seeded sampler over one row of float32 logits (bias, penalties, temperature, top-k, top-p, min-p).
#[pyclass(module = "lily._lily", name = "Sampler")]
pub struct PySampler {
    inner: CoreSampler,
}

fn value_error(e: lily_core::error::Error) -> PyErr {
    PyValueError::new_err(e.to_string())
}

#[pymethods]
impl PySampler {
    #[new]
    #[pyo3(signature = (*, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                        presence_penalty=0.0, frequency_penalty=0.0, logit_bias=None, vocab_limit=None, seed=0))]
    fn new(
        temperature: f32,
        top_k: usize,
        top_p: f32,
        min_p: f32,
        repetition_penalty: f32,
        presence_penalty: f32,
        frequency_penalty: f32,
        logit_bias: Option<HashMap<u32, f32>>,
        vocab_limit: Option<usize>,
        seed: u64,
    ) -> PyResult<Self> {
        let mut logit_bias: Vec<(u32, f32)> = logit_bias.unwrap_or_default().into_iter().collect();
        logit_bias.sort_by_key(|&(id, _)| id);
        let params = SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            presence_penalty,
            frequency_penalty,
            logit_bias,
            vocab_limit,
        };
        let inner = CoreSampler::new(params, seed).map_err(value_error)?;
        Ok(PySampler { inner })
    }

    /// Draws one token from a 1-D float32 row (read in place, not copied) and records it for the
    /// penalties. Returns `(token, logprob)`; `logprob` is the raw log-softmax of the token, or None
    /// unless asked for. With a `constraint`, only ids its grammar allows are drawn, and the
    /// token is committed to it (its next mask is then computed while the caller runs the model).
    #[pyo3(signature = (logits, logprob=false, constraint=None))]
    fn sample(
        &mut self,
        py: Python<'_>,
        logits: PyReadonlyArray1<'_, f32>,
        logprob: bool,
        constraint: Option<PyRef<'_, PyConstraint>>,
    ) -> PyResult<(u32, Option<f32>)> {
        let row = logits
            .as_slice()
            .map_err(|_| PyValueError::new_err("logits must be a contiguous 1-D float32 array"))?;
        let inner = &mut self.inner;
        let s = match constraint {
            None => py.detach(|| inner.sample(row, logprob)),
            Some(c) => {
                let c = &c.inner;
                py.detach(|| {
                    let mut c = c.lock().unwrap_or_else(|e| e.into_inner());
                    let s = inner.sample_allowed(row, Some(c.mask()?), logprob)?;
                    c.commit(s.token)?;
                    Ok(s)
                })
            }
        }
        .map_err(value_error)?;
        Ok((s.token, s.logprob))
    }

    /// The `k` most likely ids under the raw logits with their log-probabilities, most likely first.
    fn top_logprobs(
        &mut self,
        py: Python<'_>,
        logits: PyReadonlyArray1<'_, f32>,
        k: usize,
    ) -> PyResult<Vec<(u32, f32)>> {
        let row = logits
            .as_slice()
            .map_err(|_| PyValueError::new_err("logits must be a contiguous 1-D float32 array"))?;
        let inner = &mut self.inner;
        Ok(py.detach(|| inner.top_logprobs(row, k)))
    }

    /// Starts a new sequence: re-seeds, forgets the counts, and counts `prompt` for the repetition penalty.
    #[pyo3(signature = (prompt, seed))]
    fn reset(&mut self, prompt: Vec<u32>, seed: u64) {
        self.inner.reset(&prompt, seed);
    }

    /// Records a token chosen elsewhere (for the penalties).
    fn accept(&mut self, token: u32) {
        self.inner.accept(token);
    }
}

/// The token bytes of one tokenizer, for compiling grammars (built once per model).
#[pyclass(module = "lily._lily", name = "Vocab", frozen)]
pub struct PyVocab {
    inner: CoreVocab,
}

#[pymethods]
impl PyVocab {
    #[new]
    #[pyo3(signature = (tokens, *, special, eos, rows))]
    fn new(py: Python<'_>, tokens: Vec<Vec<u8>>, special: Vec<u32>, eos: Vec<u32>, rows: usize) -> PyResult<Self> {
        let inner = py
            .detach(|| CoreVocab::new(&tokens, &special, &eos, rows))
            .map_err(value_error)?;
        Ok(PyVocab { inner })
    }

    /// Compiles a grammar (`kind`: "json_schema", "lark", "regex" or "llguidance") into a fresh
    /// constraint for one generation.
    fn constrain(&self, py: Python<'_>, kind: &str, source: &str) -> PyResult<PyConstraint> {
        let kind = GrammarKind::parse(kind).map_err(value_error)?;
        let inner = py.detach(|| self.inner.constrain(kind, source)).map_err(value_error)?;
        Ok(PyConstraint {
            inner: Mutex::new(inner),
        })
    }

    /// Entries of the logits row a mask covers.
    #[getter]
    fn rows(&self) -> usize {
        self.inner.rows()
    }
}

/// A grammar followed by one generation; pass it to `Sampler.sample` at every step.
#[pyclass(module = "lily._lily", name = "Constraint", frozen)]
pub struct PyConstraint {
    inner: Mutex<CoreConstraint>,
}

#[pymethods]
impl PyConstraint {
    /// Whether the grammar allows `token` next (waits for the mask if it is being computed).
    fn allows(&self, py: Python<'_>, token: u32) -> PyResult<bool> {
        py.detach(|| {
            let mut c = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            Ok(lily_core::constraint::allowed(c.mask()?, token))
        })
        .map_err(value_error)
    }
}

/// Adds this file's classes to `lily._lily`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySampler>()?;
    m.add_class::<PyVocab>()?;
    m.add_class::<PyConstraint>()?;
    Ok(())
}
