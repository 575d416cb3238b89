//! `diff`: new checkpoint XOR base checkpoint, tensor by tensor, in chunks, compressed, into one
//! delta file. Segments run in parallel (largest first); each thread holds about seven chunks
//! (the mapped new and base chunks, planes, XOR scratch, sparse payload, two frame buffers), so
//! memory is `threads × 7 × chunk_bytes` plus the manifest, whatever the checkpoint size.
//! Frames land in the file in the order threads finish them (the manifest says where each is),
//! so the file's bytes depend on scheduling; the result it rebuilds does not.

use crate::checkpoint::{self, CheckpointManifest, FileDigests, SegmentDigest};
use crate::codec::Codec;
use crate::delta::{self, DeltaManifest, DeltaSegment, Frame, VersionId, MAGIC};
use crate::digest::SegmentHash;
use crate::error::{Result, WeightsError};
use crate::layout::{self, Segment};
use crate::map;
use crate::parallel;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// zstd level chosen by `kvrouter weights bench` (docs/weights.md): level 1 already reaches
/// the size of higher levels on XOR planes and is the fastest.
pub const DEFAULT_ZSTD_LEVEL: i32 = 1;
/// Chunk (and zstd window) size: 1 MiB, the fastest of 1/4/16 MiB at the same delta size
/// (the chunk sweep of `kvrouter weights bench`, docs/weights.md).
pub const DEFAULT_CHUNK_BYTES: usize = 1 << 20;

/// How to diff.
#[derive(Clone, Debug)]
pub struct CodecOptions {
    /// zstd level.
    pub zstd_level: i32,
    /// Chunk size in bytes (one zstd frame each).
    pub chunk_bytes: usize,
    /// Worker threads.
    pub threads: usize,
}

