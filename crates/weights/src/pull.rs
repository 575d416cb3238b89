//! `pull`: a version from object storage onto this machine. The chain is walked from a local copy
//! already on it (or the nearest full checkpoint at or below the wanted version), one delta at a
//! time, each verified. With a directory to recycle, every applied delta overwrites the files of
//! a version no longer needed (the given one first, then each superseded intermediate) instead of
//! allocating new pages (see `apply_recycling`).

use crate::checkpoint::{self, CheckpointManifest};
use crate::error::{Result, WeightsError};
use crate::layout::MARKER;
use crate::store::{blocking, copy_checkpoint, transfer, Store};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// What `pull` did.
#[derive(Clone, Debug, Serialize)]
pub struct PullReport {
    /// The version now in `out`.
    pub version: u64,
    /// Where the chain started: a full checkpoint downloaded, or the local copy given.
    pub started_from: u64,
    /// Whether a full checkpoint was downloaded.
    pub downloaded_full: bool,
    /// Deltas downloaded and applied.
    pub deltas: u64,
    /// Deltas applied into the files of a recycled directory.
    pub recycled: u64,
    /// Object-store read requests.
    pub store_reads: u64,
}

/// Pulls `version` (default: `latest`) into `out` (which must not exist), starting from `have`
/// (a local checkpoint with a marker) when it is on the chain. `work` holds downloads and
/// intermediate versions (resumable: a rerun after a failure in transfer continues partial
/// downloads). A pull refused for its arguments ([`WeightsError::is_refusal`]: `have` is not the
/// base the chain needs, `recycle` may not be overwritten, `out` exists) removes `work` if it
/// created it: a rerun with the same arguments would fail the same way. A `work` that was
/// there before is the caller's and stays. `work` must be new, empty or an earlier pull's, and
/// may not be or hold `out`, `have`, `recycle` or a `file://` store, nor lie inside `out`
/// ([`crate::workdir`]).
pub async fn pull(
    store: &Store,
    version: Option<u64>,
    out: &Path,
    have: Option<&Path>,
    work: &Path,
    threads: usize,
) -> Result<PullReport> {
    pull_recycling(store, version, out, have, work, threads, None).await
}

/// [`pull`], applying the first delta into the files of `recycle` (an older version directory
/// on the same file system that neither is nor holds `have`, `out` or `work`), and each later
/// one into the intermediate version it supersedes. `recycle` is consumed once the first apply
/// starts (as by `apply_recycling`, which checks the whole delta first); it is left alone when
/// no delta is applied (a full download, or `have` is the wanted version) or a check or
/// download fails before that.
pub async fn pull_recycling(
    store: &Store,
    version: Option<u64>,
    out: &Path,
    have: Option<&Path>,
    work: &Path,
    threads: usize,
    recycle: Option<&Path>,
) -> Result<PullReport> {
    let store_dir = store.local_dir();
    let mut others = vec![("--out", out)];
    others.extend(have.map(|h| ("--have", h)));
    others.extend(recycle.map(|r| ("--recycle", r)));
    others.extend(store_dir.as_deref().map(|d| ("--store", d)));
    crate::workdir::check_apart(work, &others)?;
    pull_into(store, version, out, have, work, threads, recycle).await
}

