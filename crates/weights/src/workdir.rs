//! A pull's work directory (`--work`): partial downloads and intermediate versions, removed
//! after a success. Removing a directory the user had is data loss, so a pull claims one only
//! when it is new, empty, or an earlier pull's (marked with [`WORK_MARK`]), and never one that
//! is, holds or lies inside the pull's other paths. A claimed directory is held by an advisory
//! lock (`flock`, released by the kernel when its holder exits, whatever its PID namespace), so a
//! second pull into it is refused, and only its holder removes it.

use crate::error::{Result, WeightsError};
use rustix::fs::{flock, FlockOperation};
use std::path::{Component, Path, PathBuf};

/// The file that marks a directory as a pull's work directory.
pub const WORK_MARK: &str = ".kvrouter-pull-work";

/// The lock file of a work directory (locked, never removed while the directory is in use).
pub const WORK_LOCK: &str = ".kvrouter-pull-work.lock";

/// `path` made absolute, with its longest existing ancestor's symbolic links resolved (the rest,
/// not there yet, appended as given), so two spellings of one place compare equal. Paths with a
/// `..` component are refused before this is asked ([`no_parent_steps`]).
fn resolved(path: &Path) -> PathBuf {
    let mut absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    // Links followed by hand (one that names nothing yet cannot be canonicalized), at most as
    // many as the kernel follows.
    for _ in 0..40 {
        let mut head = absolute.as_path();
        let mut tail = Vec::new();
        let dangling = loop {
            if let Ok(real) = head.canonicalize() {
                return tail.iter().rev().fold(real, |p, part| p.join(part));
            }
            if head.symlink_metadata().is_ok_and(|m| m.is_symlink()) {
                break head;
            }
            match (head.parent(), head.file_name()) {
                (Some(parent), Some(name)) => {
                    tail.push(name.to_owned());
                    head = parent;
                }
                _ => return absolute,
            }
        };
        let Ok(target) = std::fs::read_link(dangling) else {
            return absolute;
        };
        let base = dangling.parent().unwrap_or(Path::new("/"));
        absolute = tail
            .iter()
            .rev()
            .fold(base.join(target), |p, part| p.join(part));
    }
    absolute
}

/// Whether `inner` is `outer` or lies inside it (symbolic links resolved as far as the paths exist).
pub(crate) fn within(inner: &Path, outer: &Path) -> bool {
    resolved(inner).starts_with(resolved(outer))
}

/// Refuses a directory to be removed later (`flag`'s `path`) that is spelled with `..`: through
/// a folder not there yet, `missing/../data` names `data` only once `missing` is created, so no
/// check made before can tell what it names.
pub(crate) fn no_parent_steps(flag: &str, path: &Path) -> Result<()> {
    if path.components().any(|c| c == Component::ParentDir) {
        return Err(WeightsError::Invalid(format!(
            "{flag} {}: give it without `..` (it is removed after use)",
            path.display()
        )));
    }
    Ok(())
}

/// Checks `work` against the pull's other paths (`(flag, path)`) before anything is written: it
/// must not be, hold or lie inside any of them (a success removes it, and a failure leaves it
/// where a reader of the other would find it).
pub fn check_apart(work: &Path, others: &[(&str, &Path)]) -> Result<()> {
    no_parent_steps("--work", work)?;
    for (flag, path) in others {
        if within(path, work) {
            return Err(WeightsError::Invalid(format!(
                "--work {}: it holds {flag} {} (the work directory is removed after a pull)",
                work.display(),
                path.display()
            )));
        }
        if within(work, path) {
            return Err(WeightsError::Invalid(format!(
                "--work {}: it lies inside {flag} {}",
                work.display(),
                path.display()
            )));
        }
    }
    Ok(())
}

/// A claimed work directory, held until this is dropped.
#[derive(Debug)]
pub struct WorkLock {
    _lock: std::fs::File,
    created: bool,
}

impl WorkLock {
    /// Whether this pull created the directory (a refused pull removes only such a one).
    pub fn created(&self) -> bool {
        self.created
    }
}

/// The open flag that refuses to follow a symbolic link at the path's last component: a link
/// planted in a work directory would have a write land on the file it names.
pub(crate) const NO_FOLLOW: i32 = rustix::fs::OFlags::NOFOLLOW.bits() as i32;

