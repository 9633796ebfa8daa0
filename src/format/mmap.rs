//! The one place kvrun memory-maps a file.

use crate::error::{Error, Result};
use std::path::Path;

/// A read-only memory map of a whole file (an empty file maps to no bytes).
#[derive(Debug)]
pub struct Mapped {
    map: Option<memmap2::Mmap>,
}

impl Mapped {
    /// Map `path` read-only.
    pub fn open(path: &Path) -> Result<Mapped> {
        let io = |source| Error::Io {
            path: path.to_owned(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len == 0 {
            return Ok(Mapped { map: None });
        }
        // SAFETY: the map is read-only and private to this process. kvrun never
        // writes model files; a concurrent truncation by another process is the
        // usual mmap caveat (SIGBUS) that every mmap-based loader accepts.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Ok(Mapped { map: Some(map) })
    }

    /// Bytes built in memory (an anonymous map, made read-only): a model
    /// generated without a file (`-m synth:...`).
    pub fn from_anon(map: memmap2::MmapMut) -> Result<Mapped> {
        let map = map.make_read_only().map_err(|source| Error::Io {
            path: "<anonymous map>".into(),
            source,
        })?;
        Ok(Mapped { map: Some(map) })
    }

    /// The mapped bytes.
    pub fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }
}
