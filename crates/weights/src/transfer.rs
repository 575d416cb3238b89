//! Getting a version onto this machine: from an in-region peer (`kvrouter weights serve`) over
//! HTTP with resumable range requests, or from the object store; verified against the marker's
//! digests before it is renamed into place. A local cache directory holds `vN/` checkpoints.

use crate::checkpoint::{self, CheckpointManifest};
use crate::error::{Result, WeightsError};
use crate::store::{self, blocking, partial_path, Store};
use futures::StreamExt;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::io::AsyncWriteExt;

/// Where a version comes from: a peer first (if any), else the object store.
#[derive(Clone, Debug, Default)]
pub struct Source {
    /// Base URL of an in-region `kvrouter weights serve`.
    pub peer: Option<String>,
    /// The object store.
    pub store: Option<Store>,
    /// Versions a cache keeps (at least 1; `None`: all). A fetch that would leave more recycles
    /// the files of the newest one it drops into the new version and deletes the others, once
    /// the new version is in place.
    pub keep: Option<usize>,
    /// Versions never recycled or deleted, whatever `keep` says: the ones engines run now (after
    /// a rollback that is not the newest).
    pub protect: Vec<u64>,
}

/// What a fetch does to the versions already in a cache that keeps `keep` of them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Retention {
    /// The version whose files the new one is written into (never the base it is applied to).
    pub(crate) recycle: Option<u64>,
    /// Versions deleted once the new one is in place.
    pub(crate) delete: Vec<u64>,
}

/// The cache holds `local` and fetches `new` starting from `have`: the `protect`ed versions and
/// the newest `keep - 1` others stay; of the rest, the newest that is not `have` is recycled,
/// and the others are deleted.
pub(crate) fn retention(
    local: &[u64],
    new: u64,
    keep: usize,
    have: Option<u64>,
    protect: &[u64],
) -> Retention {
    let mut others: Vec<u64> = local
        .iter()
        .copied()
        .filter(|&v| v != new && !protect.contains(&v))
        .collect();
    others.sort_unstable_by(|a, b| b.cmp(a));
    others.dedup();
    let mut drop = others.split_off(keep.saturating_sub(1).min(others.len()));
    let recycle = drop
        .iter()
        .position(|&v| Some(v) != have)
        .map(|i| drop.remove(i));
    Retention {
        recycle,
        delete: drop,
    }
}

/// Every complete version in `cache`, with its directory.
pub fn local_versions(cache: &Path) -> Vec<(u64, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(cache) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let v = crate::layout::version_name(e.file_name().to_str()?)?;
            let marker = checkpoint::read_marker(&e.path()).ok()??;
            (marker.version == v).then(|| (v, e.path()))
        })
        .collect()
}

/// `cache/vN`.
pub fn version_dir(cache: &Path, version: u64) -> PathBuf {
    cache.join(format!("v{version}"))
}

/// The newest complete version in `cache` at or below `at_most`.
pub fn newest_local(cache: &Path, at_most: u64) -> Option<(u64, PathBuf)> {
    newest_at_most(&local_versions(cache), at_most)
}

fn newest_at_most(local: &[(u64, PathBuf)], at_most: u64) -> Option<(u64, PathBuf)> {
    local
        .iter()
        .filter(|(v, _)| *v <= at_most)
        .max_by_key(|(v, _)| *v)
        .cloned()
}

/// Makes `cache/vN` hold version N (nothing to do when it does): from the peer, else the store
/// (moving a local older version forward by deltas where there is one).
pub async fn fetch_version(
    source: &Source,
    version: u64,
    cache: &Path,
    threads: usize,
) -> Result<PathBuf> {
    let dest = version_dir(cache, version);
    // One scan of the cache (each version's marker is read): what is here, and the newest
    // version at or below the wanted one to move forward.
    let local = local_versions(cache);
    if local.iter().any(|(v, _)| *v == version) {
        return Ok(dest);
    }
    // The cache's own work directory: always a pull's (one an older build left unmarked too).
    let work = cache.join(".work");
    crate::workdir::adopt(&work)?;
    let have = newest_at_most(&local, version);
    let plan = source.keep.map_or_else(Retention::default, |keep| {
        let versions: Vec<u64> = local.iter().map(|(v, _)| *v).collect();
        let have = have.as_ref().map(|(v, _)| *v);
        retention(&versions, version, keep.max(1), have, &source.protect)
    });
    let mut drop: Vec<PathBuf> = plan.delete.iter().map(|&v| version_dir(cache, v)).collect();
    let recycle = plan.recycle.map(|v| version_dir(cache, v));
    if let Some(peer) = &source.peer {
        let client = PeerClient::new(PEER_READ_TIMEOUT)?;
        match pull_from_peer(&client, peer, version, &dest, &work, threads).await {
            Ok(_) => {
                drop.extend(recycle);
                remove_versions(&drop).await;
                return Ok(dest);
            }
            // A peer that cannot deliver is not the end when the store can.
            Err(e) if source.store.is_some() => {
                tracing::warn!("peer {peer}: {e}; pulling version {version} from the store");
            }
            Err(e) => return Err(e),
        }
    }
    let Some(store) = &source.store else {
        return Err(WeightsError::Invalid(
            "a weight source needs a peer or a store".into(),
        ));
    };
    let have = have.map(|(_, p)| p);
    let report = store::pull_recycling(
        store,
        Some(version),
        &dest,
        have.as_deref(),
        &work,
        threads,
        recycle.as_deref(),
    )
    .await?;
    if report.recycled == 0 {
        drop.extend(recycle);
    }
    remove_versions(&drop).await;
    Ok(dest)
}

