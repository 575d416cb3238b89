//! A checkpoint directory as files cut into segments: each `*.safetensors` file is its header
//! segment (`__header__:FILE`: the 8-byte length and the JSON) followed by one segment per tensor;
//! any other file is one segment (`__file__:NAME`). Segments cover every byte of every file, so
//! digests of the segments are digests of the whole checkpoint. Parsing reads only the headers.

use crate::error::{Result, WeightsError};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The name of the version marker a checkpoint directory carries (never part of the layout).
pub const MARKER: &str = "weights.json";

/// Largest safetensors header accepted (the format's own limit is 100 MB).
const MAX_HEADER_BYTES: u64 = 100 << 20;

/// One contiguous byte range of a file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    /// Tensor name, `__header__:FILE` or `__file__:NAME`.
    pub name: String,
    /// safetensors dtype (`BF16`, …), `HEADER` or `BLOB`.
    pub dtype: String,
    /// Tensor shape (empty for headers and blobs).
    #[serde(default)]
    pub shape: Vec<u64>,
    /// Byte offset in the file.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

impl Segment {
    /// Bytes per element, for byte-plane shuffling (1 where it does not apply).
    pub fn element_bytes(&self) -> usize {
        match self.dtype.as_str() {
            "F64" | "I64" | "U64" => 8,
            "F32" | "I32" | "U32" => 4,
            "BF16" | "F16" | "I16" | "U16" => 2,
            _ => 1,
        }
    }
}

/// One file of a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileLayout {
    /// Path inside the checkpoint directory, components joined with `/` (`original/params.json`).
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// Segments in file order, covering `[0, size)`.
    pub segments: Vec<Segment>,
}

#[derive(Deserialize)]
struct HeaderEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

/// How deep a checkpoint's subdirectories may nest (a Hugging Face repository has one level,
/// `original/`); deeper is refused, which also ends a loop of linked directories.
pub const MAX_DEPTH: usize = 8;

/// One regular file found under a checkpoint directory.
pub struct Found {
    /// Its path relative to the directory, components joined with `/`.
    pub name: String,
    /// Its path on disk.
    pub path: PathBuf,
    /// Its metadata (of the link's target where links are followed).
    pub meta: std::fs::Metadata,
}

/// Every entry under `dir`, depth first. With `follow_links`, a symbolic link counts as what
/// it points to (a Hugging Face cache snapshot is all links) and a link to nothing is an error
/// naming it; without, links are returned as links (`meta.is_symlink()`) and not entered.
/// Hidden entries (a name starting with `.`: `.cache/` of a `--local-dir` download, our own
/// temporaries) are left out with `skip_hidden`. Directories themselves are not returned.
pub fn walk(dir: &Path, follow_links: bool, skip_hidden: bool) -> Result<Vec<Found>> {
    let mut found = Vec::new();
    walk_into(dir, "", 0, follow_links, skip_hidden, &mut found)?;
    Ok(found)
}

fn walk_into(
    dir: &Path,
    prefix: &str,
    depth: usize,
    follow_links: bool,
    skip_hidden: bool,
    found: &mut Vec<Found>,
) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|e| WeightsError::io(dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| WeightsError::io(dir, e))?;
        let path = entry.path();
        let os_name = entry.file_name();
        if skip_hidden && os_name.as_encoded_bytes().starts_with(b".") {
            continue;
        }
        let Some(name) = os_name.to_str().map(str::to_owned) else {
            return Err(WeightsError::format(&path, "a file name that is not UTF-8"));
        };
        if name.chars().any(char::is_control) {
            // A peer's file URL could not carry it, nor a log line show it plainly (the path in
            // the error is escaped for the same reason).
            return Err(WeightsError::format(
                name.escape_debug().to_string(),
                "a file name with a control character (a newline, a tab, ...)",
            ));
        }
        let mut meta = std::fs::symlink_metadata(&path).map_err(|e| WeightsError::io(&path, e))?;
        if follow_links && meta.is_symlink() {
            meta = std::fs::metadata(&path).map_err(|e| WeightsError::io(&path, e))?;
        }
        let name = format!("{prefix}{name}");
        if meta.is_dir() {
            if depth + 1 >= MAX_DEPTH {
                return Err(WeightsError::format(
                    &path,
                    format!("nested more than {MAX_DEPTH} directories deep (a loop of links?)"),
                ));
            }
            walk_into(
                &path,
                &format!("{name}/"),
                depth + 1,
                follow_links,
                skip_hidden,
                found,
            )?;
        } else {
            found.push(Found { name, path, meta });
        }
    }
    Ok(())
}

