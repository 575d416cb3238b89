//! The delta file (`*.kvwd`): `KVWDLT01`, the zstd frames, the manifest (JSON), then a 56-byte
//! trailer: manifest offset and length (u64 LE), the manifest's SHA-256, `KVWDEND1`.
//!
//! The manifest holds the base version id, the full marker of the result (every tensor's name,
//! dtype, shape, offsets and digest: BLAKE3 in a format 2 marker), and per segment its base
//! range and frames (offset, length, mode) with the SHA-256 of its frames; `data_sha256` is the
//! SHA-256 of all frames (the delta file less its manifest and trailer).

use crate::checkpoint::CheckpointManifest;
use crate::error::{Result, WeightsError};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// First bytes of a delta file.
pub const MAGIC: &[u8; 8] = b"KVWDLT01";
/// Last bytes of a delta file.
pub const END: &[u8; 8] = b"KVWDEND1";
/// Trailer length.
pub const TRAILER_BYTES: u64 = 56;
/// Largest manifest read back (a 100 GB checkpoint in 4 MiB frames needs a few MB).
const MAX_MANIFEST_BYTES: u64 = 1 << 30;

/// The manifest format written: 2 added sparse frames.
pub const FORMAT: u32 = 2;

/// A version and its checkpoint digest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionId {
    /// Policy version.
    pub version: u64,
    /// Checkpoint digest ([`CheckpointManifest::digest`]).
    pub digest: String,
    /// The format of the marker that digest came from (so a base without a marker is hashed
    /// the same way); 1 in deltas written before it was recorded.
    #[serde(default = "first_marker_format")]
    pub marker_format: u32,
}

fn first_marker_format() -> u32 {
    1
}

/// One zstd frame: a chunk of a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Frame {
    /// Offset in the delta file.
    pub offset: u64,
    /// Compressed length.
    pub len: u64,
    /// Length of the chunk it decodes to.
    pub raw: u64,
    /// The chunk is new XOR base (else the new bytes themselves).
    pub xor: bool,
    /// Byte planes the chunk was split into before compression (1: none); for a sparse frame,
    /// the element size.
    pub planes: u8,
    /// Only the changed elements are listed (format 2; see `sparse`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub sparse: bool,
}

/// How one segment of the result is rebuilt.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeltaSegment {
    /// The base file and offset its XOR partner starts at (same length), if any.
    pub base: Option<(String, u64)>,
    /// Its frames in order.
    pub frames: Vec<Frame>,
    /// SHA-256 of its frames' bytes in order, hex.
    pub frames_sha256: String,
}

/// The delta manifest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeltaManifest {
    /// Format: 2 ([`FORMAT`]); 1 (no sparse frames) is still read.
    pub format: u32,
    /// The base it applies to.
    pub base: VersionId,
    /// The result, with the digest of every segment.
    pub new: CheckpointManifest,
    /// zstd level used.
    pub zstd_level: i32,
    /// Chunk (frame) size.
    pub chunk_bytes: u64,
    /// Bytes of frames.
    pub data_len: u64,
    /// SHA-256 of all frames, hex.
    pub data_sha256: String,
    /// One per segment of `new`, in its order.
    pub segments: Vec<DeltaSegment>,
}

impl DeltaManifest {
    /// `vA->vB`, for error messages.
    pub fn label(&self) -> String {
        format!("v{}->v{}", self.base.version, self.new.version)
    }

    /// Structural checks: one entry per segment, frames cover each segment and tile the data.
    pub fn check(&self) -> Result<()> {
        let label = self.label();
        if !(1..=FORMAT).contains(&self.format)
            || crate::digest::SegmentHash::of_format(self.base.marker_format).is_none()
            || !self.new.is_consistent()
            || !(4096..=256 << 20).contains(&self.chunk_bytes)
        {
            return Err(WeightsError::corrupted(
                "__manifest__",
                label,
                "unknown format or inconsistent result digest",
            ));
        }
        let segs: Vec<_> = self.new.files.iter().flat_map(|f| &f.segments).collect();
        if segs.len() != self.segments.len() {
            return Err(WeightsError::corrupted(
                "__manifest__",
                label,
                "segment count differs from the result's",
            ));
        }
        let mut frames: Vec<(u64, u64)> = Vec::new();
        for (s, d) in segs.iter().zip(&self.segments) {
            let raw: u64 = d.frames.iter().map(|f| f.raw).sum();
            if raw != s.segment.len
                || d.frames.iter().any(|f| {
                    f.raw > self.chunk_bytes
                        || f.planes == 0
                        || (f.sparse && (!f.xor || self.format < 2))
                })
            {
                return Err(WeightsError::corrupted(
                    &s.segment.name,
                    label,
                    "its frames do not cover it",
                ));
            }
            frames.extend(d.frames.iter().map(|f| (f.offset, f.len)));
        }
        frames.sort_unstable();
        let mut at = MAGIC.len() as u64;
        for (offset, len) in frames {
            if offset != at {
                return Err(WeightsError::corrupted(
                    "__manifest__",
                    label,
                    "frames do not tile the data region",
                ));
            }
            at += len;
        }
        if at != MAGIC.len() as u64 + self.data_len {
            return Err(WeightsError::corrupted(
                "__manifest__",
                label,
                "frames do not fill the data region",
            ));
        }
        Ok(())
    }
}

