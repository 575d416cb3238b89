//! A pull's work directory (`--work`): partial downloads and intermediate versions, removed
//! after a success. Removing a directory the user had is data loss, so a pull claims one only
//! when it is new, empty, or an earlier pull's (marked with [`WORK_MARK`]), and never one that
//! is or holds the pull's other paths, or lies inside its output.

use crate::error::{Result, WeightsError};
use std::path::{Path, PathBuf};

/// The file that marks a directory as a pull's work directory.
pub const WORK_MARK: &str = ".kvrouter-pull-work";

/// `path` made absolute, with its longest existing ancestor's symbolic links resolved (the rest,
/// not there yet, appended as given), so two spellings of one place compare equal.
fn resolved(path: &Path) -> PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut head = absolute.as_path();
    let mut tail = Vec::new();
    loop {
        if let Ok(real) = head.canonicalize() {
            return tail.iter().rev().fold(real, |p, part| p.join(part));
        }
        match (head.parent(), head.file_name()) {
            (Some(parent), Some(name)) => {
                tail.push(name.to_owned());
                head = parent;
            }
            _ => return absolute,
        }
    }
}

/// Whether `inner` is `outer` or lies inside it (symbolic links resolved as far as the paths exist).
pub(crate) fn within(inner: &Path, outer: &Path) -> bool {
    resolved(inner).starts_with(resolved(outer))
}

/// Checks `work` against the pull's other paths (`(flag, path)`: the output first) before
/// anything is written: it must not be or hold any of them (a success removes it), nor lie
/// inside the output.
pub fn check_apart(work: &Path, others: &[(&str, &Path)]) -> Result<()> {
    for (flag, path) in others {
        if within(path, work) {
            return Err(WeightsError::Invalid(format!(
                "--work {}: it holds {flag} {} (the work directory is removed after a pull)",
                work.display(),
                path.display()
            )));
        }
        if *flag == "--out" && within(work, path) {
            return Err(WeightsError::Invalid(format!(
                "--work {}: it lies inside --out {}",
                work.display(),
                path.display()
            )));
        }
    }
    Ok(())
}

/// A claimed work directory, held until this is dropped: a lock file beside the mark names the
/// holding process, so a second pull into the same directory is refused instead of writing into
/// the first one's files. A lock whose process is gone (a killed pull) is taken over.
#[derive(Debug)]
pub struct WorkLock {
    path: PathBuf,
}

impl Drop for WorkLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The lock file of a held work directory.
const LOCK: &str = ".kvrouter-pull-work.lock";

/// Takes `work` for a pull: creates it (and marks it), or accepts an empty directory (marking
/// it) or an earlier pull's; refuses anything else, naming it, and a directory another pull
/// holds.
pub fn claim(work: &Path) -> Result<WorkLock> {
    check_claimable(work)?;
    let mark = work.join(WORK_MARK);
    std::fs::write(&mark, b"").map_err(|e| WeightsError::io(&mark, e))?;
    let path = work.join(LOCK);
    for _ in 0..2 {
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
        {
            Ok(mut f) => {
                use std::io::Write;
                write!(f, "{}", std::process::id()).map_err(|e| WeightsError::io(&path, e))?;
                return Ok(WorkLock { path });
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                if holder_alive(&path) {
                    return Err(WeightsError::Invalid(format!(
                        "--work {}: another pull is using it (give each pull its own --out \
                         and --work)",
                        work.display()
                    )));
                }
                // Left by a pull that is gone: taken over.
                let _ = std::fs::remove_file(&path);
            }
            Err(e) => return Err(WeightsError::io(&path, e)),
        }
    }
    Err(WeightsError::Invalid(format!(
        "--work {}: another pull is using it",
        work.display()
    )))
}

/// Whether the process named in the lock file at `path` may still hold it: it is running
/// (`/proc/PID`; elsewhere than Linux every holder counts as running), or the file names none
/// yet and was written in the last 10 s (a holder between creating and writing it).
fn holder_alive(path: &Path) -> bool {
    if !cfg!(target_os = "linux") {
        return true;
    }
    match std::fs::read_to_string(path)
        .ok()
        .and_then(|t| t.trim().parse::<u32>().ok())
    {
        Some(pid) => Path::new(&format!("/proc/{pid}")).exists(),
        None => std::fs::metadata(path)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_none_or(|age| age < std::time::Duration::from_secs(10)),
    }
}

