//! The version marker of a checkpoint directory (`weights.json`): its version id, the SHA-256
//! of every segment (every tensor, every safetensors header, every other file) and a checkpoint
//! digest over all of them. `stamp` computes it, `verify` checks a directory against it.

use crate::error::{Result, WeightsError};
use crate::layout::{self, FileLayout, Segment, MARKER};
use crate::parallel;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Bytes read at a time while hashing (per thread).
pub const HASH_CHUNK_BYTES: usize = 4 << 20;

/// A segment with its SHA-256.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentDigest {
    /// Where it is and what it is.
    #[serde(flatten)]
    pub segment: Segment,
    /// SHA-256 of its bytes, hex.
    pub sha256: String,
}

/// One file of a stamped checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileDigests {
    /// File name.
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// Its segments in file order, with digests.
    pub segments: Vec<SegmentDigest>,
}

/// The marker: version id plus digests.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointManifest {
    /// Format of this file (1).
    pub format: u32,
    /// Policy version.
    pub version: u64,
    /// SHA-256 over the sorted list of (file, segment, offset, length, digest), hex.
    pub digest: String,
    /// Every file.
    pub files: Vec<FileDigests>,
}

impl CheckpointManifest {
    /// Builds the manifest (computing the checkpoint digest) from digested files.
    pub fn new(version: u64, files: Vec<FileDigests>) -> Self {
        let digest = checkpoint_digest(&files);
        CheckpointManifest {
            format: 1,
            version,
            digest,
            files,
        }
    }

    /// Total bytes of the checkpoint.
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }

    /// The layout without digests.
    pub fn layout(&self) -> Vec<FileLayout> {
        self.files
            .iter()
            .map(|f| FileLayout {
                name: f.name.clone(),
                size: f.size,
                segments: f.segments.iter().map(|s| s.segment.clone()).collect(),
            })
            .collect()
    }

    /// Whether the digest matches the listed segments.
    pub fn is_consistent(&self) -> bool {
        self.format == 1 && checkpoint_digest(&self.files) == self.digest
    }
}

fn checkpoint_digest(files: &[FileDigests]) -> String {
    let mut h = Sha256::new();
    for f in files {
        h.update(format!("file\t{}\t{}\n", f.name, f.size));
        for s in &f.segments {
            let g = &s.segment;
            h.update(format!(
                "{}\t{}\t{:?}\t{}\t{}\t{}\n",
                g.name, g.dtype, g.shape, g.offset, g.len, s.sha256
            ));
        }
    }
    hex::encode(h.finalize())
}

/// SHA-256 of `len` bytes of `file` from `offset`, read `buf.len()` at a time.
pub(crate) fn hash_range(
    file: &File,
    path: &Path,
    offset: u64,
    len: u64,
    buf: &mut [u8],
) -> Result<String> {
    let mut h = Sha256::new();
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(buf.len() as u64) as usize;
        file.read_exact_at(&mut buf[..n], offset + done)
            .map_err(|e| WeightsError::io(path, e))?;
        h.update(&buf[..n]);
        done += n as u64;
    }
    Ok(hex::encode(h.finalize()))
}

/// Hashes every segment of `files` under `dir` on `threads` threads.
pub fn digest_layout(dir: &Path, files: &[FileLayout], threads: usize) -> Result<Vec<FileDigests>> {
    let jobs: Vec<(usize, &Segment)> = files
        .iter()
        .enumerate()
        .flat_map(|(i, f)| f.segments.iter().map(move |s| (i, s)))
        .collect();
    let digests = parallel::run(
        threads,
        &jobs,
        || vec![0u8; HASH_CHUNK_BYTES],
        |(i, seg), buf| {
            let path = layout::file_path(dir, &files[*i].name)?;
            let file = File::open(&path).map_err(|e| WeightsError::io(&path, e))?;
            hash_range(&file, &path, seg.offset, seg.len, buf)
        },
    )?;
    let mut it = digests.into_iter();
    Ok(files
        .iter()
        .map(|f| FileDigests {
            name: f.name.clone(),
            size: f.size,
            segments: f
                .segments
                .iter()
                .map(|s| SegmentDigest {
                    segment: s.clone(),
                    sha256: it.next().expect("one digest per segment"),
                })
                .collect(),
        })
        .collect())
}

