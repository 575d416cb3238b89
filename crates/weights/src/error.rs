//! The one error type of the crate: what went wrong, and where (file, tensor, version).

use std::path::PathBuf;

/// Everything that can fail in diff, apply, stamp, publish, pull and serve.
#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    /// Reading or writing a local file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A checkpoint file is not valid safetensors (or a checkpoint directory is unusable).
    #[error("{path}: {message}")]
    Format {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The delta was made against another base than the one given.
    #[error("base mismatch: the delta v{delta_base}->v{delta_new} needs base v{delta_base} (digest {want}), but {dir} holds {} (digest {have})", have_version.map_or("a checkpoint with no weights.json".to_owned(), |v| format!("v{v}")))]
    BaseMismatch {
        /// The base version the delta needs.
        delta_base: u64,
        /// The version the delta produces.
        delta_new: u64,
        /// Digest of the base the delta needs.
        want: String,
        /// The directory given as base.
        dir: PathBuf,
        /// The version its marker names (`None`: it has none, and was hashed as given).
        have_version: Option<u64>,
        /// Its digest.
        have: String,
    },
    /// A byte is wrong somewhere: named by what holds it.
    #[error("corrupted: {what} (tensor `{tensor}`, version {version})")]
    Corrupted {
        /// Which tensor (or segment: `__header__:FILE`, `__file__:NAME`, `__manifest__`).
        tensor: String,
        /// Which version: `vN` for a checkpoint, `vA->vB` for a delta.
        version: String,
        /// What was found.
        what: String,
    },
    /// Object store or peer transfer failed.
    #[error("transfer: {0}")]
    Transfer(String),
    /// The source does not have what was asked for (a version beyond the store, a missing
    /// object of the chain): not a transfer failure, and retrying does not help until it is
    /// published.
    #[error("not found: {0}")]
    Missing(String),
    /// Bad argument from the caller.
    #[error("{0}")]
    Invalid(String),
}

impl WeightsError {
    /// The arguments cannot work (a base that is not the one the chain needs, a directory that
    /// may not be recycled, an output that exists): a rerun with the same ones fails the same
    /// way, unlike a transfer that broke off.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            WeightsError::BaseMismatch { .. } | WeightsError::Invalid(_)
        )
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        WeightsError::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn format(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        WeightsError::Format {
            path: path.into(),
            message: message.into(),
        }
    }

    pub(crate) fn corrupted(
        tensor: impl Into<String>,
        version: impl Into<String>,
        what: impl Into<String>,
    ) -> Self {
        WeightsError::Corrupted {
            tensor: tensor.into(),
            version: version.into(),
            what: what.into(),
        }
    }
}

/// The crate's result type.
pub type Result<T, E = WeightsError> = std::result::Result<T, E>;