/// The trailer bytes for a manifest written at `offset`.
pub(crate) fn trailer(offset: u64, manifest: &[u8]) -> Vec<u8> {
    let mut t = Vec::with_capacity(TRAILER_BYTES as usize);
    t.extend_from_slice(&offset.to_le_bytes());
    t.extend_from_slice(&(manifest.len() as u64).to_le_bytes());
    t.extend_from_slice(&Sha256::digest(manifest));
    t.extend_from_slice(END);
    t
}

/// Reads and checks the manifest of the delta file at `path` (not the frames).
pub fn read_manifest(path: &Path) -> Result<DeltaManifest> {
    let file = File::open(path).map_err(|e| WeightsError::io(path, e))?;
    let size = file
        .metadata()
        .map_err(|e| WeightsError::io(path, e))?
        .len();
    let bad = |what: &str| {
        WeightsError::corrupted(
            "__manifest__",
            "unknown",
            format!("{}: {what}", path.display()),
        )
    };
    if size < MAGIC.len() as u64 + TRAILER_BYTES {
        return Err(bad("too short for a delta file"));
    }
    let mut head = [0u8; 8];
    file.read_exact_at(&mut head, 0)
        .map_err(|e| WeightsError::io(path, e))?;
    let mut t = [0u8; TRAILER_BYTES as usize];
    file.read_exact_at(&mut t, size - TRAILER_BYTES)
        .map_err(|e| WeightsError::io(path, e))?;
    if &head != MAGIC || &t[48..] != END {
        return Err(bad("not a delta file (magic bytes differ)"));
    }
    let offset = u64::from_le_bytes(t[0..8].try_into().expect("8 bytes"));
    let len = u64::from_le_bytes(t[8..16].try_into().expect("8 bytes"));
    if len > MAX_MANIFEST_BYTES || offset.checked_add(len) != Some(size - TRAILER_BYTES) {
        return Err(bad("trailer offsets are out of bounds"));
    }
    let mut bytes = vec![0u8; len as usize];
    file.read_exact_at(&mut bytes, offset)
        .map_err(|e| WeightsError::io(path, e))?;
    if Sha256::digest(&bytes)[..] != t[16..48] {
        return Err(bad("the manifest's SHA-256 does not match the trailer"));
    }
    let m: DeltaManifest =
        serde_json::from_slice(&bytes).map_err(|e| bad(&format!("manifest: {e}")))?;
    if MAGIC.len() as u64 + m.data_len != offset {
        return Err(WeightsError::corrupted(
            "__manifest__",
            m.label(),
            "data length disagrees with the trailer",
        ));
    }
    m.check()?;
    Ok(m)
}

/// Checks the whole delta file: manifest, then the SHA-256 of the frames of every segment
/// (naming the first bad one) and of all frames.
pub fn verify_file(path: &Path) -> Result<DeltaManifest> {
    let m = read_manifest(path)?;
    let file = File::open(path).map_err(|e| WeightsError::io(path, e))?;
    let mut all = Sha256::new();
    let mut buf = Vec::new();
    let names: Vec<&str> = m
        .new
        .files
        .iter()
        .flat_map(|f| &f.segments)
        .map(|s| s.segment.name.as_str())
        .collect();
    let mut frames: Vec<(Frame, usize)> = Vec::new();
    for (i, d) in m.segments.iter().enumerate() {
        let mut h = Sha256::new();
        for f in &d.frames {
            buf.resize(f.len as usize, 0);
            file.read_exact_at(&mut buf, f.offset)
                .map_err(|e| WeightsError::io(path, e))?;
            h.update(&buf);
            frames.push((*f, i));
        }
        if hex::encode(h.finalize()) != d.frames_sha256 {
            return Err(WeightsError::corrupted(
                names[i],
                m.label(),
                "the delta's frames of this tensor do not match their SHA-256",
            ));
        }
    }
    frames.sort_unstable_by_key(|(f, _)| f.offset);
    for (f, _) in frames {
        buf.resize(f.len as usize, 0);
        file.read_exact_at(&mut buf, f.offset)
            .map_err(|e| WeightsError::io(path, e))?;
        all.update(&buf);
    }
    if hex::encode(all.finalize()) != m.data_sha256 {
        return Err(WeightsError::corrupted(
            "__data__",
            m.label(),
            "the delta's data SHA-256 does not match",
        ));
    }
    Ok(m)
}
