//! `apply`: base checkpoint + delta file -> new checkpoint, verified. Refuses a delta made
//! against another base (by the base's marker, or by hashing it when it has none); writes into a
//! hidden sibling directory, checks the digest of every segment as it is written, and renames
//! it into place only when all match (with `recycle`, into the files of an older version).
//! Memory: `threads × (5 × chunk_bytes + largest frame)`.

use crate::checkpoint::{self, CheckpointManifest};
use crate::codec::Codec;
use crate::delta::{self, DeltaManifest};
use crate::diff::temp_path;
use crate::digest::SegmentHash;
use crate::error::{Result, WeightsError};
use crate::layout;
use crate::parallel;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Rebuilds the checkpoint `delta` produces from `base` into `out` (which must not exist).
pub fn apply(
    base: &Path,
    delta_path: &Path,
    out: &Path,
    threads: usize,
) -> Result<CheckpointManifest> {
    apply_recycling(base, delta_path, out, threads, None)
}

/// [`apply`], overwriting the files of `recycle` (an older version directory, on the same file
/// system) instead of allocating new ones: a rollout worker that keeps two versions turns the
/// older into the newer. Allocating fresh page-cache pages for a new file costs the kernel
/// about as much CPU as hashing it (docs/weights.md, "Numbers"). `recycle` must be a checkpoint
/// directory (with a marker) that neither is nor holds the base or the output. It is left alone
/// when a check fails (the base, `recycle` itself, the whole delta file); after that it is
/// consumed: its marker is removed first (it no longer claims a version), its files move into
/// the output, and it is gone afterwards, whether or not the rebuild succeeds (a base whose
/// bytes are damaged is found only then).
pub fn apply_recycling(
    base: &Path,
    delta_path: &Path,
    out: &Path,
    threads: usize,
    recycle: Option<&Path>,
) -> Result<CheckpointManifest> {
    if threads == 0 {
        return Err(WeightsError::Invalid("threads must be at least 1".into()));
    }
    let m = delta::read_manifest(delta_path)?;
    check_base(base, &m, threads)?;
    if out.exists() {
        return Err(WeightsError::Invalid(format!(
            "{} exists already; apply writes a new directory",
            out.display()
        )));
    }
    let tmp = temp_path(out);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| WeightsError::io(&tmp, e))?;
    }
    if let Some(old) = recycle {
        check_recycle(old, &tmp, &[base, out, &tmp, delta_path])?;
        // A damaged delta would fail after `old`'s files are overwritten: check it whole first.
        delta::verify_file(delta_path)?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| WeightsError::io(&tmp, e))?;
    let result = recycle
        .map_or(Ok(()), |old| move_files(old, &tmp, &m.new))
        .and_then(|()| rebuild(base, delta_path, &m, &tmp, threads))
        .and_then(|()| {
            checkpoint::write_marker(&tmp, &m.new)?;
            std::fs::rename(&tmp, out).map_err(|e| WeightsError::io(out, e))
        });
    if let Some(old) = recycle {
        let _ = std::fs::remove_dir_all(old);
    }
    if let Err(e) = result {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    Ok(m.new)
}

/// `recycle` must be a checkpoint directory (it has a version marker) that is neither one of
/// `spare` nor holds one of them (a parent of the base would take the base with it), on the
/// filesystem of `dest` (where its files are moved: a rename cannot cross filesystems, and the
/// failure would come after its marker is gone and before the directory is removed).
pub(crate) fn check_recycle(old: &Path, dest: &Path, spare: &[&Path]) -> Result<()> {
    let invalid = |why: &str| {
        Err(WeightsError::Invalid(format!(
            "the directory to recycle {} {why}",
            old.display()
        )))
    };
    if !old.exists() {
        return invalid("does not exist");
    }
    if !old.is_dir() {
        return invalid("is not a directory");
    }
    let canonical = std::fs::canonicalize(old).map_err(|e| WeightsError::io(old, e))?;
    for p in spare {
        if canonical_or_planned(p).is_some_and(|p| p.starts_with(&canonical)) {
            return invalid(&format!("is or holds {}, which must survive", p.display()));
        }
    }
    if checkpoint::read_marker(old)?.is_none() {
        return invalid("has no weights.json: only a checkpoint directory is recycled");
    }
    let dest_dev = nearest_existing(dest).and_then(|p| std::fs::metadata(p).ok());
    let old_dev = std::fs::metadata(old).map_err(|e| WeightsError::io(old, e))?;
    if let Some(d) = dest_dev {
        use std::os::unix::fs::MetadataExt;
        if d.dev() != old_dev.dev() {
            return invalid(&format!(
                "is on another filesystem than {}: its files are moved, not copied, so it must \
                 be on the output's filesystem",
                dest.display()
            ));
        }
    }
    // Its files are overwritten in place: one with another name (a hard link, say into the
    // base, or a symbolic link, say into a model cache) would change under that name too.
    for f in layout::walk(old, false, false)? {
        if f.meta.is_symlink() {
            return invalid(&format!(
                "holds {}, a symbolic link: overwriting it would change the file it points to",
                f.path.display()
            ));
        }
        if f.meta.is_file() && std::os::unix::fs::MetadataExt::nlink(&f.meta) > 1 {
            return invalid(&format!(
                "holds {}, which has other hard links: overwriting it would change them",
                f.path.display()
            ));
        }
    }
    Ok(())
}