/// Whether `source` can deliver `version`, asked without fetching it: the peer
/// (`GET /v1/versions/N`, which asks its store), then the store (HEAD of the delta that makes it,
/// or of its full checkpoint's marker). `Ok(false)`: no one has it. An error: no one could be
/// asked (each request bounded by `timeout`).
pub async fn has_version(source: &Source, version: u64, timeout: Duration) -> Result<bool> {
    let mut unreachable = None;
    if let Some(peer) = &source.peer {
        let url = format!("{}/v1/versions/{version}", peer.trim_end_matches('/'));
        let answer = reqwest::Client::new()
            .get(&url)
            .timeout(timeout)
            .send()
            .await;
        match answer {
            Ok(r) if r.status().is_success() => return Ok(true),
            Ok(r) if r.status() == reqwest::StatusCode::NOT_FOUND => {}
            Ok(r) => unreachable = Some(format!("{url} answered {}", r.status())),
            Err(e) => unreachable = Some(format!("{url}: {e}")),
        }
    }
    match (&source.store, unreachable) {
        (Some(store), _) => tokio::time::timeout(timeout, store.has_version(version))
            .await
            .map_err(|_| {
                WeightsError::Transfer(format!("{}: no answer within {timeout:?}", store.url()))
            })?,
        (None, Some(why)) => Err(WeightsError::Transfer(why)),
        (None, None) => Ok(false),
    }
}

/// Deletes superseded version directories (best effort: one that cannot be deleted is only
/// disk space, and the next fetch tries again).
async fn remove_versions(dirs: &[PathBuf]) {
    for d in dirs {
        if let Err(e) = tokio::fs::remove_dir_all(d).await {
            tracing::warn!("removing the superseded version {}: {e}", d.display());
        }
    }
}

