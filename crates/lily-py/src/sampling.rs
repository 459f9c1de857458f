//! `lily._lily.Sampler`: the native half of `lily.Sampler`. Python holds the policy and its
//! defaults; this class does the per-token work on the full logits row, with the GIL released.

use std::collections::HashMap;

use lily_core::sampling::{Sampler as CoreSampler, SamplingParams};
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
    /// unless asked for.
    #[pyo3(signature = (logits, logprob=false))]
    fn sample(
        &mut self,
        py: Python<'_>,
        logits: PyReadonlyArray1<'_, f32>,
        logprob: bool,
    ) -> PyResult<(u32, Option<f32>)> {
        let row = logits
            .as_slice()
            .map_err(|_| PyValueError::new_err("logits must be a contiguous 1-D float32 array"))?;
        let inner = &mut self.inner;
        let s = py.detach(|| inner.sample(row, logprob)).map_err(value_error)?;
        Ok((s.token, s.logprob))
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

/// Adds this file's classes to `lily._lily`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySampler>()?;
    Ok(())
}
