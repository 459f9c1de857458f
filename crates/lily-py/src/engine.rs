//! `lily.Engine`: a thin wrapper over `lily_core::Engine`. Token ids in, numpy logits out;
//! the GIL is released while the model runs.

use std::{path::PathBuf, sync::Mutex};

use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::{exceptions::PyValueError, prelude::*, types::PyAny};

use crate::errors::PyLilyError;
use lily_core::{
    backend::KvDtype,
    engine::{Options, Snapshot as CoreSnapshot},
    BackendKind, Engine as CoreEngine,
};

/// The sequence state at one position (DeltaNet states + token prefix), from `Engine.snapshot`.
#[pyclass(module = "lily._lily", name = "Snapshot", frozen)]
pub struct Snapshot {
    inner: Mutex<CoreSnapshot>,
    position: usize,
}

#[pymethods]
impl Snapshot {
    #[getter]
    fn position(&self) -> usize {
        self.position
    }

    /// The sequence's token ids when the snapshot was taken.
    #[getter]
    fn tokens(&self) -> PyResult<Vec<u32>> {
        Ok(self
            .inner
            .lock()
            .map_err(|_| PyValueError::new_err("snapshot lock poisoned"))?
            .tokens()
            .to_vec())
    }

    fn __repr__(&self) -> String {
        format!("Snapshot(position={})", self.position)
    }
}

#[pyclass(module = "lily._lily", name = "Engine")]
pub struct Engine {
    inner: CoreEngine,
}

fn to_ids(tokens: Vec<i64>, vocab: usize) -> PyResult<Vec<u32>> {
    tokens
        .into_iter()
        .map(|t| {
            if t < 0 || t as u64 >= vocab as u64 {
                Err(PyValueError::new_err(format!(
                    "token id {t} out of range: vocabulary has {vocab} entries"
                )))
            } else {
                Ok(t as u32)
            }
        })
        .collect()
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (path, *, backend = "auto", max_seq = None, prefill_chunk = None, progress = None, kv_dtype = "bf16"))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        backend: &str,
        max_seq: Option<i64>,
        prefill_chunk: Option<i64>,
        progress: Option<Py<PyAny>>,
        kv_dtype: &str,
    ) -> PyResult<Self> {
        let kind = BackendKind::parse(backend).map_err(PyLilyError::from)?;
        let kv_dtype = KvDtype::parse(kv_dtype).map_err(PyLilyError::from)?;
        let max_seq = match max_seq {
            Some(n) if n < 1 => return Err(PyValueError::new_err(format!("max_seq must be at least 1, got {n}"))),
            Some(n) => Some(n as usize),
            None => None,
        };
        let prefill_chunk = match prefill_chunk {
            Some(n) if n < 1 => {
                return Err(PyValueError::new_err(format!(
                    "prefill_chunk must be at least 1, got {n}"
                )))
            }
            Some(n) => Some(n as usize),
            None => None,
        };
        let inner = py.detach(|| {
            let mut report = |done: usize, total: usize| {
                if let Some(cb) = &progress {
                    // A failing progress callback must not abort the load: its error is printed.
                    Python::attach(|py| {
                        if let Err(e) = cb.call1(py, (done, total)) {
                            e.print(py);
                        }
                    });
                }
            };
            let opts = Options {
                backend: kind,
                max_seq,
                prefill_chunk,
                kv_dtype,
            };
            CoreEngine::load(&path, &opts, &mut report)
        });
        Ok(Engine {
            inner: inner.map_err(PyLilyError::from)?,
        })
    }

    /// Append tokens to the sequence; logits of the last one, or of every one with all_logits.
    #[pyo3(signature = (tokens, *, all_logits = false))]
    fn prefill<'py>(&mut self, py: Python<'py>, tokens: Vec<i64>, all_logits: bool) -> PyResult<Bound<'py, PyAny>> {
        let vocab = self.inner.vocab_size();
        let ids = to_ids(tokens, vocab)?;
        let n = ids.len();
        let inner = &mut self.inner;
        let logits = py
            .detach(|| inner.prefill(&ids, all_logits))
            .map_err(PyLilyError::from)?;
        let arr = PyArray1::from_vec(py, logits);
        if all_logits {
            let arr2: Bound<'py, PyArray2<f32>> = arr.reshape([n, vocab])?;
            Ok(arr2.into_any())
        } else {
            Ok(arr.into_any())
        }
    }

    /// Append one token; its next-token logits [vocab].
    fn decode<'py>(&mut self, py: Python<'py>, token: i64) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let vocab = self.inner.vocab_size();
        let id = to_ids(vec![token], vocab)?[0];
        let inner = &mut self.inner;
        let logits = py.detach(|| inner.decode(id)).map_err(PyLilyError::from)?;
        Ok(PyArray1::from_vec(py, logits))
    }

    /// Copy the sequence state at the current position (for prefix reuse).
    fn snapshot(&self, py: Python<'_>) -> PyResult<Snapshot> {
        let inner = &self.inner;
        let snap = py.detach(|| inner.snapshot()).map_err(PyLilyError::from)?;
        let position = snap.position();
        Ok(Snapshot {
            inner: Mutex::new(snap),
            position,
        })
    }

    /// Return to a snapshot of this engine whose tokens are still in the KV cache.
    /// (A state copy of tens of MB: done with the GIL held, since the snapshot is not Sync.)
    fn restore(&mut self, snapshot: &Snapshot) -> PyResult<()> {
        let snap = snapshot
            .inner
            .lock()
            .map_err(|_| PyValueError::new_err("snapshot lock poisoned"))?;
        self.inner.restore(&snap).map_err(PyLilyError::from)?;
        Ok(())
    }

    /// How many leading `tokens` match the tokens whose KV rows are cached.
    fn cached_prefix(&self, tokens: Vec<i64>) -> usize {
        let ids: Vec<u32> = tokens
            .iter()
            .take_while(|&&t| (0..u32::MAX as i64).contains(&t))
            .map(|&t| t as u32)
            .collect();
        self.inner.cached_prefix(&ids)
    }

    /// Forget the sequence (state and position back to zero).
    fn reset(&mut self, py: Python<'_>) -> PyResult<()> {
        let inner = &mut self.inner;
        py.detach(|| inner.reset()).map_err(PyLilyError::from)?;
        Ok(())
    }

    #[getter]
    fn position(&self) -> usize {
        self.inner.position()
    }

    #[getter]
    fn max_seq(&self) -> usize {
        self.inner.max_seq()
    }

    /// Element type of the stored K/V rows: "bf16", "f16" or "f32".
    #[getter]
    fn kv_dtype(&self) -> &'static str {
        self.inner.kv_dtype().name()
    }

    /// Bytes of KV cache held now (it grows in segments with the sequence).
    #[getter]
    fn kv_bytes(&self) -> usize {
        self.inner.kv_bytes()
    }

    #[getter]
    fn prefill_chunk(&self) -> usize {
        self.inner.prefill_chunk()
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    #[getter]
    fn backend(&self) -> &'static str {
        self.inner.backend_name()
    }

    /// The checkpoint's config.json as a dict.
    #[getter]
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let text = self.inner.config().raw.to_string();
        py.import("json")?.call_method1("loads", (text,))
    }

    fn __repr__(&self) -> String {
        format!(
            "Engine(backend={:?}, position={}, max_seq={}, vocab_size={})",
            self.inner.backend_name(),
            self.inner.position(),
            self.inner.max_seq(),
            self.inner.vocab_size()
        )
    }
}
