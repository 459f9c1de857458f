//! `lily.Engine`: a thin wrapper over `lily_core::Engine`. Token ids in, numpy logits out;
//! the GIL is released while the model runs, calls from several threads take turns, and Ctrl-C
//! stops a load or a prefill within one layer or chunk.

use std::{
    path::PathBuf,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Mutex, TryLockError,
    },
};

use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::{
    exceptions::{PyOverflowError, PyRuntimeError, PyTypeError, PyValueError},
    prelude::*,
    types::{PyAny, PyDict},
};

use crate::{
    errors::{LilyError, PyLilyError},
    transfer,
};
use lily_core::{
    backend::{cpu::Precision, KvDtype},
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

/// One engine, shared by every Python thread that holds it: calls take turns on `inner` (a call
/// made while another runs waits for it, with the GIL released) instead of failing. What never
/// changes after loading is kept outside the lock.
#[pyclass(module = "lily._lily", name = "Engine", frozen)]
pub struct Engine {
    inner: Mutex<CoreEngine>,
    /// The thread inside a call (`thread_mark`), 0 when none: Python code run from inside a call (a
    /// signal handler between prefill chunks) calling this engine again gets an error, not a deadlock.
    holder: AtomicUsize,
    vocab: usize,
    max_seq: usize,
    prefill_chunk: usize,
    backend: &'static str,
    config_json: String,
    kv_dtype: &'static str,
    precision: &'static str,
    notes: Vec<String>,
    copied_weight_bytes: u64,
}

impl Engine {
    /// A batch of `(sequence, token)` pairs from Python, each checked.
    fn batch_pairs(&self, batch: &[(i64, Bound<'_, PyAny>)]) -> PyResult<Vec<(usize, u32)>> {
        batch
            .iter()
            .map(|(seq, token)| Ok((seq_id(*seq)?, to_ids("token", token, self.vocab, true)?[0])))
            .collect()
    }

    /// `f` on the core engine, with the GIL released while waiting for the engine and while `f` runs.
    fn with<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut CoreEngine) -> R + Send) -> PyResult<R> {
        let me = thread_mark();
        if self.holder.load(Ordering::Acquire) == me {
            return Err(PyRuntimeError::new_err(
                "reentrant call: this engine was called from code that runs inside a call on it (a signal handler?)",
            ));
        }
        py.detach(|| {
            let mut engine = self.inner.lock().map_err(|_| poisoned())?;
            struct Held<'a>(&'a AtomicUsize);
            impl Drop for Held<'_> {
                fn drop(&mut self) {
                    self.0.store(0, Ordering::Release);
                }
            }
            self.holder.store(me, Ordering::Release);
            let _held = Held(&self.holder);
            Ok(f(&mut engine))
        })
    }

    /// `f` for a quick read: with the GIL held when the engine is free (no GIL hand-over per call, which
    /// can cost a thread switch interval when other threads want it), else as `with`.
    fn peek<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&CoreEngine) -> R + Send) -> PyResult<R> {
        match self.inner.try_lock() {
            Ok(engine) => Ok(f(&engine)),
            Err(TryLockError::WouldBlock) => self.with(py, |e| f(e)),
            Err(TryLockError::Poisoned(_)) => Err(poisoned()),
        }
    }
}

fn poisoned() -> PyErr {
    LilyError::new_err(
        "an earlier call failed inside the engine and left it unusable (a bug: please report it); load the model again",
    )
}

/// A number unique to the calling thread while it runs (the address of a thread-local).
fn thread_mark() -> usize {
    thread_local!(static MARK: u8 = const { 0 });
    MARK.with(|m| m as *const u8 as usize)
}

/// The `proceed` of long core calls, run between a load's layers and a prefill's chunks: Python's
/// pending signal handlers run here, so Ctrl-C raises `KeyboardInterrupt` within one step; that
/// error (or the progress callback's) is kept in `raised` and stops the call.
fn proceed(raised: &mut Option<PyErr>, progress: Option<(&Py<PyAny>, usize, usize)>) -> lily_core::Result<()> {
    Python::attach(|py| {
        py.check_signals()?;
        if let Some((cb, done, total)) = progress {
            cb.call1(py, (done, total))?;
        }
        Ok(())
    })
    .map_err(|e: PyErr| {
        *raised = Some(e);
        lily_core::Error::Interrupted
    })
}