async fn pull_into(
    store: &Store,
    version: Option<u64>,
    out: &Path,
    have: Option<&Path>,
    work: &Path,
    threads: usize,
    recycle: Option<&Path>,
) -> Result<PullReport> {
    if let Some(old) = recycle {
        let mut spare = vec![out, work];
        spare.extend(have);
        crate::apply::check_recycle(old, out, &spare)?;
    }
    let reads_before = store.reads();
    // `latest` is written last when a version is published: a version past it is not (or not
    // yet wholly) there, and is refused before anything is downloaded.
    let latest = store.latest().await?;
    let target = match (version, latest) {
        (Some(v), Some(l)) if v <= l => v,
        (Some(v), Some(l)) => {
            return Err(WeightsError::Missing(format!(
                "--version {v}: the store's latest version is v{l} (a later one is not published)"
            )))
        }
        (Some(v), None) => {
            return Err(WeightsError::Missing(format!(
                "--version {v}: the store has no published version (no `latest`)"
            )))
        }
        (None, Some(l)) => l,
        (None, None) => return Err(transfer("the store has no `latest`")),
    };
    if out.exists() {
        return Err(checkpoint::occupied(out));
    }
    let have_version = match have {
        Some(dir) => Some(
            checkpoint::read_marker(dir)?
                .ok_or_else(|| {
                    WeightsError::Invalid(format!(
                        "--have {}: no {MARKER} there (not a checkpoint directory)",
                        dir.display()
                    ))
                })?
                .version,
        ),
        None => None,
    };
    let fulls = store.full_versions().await?;
    let links = store.delta_links().await?;
    let starts = chain_starts(have.zip(have_version), &fulls, &links, target)?;
    let held = crate::workdir::claim(work)?;
    let result = walk_chain(store, &starts, target, out, work, threads, recycle).await;
    if result.as_ref().is_err_and(WeightsError::is_refusal) && held.created() {
        // Refused for its arguments (a rerun fails the same way): the directory this pull made
        // goes, while its lock is still held.
        if let Err(e) = tokio::fs::remove_dir_all(work).await {
            tracing::warn!("removing {} after a refused pull: {e}", work.display());
        }
    }
    drop(held);
    let (started_from, downloaded_full, deltas, recycled) = result?;
    Ok(PullReport {
        version: target,
        started_from,
        downloaded_full,
        deltas,
        recycled,
        store_reads: store.reads() - reads_before,
    })
}

/// Walks the chain from the first start that can be had up to `target` into `out`: where it
/// started, whether a full checkpoint was downloaded, deltas applied and recycled.
async fn walk_chain(
    store: &Store,
    starts: &[Start<'_>],
    target: u64,
    out: &Path,
    work: &Path,
    threads: usize,
    recycle: Option<&Path>,
) -> Result<(u64, bool, u64, u64)> {
    let (mut current, mut at, downloaded_full) = start_chain(store, starts, work, threads).await?;
    let started_from = at;
    let (mut deltas, mut recycled) = (0, 0);
    let mut spare = recycle.map(Path::to_path_buf);
    while at < target {
        let rel = format!("delta/v{at}-v{}/delta.kvwd", at + 1);
        let local = work.join(format!("delta-v{at}-v{}.kvwd", at + 1));
        store.download(&rel, &local).await?;
        let next = work.join(format!("v{}", at + 1));
        if next.exists() {
            tokio::fs::remove_dir_all(&next)
                .await
                .map_err(|e| WeightsError::io(&next, e))?;
        }
        let reuse = spare.take();
        recycled += u64::from(reuse.is_some());
        let built = blocking({
            let (current, local, next) = (current.clone(), local.clone(), next.clone());
            move || {
                crate::apply::apply_recycling(&current, &local, &next, threads, reuse.as_deref())
            }
        })
        .await?;
        if built.version != at + 1 {
            // A delta filed under the wrong name: what it builds is not the version wanted.
            let _ = tokio::fs::remove_dir_all(&next).await;
            let _ = tokio::fs::remove_file(&local).await;
            return Err(WeightsError::corrupted(
                "__manifest__",
                format!("v{}", at + 1),
                format!("{rel} builds v{}", built.version),
            ));
        }
        let _ = tokio::fs::remove_file(&local).await;
        if current.starts_with(work) {
            // Superseded: the next delta overwrites its files.
            spare = Some(current);
        }
        current = next;
        at += 1;
        deltas += 1;
    }
    if let Some(s) = spare.filter(|s| s.starts_with(work)) {
        let _ = tokio::fs::remove_dir_all(&s).await;
    }
    if current.starts_with(work) {
        tokio::fs::rename(&current, out)
            .await
            .map_err(|e| WeightsError::io(out, e))?;
    } else {
        copy_checkpoint(&current, out).await?;
    }
    Ok((started_from, downloaded_full, deltas, recycled))
}

/// Where a pull's chain starts: the local copy given (`--have`, its version) or a full
/// checkpoint downloaded from the store.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Start<'a> {
    Local(&'a Path, u64),
    Full(u64),
}

/// The starts from which every delta up to `target` is in the store (`links`), best first: the
/// local copy (cheaper to move forward than a download), then each full checkpoint at or below
/// `target`, newest first (a later one whose upload turns out incomplete gives way to the next).
/// None: an error naming the first missing delta of each way tried.
fn chain_starts<'a>(
    local: Option<(&'a Path, u64)>,
    fulls: &[u64],
    links: &std::collections::BTreeSet<(u64, u64)>,
    target: u64,
) -> Result<Vec<Start<'a>>> {
    let gap = |from: u64| (from..target).find(|&v| !links.contains(&(v, v + 1)));
    let mut starts = Vec::new();
    let mut gaps = Vec::new();
    if let Some((dir, h)) = local.filter(|&(_, h)| h <= target) {
        match gap(h) {
            None => starts.push(Start::Local(dir, h)),
            Some(v) => gaps.push(format!("from --have v{h}, delta/v{v}-v{}", v + 1)),
        }
    }
    for &f in fulls.iter().rev().filter(|&&f| f <= target) {
        match gap(f) {
            None => starts.push(Start::Full(f)),
            Some(v) => gaps.push(format!("from base/v{f}, delta/v{v}-v{}", v + 1)),
        }
    }
    if !starts.is_empty() {
        return Ok(starts);
    }
    if fulls.iter().all(|&f| f > target) {
        let oldest = fulls
            .first()
            .map_or("it has none".to_owned(), |v| format!("the oldest is v{v}"));
        let have = match local {
            Some((_, h)) if h > target => format!("; --have is v{h}, past it"),
            _ => String::new(),
        };
        if gaps.is_empty() {
            return Err(WeightsError::Missing(format!(
                "no full checkpoint at or below v{target} in the store ({oldest}){have}"
            )));
        }
    }
    Err(WeightsError::Missing(format!(
        "no way to v{target} in the store: {} is missing",
        gaps.join("; ")
    )))
}

