//! The version marker of a checkpoint directory (`weights.json`): its version id, the digest
//! of every segment (every tensor, every safetensors header, every other file; BLAKE3 in format
//! 2, SHA-256 in format 1, see `digest`) and a checkpoint digest (SHA-256) over all of them.
//! `stamp` computes it, `verify` checks a directory against it.

use crate::digest::SegmentHash;
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

/// A segment with its digest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentDigest {
    /// Where it is and what it is.
    #[serde(flatten)]
    pub segment: Segment,
    /// The digest of its bytes, hex, by the marker's [`CheckpointManifest::hash`] (named
    /// `sha256` in format 1 markers, which are still read).
    #[serde(alias = "sha256")]
    pub digest: String,
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

/// The marker: version id plus digests. Serialized with each segment's digest under `sha256`
/// in format 1 (as the binaries that wrote format 1 read it) and `digest` in format 2.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct CheckpointManifest {
    /// Format of this file: 2 (segments digested with BLAKE3, written) or 1 (SHA-256, read).
    pub format: u32,
    /// Policy version.
    pub version: u64,
    /// SHA-256 over the sorted list of (file, segment, offset, length, digest), hex.
    pub digest: String,
    /// Every file.
    pub files: Vec<FileDigests>,
}

impl CheckpointManifest {
    /// Builds the manifest (computing the checkpoint digest) from files digested with `hash`.
    pub fn new(version: u64, hash: SegmentHash, files: Vec<FileDigests>) -> Self {
        let digest = checkpoint_digest(hash.format(), &files);
        CheckpointManifest {
            format: hash.format(),
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

    /// How its segments are digested (SHA-256 for a format it does not know; `is_consistent`
    /// refuses those).
    pub fn hash(&self) -> SegmentHash {
        SegmentHash::of_format(self.format).unwrap_or(SegmentHash::Sha256)
    }

    /// Whether its format is known and the digest matches the listed segments.
    pub fn is_consistent(&self) -> bool {
        self.check().is_ok()
    }

    /// [`is_consistent`](Self::is_consistent), saying why not.
    pub fn check(&self) -> std::result::Result<(), String> {
        if SegmentHash::of_format(self.format).is_none() {
            return Err(format!(
                "unknown marker format {} (this binary reads 1 and 2)",
                self.format
            ));
        }
        if checkpoint_digest(self.format, &self.files) != self.digest {
            return Err("the marker's digest does not match its segment list".into());
        }
        // What the digest cannot say: one entry per file, none named as the marker itself, and
        // each file's segments covering it end to end (bytes outside every segment would be
        // written and verified by nobody).
        let mut names = std::collections::BTreeSet::new();
        for f in &self.files {
            crate::layout::check_name(&f.name)?;
            if f.name == crate::layout::MARKER || !names.insert(f.name.as_str()) {
                return Err(format!(
                    "file `{}` is listed twice or is named as the marker",
                    f.name
                ));
            }
            let mut at = 0u64;
            for s in &f.segments {
                if s.segment.offset != at {
                    return Err(format!(
                        "the segments of `{}` do not cover it end to end (at byte {at})",
                        f.name
                    ));
                }
                at = at.saturating_add(s.segment.len);
            }
            if at != f.size {
                return Err(format!(
                    "the segments of `{}` cover {at} of its {} bytes",
                    f.name, f.size
                ));
            }
        }
        Ok(())
    }
}

impl Serialize for CheckpointManifest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Seg<'a> {
            #[serde(flatten)]
            segment: &'a Segment,
            #[serde(skip_serializing_if = "Option::is_none")]
            sha256: Option<&'a str>,
            #[serde(skip_serializing_if = "Option::is_none")]
            digest: Option<&'a str>,
        }
        #[derive(Serialize)]
        struct Files<'a> {
            name: &'a str,
            size: u64,
            segments: Vec<Seg<'a>>,
        }
        #[derive(Serialize)]
        struct Marker<'a> {
            format: u32,
            version: u64,
            digest: &'a str,
            files: Vec<Files<'a>>,
        }
        let old = self.format == 1;
        Marker {
            format: self.format,
            version: self.version,
            digest: &self.digest,
            files: self
                .files
                .iter()
                .map(|f| Files {
                    name: &f.name,
                    size: f.size,
                    segments: f
                        .segments
                        .iter()
                        .map(|g| Seg {
                            segment: &g.segment,
                            sha256: old.then_some(g.digest.as_str()),
                            digest: (!old).then_some(g.digest.as_str()),
                        })
                        .collect(),
                })
                .collect(),
        }
        .serialize(s)
    }
}

/// SHA-256 over the segment list; from format 2 on, the format's own line first, so a marker
/// relabelled to another format no longer matches its digest.
fn checkpoint_digest(format: u32, files: &[FileDigests]) -> String {
    let mut h = Sha256::new();
    if format >= 2 {
        h.update(format!("format\t{format}\n"));
    }
    for f in files {
        h.update(format!("file\t{}\t{}\n", f.name, f.size));
        for s in &f.segments {
            let g = &s.segment;
            h.update(format!(
                "{}\t{}\t{:?}\t{}\t{}\t{}\n",
                g.name, g.dtype, g.shape, g.offset, g.len, s.digest
            ));
        }
    }
    hex::encode(h.finalize())
}