/// A core error as a Python exception; the one raised by `proceed` when it stopped the call.
fn stopped(e: lily_core::Error, raised: Option<PyErr>) -> PyErr {
    match (e, raised) {
        (lily_core::Error::Interrupted, Some(err)) => err,
        (e, _) => PyLilyError(e).into(),
    }
}

/// Token ids of argument `arg` in [0, vocab): a list of ints, or one int when `one`. An int too
/// large for i64 is out of range like any other (a ValueError, not pyo3's OverflowError).
fn to_ids(arg: &str, obj: &Bound<'_, PyAny>, vocab: usize, one: bool) -> PyResult<Vec<u32>> {
    let py = obj.py();
    let tokens = if one {
        obj.extract().map(|t| vec![t])
    } else {
        obj.extract::<Vec<i64>>()
    };
    let tokens = tokens.map_err(|e| {
        if e.is_instance_of::<PyOverflowError>(py) {
            PyValueError::new_err(format!("{arg}: token id out of range: vocabulary has {vocab} entries"))
        } else if e.is_instance_of::<PyTypeError>(py) {
            PyTypeError::new_err(format!("argument '{arg}': {}", e.value(py)))
        } else {
            e
        }
    })?;
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

/// A sequence id from Python: a negative one names no sequence.
fn seq_id(seq: i64) -> PyResult<usize> {
    usize::try_from(seq).map_err(|_| PyValueError::new_err(format!("no sequence {seq}: sequence ids are >= 0")))
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (path, *, backend = "auto", max_seq = None, prefill_chunk = None, progress = None, kv_dtype = "bf16", precision = "exact"))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        backend: &str,
        max_seq: Option<i64>,
        prefill_chunk: Option<i64>,
        progress: Option<Py<PyAny>>,
        kv_dtype: &str,
        precision: &str,
    ) -> PyResult<Self> {
        let kind = BackendKind::parse(backend).map_err(PyLilyError::from)?;
        let kv_dtype = KvDtype::parse(kv_dtype).map_err(PyLilyError::from)?;
        let precision = Precision::parse(precision).map_err(PyLilyError::from)?;
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
        let mut raised = None;
        let engine = py.detach(|| {
            let mut report = |done, total| proceed(&mut raised, progress.as_ref().map(|cb| (cb, done, total)));
            let opts = Options {
                backend: kind,
                max_seq,
                prefill_chunk,
                kv_dtype,
                precision,
            };
            CoreEngine::load(&path, &opts, &mut report)
        });
        let engine = engine.map_err(|e| stopped(e, raised))?;
        Ok(Engine {
            vocab: engine.vocab_size(),
            max_seq: engine.max_seq(),
            prefill_chunk: engine.prefill_chunk(),
            backend: engine.backend_name(),
            config_json: engine.config().raw.to_string(),
            kv_dtype: engine.kv_dtype().name(),
            precision: precision.name(),
            notes: engine.notes().to_vec(),
            copied_weight_bytes: engine.copied_weight_bytes(),
            inner: Mutex::new(engine),
            holder: AtomicUsize::new(0),
        })
    }

    /// Append tokens to the sequence; logits of the last one, or of every one with all_logits.
    /// Ctrl-C stops it between chunks, keeping the completed chunks in the sequence.
    #[pyo3(signature = (tokens, *, all_logits = false, seq = 0))]
    fn prefill<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        all_logits: bool,
        seq: i64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let ids = to_ids("tokens", tokens, self.vocab, false)?;
        let seq = seq_id(seq)?;
        let mut raised = None;
        let logits = self
            .with(py, |e| {
                e.prefill_in(seq, &ids, all_logits, &mut || proceed(&mut raised, None))
            })?
            .map_err(|e| stopped(e, raised))?;
        let arr = PyArray1::from_vec(py, logits);
        if all_logits {
            let arr2: Bound<'py, PyArray2<f32>> = arr.reshape([ids.len(), self.vocab])?;
            Ok(arr2.into_any())
        } else {
            Ok(arr.into_any())
        }
    }

    /// Append one token; its next-token logits [vocab].
    /// Append one token; the id of its largest next-token logit (greedy decoding without copying
    /// the logits to Python; on a GPU only the id leaves the device).
    #[pyo3(signature = (token, *, seq = 0))]
    fn decode_greedy(&self, py: Python<'_>, token: &Bound<'_, PyAny>, seq: i64) -> PyResult<u32> {
        let id = to_ids("token", token, self.vocab, true)?[0];
        let seq = seq_id(seq)?;
        Ok(self
            .with(py, |e| e.decode_greedy_in(seq, id))?
            .map_err(PyLilyError::from)?)
    }

    #[pyo3(signature = (token, *, seq = 0))]
    fn decode<'py>(&self, py: Python<'py>, token: &Bound<'py, PyAny>, seq: i64) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let id = to_ids("token", token, self.vocab, true)?[0];
        let seq = seq_id(seq)?;
        let mut logits = vec![0f32; self.vocab];
        self.with(py, |e| e.decode_in(seq, id, &mut logits))?
            .map_err(PyLilyError::from)?;
        Ok(PyArray1::from_vec(py, logits))
    }

    /// One decode step of several sequences in one pass over the weights: `batch` is a list of
    /// (sequence, token) pairs, each sequence at most once; the logits [len(batch), vocab] in
    /// that order.
    fn decode_batch<'py>(
        &self,
        py: Python<'py>,
        batch: Vec<(i64, Bound<'py, PyAny>)>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let pairs = self.batch_pairs(&batch)?;
        let mut logits = vec![0f32; pairs.len() * self.vocab];
        self.with(py, |e| e.decode_batch(&pairs, &mut logits))?
            .map_err(PyLilyError::from)?;
        PyArray1::from_vec(py, logits).reshape([pairs.len(), self.vocab])
    }

    /// `decode_batch` for greedy decoding: the id of each sequence's largest next-token logit,
    /// in the order given (no [len(batch), vocab] logits copied out).
    fn decode_batch_greedy(&self, py: Python<'_>, batch: Vec<(i64, Bound<'_, PyAny>)>) -> PyResult<Vec<u32>> {
        let pairs = self.batch_pairs(&batch)?;
        let mut ids = vec![0u32; pairs.len()];
        self.with(py, |e| e.decode_batch_greedy(&pairs, &mut ids))?
            .map_err(PyLilyError::from)?;
        Ok(ids)
    }

    /// A new empty sequence; its id.
    fn new_sequence(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.with(py, |e| e.new_sequence())?.map_err(PyLilyError::from)?)
    }

    /// A new sequence holding a copy of `seq` (KV rows, DeltaNet states, position, tokens).
    #[pyo3(signature = (seq = 0))]
    fn fork(&self, py: Python<'_>, seq: i64) -> PyResult<usize> {
        let seq = seq_id(seq)?;
        Ok(self.with(py, |e| e.fork(seq))?.map_err(PyLilyError::from)?)
    }

    /// Sequence `dst` becomes a copy of `src` (what it held before is gone).
    fn copy_sequence(&self, py: Python<'_>, src: i64, dst: i64) -> PyResult<()> {
        let (src, dst) = (seq_id(src)?, seq_id(dst)?);
        Ok(self
            .with(py, |e| e.copy_sequence(src, dst))?
            .map_err(PyLilyError::from)?)
    }

    /// Sequence `seq`'s state at its position: `(tokens, kv_dtype, tensors)`, the tensors K/V
    /// rows from `first_row` on and DeltaNet states by layer (see `import_sequence`, which takes
    /// whole states: `first_row` 0).
    #[pyo3(signature = (seq = 0, *, first_row = 0))]
    fn export_sequence<'py>(
        &self,
        py: Python<'py>,
        seq: i64,
        first_row: usize,
    ) -> PyResult<(Vec<u32>, &'static str, Bound<'py, PyDict>)> {
        let seq = seq_id(seq)?;
        let (st, width) = self.with(py, |e| {
            let c = e.config();
            (e.export_sequence(seq, first_row), c.num_key_value_heads * c.head_dim)
        })?;
        transfer::to_python(py, st.map_err(PyLilyError::from)?, width)
    }

    /// Sequence `seq` becomes a state from `export_sequence` (of this engine or another of the
    /// same model and kv_dtype); a state that does not fit is a ValueError / TypeError that
    /// changes nothing.
    #[pyo3(signature = (tokens, kv_dtype, tensors, *, seq = 0))]
    fn import_sequence(
        &self,
        py: Python<'_>,
        tokens: Vec<i64>,
        kv_dtype: &str,
        tensors: &Bound<'_, PyDict>,
        seq: i64,
    ) -> PyResult<()> {
        let seq = seq_id(seq)?;
        let kinds = self.peek(py, |e| e.config().layer_types.clone())?;
        let st = transfer::from_python(tokens, kv_dtype, tensors, &kinds)?;
        Ok(self
            .with(py, |e| e.import_sequence(seq, &st))?
            .map_err(PyLilyError::from)?)
    }

    /// Free a sequence's memory (its id is not used again; the default sequence 0 stays).
    fn drop_sequence(&self, py: Python<'_>, seq: i64) -> PyResult<()> {
        let seq = seq_id(seq)?;
        Ok(self.with(py, |e| e.drop_sequence(seq))?.map_err(PyLilyError::from)?)
    }

    /// The live sequences' ids.
    #[getter]
    fn sequences(&self, py: Python<'_>) -> PyResult<Vec<usize>> {
        self.peek(py, |e| e.sequences())
    }

    /// Tokens in sequence `seq`.
    fn sequence_position(&self, py: Python<'_>, seq: i64) -> PyResult<usize> {
        let seq = seq_id(seq)?;
        Ok(self.peek(py, |e| e.position_in(seq))?.map_err(PyLilyError::from)?)
    }

    /// The token ids of sequence `seq` (0..position).
    fn sequence_tokens(&self, py: Python<'_>, seq: i64) -> PyResult<Vec<u32>> {
        let seq = seq_id(seq)?;
        Ok(self.peek(py, |e| e.tokens_in(seq))?.map_err(PyLilyError::from)?)
    }

    /// Bytes sequence `seq` holds (KV segments + DeltaNet states), the KV segments it shares
    /// with forks included.
    fn sequence_bytes(&self, py: Python<'_>, seq: i64) -> PyResult<usize> {
        let seq = seq_id(seq)?;
        Ok(self.peek(py, |e| e.sequence_bytes(seq))?.map_err(PyLilyError::from)?)
    }

    /// Bytes the sequences hold together, a KV segment they share counted once.
    fn sequences_bytes(&self, py: Python<'_>, seqs: Vec<i64>) -> PyResult<usize> {
        let seqs = seqs.into_iter().map(seq_id).collect::<PyResult<Vec<_>>>()?;
        Ok(self
            .peek(py, |e| e.sequences_bytes(&seqs))?
            .map_err(PyLilyError::from)?)
    }

    /// Bytes only sequence `seq` holds (what dropping it frees): the KV segments it shares with
    /// forks excluded.
    fn sequence_unique_bytes(&self, py: Python<'_>, seq: i64) -> PyResult<usize> {
        let seq = seq_id(seq)?;
        Ok(self
            .peek(py, |e| e.sequence_unique_bytes(seq))?
            .map_err(PyLilyError::from)?)
    }

    /// Copy the sequence state at the current position (for prefix reuse).
    #[pyo3(signature = (*, seq = 0))]
    fn snapshot(&self, py: Python<'_>, seq: i64) -> PyResult<Snapshot> {
        let seq = seq_id(seq)?;
        let snap = self.with(py, |e| e.snapshot_in(seq))?.map_err(PyLilyError::from)?;
        let position = snap.position();
        Ok(Snapshot {
            inner: Mutex::new(snap),
            position,
        })
    }

    /// Return to a snapshot of this engine whose tokens are still in the KV cache.
    #[pyo3(signature = (snapshot, *, seq = 0))]
    fn restore(&self, py: Python<'_>, snapshot: &Snapshot, seq: i64) -> PyResult<()> {
        let seq = seq_id(seq)?;
        self.with(py, |e| {
            let snap = snapshot
                .inner
                .lock()
                .map_err(|_| PyValueError::new_err("snapshot lock poisoned"))?;
            e.restore_in(seq, &snap).map_err(|e| PyLilyError(e).into())
        })?
    }

    /// How many leading `tokens` match the tokens whose KV rows are cached.
    #[pyo3(signature = (tokens, *, seq = 0))]
    fn cached_prefix(&self, py: Python<'_>, tokens: Vec<Bound<'_, PyAny>>, seq: i64) -> PyResult<usize> {
        let seq = seq_id(seq)?;
        let mut ids = Vec::with_capacity(tokens.len());
        for t in &tokens {
            match t.extract::<i64>() {
                Ok(t) if (0..=u32::MAX as i64).contains(&t) => ids.push(t as u32),
                // An id no vocabulary has (negative, or too large even for i64) matches nothing.
                Ok(_) => break,
                Err(e) if e.is_instance_of::<PyOverflowError>(py) => break,
                Err(e) => return Err(PyTypeError::new_err(format!("argument 'tokens': {}", e.value(py)))),
            }
        }
        Ok(self
            .peek(py, |e| e.cached_prefix_in(seq, &ids))?
            .map_err(PyLilyError::from)?)
    }

    /// Append n positions of synthetic context (random K/V rows in the attention layers, the
    /// DeltaNet state as it is): decode then runs at depth position + n without the prefill's
    /// cost. For benchmarks; these positions match no token, so prefix reuse stops before them.
    #[pyo3(signature = (n, *, seed = 0))]
    fn fill_context(&self, py: Python<'_>, n: i64, seed: u64) -> PyResult<()> {
        if n < 1 {
            return Err(PyValueError::new_err(format!("n must be at least 1, got {n}")));
        }
        Ok(self
            .with(py, |e| e.fill_context(n as usize, seed))?
            .map_err(PyLilyError::from)?)
    }

    /// Forget the sequence (state and position back to zero).
    #[pyo3(signature = (*, seq = 0))]
    fn reset(&self, py: Python<'_>, seq: i64) -> PyResult<()> {
        let seq = seq_id(seq)?;
        Ok(self.with(py, |e| e.reset_in(seq))?.map_err(PyLilyError::from)?)
    }

    #[getter]
    fn position(&self, py: Python<'_>) -> PyResult<usize> {
        self.peek(py, |e| e.position())
    }

    #[getter]
    fn max_seq(&self) -> usize {
        self.max_seq
    }

    /// Element type of the stored K/V rows: "bf16", "f16" or "f32".
    #[getter]
    fn kv_dtype(&self) -> &'static str {
        self.kv_dtype
    }

    /// How the CPU's 4-bit matmuls round the activations: "exact" or "fast".
    #[getter]
    fn precision(&self) -> &'static str {
        self.precision
    }

    /// What the engine chose at load, in words: the backend "auto" picked and why, a max_seq
    /// fitted to the device's memory.
    #[getter]
    fn notes(&self) -> Vec<String> {
        self.notes.clone()
    }

    /// Bytes of weights the backend copied because it could not read them in place from the
    /// mapped checkpoint (Metal: a tensor not 4-byte aligned in its file); 0 on the CPU.
    #[getter]
    fn copied_weight_bytes(&self) -> u64 {
        self.copied_weight_bytes
    }

    /// Bytes of KV cache held now (it grows in segments with the sequence).
    #[getter]
    fn kv_bytes(&self, py: Python<'_>) -> PyResult<usize> {
        self.peek(py, |e| e.kv_bytes())
    }

    #[getter]
    fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.vocab
    }

    #[getter]
    fn backend(&self) -> &'static str {
        self.backend
    }

    /// The device the engine runs on, in words.
    #[getter]
    fn device(&self, py: Python<'_>) -> PyResult<String> {
        self.peek(py, |e| e.device_description())
    }

    /// Peak device memory the engine has allocated (weights, state, scratch), where the backend
    /// tracks it (CUDA); None elsewhere.
    #[getter]
    fn device_peak_bytes(&self, py: Python<'_>) -> PyResult<Option<usize>> {
        self.peek(py, |e| e.device_peak_bytes())
    }

    /// Device memory bandwidth in GB/s ((bytes read + bytes written) / time of a device-to-device
    /// copy of `mib` MiB, best of 5) on a GPU backend; None on the CPU backends.
    #[pyo3(signature = (mib = 1024))]
    fn measure_device_bandwidth(&self, py: Python<'_>, mib: usize) -> PyResult<Option<f64>> {
        let bytes = mib
            .checked_mul(1 << 20)
            .filter(|&b| b > 0)
            .ok_or_else(|| PyValueError::new_err(format!("mib must be from 1 to {}, got {mib}", usize::MAX >> 20)))?;
        Ok(self
            .with(py, |e| e.measure_device_bandwidth(bytes))?
            .map_err(PyLilyError::from)?)
    }

    /// The checkpoint's config.json as a dict.
    #[getter]
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        py.import("json")?.call_method1("loads", (&self.config_json,))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let position = self.position(py)?;
        Ok(format!(
            "Engine(backend={:?}, position={position}, max_seq={}, vocab_size={})",
            self.backend, self.max_seq, self.vocab
        ))
    }
}