/// Starts the chain from the first of `starts` that can be had: a full checkpoint whose upload
/// is incomplete (no marker) gives way to the next. Answers the start's directory, its version
/// and whether it was downloaded.
async fn start_chain(
    store: &Store,
    starts: &[Start<'_>],
    work: &Path,
    threads: usize,
) -> Result<(PathBuf, u64, bool)> {
    let mut incomplete = None;
    for start in starts {
        match *start {
            Start::Local(dir, h) => return Ok((dir.to_path_buf(), h, false)),
            Start::Full(f) => match download_full(store, f, work, threads).await {
                Ok(dir) => return Ok((dir, f, true)),
                Err(WeightsError::Missing(why)) => {
                    tracing::warn!("{why}; trying an older start");
                    incomplete = Some(why);
                }
                Err(e) => return Err(e),
            },
        }
    }
    Err(WeightsError::Missing(
        incomplete.unwrap_or_else(|| "no start for the chain".into()),
    ))
}

async fn download_full(
    store: &Store,
    version: u64,
    work: &Path,
    threads: usize,
) -> Result<PathBuf> {
    let dir = work.join(format!("base-v{version}"));
    let bytes = store
        .get_bytes(&format!("base/v{version}/{MARKER}"))
        .await?
        .ok_or_else(|| {
            WeightsError::Missing(format!(
                "base/v{version} has no {MARKER} (incomplete upload)"
            ))
        })?;
    let marker: CheckpointManifest = serde_json::from_slice(&bytes).map_err(|e| {
        WeightsError::corrupted("__manifest__", format!("v{version}"), e.to_string())
    })?;
    if marker.version != version {
        return Err(WeightsError::corrupted(
            "__manifest__",
            format!("v{version}"),
            format!(
                "base/v{version}/{MARKER} is the marker of v{}",
                marker.version
            ),
        ));
    }
    tokio::fs::create_dir_all(&dir)
        .await
        .map_err(|e| WeightsError::io(&dir, e))?;
    for f in &marker.files {
        let dest = crate::layout::output_path(&dir, &f.name)?;
        let complete = tokio::fs::metadata(&dest)
            .await
            .map(|m| m.len() == f.size)
            .unwrap_or(false);
        if !complete {
            store
                .download(&format!("base/v{version}/{}", f.name), &dest)
                .await?;
        }
    }
    let verified = blocking({
        let dir = dir.clone();
        move || {
            checkpoint::verify(&dir, &marker, threads)?;
            checkpoint::write_marker(&dir, &marker)
        }
    })
    .await;
    if let Err(e @ WeightsError::Corrupted { .. }) = verified {
        // A file of the right size but wrong bytes would otherwise be kept (it looks complete)
        // and fail every later pull the same way: the next pull downloads the version afresh.
        let _ = tokio::fs::remove_dir_all(&dir).await;
        return Err(e);
    }
    verified?;
    Ok(dir)
}