impl Default for CodecOptions {
    fn default() -> Self {
        CodecOptions {
            zstd_level: DEFAULT_ZSTD_LEVEL,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }
}

impl CodecOptions {
    pub(crate) fn check(&self) -> Result<()> {
        if self.chunk_bytes < 4096 || self.chunk_bytes > 256 << 20 {
            return Err(WeightsError::Invalid(
                "chunk size must be between 4 KiB and 256 MiB".into(),
            ));
        }
        if self.threads == 0 {
            return Err(WeightsError::Invalid("threads must be at least 1".into()));
        }
        Ok(())
    }
}

struct Writer {
    file: File,
    offset: u64,
    sha: Sha256,
}

/// Writes the delta `base -> new` to `out` (through a temporary file and a rename). `base` must
/// carry a marker or `base_version` be given (then it is hashed); `new` is stamped `new_version`
/// (its marker, if it has one, must say so). `out` must not exist, nor lie inside `base` or
/// `new`. Returns the manifest.
pub fn diff(
    base: &Path,
    base_version: Option<u64>,
    new: &Path,
    new_version: u64,
    out: &Path,
    opts: &CodecOptions,
) -> Result<DeltaManifest> {
    opts.check()?;
    if out.is_dir() {
        return Err(WeightsError::Invalid(format!(
            "{} is a directory; --out names the delta file to write",
            out.display()
        )));
    }
    if out.symlink_metadata().is_ok() {
        return Err(WeightsError::Invalid(format!(
            "--out {}: it exists (a delta is never written over a file)",
            out.display()
        )));
    }
    for (flag, dir) in [("--base", base), ("--new", new)] {
        if crate::workdir::within(out, dir) {
            return Err(WeightsError::Invalid(format!(
                "--out {}: inside {flag} {} (the delta would become part of the checkpoint)",
                out.display(),
                dir.display()
            )));
        }
    }
    let tmp = temp_path(out);
    let manifest = write_delta(base, base_version, new, new_version, &tmp, opts)?;
    std::fs::rename(&tmp, out).map_err(|e| WeightsError::io(out, e))?;
    Ok(manifest)
}

/// Writes the delta `base -> new` into `tmp` (a file the caller names and removes; removed here
/// on failure), as [`diff`] does before its rename.
pub(crate) fn write_delta(
    base: &Path,
    base_version: Option<u64>,
    new: &Path,
    new_version: u64,
    tmp: &Path,
    opts: &CodecOptions,
) -> Result<DeltaManifest> {
    opts.check()?;
    let base_marker = checkpoint::marker_or_stamp(base, base_version, opts.threads)?;
    if let Some(m) = checkpoint::read_marker(new)? {
        if m.version != new_version {
            return Err(WeightsError::Invalid(format!(
                "--new-version {new_version}: {} is stamped v{}",
                new.display(),
                m.version
            )));
        }
    }
    if new_version <= base_marker.version {
        return Err(WeightsError::Invalid(format!(
            "the new version v{new_version} must be newer than the base v{}",
            base_marker.version
        )));
    }
    let new_files = layout::read_dir_layout(new)?;
    let mut base_by_name: HashMap<&str, (&str, &Segment)> = HashMap::new();
    for f in &base_marker.files {
        for s in &f.segments {
            base_by_name.insert(&s.segment.name, (&f.name, &s.segment));
        }
    }
    let mut jobs: Vec<(usize, usize)> = new_files
        .iter()
        .enumerate()
        .flat_map(|(fi, f)| (0..f.segments.len()).map(move |si| (fi, si)))
        .collect();
    jobs.sort_by_key(|&(fi, si)| std::cmp::Reverse(new_files[fi].segments[si].len));

    let file = File::create(tmp).map_err(|e| WeightsError::io(tmp, e))?;
    file.write_all_at(MAGIC, 0)
        .map_err(|e| WeightsError::io(tmp, e))?;
    let writer = Mutex::new(Writer {
        file,
        offset: MAGIC.len() as u64,
        sha: Sha256::new(),
    });
    let chunk = opts.chunk_bytes;
    let result = parallel::run(
        opts.threads,
        &jobs,
        || Codec::new(opts.zstd_level, chunk),
        |&(fi, si), codec| {
            let codec = codec
                .as_mut()
                .map_err(|e| WeightsError::Invalid(format!("zstd: {e}")))?;
            let seg = &new_files[fi].segments[si];
            let partner = base_by_name
                .get(seg.name.as_str())
                .filter(|(_, b)| b.len == seg.len);
            let new_path = new.join(&new_files[fi].name);
            let new_file = File::open(&new_path).map_err(|e| WeightsError::io(&new_path, e))?;
            let base_file = match partner {
                Some((name, _)) => {
                    let p = layout::file_path(base, name)?;
                    Some((File::open(&p).map_err(|e| WeightsError::io(&p, e))?, p))
                }
                None => None,
            };
            let (mut sha, mut frames_sha, mut frames) =
                (SegmentHash::WRITTEN.hasher(), Sha256::new(), Vec::new());
            let mut done = 0u64;
            while done < seg.len {
                let n = (seg.len - done).min(chunk as u64) as usize;
                let nb = map::chunk(&new_file, &new_path, seg.offset + done, n)?;
                sha.update(&nb[..]);
                let base_chunk = match (&base_file, partner) {
                    (Some((f, p)), Some((_, b))) => Some(map::chunk(f, p, b.offset + done, n)?),
                    _ => None,
                };
                let mode = codec
                    .encode(&nb, base_chunk.as_deref(), seg.element_bytes())
                    .map_err(|e| WeightsError::Invalid(format!("zstd: {e}")))?;
                frames_sha.update(&codec.out);
                let offset = {
                    let mut w = writer.lock().expect("writer lock");
                    let at = w.offset;
                    w.file
                        .write_all_at(&codec.out, at)
                        .map_err(|e| WeightsError::io(tmp, e))?;
                    w.sha.update(&codec.out);
                    w.offset += codec.out.len() as u64;
                    at
                };
                frames.push(Frame {
                    offset,
                    len: codec.out.len() as u64,
                    raw: n as u64,
                    xor: mode.xor,
                    planes: mode.planes,
                    sparse: mode.sparse,
                });
                done += n as u64;
            }
            let base = partner.map(|(name, b)| (name.to_string(), b.offset));
            Ok((
                sha.hex(),
                DeltaSegment {
                    base,
                    frames,
                    frames_sha256: hex::encode(frames_sha.finalize()),
                },
            ))
        },
    );
    let result = match result {
        Ok(r) => r,
        Err(e) => {
            let _ = std::fs::remove_file(tmp);
            return Err(e);
        }
    };
    let mut by_job: HashMap<(usize, usize), (String, DeltaSegment)> =
        jobs.into_iter().zip(result).collect();
    let mut files = Vec::new();
    let mut segments = Vec::new();
    for (fi, f) in new_files.iter().enumerate() {
        let mut segs = Vec::new();
        for (si, s) in f.segments.iter().enumerate() {
            let (digest, d) = by_job.remove(&(fi, si)).expect("every segment ran");
            segs.push(SegmentDigest {
                segment: s.clone(),
                digest,
            });
            segments.push(d);
        }
        files.push(FileDigests {
            name: f.name.clone(),
            size: f.size,
            segments: segs,
        });
    }
    let w = writer.into_inner().expect("writer lock");
    let manifest = DeltaManifest {
        format: delta::FORMAT,
        base: VersionId {
            version: base_marker.version,
            digest: base_marker.digest.clone(),
            marker_format: base_marker.format,
        },
        new: CheckpointManifest::new(new_version, SegmentHash::WRITTEN, files),
        zstd_level: opts.zstd_level,
        chunk_bytes: chunk as u64,
        data_len: w.offset - MAGIC.len() as u64,
        data_sha256: hex::encode(w.sha.finalize()),
        segments,
    };
    let bytes = serde_json::to_vec(&manifest).expect("manifest serializes");
    let finish = || -> std::io::Result<()> {
        w.file.write_all_at(&bytes, w.offset)?;
        w.file.write_all_at(
            &delta::trailer(w.offset, &bytes),
            w.offset + bytes.len() as u64,
        )?;
        w.file.sync_all()
    };
    finish().map_err(|e| {
        let _ = std::fs::remove_file(tmp);
        WeightsError::io(tmp, e)
    })?;
    Ok(manifest)
}

/// A sibling of `path` to write before renaming.
pub(crate) fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    remove_stale_partials(path, &name);
    path.with_file_name(format!(".{name}.partial-{}", std::process::id()))
}

