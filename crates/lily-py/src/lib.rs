//! `lily._lily`: the native module. Python owns tokenization, sampling policy and the CLI;
//! this crate only moves token ids in and logits out.

mod engine;
mod errors;
mod info;
mod sampling;
mod transfer;

use pyo3::prelude::*;

#[pymodule]
fn _lily(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    // Load NumPy's C API now: the first array made afterwards would import it, running Python code
    // that raises a Ctrl-C pressed during the call that made it, and rust-numpy panics on that.
    numpy::PyArray1::<f32>::zeros(py, 0, false);
    m.add_class::<engine::Engine>()?;
    m.add_class::<engine::Snapshot>()?;
    m.add("LilyError", py.get_type::<errors::LilyError>())?;
    m.add("ModelLoadError", py.get_type::<errors::ModelLoadError>())?;
    m.add("ContextFullError", py.get_type::<errors::ContextFullError>())?;
    m.add("DeviceError", py.get_type::<errors::DeviceError>())?;
    m.add("SequenceEvictedError", py.get_type::<errors::SequenceEvictedError>())?;
    m.add_function(wrap_pyfunction!(info::system_info, m)?)?;
    m.add_function(wrap_pyfunction!(info::checkpoint_fit, m)?)?;
    sampling::register(m)?;
    Ok(())
}