/// An open with [`NO_FOLLOW`] that failed: a link found there is named as one.
pub(crate) fn no_follow_error(path: &Path, e: std::io::Error) -> WeightsError {
    match e.raw_os_error() {
        Some(code) if code == rustix::io::Errno::LOOP.raw_os_error() => WeightsError::Invalid(
            format!("{}: a symbolic link (not written through)", path.display()),
        ),
        _ => WeightsError::io(path, e),
    }
}

/// Opens `path` to write, never through a symbolic link.
fn open_no_follow(path: &Path, truncate: bool) -> Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(truncate)
        .write(true)
        .custom_flags(NO_FOLLOW)
        .open(path)
        .map_err(|e| no_follow_error(path, e))
}

/// Writes the (empty) mark in `work`.
fn mark(work: &Path) -> Result<()> {
    open_no_follow(&work.join(WORK_MARK), true).map(drop)
}

/// Opens and locks (without waiting) `work`'s lock file: `None` when another process holds it.
fn lock(work: &Path) -> Result<Option<std::fs::File>> {
    let path = work.join(WORK_LOCK);
    let file = open_no_follow(&path, false)?;
    match flock(&file, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(Some(file)),
        Err(e) if e == rustix::io::Errno::WOULDBLOCK => Ok(None),
        Err(e) => Err(WeightsError::io(&path, e.into())),
    }
}

/// Takes `work` for a pull: creates it (and marks it), or accepts an empty directory (marking
/// it) or an earlier pull's; refuses anything else, naming it, and a directory another pull
/// holds.
pub fn claim(work: &Path) -> Result<WorkLock> {
    no_parent_steps("--work", work)?;
    refuse_link("--work", work)?;
    let created = check_claimable(work)?;
    let Some(file) = lock(work)? else {
        return Err(WeightsError::Invalid(format!(
            "--work {}: another pull is using it (its lock {WORK_LOCK} is held; give each pull its \
             own --out and --work)",
            work.display()
        )));
    };
    // What an earlier pull left is ours to resume, unless something in it was planted: a link
    // (a download would be written where it points) or a file with other hard links (it would
    // be truncated or appended to).
    check_contents(work, 0)?;
    mark(work)?;
    Ok(WorkLock {
        _lock: file,
        created,
    })
}

/// Refuses a work directory holding a symbolic link or a file with other hard links, at any
/// depth (a pull's own entries are neither).
fn check_contents(dir: &Path, depth: usize) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    if depth > crate::layout::MAX_DEPTH + 2 {
        return Err(WeightsError::Invalid(format!(
            "{}: nested deeper than any pull's work directory",
            dir.display()
        )));
    }
    for entry in std::fs::read_dir(dir).map_err(|e| WeightsError::io(dir, e))? {
        let entry = entry.map_err(|e| WeightsError::io(dir, e))?;
        let path = entry.path();
        let meta = path
            .symlink_metadata()
            .map_err(|e| WeightsError::io(&path, e))?;
        if meta.is_symlink() {
            return Err(WeightsError::Invalid(format!(
                "{}: a symbolic link in the work directory (a pull never makes one; remove it)",
                path.display()
            )));
        }
        if meta.is_file() && meta.nlink() > 1 {
            return Err(WeightsError::Invalid(format!(
                "{}: a file with other hard links in the work directory (a pull never makes \
                 one; remove it)",
                path.display()
            )));
        }
        if meta.is_dir() {
            check_contents(&path, depth + 1)?;
        }
    }
    Ok(())
}

