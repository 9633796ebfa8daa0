//! JSON files of a Hugging Face model directory: reading them, and the
//! error that names the file.

use crate::error::{Error, Result};
use serde_json::Value as Json;
use std::path::Path;

/// A problem with the checkpoint file `path`.
pub(super) fn bad(path: &Path, what: impl Into<String>) -> Error {
    Error::BadCheckpoint {
        path: path.to_owned(),
        what: what.into(),
    }
}

/// Parse the JSON file `path`.
pub(super) fn read_json(path: &Path) -> Result<Json> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_owned(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| bad(path, format!("invalid JSON: {e}")))
}