/// [`claim`]'s checks and creation, before the mark and the lock.
fn check_claimable(work: &Path) -> Result<()> {
    match std::fs::read_dir(work) {
        Ok(mut entries) => {
            let marked = work.join(WORK_MARK).is_file();
            if !marked && entries.next().is_some() {
                return Err(WeightsError::Invalid(format!(
                    "--work {}: the directory holds files no pull put there (no {WORK_MARK}); \
                     give a new or empty directory (a pull removes its work directory after it)",
                    work.display()
                )));
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(work).map_err(|e| WeightsError::io(work, e))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => {
            return Err(WeightsError::Invalid(format!(
                "--work {}: not a directory",
                work.display()
            )))
        }
        Err(e) => return Err(WeightsError::io(work, e)),
    }
    Ok(())
}

/// Marks `work` (created if missing) as a pull's whatever it holds: for a directory only pulls
/// write, such as a weight source's cache's `.work`.
pub(crate) fn adopt(work: &Path) -> Result<()> {
    std::fs::create_dir_all(work).map_err(|e| WeightsError::io(work, e))?;
    let mark = work.join(WORK_MARK);
    std::fs::write(&mark, b"").map_err(|e| WeightsError::io(&mark, e))
}

/// Removes a claimed work directory after a success; one without the mark (not a pull's) stays.
pub fn release(work: &Path) {
    if work.join(WORK_MARK).is_file() {
        if let Err(e) = std::fs::remove_dir_all(work) {
            tracing::warn!("removing the work directory {}: {e}", work.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_with_the_users_files_is_refused_and_kept() {
        let t = tempfile::tempdir().unwrap();
        let mine = t.path().join("mine");
        std::fs::create_dir(&mine).unwrap();
        std::fs::write(mine.join("notes.txt"), "data").unwrap();
        let e = claim(&mine).unwrap_err().to_string();
        assert!(
            e.contains("--work") && e.contains("no .kvrouter-pull-work"),
            "{e}"
        );
        release(&mine);
        assert!(mine.join("notes.txt").exists());
        // A file is not a directory.
        let e = claim(&mine.join("notes.txt")).unwrap_err().to_string();
        assert!(e.contains("not a directory"), "{e}");
    }

    #[test]
    fn new_empty_and_earlier_pulls_directories_are_claimed_and_released() {
        let t = tempfile::tempdir().unwrap();
        let new = t.path().join("a/b");
        let lock = claim(&new).unwrap();
        assert!(new.join(WORK_MARK).is_file());
        std::fs::write(new.join("partial"), "x").unwrap();
        // Held by a pull: a second one is refused.
        let e = claim(&new).unwrap_err().to_string();
        assert!(e.contains("another pull is using it"), "{e}");
        // A lock left by a pull that is gone is taken over.
        std::mem::forget(lock);
        std::fs::write(new.join(LOCK), format!("{}", u32::MAX)).unwrap();
        // An earlier pull's, with its partial files: resumed.
        drop(claim(&new).unwrap());
        assert!(!new.join(LOCK).exists());
        release(&new);
        assert!(!new.exists());
        let empty = t.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        drop(claim(&empty).unwrap());
        release(&empty);
        assert!(!empty.exists());
    }

    #[test]
    fn work_may_not_hold_the_other_paths_nor_lie_in_the_output() {
        let t = tempfile::tempdir().unwrap();
        let p = |s: &str| t.path().join(s);
        std::fs::create_dir_all(p("have")).unwrap();
        let ok = [("--out", p("out").clone()), ("--have", p("have"))];
        let others: Vec<(&str, &Path)> = ok.iter().map(|(f, q)| (*f, q.as_path())).collect();
        check_apart(&p("out.work"), &others).unwrap();
        for (work, needle) in [
            (p("out"), "holds --out"),
            (t.path().to_path_buf(), "holds --out"),
            (p("have"), "holds --have"),
            (p("out/w"), "inside --out"),
        ] {
            let e = check_apart(&work, &others).unwrap_err().to_string();
            assert!(e.contains(needle), "{work:?}: {e}");
        }
        // Two spellings of one place, and a link to it, are the same place.
        let dotted = t.path().join("have/../out");
        let e = check_apart(&dotted, &others).unwrap_err().to_string();
        assert!(e.contains("holds --out"), "{e}");
        std::os::unix::fs::symlink(p("have"), p("link")).unwrap();
        let e = check_apart(&p("link"), &others).unwrap_err().to_string();
        assert!(e.contains("holds --have"), "{e}");
    }
}