/// How long a peer may take to connect.
pub const PEER_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a transfer of a file the peer has may go without a byte before it fails (a stalled
/// peer; a slow one that keeps sending is not cut off, whatever the checkpoint's size).
pub const PEER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the peer may take to answer for a version's marker: a peer that lacks the version
/// fetches it from its store first (a whole checkpoint and its deltas over the WAN) and answers
/// when it has it, so this bounds that fetch rather than a stall.
pub const PEER_MARKER_TIMEOUT: Duration = Duration::from_secs(1800);

/// The HTTP client for peer transfers: how long a file transfer may stall, and how long the
/// peer may take to answer for a version's marker.
#[derive(Clone, Debug)]
pub struct PeerClient {
    http: reqwest::Client,
    stall: Duration,
    marker: Duration,
}

impl PeerClient {
    /// [`PEER_CONNECT_TIMEOUT`] to connect; a file's answer or its next bytes within `stall`;
    /// a marker within [`PEER_MARKER_TIMEOUT`].
    pub fn new(stall: Duration) -> Result<Self> {
        Self::with_marker_timeout(stall, PEER_MARKER_TIMEOUT)
    }

    /// As [`PeerClient::new`], the marker within `marker`.
    pub fn with_marker_timeout(stall: Duration, marker: Duration) -> Result<Self> {
        let http = reqwest::Client::builder()
            .connect_timeout(PEER_CONNECT_TIMEOUT)
            .build()
            .map_err(|e| WeightsError::Transfer(e.to_string()))?;
        Ok(Self {
            http,
            stall,
            marker,
        })
    }

    /// `fut` within the stall bound, or a transfer error naming `url`.
    async fn unstalled<T>(
        &self,
        url: &str,
        fut: impl std::future::Future<Output = T>,
    ) -> Result<T> {
        tokio::time::timeout(self.stall, fut).await.map_err(|_| {
            WeightsError::Transfer(format!(
                "{url}: no bytes for {} s (the peer stalled)",
                self.stall.as_secs_f64()
            ))
        })
    }
}

/// Downloads version `version` from the peer at `peer` into `out` (which must not exist),
/// resuming partial files in `work`, verifying every segment. Returns the bytes transferred.
pub async fn pull_from_peer(
    client: &PeerClient,
    peer: &str,
    version: u64,
    out: &Path,
    work: &Path,
    threads: usize,
) -> Result<u64> {
    let peer = peer.trim_end_matches('/');
    crate::workdir::check_apart(work, &[("--out", out)])?;
    if out.exists() {
        return Err(checkpoint::occupied(out));
    }
    let marker_url = format!("{peer}/v1/versions/{version}/marker");
    let response = client
        .http
        .get(&marker_url)
        .timeout(client.marker)
        .send()
        .await
        .map_err(|e| WeightsError::Transfer(format!("{marker_url}: {e}")))?;
    if !response.status().is_success() {
        let status = response.status();
        let body = response.text().await.unwrap_or_default();
        return Err(WeightsError::Transfer(format!(
            "{marker_url} answered {status}: {body}"
        )));
    }
    let mut bytes = Vec::new();
    let mut body = response.bytes_stream();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| WeightsError::Transfer(format!("{marker_url}: {e}")))?;
        if (bytes.len() + chunk.len()) as u64 > store::MAX_SMALL_OBJECT_BYTES {
            return Err(WeightsError::Transfer(format!(
                "{marker_url}: the marker is larger than {} bytes",
                store::MAX_SMALL_OBJECT_BYTES
            )));
        }
        bytes.extend_from_slice(&chunk);
    }
    let marker: CheckpointManifest = serde_json::from_slice(&bytes).map_err(|e| {
        WeightsError::corrupted("__manifest__", format!("v{version}"), e.to_string())
    })?;
    if marker.version != version {
        return Err(WeightsError::Transfer(format!(
            "the peer sent v{} for v{version}",
            marker.version
        )));
    }
    let _held = crate::workdir::claim(work)?;
    let staging = work.join(format!("peer-v{version}"));
    tokio::fs::create_dir_all(&staging)
        .await
        .map_err(|e| WeightsError::io(&staging, e))?;
    let mut transferred = 0;
    for f in &marker.files {
        let dest = crate::layout::output_path(&staging, &f.name)?;
        if tokio::fs::metadata(&dest)
            .await
            .is_ok_and(|m| m.len() == f.size)
        {
            continue;
        }
        transferred += download(client, &file_url(peer, version, &f.name)?, &dest, f.size).await?;
    }
    blocking({
        let staging = staging.clone();
        move || {
            checkpoint::verify(&staging, &marker, threads)?;
            checkpoint::write_marker(&staging, &marker)
        }
    })
    .await
    .inspect_err(|_| {
        let _ = std::fs::remove_dir_all(&staging);
    })?;
    tokio::fs::rename(&staging, out)
        .await
        .map_err(|e| WeightsError::io(out, e))?;
    Ok(transferred)
}

/// The URL of file `name` of `version` on `peer`, each component of the name escaped (a file
/// name may hold `%`, `#`, `?` or spaces; its `/`s stay path separators).
fn file_url(peer: &str, version: u64, name: &str) -> Result<String> {
    let mut url =
        url::Url::parse(peer).map_err(|e| WeightsError::Invalid(format!("--peer {peer}: {e}")))?;
    url.path_segments_mut()
        .map_err(|()| WeightsError::Invalid(format!("--peer {peer}: not a base URL")))?
        .pop_if_empty()
        .extend(["v1", "versions", &version.to_string(), "files"])
        .extend(name.split('/'));
    Ok(url.into())
}

