//! One error type for the crate. Anything a user or a checkpoint can cause is an `Error`,
//! never a panic: the Python layer maps each variant to a typed exception.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `config.json` is missing a field, has a wrong value, or describes another model.
    #[error("config: {0}")]
    Config(String),
    /// A checkpoint tensor is missing, mis-shaped or of an unsupported dtype.
    #[error("weight `{name}`: {msg}")]
    Weight { name: String, msg: String },
    /// A checkpoint file could not be read or parsed.
    #[error("{}: {msg}", path.display())]
    File { path: PathBuf, msg: String },
    #[error("context full: {used} tokens in the sequence + {requested} new > max_seq {max}")]
    ContextFull { used: usize, requested: usize, max: usize },
    #[error("token id {token} out of range: vocabulary has {vocab} entries")]
    InvalidToken { token: u32, vocab: usize },
    /// A bad argument to an API call (empty prompt, unknown backend name, ...).
    #[error("{0}")]
    InvalidArgument(String),
    /// The device could not be opened or a command failed on it.
    #[error("device: {0}")]
    Device(String),
    /// The caller stopped a long call (a progress callback or an interrupt check said so).
    #[error("interrupted")]
    Interrupted,
    /// The backend does not implement an operation (yet).
    #[error("{0}")]
    Unsupported(String),
    /// No live sequence has this id (never created, or dropped).
    #[error("no sequence {0}: it was never created or has been dropped")]
    NoSequence(usize),
}

impl Error {
    pub(crate) fn weight(name: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Weight {
            name: name.into(),
            msg: msg.into(),
        }
    }
    pub(crate) fn file(path: impl Into<PathBuf>, msg: impl std::fmt::Display) -> Self {
        Error::File {
            path: path.into(),
            msg: msg.to_string(),
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;
