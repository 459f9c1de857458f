//! lily-core errors as typed Python exceptions (the message is the core's text).

use pyo3::{
    create_exception,
    exceptions::{PyException, PyKeyboardInterrupt, PyNotImplementedError, PyValueError},
    PyErr,
};

create_exception!(lily, LilyError, PyException, "Base class of every Lily error.");
create_exception!(
    lily,
    ModelLoadError,
    LilyError,
    "The checkpoint or its config.json could not be loaded."
);
create_exception!(
    lily,
    ContextFullError,
    LilyError,
    "The sequence would exceed the engine's max_seq."
);
create_exception!(
    lily,
    SequenceEvictedError,
    LilyError,
    "A generation's sequence was taken over by a later one on the same model."
);
create_exception!(
    lily,
    DeviceError,
    LilyError,
    "The backend device is unavailable or a command failed on it."
);

/// Newtype so `?` converts core errors (orphan rule).
pub struct PyLilyError(pub lily_core::Error);

impl From<lily_core::Error> for PyLilyError {
    fn from(e: lily_core::Error) -> Self {
        Self(e)
    }
}

impl From<PyLilyError> for PyErr {
    fn from(e: PyLilyError) -> PyErr {
        use lily_core::Error::*;
        let msg = e.0.to_string();
        match e.0 {
            Config(_) | Weight { .. } | File { .. } => ModelLoadError::new_err(msg),
            ContextFull { .. } => ContextFullError::new_err(msg),
            InvalidToken { .. } | InvalidArgument(_) | NoSequence(_) => PyValueError::new_err(msg),
            Unsupported(_) => PyNotImplementedError::new_err(msg),
            Device(_) => DeviceError::new_err(msg),
            Interrupted => PyKeyboardInterrupt::new_err(msg),
        }
    }
}
