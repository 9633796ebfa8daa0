//! The one place kvrun memory-maps a file.

use crate::error::{Error, Result};
use std::path::Path;
use std::sync::Mutex;

/// Address ranges `(start, len)` of the live maps of files: the only
/// memory [`release`] will drop pages of (dropping those of an anonymous
/// map or the heap would lose them).
static FILE_MAPS: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

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
        let mut maps = FILE_MAPS.lock().unwrap_or_else(|e| e.into_inner());
        maps.push((map.as_ptr() as usize, map.len()));
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

impl Drop for Mapped {
    fn drop(&mut self) {
        if let Some(m) = &self.map {
            let start = m.as_ptr() as usize;
            let mut maps = FILE_MAPS.lock().unwrap_or_else(|e| e.into_inner());
            maps.retain(|&(s, _)| s != start);
        }
    }
}

/// Whether `bytes` lie inside the live map of a file (not an anonymous
/// map, not the heap).
pub fn in_file_map(bytes: &[u8]) -> bool {
    within(&FILE_MAPS.lock().unwrap_or_else(|e| e.into_inner()), bytes)
}

/// Whether `bytes` lie inside one of the maps `maps`.
fn within(maps: &[(usize, usize)], bytes: &[u8]) -> bool {
    let (a, n) = (bytes.as_ptr() as usize, bytes.len());
    maps.iter().any(|&(s, len)| a >= s && a + n <= s + len)
}

/// Drop the whole pages of `bytes` from this process's resident memory
/// when they belong to the map of a file (a backend that keeps its own
/// copy of some weights, e.g. repacked, calls this so those weights are
/// not resident twice); a later read faults them back in from the file,
/// unchanged. Returns how many bytes were released (0 when `bytes` is not
/// in a file map).
pub fn release(bytes: &[u8]) -> usize {
    let (a, n) = (bytes.as_ptr() as usize, bytes.len());
    let maps = FILE_MAPS.lock().unwrap_or_else(|e| e.into_inner());
    if !within(&maps, bytes) {
        return 0;
    }
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as usize;
    let (lo, hi) = (a.div_ceil(page) * page, (a + n) / page * page);
    if hi <= lo {
        return 0;
    }
    // SAFETY: [lo, hi) is whole pages inside a live read-only map of a
    // file (checked above, under the lock that its Drop takes), which
    // this process never writes: MADV_DONTNEED only drops the pages, and a
    // later read maps the file's same bytes back in.
    let rc = unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_DONTNEED) };
    if rc == 0 {
        hi - lo
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `release` drops the pages of a file's map only, and the bytes read
    /// the same afterwards; heap and anonymous-map bytes are left alone.
    #[test]
    fn release_drops_file_pages_only_and_keeps_the_bytes() {
        let path = std::env::temp_dir().join(format!("kvrun-release-{}.bin", std::process::id()));
        let want: Vec<u8> = (0..(1u32 << 20))
            .map(|i| (i * 2654435761u32 >> 24) as u8)
            .collect();
        std::fs::write(&path, &want).unwrap();
        let m = Mapped::open(&path).unwrap();
        let sum = |b: &[u8]| b.iter().map(|&x| x as u64).sum::<u64>();
        assert_eq!(sum(m.bytes()), sum(&want));
        // a range that starts and ends mid-page: only its whole pages go
        let part = &m.bytes()[100..(1 << 20) - 100];
        let dropped = release(part);
        assert!(dropped > 0 && dropped < part.len(), "{dropped}");
        assert_eq!(m.bytes(), &want[..]);
        // not a file map: nothing happens (DONTNEED would zero these)
        let heap = want.clone();
        assert_eq!(release(&heap), 0);
        assert_eq!(heap, want);
        let mut anon = memmap2::MmapMut::map_anon(want.len()).unwrap();
        anon.copy_from_slice(&want);
        let anon = Mapped::from_anon(anon).unwrap();
        assert_eq!(release(anon.bytes()), 0);
        assert_eq!(anon.bytes(), &want[..]);
        // a dropped map is forgotten
        let (start, len) = (m.bytes().as_ptr() as usize, m.bytes().len());
        drop(m);
        let maps = FILE_MAPS.lock().unwrap();
        assert!(!maps.iter().any(|&(s, l)| s == start && l == len));
        drop(maps);
        std::fs::remove_file(&path).unwrap();
    }
}
