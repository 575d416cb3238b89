//! Where `sim`, `bench` and `plan` write their results (`--out DIR`, `--perfetto FILE`),
//! checked before the run: a run of minutes was lost at its end to an `--out` that is a file,
//! or a `--perfetto` in a directory that does not exist.

use anyhow::Context;
use std::path::Path;

/// `dir` is a directory a file can be written in, or can be made one: its nearest existing
/// ancestor is a directory a file can be written in. Nothing is left behind (a run that fails
/// before writing creates no directory).
pub(crate) fn check_dir(dir: &Path, flag: &str) -> anyhow::Result<()> {
    let mut at = dir;
    while std::fs::symlink_metadata(at).is_err() {
        at = match at.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
    }
    if !at.is_dir() {
        anyhow::bail!(
            "{flag} {}: {} is not a directory",
            dir.display(),
            at.display()
        );
    }
    let probe = at.join(format!(".kvrouter-write-check-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .with_context(|| format!("{flag} {}: cannot write in {}", dir.display(), at.display()))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// `file` can be created or overwritten (nothing of an existing one is changed here). Only a
/// regular file or a new one is tried: opening a named pipe would end its reader's input, and
/// a link is left as it is.
pub(crate) fn check_file(file: &Path, flag: &str) -> anyhow::Result<()> {
    if file.is_dir() {
        anyhow::bail!("{flag} {}: is a directory, not a file", file.display());
    }
    let existed = match std::fs::symlink_metadata(file) {
        Ok(m) if !m.is_file() => return Ok(()),
        Ok(_) => true,
        Err(_) => false,
    };
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(file)
        .with_context(|| format!("{flag} {}: cannot create", file.display()))?;
    if !existed {
        let _ = std::fs::remove_file(file);
    }
    Ok(())
}

/// A `--perfetto` file that is the `--out` directory's own path: written first, it left no
/// room for the directory, and the run failed at its end.
pub(crate) fn check_not_out(file: &Path, out: &Path) -> anyhow::Result<()> {
    let abs = |p: &Path| std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf());
    if abs(file) == abs(out) {
        anyhow::bail!(
            "--perfetto {}: the --out directory's own path (give a file beside or inside it)",
            file.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unusable_outputs_are_refused_naming_the_flag_and_usable_ones_left_as_they_were() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, b"kept").unwrap();
        let e = check_dir(&file, "--out").unwrap_err().to_string();
        assert!(e.contains("--out"), "{e}");
        let e = check_file(&dir.path().join("none/x.json"), "--perfetto")
            .unwrap_err()
            .to_string();
        assert!(e.contains("--perfetto"), "{e}");
        assert!(check_file(dir.path(), "--perfetto").is_err());
        check_file(&file, "--perfetto").unwrap();
        let out = dir.path().join("o3");
        let e = check_not_out(&out, &out).unwrap_err().to_string();
        assert!(e.contains("--perfetto") && e.contains("--out"), "{e}");
        check_not_out(&out.join("trace.json"), &out).unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"kept");
        let fresh = dir.path().join("new.json");
        check_file(&fresh, "--perfetto").unwrap();
        assert!(!fresh.exists(), "a checked file is not left behind");
        // A link is left as it is (its target was created, then the link removed).
        let link = dir.path().join("link.json");
        std::os::unix::fs::symlink(dir.path().join("gone/target.json"), &link).unwrap();
        check_file(&link, "--perfetto").unwrap();
        assert!(std::fs::symlink_metadata(&link).is_ok() && !link.exists());
        check_dir(&dir.path().join("a/b"), "--out").unwrap();
        assert!(!dir.path().join("a").exists(), "nothing is created");
        let e = check_dir(&file.join("x"), "--out").unwrap_err().to_string();
        assert!(e.contains("is not a directory"), "{e}");
        check_dir(dir.path(), "--out").unwrap();
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(left.len(), 2, "the probe file is removed: {left:?}");
    }
}