/// `p` if it exists, else its nearest existing ancestor (`.` for a relative path none of
/// whose ancestors exist).
fn nearest_existing(p: &Path) -> Option<&Path> {
    let mut p = p;
    loop {
        if p.exists() {
            return Some(p);
        }
        match p.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => p = parent,
            _ => return Some(Path::new(".")),
        }
    }
}

/// `p` made absolute with its symbolic links resolved; for a path not created yet, its
/// nearest existing ancestor's resolution joined with the rest.
fn canonical_or_planned(p: &Path) -> Option<std::path::PathBuf> {
    if let Ok(c) = std::fs::canonicalize(p) {
        return Some(c);
    }
    let parent = p
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    Some(canonical_or_planned(parent)?.join(p.file_name()?))
}

/// Moves the files of `old` into `tmp` under the names of `new`'s files, largest to largest,
/// after removing `old`'s marker.
fn move_files(old: &Path, tmp: &Path, new: &CheckpointManifest) -> Result<()> {
    checkpoint::remove_marker(old)?;
    let mut have: Vec<_> = layout::walk(old, false, false)?
        .into_iter()
        .filter(|f| f.meta.is_file())
        .map(|f| (f.meta.len(), f.path))
        .collect();
    have.sort_unstable_by(|a, b| b.cmp(a));
    let mut want: Vec<_> = new.files.iter().collect();
    want.sort_unstable_by_key(|f| std::cmp::Reverse(f.size));
    for ((_, from), f) in have.into_iter().zip(want) {
        let to = layout::output_path(tmp, &f.name)?;
        std::fs::rename(&from, &to).map_err(|e| WeightsError::io(&from, e))?;
    }
    Ok(())
}

/// The base must be the version the delta was made against. A base whose marker hashes its
/// segments another way than the delta's base marker did (a cache stamped before BLAKE3, a
/// store published after) is hashed again the delta's way: the same bytes, another digest.
fn check_base(base: &Path, m: &DeltaManifest, threads: usize) -> Result<()> {
    let want_hash = SegmentHash::of_format(m.base.marker_format).ok_or_else(|| {
        WeightsError::corrupted(
            "__manifest__",
            m.label(),
            format!("unknown base marker format {}", m.base.marker_format),
        )
    })?;
    let stamped = checkpoint::read_consistent_marker(base)?;
    let have_version = stamped.as_ref().map(|m| m.version);
    let have = match stamped {
        Some(marker) => {
            if marker.version == m.base.version
                && marker.digest != m.base.digest
                && marker.hash() != want_hash
            {
                checkpoint::stamp_with(base, marker.version, want_hash, threads)?
            } else {
                marker
            }
        }
        None => checkpoint::stamp_with(base, m.base.version, want_hash, threads)?,
    };
    if have.version != m.base.version || have.digest != m.base.digest {
        return Err(WeightsError::BaseMismatch {
            delta_base: m.base.version,
            delta_new: m.new.version,
            want: m.base.digest.clone(),
            dir: base.to_path_buf(),
            have_version,
            have: have.digest,
        });
    }
    Ok(())
}