/// [`claim`]'s checks and creation, before the lock and the mark: whether it created `work`.
fn check_claimable(work: &Path) -> Result<bool> {
    match std::fs::read_dir(work) {
        Ok(entries) => {
            // The mark itself, not a link named like it.
            let marked = work
                .join(WORK_MARK)
                .symlink_metadata()
                .is_ok_and(|m| m.is_file());
            let foreign = entries
                .filter_map(|e| e.ok())
                .any(|e| e.file_name() != WORK_LOCK && e.file_name() != WORK_MARK);
            if !marked && foreign {
                return Err(WeightsError::Invalid(format!(
                    "--work {}: the directory holds files no pull put there (no {WORK_MARK}); \
                     give a new or empty directory (a pull removes its work directory after it)",
                    work.display()
                )));
            }
            Ok(false)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(work).map_err(|e| WeightsError::io(work, e))?;
            Ok(true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => Err(WeightsError::Invalid(
            format!("--work {}: not a directory", work.display()),
        )),
        Err(e) => Err(WeightsError::io(work, e)),
    }
}

/// Marks `work` (created if missing) as a pull's whatever it holds: for a directory only pulls
/// write, such as a weight source's cache's `.work`.
pub(crate) fn adopt(work: &Path) -> Result<()> {
    refuse_link("--work", work)?;
    std::fs::create_dir_all(work).map_err(|e| WeightsError::io(work, e))?;
    mark(work)
}

/// Refuses a directory to be removed later (`flag`'s `path`) that is a symbolic link: removing
/// it would take the link and leave what it names full.
pub(crate) fn refuse_link(flag: &str, path: &Path) -> Result<()> {
    if path.symlink_metadata().is_ok_and(|m| m.is_symlink()) {
        return Err(WeightsError::Invalid(format!(
            "{flag} {}: a symbolic link; give the directory itself (it is removed after use)",
            path.display()
        )));
    }
    Ok(())
}

/// Removes a pull's work directory after its success, holding its lock while it does: one
/// without the mark (not a pull's), or that another pull holds, stays.
pub fn release(work: &Path) {
    let marked = work
        .join(WORK_MARK)
        .symlink_metadata()
        .is_ok_and(|m| m.is_file());
    let linked = work.symlink_metadata().is_ok_and(|m| m.is_symlink());
    if !marked || linked {
        return;
    }
    match lock(work) {
        Ok(Some(_held)) => {
            if let Err(e) = std::fs::remove_dir_all(work) {
                tracing::warn!("removing the work directory {}: {e}", work.display());
            }
        }
        Ok(None) => tracing::info!(
            "the work directory {} is in use by another pull: left",
            work.display()
        ),
        Err(e) => tracing::warn!("the work directory {}: {e}", work.display()),
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
        assert!(lock.created() && new.join(WORK_MARK).is_file());
        std::fs::write(new.join("partial"), "x").unwrap();
        // Held by a pull: a second one is refused, and cannot remove it.
        let e = claim(&new).unwrap_err().to_string();
        assert!(e.contains("another pull is using it"), "{e}");
        release(&new);
        assert!(new.join("partial").exists());
        // The lock goes with its holder (here its file; a process that exits the same way).
        drop(lock);
        // An earlier pull's, with its partial files: resumed (not created by this pull).
        let again = claim(&new).unwrap();
        assert!(!again.created());
        drop(again);
        release(&new);
        assert!(!new.exists());
        let empty = t.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        drop(claim(&empty).unwrap());
        release(&empty);
        assert!(!empty.exists());
        // Spelled through a folder not there yet, a path names nothing checkable: refused.
        std::fs::create_dir(t.path().join("data")).unwrap();
        std::fs::write(t.path().join("data/notes.txt"), "x").unwrap();
        let e = claim(&t.path().join("missing/../data"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("without `..`"), "{e}");
        assert!(!t.path().join("missing").exists() && t.path().join("data/notes.txt").exists());
    }

    #[test]
    fn a_caches_work_directory_that_is_a_link_is_refused_before_anything_is_marked() {
        let t = tempfile::tempdir().unwrap();
        let user = t.path().join("user");
        std::fs::create_dir(&user).unwrap();
        std::os::unix::fs::symlink(&user, t.path().join(".work")).unwrap();
        let e = adopt(&t.path().join(".work")).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        assert_eq!(std::fs::read_dir(&user).unwrap().count(), 0);
    }

    #[test]
    fn work_may_not_hold_nor_lie_in_the_other_paths() {
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
            (p("have/tmp"), "inside --have"),
            (p("have/../out"), "without `..`"),
        ] {
            let e = check_apart(&work, &others).unwrap_err().to_string();
            assert!(e.contains(needle), "{work:?}: {e}");
        }
        std::os::unix::fs::symlink(p("have"), p("link")).unwrap();
        let e = check_apart(&p("link"), &others).unwrap_err().to_string();
        assert!(e.contains("holds --have"), "{e}");
        // A link to a directory not made yet: `--out wl/o` lies in `--work W` once W exists.
        std::os::unix::fs::symlink(p("W"), p("wl")).unwrap();
        let out = p("wl/o");
        let e = check_apart(&p("W"), &[("--out", out.as_path())])
            .unwrap_err()
            .to_string();
        assert!(e.contains("holds --out"), "{e}");
    }
}
