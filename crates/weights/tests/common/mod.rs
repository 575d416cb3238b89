//! Checkpoint-tree helpers shared by the integration tests: a checkpoint's files are every file
//! under its directory, subdirectories included (a Hugging Face repository's `original/`), less
//! its marker and hidden entries.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// The checkpoint's files under `dir` (subdirectories included; the marker and hidden entries
/// left out), by path relative to it.
pub(crate) fn checkpoint_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut todo = vec![PathBuf::new()];
    while let Some(rel) = todo.pop() {
        for e in std::fs::read_dir(dir.join(&rel)).unwrap() {
            let e = e.unwrap();
            let name = e.file_name();
            if name.to_string_lossy().starts_with('.')
                || (rel.as_os_str().is_empty() && name == "weights.json")
            {
                continue;
            }
            if e.file_type().unwrap().is_dir() {
                todo.push(rel.join(&name));
            } else {
                files.push(rel.join(&name));
            }
        }
    }
    files.sort();
    files
}

/// `a` and `b` hold the same checkpoint files with the same bytes.
pub(crate) fn assert_same_files(a: &Path, b: &Path) {
    let files = checkpoint_files(a);
    assert_eq!(files, checkpoint_files(b));
    for name in files {
        assert_eq!(
            std::fs::read(a.join(&name)).unwrap(),
            std::fs::read(b.join(&name)).unwrap(),
            "{name:?}"
        );
    }
}

/// Puts each checkpoint file of `from` (and its marker, if any) at the same path under `to`
/// with `put(source, destination)`: a copy, a hard link, a symbolic link.
pub(crate) fn copy_tree(from: &Path, to: &Path, put: impl Fn(&Path, &Path)) {
    let mut files = checkpoint_files(from);
    if from.join("weights.json").exists() {
        files.push("weights.json".into());
    }
    for name in files {
        let dest = to.join(&name);
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        put(&from.join(&name), &dest);
    }
}

/// A copy of checkpoint directory `from` (marker included) at `to`.
pub(crate) fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    copy_tree(from, to, |a, b| {
        std::fs::copy(a, b).unwrap();
    });
}

/// Adds a file in a subdirectory (`original/params.json`, whose name must be escaped in a URL)
/// to checkpoint directory `dir`, its bytes depending on `k`.
pub(crate) fn add_nested_file(dir: &Path, k: u32) {
    // And a hidden tree deeper than a checkpoint may nest (a git clone's `.git/`): no part of
    // the checkpoint, never walked.
    let deep = dir.join(".git/objects/a/b/c/d/e/f/g/h");
    std::fs::create_dir_all(&deep).unwrap();
    std::fs::write(deep.join("pack"), b"x").unwrap();
    std::fs::create_dir_all(dir.join("original")).unwrap();
    std::fs::write(dir.join(NESTED), format!("{{\"dim\": 8, \"step\": {k}}}")).unwrap();
}

/// The nested file [`add_nested_file`] writes.
pub(crate) const NESTED: &str = "original/params #1 50%.json";