/// GET `url` into `dest`, resuming `dest.partial` with `Range: bytes=N-`.
async fn download(client: &PeerClient, url: &str, dest: &Path, size: u64) -> Result<u64> {
    let partial = partial_path(dest);
    let have = tokio::fs::metadata(&partial)
        .await
        .map(|m| m.len())
        .unwrap_or(0);
    let mut request = client.http.get(url);
    if have > 0 {
        request = request.header(reqwest::header::RANGE, format!("bytes={have}-"));
    }
    let response = client
        .unstalled(url, request.send())
        .await?
        .map_err(|e| WeightsError::Transfer(format!("{url}: {e}")))?;
    let status = response.status();
    let mut file = match status.as_u16() {
        206 => store::open_partial(&partial, true).await?,
        200 => store::open_partial(&partial, false).await?,
        _ => return Err(WeightsError::Transfer(format!("{url} answered {status}"))),
    };
    let mut n = 0;
    // What the file holds before this answer's bytes: a peer that sends past the marker's size
    // is cut off (an endless body would fill the disk; the rest is refused by the digests).
    let before = if status.as_u16() == 206 { have } else { 0 };
    let mut stream = response.bytes_stream();
    while let Some(chunk) = client.unstalled(url, stream.next()).await? {
        let chunk = chunk.map_err(|e| WeightsError::Transfer(format!("{url}: {e}")))?;
        if before + n + chunk.len() as u64 > size {
            drop(file);
            let _ = tokio::fs::remove_file(&partial).await;
            return Err(WeightsError::Transfer(format!(
                "{url}: the peer sent more than the marker's {size} bytes"
            )));
        }
        file.write_all(&chunk)
            .await
            .map_err(|e| WeightsError::io(&partial, e))?;
        n += chunk.len() as u64;
    }
    file.sync_all()
        .await
        .map_err(|e| WeightsError::io(&partial, e))?;
    tokio::fs::rename(&partial, dest)
        .await
        .map_err(|e| WeightsError::io(dest, e))?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_cache_of_two_recycles_the_version_before_the_one_it_moves_forward() {
        // The engine runs v6; v7 arrives: v5 is overwritten, v6 stays as the base.
        let r = retention(&[5, 6], 7, 2, Some(6), &[]);
        assert_eq!(
            r,
            Retention {
                recycle: Some(5),
                delete: vec![]
            }
        );
        // Older leftovers beyond the one recycled go.
        let r = retention(&[2, 3, 5, 6], 7, 2, Some(6), &[]);
        assert_eq!(r.recycle, Some(5));
        assert_eq!(r.delete, vec![3, 2]);
        // Nothing to drop while the cache is not full.
        assert_eq!(retention(&[6], 7, 2, Some(6), &[]), Retention::default());
        assert_eq!(retention(&[], 7, 3, None, &[]), Retention::default());
    }

    #[test]
    fn the_base_of_the_apply_is_never_recycled() {
        // keep = 1: the base itself must go, but only after the new version is built from it.
        let r = retention(&[6], 7, 1, Some(6), &[]);
        assert_eq!(r.recycle, None);
        assert_eq!(r.delete, vec![6]);
        let r = retention(&[5, 6], 7, 1, Some(6), &[]);
        assert_eq!(r.recycle, Some(5));
        assert_eq!(r.delete, vec![6]);
    }

    #[test]
    fn a_version_an_engine_runs_is_never_recycled_nor_deleted() {
        // Rolled back to v1 while v4 is cached: fetching v5 must not write into v1's files.
        let r = retention(&[1, 4], 5, 2, Some(4), &[1]);
        assert_eq!(r, Retention::default());
        let r = retention(&[1, 3, 4], 5, 2, Some(4), &[1]);
        assert_eq!(r.recycle, Some(3));
        assert!(r.delete.is_empty());
        let r = retention(&[1, 4], 5, 1, Some(4), &[1]);
        assert_eq!((r.recycle, r.delete), (None, vec![4]));
    }

    proptest! {
        /// Against the plain statement: after the fetch the cache holds the new version and the
        /// newest `keep - 1` others and the protected ones; every other version is recycled or
        /// deleted exactly once; the base is never recycled.
        #[test]
        fn retention_keeps_the_newest(
            local in proptest::collection::btree_set(0u64..20, 0..8),
            new in 0u64..20,
            keep in 1usize..5,
            have_at in proptest::option::of(0usize..8),
            protect in proptest::collection::vec(0u64..20, 0..3),
        ) {
            let local: Vec<u64> = local.into_iter().collect();
            let have = have_at.and_then(|i| local.get(i).copied());
            let r = retention(&local, new, keep, have, &protect);
            let mut others: Vec<u64> = local
                .iter()
                .copied()
                .filter(|&v| v != new && !protect.contains(&v))
                .collect();
            others.sort_unstable();
            let stay: Vec<u64> = others.iter().rev().take(keep - 1).copied().collect();
            let mut gone: Vec<u64> = r.delete.clone();
            gone.extend(r.recycle);
            gone.sort_unstable();
            let mut want: Vec<u64> = others.iter().copied().filter(|v| !stay.contains(v)).collect();
            want.sort_unstable();
            prop_assert_eq!(gone, want);
            prop_assert!(r.recycle.is_none() || r.recycle != have);
            if let Some(v) = r.recycle {
                prop_assert!(r.delete.iter().all(|&d| d < v || Some(d) == have));
            }
        }
    }
}