fn rebuild(
    base: &Path,
    delta_path: &Path,
    m: &DeltaManifest,
    tmp: &Path,
    threads: usize,
) -> Result<()> {
    let label = m.label();
    let delta_file = File::open(delta_path).map_err(|e| WeightsError::io(delta_path, e))?;
    let mut base_files: HashMap<&str, File> = HashMap::new();
    for d in &m.segments {
        if let Some((name, _)) = &d.base {
            if !base_files.contains_key(name.as_str()) {
                let p = layout::file_path(base, name)?;
                base_files.insert(name, File::open(&p).map_err(|e| WeightsError::io(&p, e))?);
            }
        }
    }
    let mut out_files = Vec::new();
    for f in &m.new.files {
        let p = layout::output_path(tmp, &f.name)?;
        // Not truncated: a recycled file keeps its pages; every byte is rewritten below.
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(&p)
            .map_err(|e| WeightsError::io(&p, e))?;
        file.set_len(f.size).map_err(|e| WeightsError::io(&p, e))?;
        out_files.push((file, p));
    }
    let mut jobs: Vec<(usize, usize, usize)> = Vec::new();
    for (fi, f) in m.new.files.iter().enumerate() {
        for si in 0..f.segments.len() {
            jobs.push((fi, si, jobs.len()));
        }
    }
    jobs.sort_by_key(|&(fi, si, _)| std::cmp::Reverse(m.new.files[fi].segments[si].segment.len));
    let chunk = m.chunk_bytes as usize;
    parallel::run(
        threads,
        &jobs,
        || {
            (
                Vec::new(),
                vec![0u8; chunk],
                vec![0u8; chunk],
                Codec::new(1, chunk),
            )
        },
        |&(fi, si, k), (frame_buf, base_buf, out_buf, codec)| {
            let codec = codec
                .as_mut()
                .map_err(|e| WeightsError::Invalid(format!("zstd: {e}")))?;
            let want = &m.new.files[fi].segments[si];
            let name = &want.segment.name;
            let d = &m.segments[k];
            let (out_file, out_path) = &out_files[fi];
            let (mut sha, mut frames_sha) = (m.new.hash().hasher(), Sha256::new());
            let mut done = 0u64;
            for frame in &d.frames {
                frame_buf.resize(frame.len as usize, 0);
                delta_file
                    .read_exact_at(frame_buf, frame.offset)
                    .map_err(|e| WeightsError::io(delta_path, e))?;
                frames_sha.update(&*frame_buf);
                let n = frame.raw as usize;
                let corrupt = |e: String| {
                    WeightsError::corrupted(
                        name,
                        &label,
                        format!("a frame of the delta does not decode: {e}"),
                    )
                };
                let base_range = match (&d.base, frame.xor) {
                    (Some((bname, boff)), true) => Some((bname, boff + done)),
                    (None, true) => {
                        return Err(WeightsError::corrupted(
                            name,
                            &label,
                            "an XOR frame without a base",
                        ))
                    }
                    _ => None,
                };
                let read_base = |bname: &String, at: u64, buf: &mut [u8]| {
                    base_files[bname.as_str()]
                        .read_exact_at(buf, at)
                        .map_err(|e| WeightsError::io(base.join(bname), e))
                };
                match base_range {
                    // The base chunk goes straight into the output, then the changes onto it.
                    Some((bname, at)) if frame.sparse => {
                        read_base(bname, at, &mut out_buf[..n])?;
                        codec
                            .patch(frame, frame_buf, &mut out_buf[..n])
                            .map_err(corrupt)?;
                    }
                    Some((bname, at)) => {
                        read_base(bname, at, &mut base_buf[..n])?;
                        codec
                            .decode(frame, frame_buf, Some(&base_buf[..n]), out_buf)
                            .map_err(corrupt)?;
                    }
                    None => codec
                        .decode(frame, frame_buf, None, out_buf)
                        .map_err(corrupt)?,
                }
                sha.update(&out_buf[..n]);
                out_file
                    .write_all_at(&out_buf[..n], want.segment.offset + done)
                    .map_err(|e| WeightsError::io(out_path, e))?;
                done += n as u64;
            }
            if hex::encode(frames_sha.finalize()) != d.frames_sha256 {
                return Err(WeightsError::corrupted(
                    name,
                    &label,
                    "the delta's frames of this tensor do not match their SHA-256",
                ));
            }
            if sha.hex() != want.digest {
                let what = "the rebuilt tensor's digest is wrong while the delta's frames are intact: the base tensor is corrupted";
                return Err(WeightsError::corrupted(
                    name,
                    format!("v{}", m.base.version),
                    what,
                ));
            }
            Ok(())
        },
    )?;
    for (f, p) in &out_files {
        f.sync_all().map_err(|e| WeightsError::io(p, e))?;
    }
    Ok(())
}