/// Reads the layout of every regular file under `dir`, subdirectories included (a Hugging
/// Face repository's `original/`), sorted by name (`original/params.json`); the marker and
/// hidden entries are left out. A symbolic link counts as the file or directory it points to;
/// a link that points nowhere is an error naming it.
pub fn read_dir_layout(dir: &Path) -> Result<Vec<FileLayout>> {
    let mut names: Vec<String> = walk(dir, true, true)?
        .into_iter()
        .filter(|f| f.meta.is_file() && f.name != MARKER)
        .map(|f| f.name)
        .collect();
    names.sort();
    if names.is_empty() {
        return Err(WeightsError::format(
            dir,
            "no checkpoint files in this directory",
        ));
    }
    names.iter().map(|n| read_file_layout(dir, n)).collect()
}

/// The layout of one file: safetensors by extension, otherwise one blob segment.
pub fn read_file_layout(dir: &Path, name: &str) -> Result<FileLayout> {
    let path = dir.join(name);
    let mut file = File::open(&path).map_err(|e| WeightsError::io(&path, e))?;
    let size = file
        .metadata()
        .map_err(|e| WeightsError::io(&path, e))?
        .len();
    if !name.ends_with(".safetensors") {
        let segments = vec![Segment {
            name: format!("__file__:{name}"),
            dtype: "BLOB".into(),
            shape: Vec::new(),
            offset: 0,
            len: size,
        }];
        return Ok(FileLayout {
            name: name.into(),
            size,
            segments,
        });
    }
    let mut len8 = [0u8; 8];
    file.read_exact(&mut len8)
        .map_err(|e| WeightsError::format(&path, format!("no safetensors header length: {e}")))?;
    let header_len = u64::from_le_bytes(len8);
    if header_len > MAX_HEADER_BYTES || 8 + header_len > size {
        return Err(WeightsError::format(
            &path,
            format!("header length {header_len} is out of bounds (file is {size} bytes)"),
        ));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header)
        .map_err(|e| WeightsError::io(&path, e))?;
    let segments = parse_header(&path, name, &header, size)?;
    Ok(FileLayout {
        name: name.into(),
        size,
        segments,
    })
}

fn parse_header(path: &Path, file: &str, header: &[u8], size: u64) -> Result<Vec<Segment>> {
    let map: BTreeMap<String, serde_json::Value> = serde_json::from_slice(header)
        .map_err(|e| WeightsError::format(path, format!("the header is not a JSON object: {e}")))?;
    let data_start = 8 + header.len() as u64;
    let mut tensors = Vec::new();
    for (name, value) in map {
        if name == "__metadata__" {
            continue;
        }
        let entry: HeaderEntry = serde_json::from_value(value)
            .map_err(|e| WeightsError::format(path, format!("tensor `{name}`: {e}")))?;
        let [start, end] = entry.data_offsets;
        if end < start {
            return Err(WeightsError::format(
                path,
                format!("tensor `{name}`: data_offsets end before start"),
            ));
        }
        // Offsets past the file cannot be right, and checking it here keeps the sums below
        // from overflowing.
        if end > size.saturating_sub(data_start) {
            return Err(WeightsError::format(
                path,
                format!(
                    "tensor `{name}`: data_offsets end at {end}, past the {} bytes of data",
                    size.saturating_sub(data_start)
                ),
            ));
        }
        tensors.push(Segment {
            name,
            dtype: entry.dtype,
            shape: entry.shape,
            offset: data_start + start,
            len: end - start,
        });
    }
    tensors.sort_by_key(|t| (t.offset, t.len));
    let mut at = data_start;
    for t in &tensors {
        if t.offset != at {
            return Err(WeightsError::format(path, format!("tensor `{}` starts at {} but the previous data ends at {at} (gaps and overlaps are not supported)", t.name, t.offset)));
        }
        at += t.len;
    }
    if at != size {
        return Err(WeightsError::format(
            path,
            format!("tensor data ends at {at} but the file is {size} bytes"),
        ));
    }
    let mut segments = vec![Segment {
        name: format!("__header__:{file}"),
        dtype: "HEADER".into(),
        shape: Vec::new(),
        offset: 0,
        len: data_start,
    }];
    segments.extend(tensors);
    Ok(segments)
}

/// Total bytes of a layout.
pub fn total_bytes(files: &[FileLayout]) -> u64 {
    files.iter().map(|f| f.size).sum()
}

/// Why `name` cannot name a file of a checkpoint: empty, absolute, a `.`/`..`/empty component,
/// a backslash, a control character, or hidden (a checkpoint's hidden files are never part of
/// it).
pub fn check_name(name: &str) -> std::result::Result<(), String> {
    let bad = name.is_empty()
        || name.contains('\\')
        || name.chars().any(char::is_control)
        || name.split('/').count() > MAX_DEPTH
        || name
            .split('/')
            .any(|c| c.is_empty() || c == "." || c == ".." || c.starts_with('.'));
    if bad {
        return Err(format!(
            "bad checkpoint file name `{}`",
            name.escape_debug()
        ));
    }
    Ok(())
}

/// `dir/name`, refusing names that would leave the directory ([`check_name`]).
pub fn file_path(dir: &Path, name: &str) -> Result<PathBuf> {
    check_name(name).map_err(WeightsError::Invalid)?;
    Ok(dir.join(name))
}