/// Whether `path` (and, for a directory, every entry in it) was last modified at least `age`
/// ago. Unreadable times count as recent.
fn unmodified_for(path: &Path, age: std::time::Duration) -> bool {
    let old = |p: &Path| {
        std::fs::symlink_metadata(p)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|e| e >= age)
    };
    if !old(path) {
        return false;
    }
    match std::fs::read_dir(path) {
        Ok(entries) => entries.flatten().all(|e| old(&e.path())),
        Err(_) => true,
    }
}

/// How long a partial must have gone unmodified before another run may remove it.
const STALE_PARTIAL_AGE: std::time::Duration = std::time::Duration::from_secs(15 * 60);

/// Removes what killed runs left beside `path`: `.{name}.partial-{pid}` entries whose process
/// is gone. A signal or a crash leaves them (a checkpoint's worth of bytes each), and the pid
/// suffix means no rerun would reuse them. Gone means both: `/proc/{pid}` is absent (Linux;
/// elsewhere nothing is removed), and nothing in it was modified for [`STALE_PARTIAL_AGE`]; a
/// writer in another pid namespace (a container sharing the directory) or hidden by `hidepid`
/// is still writing, so its partial stays. Our own is left alone.
fn remove_stale_partials(path: &Path, name: &str) {
    if !cfg!(target_os = "linux") {
        return;
    }
    let prefix = format!(".{name}.partial-");
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(pid) = file_name
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let stale = entry.path();
        if !unmodified_for(&stale, STALE_PARTIAL_AGE) {
            continue;
        }
        let removed = match entry.file_type() {
            Ok(t) if t.is_dir() => std::fs::remove_dir_all(&stale),
            _ => std::fs::remove_file(&stale),
        };
        match removed {
            Ok(()) => tracing::info!("removed {} (left by a run that ended)", stale.display()),
            Err(e) => tracing::warn!("could not remove {}: {e}", stale.display()),
        }
    }
}