/// Computes the marker of `dir` as version `version` (does not write it).
pub fn stamp(dir: &Path, version: u64, threads: usize) -> Result<CheckpointManifest> {
    let files = layout::read_dir_layout(dir)?;
    Ok(CheckpointManifest::new(
        version,
        digest_layout(dir, &files, threads)?,
    ))
}

/// Checks every byte of `dir` against `manifest`; the first bad segment is named.
pub fn verify(dir: &Path, manifest: &CheckpointManifest, threads: usize) -> Result<()> {
    let version = format!("v{}", manifest.version);
    if !manifest.is_consistent() {
        return Err(WeightsError::corrupted(
            "__manifest__",
            version,
            "the marker's digest does not match its segment list",
        ));
    }
    for f in &manifest.files {
        let path = layout::file_path(dir, &f.name)?;
        let size = std::fs::metadata(&path)
            .map_err(|e| WeightsError::io(&path, e))?
            .len();
        if size != f.size {
            let first = f
                .segments
                .first()
                .map_or(f.name.clone(), |s| s.segment.name.clone());
            return Err(WeightsError::corrupted(
                first,
                version,
                format!("{} is {size} bytes, {} expected", f.name, f.size),
            ));
        }
    }
    let got = digest_layout(dir, &manifest.layout(), threads)?;
    for (want, have) in manifest.files.iter().zip(&got) {
        for (w, h) in want.segments.iter().zip(&have.segments) {
            if w.sha256 != h.sha256 {
                return Err(WeightsError::corrupted(
                    &w.segment.name,
                    version,
                    format!(
                        "SHA-256 {} in {}, {} expected",
                        h.sha256, want.name, w.sha256
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Reads `dir/weights.json`, if there is one.
pub fn read_marker(dir: &Path) -> Result<Option<CheckpointManifest>> {
    let path = dir.join(MARKER);
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| {
            WeightsError::corrupted(
                "__manifest__",
                "unknown",
                format!("{}: {e}", path.display()),
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(WeightsError::io(path, e)),
    }
}

/// Removes `dir/weights.json`, if there is one: the directory no longer claims a version.
pub(crate) fn remove_marker(dir: &Path) -> Result<()> {
    let path = dir.join(MARKER);
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(WeightsError::io(&path, e)),
        _ => Ok(()),
    }
}

/// Writes `dir/weights.json` (through a temporary file and a rename).
pub fn write_marker(dir: &Path, manifest: &CheckpointManifest) -> Result<()> {
    let path = dir.join(MARKER);
    let tmp = dir.join(".weights.json.tmp");
    let bytes = serde_json::to_vec_pretty(manifest).expect("manifest serializes");
    std::fs::write(&tmp, bytes).map_err(|e| WeightsError::io(&tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| WeightsError::io(&path, e))
}

/// The marker of `dir`, or a fresh stamp as `version` when it has none.
pub fn marker_or_stamp(
    dir: &Path,
    version: Option<u64>,
    threads: usize,
) -> Result<CheckpointManifest> {
    match read_marker(dir)? {
        Some(m) => {
            if let Some(v) = version.filter(|v| *v != m.version) {
                return Err(WeightsError::Invalid(format!(
                    "{} is stamped v{} but v{v} was given",
                    dir.display(),
                    m.version
                )));
            }
            Ok(m)
        }
        None => {
            let v = version.ok_or_else(|| {
                WeightsError::Invalid(format!(
                    "{} has no {MARKER}; give its version",
                    dir.display()
                ))
            })?;
            stamp(dir, v, threads)
        }
    }
}