/// The `hash` digest of `len` bytes of `file` from `offset`, read `buf.len()` at a time.
pub(crate) fn hash_range(
    hash: SegmentHash,
    file: &File,
    path: &Path,
    offset: u64,
    len: u64,
    buf: &mut [u8],
) -> Result<String> {
    let mut h = hash.hasher();
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(buf.len() as u64) as usize;
        file.read_exact_at(&mut buf[..n], offset + done)
            .map_err(|e| WeightsError::io(path, e))?;
        h.update(&buf[..n]);
        done += n as u64;
    }
    Ok(h.hex())
}

/// Hashes every segment of `files` under `dir` with `hash` on `threads` threads.
pub fn digest_layout(
    dir: &Path,
    files: &[FileLayout],
    hash: SegmentHash,
    threads: usize,
) -> Result<Vec<FileDigests>> {
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
            hash_range(hash, &file, &path, seg.offset, seg.len, buf)
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
                    digest: it.next().expect("one digest per segment"),
                })
                .collect(),
        })
        .collect())
}

/// Computes the marker of `dir` as version `version` (does not write it), with the hash new
/// markers use.
pub fn stamp(dir: &Path, version: u64, threads: usize) -> Result<CheckpointManifest> {
    stamp_with(dir, version, SegmentHash::WRITTEN, threads)
}

/// [`stamp`] with a given segment hash (to match a digest made with it).
pub fn stamp_with(
    dir: &Path,
    version: u64,
    hash: SegmentHash,
    threads: usize,
) -> Result<CheckpointManifest> {
    let files = layout::read_dir_layout(dir)?;
    Ok(CheckpointManifest::new(
        version,
        hash,
        digest_layout(dir, &files, hash, threads)?,
    ))
}

/// Checks every byte of `dir` against `manifest`; the first bad segment is named.
pub fn verify(dir: &Path, manifest: &CheckpointManifest, threads: usize) -> Result<()> {
    let version = format!("v{}", manifest.version);
    if let Err(why) = manifest.check() {
        return Err(WeightsError::corrupted("__manifest__", version, why));
    }
    // A file the marker does not list is not part of the version, yet a reader loading the
    // directory (every `*.safetensors` in it) would take it: the directory is not the version.
    let listed: std::collections::HashSet<&str> =
        manifest.files.iter().map(|f| f.name.as_str()).collect();
    if let Some(extra) = layout::walk(dir, true, true)?
        .into_iter()
        .find(|f| f.name != MARKER && !listed.contains(f.name.as_str()))
    {
        return Err(WeightsError::corrupted(
            "__manifest__",
            version,
            format!(
                "{} is in {} but not in its marker",
                extra.name,
                dir.display()
            ),
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
    let hash = manifest.hash();
    let got = digest_layout(dir, &manifest.layout(), hash, threads)?;
    for (want, have) in manifest.files.iter().zip(&got) {
        for (w, h) in want.segments.iter().zip(&have.segments) {
            if w.digest != h.digest {
                return Err(WeightsError::corrupted(
                    &w.segment.name,
                    version,
                    format!(
                        "{} {} in {}, {} expected",
                        hash.name(),
                        h.digest,
                        want.name,
                        w.digest
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

/// [`read_marker`], refusing a marker of an unknown format or one that does not match its own
/// digest (named as the version it claims).
pub(crate) fn read_consistent_marker(dir: &Path) -> Result<Option<CheckpointManifest>> {
    let Some(m) = read_marker(dir)? else {
        return Ok(None);
    };
    if let Err(why) = m.check() {
        return Err(WeightsError::corrupted(
            "__manifest__",
            format!("v{}", m.version),
            format!("{}/{MARKER}: {why}", dir.display()),
        ));
    }
    Ok(Some(m))
}

/// Removes `dir/weights.json`, if there is one: the directory no longer claims a version.
pub(crate) fn remove_marker(dir: &Path) -> Result<()> {
    let path = dir.join(MARKER);
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(WeightsError::io(&path, e)),
        _ => Ok(()),
    }
}

/// The refusal for an output directory that exists already, saying what it holds: a version,
/// nothing (an incomplete copy), or a marker that cannot be read (and why).
pub(crate) fn occupied(out: &Path) -> WeightsError {
    let holds = match read_marker(out) {
        Ok(Some(m)) => format!("it holds v{}", m.version),
        Ok(None) => format!("it has no {MARKER}: an incomplete version? remove it"),
        Err(e) => format!("its {MARKER} cannot be read: {e}"),
    };
    WeightsError::Invalid(format!("{} exists already; {holds}", out.display()))
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
    if !dir.is_dir() {
        return Err(WeightsError::Invalid(format!(
            "{} {}",
            dir.display(),
            if dir.exists() {
                "is not a directory"
            } else {
                "does not exist"
            }
        )));
    }
    match read_consistent_marker(dir)? {
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

#[cfg(test)]
#[path = "checkpoint_tests.rs"]
mod tests;
