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
}

/// `cache/vN`.
pub fn version_dir(cache: &Path, version: u64) -> PathBuf {
    cache.join(format!("v{version}"))
}

/// The newest complete version in `cache` at or below `at_most`.
pub fn newest_local(cache: &Path, at_most: u64) -> Option<(u64, PathBuf)> {
    let entries = std::fs::read_dir(cache).ok()?;
    entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let v: u64 = e.file_name().to_str()?.strip_prefix('v')?.parse().ok()?;
            let marker = checkpoint::read_marker(&e.path()).ok()??;
            (marker.version == v && v <= at_most).then(|| (v, e.path()))
        })
        .max_by_key(|(v, _)| *v)
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
    if newest_local(cache, version).is_some_and(|(v, _)| v == version) {
        return Ok(dest);
    }
    let work = cache.join(".work");
    if let Some(peer) = &source.peer {
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| WeightsError::Transfer(e.to_string()))?;
        match pull_from_peer(&client, peer, version, &dest, &work, threads).await {
            Ok(_) => return Ok(dest),
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
    let have = newest_local(cache, version).map(|(_, p)| p);
    store::pull(store, Some(version), &dest, have.as_deref(), &work, threads).await?;
    Ok(dest)
}

/// Downloads version `version` from the peer at `peer` into `out` (which must not exist),
/// resuming partial files in `work`, verifying every segment. Returns the bytes transferred.
pub async fn pull_from_peer(
    client: &reqwest::Client,
    peer: &str,
    version: u64,
    out: &Path,
    work: &Path,
    threads: usize,
) -> Result<u64> {
    let peer = peer.trim_end_matches('/');
    if out.exists() {
        return Err(WeightsError::Invalid(format!(
            "{} exists already",
            out.display()
        )));
    }
    let marker_url = format!("{peer}/v1/versions/{version}/marker");
    let response = client
        .get(&marker_url)
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
    let bytes = response
        .bytes()
        .await
        .map_err(|e| WeightsError::Transfer(e.to_string()))?;
    let marker: CheckpointManifest = serde_json::from_slice(&bytes).map_err(|e| {
        WeightsError::corrupted("__manifest__", format!("v{version}"), e.to_string())
    })?;
    if marker.version != version {
        return Err(WeightsError::Transfer(format!(
            "the peer sent v{} for v{version}",
            marker.version
        )));
    }
    let staging = work.join(format!("peer-v{version}"));
    tokio::fs::create_dir_all(&staging)
        .await
        .map_err(|e| WeightsError::io(&staging, e))?;
    let mut transferred = 0;
    for f in &marker.files {
        let dest = crate::layout::file_path(&staging, &f.name)?;
        if tokio::fs::metadata(&dest)
            .await
            .is_ok_and(|m| m.len() == f.size)
        {
            continue;
        }
        transferred += download(
            client,
            &format!("{peer}/v1/versions/{version}/files/{}", f.name),
            &dest,
        )
        .await?;
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

/// GET `url` into `dest`, resuming `dest.partial` with `Range: bytes=N-`.
async fn download(client: &reqwest::Client, url: &str, dest: &Path) -> Result<u64> {
    let partial = partial_path(dest);
    let have = tokio::fs::metadata(&partial)
        .await
        .map(|m| m.len())
        .unwrap_or(0);
    let mut request = client.get(url);
    if have > 0 {
        request = request.header(reqwest::header::RANGE, format!("bytes={have}-"));
    }
    let response = request
        .send()
        .await
        .map_err(|e| WeightsError::Transfer(format!("{url}: {e}")))?;
    let status = response.status();
    let mut file = match status.as_u16() {
        206 => {
            tokio::fs::OpenOptions::new()
                .append(true)
                .open(&partial)
                .await
        }
        200 => tokio::fs::File::create(&partial).await,
        _ => return Err(WeightsError::Transfer(format!("{url} answered {status}"))),
    }
    .map_err(|e| WeightsError::io(&partial, e))?;
    let mut n = 0;
    let mut stream = response.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| WeightsError::Transfer(format!("{url}: {e}")))?;
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
