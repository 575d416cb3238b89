//! Read-only memory maps of checkpoint ranges: `diff` reads a chunk of each tensor in place
//! instead of copying it out of the page cache with `pread` (that copy was a quarter of a diff's
//! CPU, docs/weights.md). This is the crate's one `unsafe`.
//!
//! One chunk is mapped at a time and unmapped when dropped, so resident memory stays at a few
//! chunks per thread whatever the checkpoint size. The map is not populated up front: the
//! kernel's fault-around then maps 16 pages per fault in a batch, which costs about a third of
//! what `MAP_POPULATE` does walking the range page by page (0.04 vs 0.10 CPU s to map two
//! 1 GB checkpoints, docs/weights.md).
//!
//! The contract, as for every reader that maps safetensors (the `safetensors` crate, vLLM): a
//! checkpoint directory is not modified while it is read. A trainer writes each version into a
//! new directory. A file that is already shorter than the range is an error naming the file; one
//! truncated by another process *during* the read ends this process with `SIGBUS`, and one
//! rewritten during it gives a delta whose digests disagree (`apply` refuses it).

#![allow(unsafe_code)]

use crate::error::{Result, WeightsError};
use std::fs::File;
use std::ops::Deref;
use std::path::Path;

/// `len` bytes of a file from `offset`, mapped read-only.
pub(crate) struct Chunk(Option<memmap2::Mmap>);

impl Deref for Chunk {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.0.as_deref().unwrap_or(&[])
    }
}

/// Maps `len` bytes of `file` (at `path`, for errors) from `offset`.
pub(crate) fn chunk(file: &File, path: &Path, offset: u64, len: usize) -> Result<Chunk> {
    if len == 0 {
        return Ok(Chunk(None));
    }
    let size = file
        .metadata()
        .map_err(|e| WeightsError::io(path, e))?
        .len();
    if offset.checked_add(len as u64).is_none_or(|end| end > size) {
        return Err(WeightsError::io(
            path,
            std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("{len} bytes at {offset} are past its end ({size} bytes)"),
            ),
        ));
    }
    // SAFETY: the mapping is read-only and private to this value; the range lies inside the file
    // (checked above). The remaining hazard, another process truncating or rewriting the file
    // while the map lives, is outside what this process can prevent; the module's contract
    // (checkpoints are immutable once written) rules it out, as for any reader that maps them.
    let map = unsafe {
        memmap2::MmapOptions::new()
            .offset(offset)
            .len(len)
            .map(file)
    }
    .map_err(|e| WeightsError::io(path, e))?;
    Ok(Chunk(Some(map)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn maps_any_range_inside_the_file_and_refuses_one_past_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let bytes: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
        File::create(&path).unwrap().write_all(&bytes).unwrap();
        let file = File::open(&path).unwrap();
        for (offset, len) in [
            (0, 1),
            (1, 4096),
            (4095, 2),
            (4096, 15_904),
            (19_999, 1),
            (7, 0),
        ] {
            let c = chunk(&file, &path, offset, len).unwrap();
            assert_eq!(&c[..], &bytes[offset as usize..offset as usize + len]);
        }
        let err = chunk(&file, &path, 19_999, 2).err().unwrap().to_string();
        assert!(err.contains("past its end") && err.contains('f'), "{err}");
        assert!(chunk(&file, &path, u64::MAX, 1).is_err());
    }
}
