//! `system_info()` and `checkpoint_fit()`: what `lily.info()` and `lily info` report, as dicts
//! (lily-core's `info`). Neither builds a backend.

use std::path::PathBuf;

use pyo3::{prelude::*, types::PyDict};

use crate::errors::PyLilyError;
use lily_core::{backend::KvDtype, engine::Options, info, BackendKind};

/// This machine: version, OS, the backend "auto" picks and why (and whether that is a fallback
/// from a GPU backend), the Metal GPU or why there is none.
#[pyfunction]
pub fn system_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let s = py.detach(info::system);
    let d = PyDict::new(py);
    d.set_item("version", s.version)?;
    d.set_item("os", &s.os)?;
    let auto = PyDict::new(py);
    auto.set_item("backend", s.auto.backend.name())?;
    auto.set_item("reason", &s.auto.reason)?;
    auto.set_item("fallback", s.auto.fallback)?;
    d.set_item("auto", auto)?;
    let metal = PyDict::new(py);
    match &s.metal {
        Ok(g) => {
            metal.set_item("device", &g.name)?;
            metal.set_item("gpu_family", g.family.to_string())?;
            metal.set_item("recommended_max_working_set_size", g.working_set)?;
            metal.set_item("unified_memory", g.unified_memory)?;
            metal.set_item("max_buffer_length", g.max_buffer_length)?;
        }
        Err(why) => metal.set_item("error", why)?,
    }
    d.set_item("metal", metal)?;
    Ok(d)
}

/// Whether the checkpoint in `path` fits `backend`'s memory at `max_seq`: the check the engine
/// makes at load, without loading.
#[pyfunction]
#[pyo3(signature = (path, *, backend = "auto", max_seq = None, prefill_chunk = None, kv_dtype = "bf16"))]
pub fn checkpoint_fit<'py>(
    py: Python<'py>,
    path: PathBuf,
    backend: &str,
    max_seq: Option<usize>,
    prefill_chunk: Option<usize>,
    kv_dtype: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let opts = Options {
        backend: BackendKind::parse(backend).map_err(PyLilyError::from)?,
        max_seq,
        prefill_chunk,
        kv_dtype: KvDtype::parse(kv_dtype).map_err(PyLilyError::from)?,
        ..Options::default()
    };
    let fit = py.detach(|| info::fit(&path, &opts)).map_err(PyLilyError::from)?;
    let d = PyDict::new(py);
    d.set_item("backend", fit.backend.name())?;
    match fit.limit {
        Some((bytes, what)) => {
            d.set_item("limit", bytes)?;
            d.set_item("limit_is", what)?;
        }
        None => {
            d.set_item("limit", py.None())?;
            d.set_item("limit_is", py.None())?;
        }
    }
    match fit.verdict {
        Ok((n, f, note)) => {
            d.set_item("fits", true)?;
            d.set_item("max_seq", n)?;
            d.set_item("note", note)?;
            let parts = PyDict::new(py);
            parts.set_item("weights", f.weights)?;
            parts.set_item("delta_net_state", f.delta_net)?;
            parts.set_item("kv_cache", f.kv)?;
            parts.set_item("activations", f.scratch)?;
            parts.set_item("total", f.total())?;
            d.set_item("bytes", parts)?;
            d.set_item("kv_dtype", f.kv_dtype.name())?;
            d.set_item("describe", f.describe())?;
        }
        Err(e) => {
            d.set_item("fits", false)?;
            d.set_item("error", e.to_string())?;
        }
    }
    Ok(d)
}