/// [`file_path`], with the directories it lies in created: where a file of a checkpoint being
/// written goes.
pub fn output_path(dir: &Path, name: &str) -> Result<PathBuf> {
    let path = file_path(dir, name)?;
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| WeightsError::io(parent, e))?;
    }
    Ok(path)
}

/// The version of a name written as `format!("v{version}")` (a version directory, one side of a
/// delta's `vA-vB`): `v` and the version's decimal digits, as written (no sign, no leading
/// zero), so one version has one name.
pub fn version_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix('v')?;
    let canonical = !digits.is_empty()
        && digits.bytes().all(|c| c.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'));
    canonical.then(|| digits.parse().ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_file_named_with_a_control_character_is_refused() {
        let t = tempfile::tempdir().unwrap();
        std::fs::write(t.path().join("ok.json"), "{}").unwrap();
        std::fs::write(t.path().join("new\nline"), "x").unwrap();
        let e = walk(t.path(), false, true)
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains("control character") && e.contains("new"), "{e}");
    }

    #[test]
    fn a_version_has_one_name() {
        for (name, v) in [
            ("v0", Some(0)),
            ("v12", Some(12)),
            ("v18446744073709551615", Some(u64::MAX)),
        ] {
            assert_eq!(version_name(name), v, "{name}");
        }
        for name in [
            "v",
            "v01",
            "v+2",
            "v-1",
            "v 1",
            "V1",
            "1",
            "v1x",
            "v18446744073709551616",
        ] {
            assert_eq!(version_name(name), None, "{name}");
        }
    }

    /// A safetensors file of one `U8` tensor `t` whose header claims `offsets`, with `data`
    /// bytes after the header.
    fn safetensors(offsets: [u64; 2], data: usize) -> Vec<u8> {
        let header = format!(
            r#"{{"t":{{"dtype":"U8","shape":[{}],"data_offsets":[{},{}]}}}}"#,
            offsets[1].wrapping_sub(offsets[0]),
            offsets[0],
            offsets[1]
        );
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend(std::iter::repeat_n(7u8, data));
        bytes
    }

    #[test]
    fn offsets_past_the_file_are_refused_not_summed() {
        let dir = tempfile::tempdir().unwrap();
        for offsets in [[u64::MAX, u64::MAX], [0, u64::MAX], [0, 9]] {
            std::fs::write(dir.path().join("m.safetensors"), safetensors(offsets, 8)).unwrap();
            let err = read_dir_layout(dir.path()).unwrap_err().to_string();
            assert!(err.contains("data_offsets end at"), "{offsets:?}: {err}");
        }
        std::fs::write(dir.path().join("m.safetensors"), safetensors([0, 8], 8)).unwrap();
        let layout = read_dir_layout(dir.path()).unwrap();
        assert_eq!(layout[0].segments.len(), 2);
    }

    #[cfg(unix)]
    #[test]
    fn linked_files_are_read_as_the_files_they_point_to() {
        let blobs = tempfile::tempdir().unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(blobs.path().join("a"), safetensors([0, 8], 8)).unwrap();
        std::fs::write(blobs.path().join("b"), b"{}").unwrap();
        std::os::unix::fs::symlink(blobs.path().join("a"), dir.path().join("m.safetensors"))
            .unwrap();
        std::os::unix::fs::symlink(blobs.path().join("b"), dir.path().join("config.json")).unwrap();
        let names: Vec<String> = read_dir_layout(dir.path())
            .unwrap()
            .into_iter()
            .map(|f| f.name)
            .collect();
        assert_eq!(names, ["config.json", "m.safetensors"]);
        // A link to nothing is named, not skipped.
        std::os::unix::fs::symlink(blobs.path().join("gone"), dir.path().join("x.bin")).unwrap();
        let err = read_dir_layout(dir.path()).unwrap_err().to_string();
        assert!(err.contains("x.bin"), "{err}");
    }

    #[test]
    fn names_may_hold_subdirectories_but_never_leave_the_checkpoint() {
        for ok in ["config.json", "original/params.json", "a/b/c.safetensors"] {
            assert!(check_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../../x",
            "a//b",
            "a/./b",
            "a/",
            ".cache/x",
            "a\\b",
            "a\nb",
            "tab\tname",
            "1/2/3/4/5/6/7/8/9",
        ] {
            assert!(file_path(Path::new("/ckpt"), bad).is_err(), "{bad}");
        }
    }

    #[cfg(unix)]
    #[test]
    fn a_loop_of_linked_directories_is_refused_not_followed_forever() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.bin"), b"x").unwrap();
        std::os::unix::fs::symlink(dir.path(), dir.path().join("loop")).unwrap();
        let err = read_dir_layout(dir.path()).unwrap_err().to_string();
        assert!(err.contains("nested more than 8"), "{err}");
        // Not followed, the link is one entry and nothing is entered.
        let found = walk(dir.path(), false, true).unwrap();
        assert_eq!(found.len(), 2);
    }
}
