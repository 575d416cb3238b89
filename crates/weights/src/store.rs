//! Versions in object storage (any `object_store` backend: `file:///…`, `s3://bucket/prefix`):
//!
//! ```text
//! PREFIX/base/vK/<files>, PREFIX/base/vK/weights.json   full checkpoints (marker uploaded last)
//! PREFIX/delta/vK-vK+1/delta.kvwd                       one delta per step
//! PREFIX/delta/vK-vK+1/weights.json                      the marker of vK+1 (after the delta)
//! PREFIX/latest                                         {"version": N}, written last
//! ```
//!
//! `publish` uploads a step (a delta against the previous version, which must be the store's
//! latest and the bytes it published, and a full checkpoint every `full_every` versions); `pull`
//! walks the chain from a local copy already on it, else the newest full checkpoint at or below
//! the wanted version from which every delta is there (one LIST of `delta/` tells), downloading
//! with resumable range requests and verifying everything, the versions built included. Every read request (GET, ranged GET, HEAD, LIST) is counted.

use crate::checkpoint;
use crate::diff;
use crate::error::{Result, WeightsError};
use crate::layout::{version_name, MARKER};
pub use crate::publish::{publish, PublishReport};
pub use crate::pull::{pull, pull_recycling, PullReport};
use futures::StreamExt;
use object_store::path::Path as ObjPath;
use object_store::{GetOptions, GetRange, ObjectStore, PutPayload, WriteMultipart};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::io::AsyncWriteExt;

/// Upload part size (and the most a single upload buffers per part).
const PART_BYTES: usize = 8 << 20;
/// Parts in flight per upload.
const PARTS_IN_FLIGHT: usize = 4;

/// The largest small object read into memory (a version marker, `latest`): a marker lists a
/// digest per segment, tens of MiB for the largest checkpoints. A store or peer that sends more
/// fails the read instead of filling memory.
pub const MAX_SMALL_OBJECT_BYTES: u64 = 128 << 20;

/// An object store under a prefix, counting reads.
#[derive(Clone)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    prefix: ObjPath,
    reads: Arc<AtomicU64>,
    url: String,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Store({})", self.url)
    }
}

pub(crate) fn transfer(e: impl std::fmt::Display) -> WeightsError {
    WeightsError::Transfer(e.to_string())
}

impl Store {
    /// Opens `url` (`file:///abs/dir`, `s3://bucket/prefix`, …) with backend options (for S3:
    /// `aws_endpoint`, `aws_region`, `aws_access_key_id`, `aws_secret_access_key`,
    /// `aws_allow_http`, …; nothing is read from the environment; without keys the S3 client asks the
    /// instance metadata service for an IAM role's).
    ///
    /// Refused: a scheme other than `file` and `s3` (`memory://` would take a publish and lose
    /// it at exit), and an option the backend does not know (the library would drop a misspelt
    /// `aws_endpont` silently and talk to AWS instead).
    pub fn open(url: &str, options: &[(String, String)]) -> Result<Store> {
        let parsed = url::Url::parse(url)
            .map_err(|e| WeightsError::Invalid(format!("--store {url}: {e}")))?;
        match parsed.scheme() {
            "file" => {
                if let Some((key, _)) = options.first() {
                    return Err(WeightsError::Invalid(format!(
                        "--store-option {key}: a file:// store takes no options"
                    )));
                }
            }
            "s3" | "s3a" => {
                for (key, _) in options {
                    key.parse::<object_store::aws::AmazonS3ConfigKey>()
                        .map_err(|_| {
                            WeightsError::Invalid(format!(
                                "--store-option {key}: not an S3 option (aws_endpoint, \
                                 aws_region, aws_access_key_id, aws_secret_access_key, \
                                 aws_allow_http, ...)"
                            ))
                        })?;
                }
            }
            other => {
                return Err(WeightsError::Invalid(format!(
                    "--store {url}: scheme {other}:// is not supported (file:// or s3://)"
                )))
            }
        }
        let (store, prefix) = object_store::parse_url_opts(
            &parsed,
            options.iter().map(|(k, v)| (k.as_str(), v.clone())),
        )
        .map_err(|e| WeightsError::Invalid(format!("--store {url}: {e}")))?;
        Ok(Store {
            inner: Arc::from(store),
            prefix,
            reads: Arc::new(AtomicU64::new(0)),
            url: url.into(),
        })
    }

    /// The local directory of a `file://` store (`None` for any other).
    pub fn local_dir(&self) -> Option<std::path::PathBuf> {
        let parsed = url::Url::parse(&self.url).ok()?;
        (parsed.scheme() == "file")
            .then(|| parsed.to_file_path().ok())
            .flatten()
    }

    /// Read requests made so far.
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }

    fn key(&self, rel: &str) -> ObjPath {
        rel.split('/')
            .fold(self.prefix.clone(), |p, part| p.child(part))
    }

    fn read(&self) {
        self.reads.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) async fn put_bytes(&self, rel: &str, bytes: Vec<u8>) -> Result<()> {
        self.inner
            .put(&self.key(rel), PutPayload::from(bytes))
            .await
            .map_err(transfer)?;
        Ok(())
    }

    /// Uploads a local file in parts (memory: `PARTS_IN_FLIGHT × PART_BYTES`).
    pub(crate) async fn put_file(&self, rel: &str, local: &Path) -> Result<()> {
        let mut file = tokio::fs::File::open(local)
            .await
            .map_err(|e| WeightsError::io(local, e))?;
        let size = file
            .metadata()
            .await
            .map_err(|e| WeightsError::io(local, e))?
            .len();
        if size <= PART_BYTES as u64 {
            let bytes = tokio::fs::read(local)
                .await
                .map_err(|e| WeightsError::io(local, e))?;
            return self.put_bytes(rel, bytes).await;
        }
        let upload = self
            .inner
            .put_multipart(&self.key(rel))
            .await
            .map_err(transfer)?;
        let mut writer = WriteMultipart::new_with_chunk_size(upload, PART_BYTES);
        let mut buf = vec![0u8; PART_BYTES];
        loop {
            let n = tokio::io::AsyncReadExt::read(&mut file, &mut buf)
                .await
                .map_err(|e| WeightsError::io(local, e))?;
            if n == 0 {
                break;
            }
            writer
                .wait_for_capacity(PARTS_IN_FLIGHT)
                .await
                .map_err(transfer)?;
            writer.write(&buf[..n]);
        }
        writer.finish().await.map_err(transfer)?;
        Ok(())
    }

    /// The whole object, or `None` when there is none.
    pub(crate) async fn get_bytes(&self, rel: &str) -> Result<Option<bytes::Bytes>> {
        self.read();
        match self.inner.get(&self.key(rel)).await {
            Ok(r) => {
                let too_big = || {
                    transfer(format!(
                        "{rel}: larger than {MAX_SMALL_OBJECT_BYTES} bytes (not a marker)"
                    ))
                };
                if r.meta.size > MAX_SMALL_OBJECT_BYTES {
                    return Err(too_big());
                }
                let mut body = Vec::with_capacity(r.meta.size as usize);
                let mut stream = r.into_stream();
                while let Some(chunk) = stream.next().await {
                    let chunk = chunk.map_err(transfer)?;
                    if (body.len() + chunk.len()) as u64 > MAX_SMALL_OBJECT_BYTES {
                        return Err(too_big());
                    }
                    body.extend_from_slice(&chunk);
                }
                Ok(Some(body.into()))
            }
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(transfer(e)),
        }
    }

    /// Downloads `rel` to `dest`, resuming from `dest.partial` with a range request.
    pub async fn download(&self, rel: &str, dest: &Path) -> Result<()> {
        let partial = partial_path(dest);
        let have = tokio::fs::metadata(&partial)
            .await
            .map(|m| m.len())
            .unwrap_or(0);
        let key = self.key(rel);
        let mut opts = GetOptions::default();
        if have > 0 {
            self.read();
            let size = self.inner.head(&key).await.map_err(transfer)?.size;
            if have == size {
                return tokio::fs::rename(&partial, dest)
                    .await
                    .map_err(|e| WeightsError::io(dest, e));
            }
            if have < size {
                opts.range = Some(GetRange::Offset(have));
            }
        }
        let resume = opts.range.is_some();
        self.read();
        let result = self.inner.get_opts(&key, opts).await.map_err(|e| match e {
            object_store::Error::NotFound { .. } => {
                WeightsError::Missing(format!("{rel} is not in the store {}", self.url))
            }
            e => transfer(format!("{rel}: {e}")),
        })?;
        let mut file = open_partial(&partial, resume).await?;
        let mut stream = result.into_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| transfer(format!("{rel}: {e}")))?;
            file.write_all(&chunk)
                .await
                .map_err(|e| WeightsError::io(&partial, e))?;
        }
        file.sync_all()
            .await
            .map_err(|e| WeightsError::io(&partial, e))?;
        tokio::fs::rename(&partial, dest)
            .await
            .map_err(|e| WeightsError::io(dest, e))
    }

    /// Whether the store holds `version`: a delta that produces it, or a complete full
    /// checkpoint of it (one or two HEAD requests; the chain before it is not walked).
    pub async fn has_version(&self, version: u64) -> Result<bool> {
        if let Some(prev) = version.checked_sub(1) {
            if self
                .exists(&format!("delta/v{prev}-v{version}/delta.kvwd"))
                .await?
            {
                return Ok(true);
            }
        }
        self.exists(&format!("base/v{version}/{MARKER}")).await
    }

    async fn exists(&self, rel: &str) -> Result<bool> {
        self.read();
        match self.inner.head(&self.key(rel)).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(transfer(format!("{rel}: {e}"))),
        }
    }

    /// The URL it was opened with.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The versions with a complete full checkpoint.
    pub async fn full_versions(&self) -> Result<Vec<u64>> {
        self.read();
        let listed = self
            .inner
            .list_with_delimiter(Some(&self.key("base")))
            .await
            .map_err(transfer)?;
        let mut out: Vec<u64> = listed
            .common_prefixes
            .iter()
            .filter_map(|p| p.filename().and_then(version_name))
            .collect();
        out.sort_unstable();
        Ok(out)
    }

    /// The marker the store holds of `version`: its full checkpoint's, else the one published
    /// beside the delta that builds it (`None`: neither, e.g. a store written before markers
    /// were kept beside deltas).
    pub async fn version_marker(
        &self,
        version: u64,
    ) -> Result<Option<checkpoint::CheckpointManifest>> {
        let mut places = vec![format!("base/v{version}/{MARKER}")];
        if let Some(p) = version.checked_sub(1) {
            places.push(format!("delta/v{p}-v{version}/{MARKER}"));
        }
        for rel in places {
            if let Some(bytes) = self.get_bytes(&rel).await? {
                let m = serde_json::from_slice(&bytes).map_err(|e| {
                    WeightsError::corrupted(
                        "__manifest__",
                        format!("v{version}"),
                        format!("{rel}: {e}"),
                    )
                })?;
                return Ok(Some(m));
            }
        }
        Ok(None)
    }

    /// The deltas the store holds, as `(from, to)` versions (one LIST request).
    pub async fn delta_links(&self) -> Result<std::collections::BTreeSet<(u64, u64)>> {
        self.read();
        let listed = self
            .inner
            .list_with_delimiter(Some(&self.key("delta")))
            .await
            .map_err(transfer)?;
        Ok(listed
            .common_prefixes
            .iter()
            .filter_map(|p| {
                let (a, b) = p.filename()?.split_once('-')?;
                Some((version_name(a)?, version_name(b)?))
            })
            .collect())
    }

    /// The `latest` pointer.
    pub async fn latest(&self) -> Result<Option<u64>> {
        let Some(bytes) = self.get_bytes("latest").await? else {
            return Ok(None);
        };
        let v: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|e| transfer(format!("latest: {e}")))?;
        v.get("version")
            .and_then(|v| v.as_u64())
            .map(Some)
            .ok_or_else(|| transfer("latest has no version"))
    }
}

/// Opens a download's partial file, to append (`resume`) or afresh, never through a symbolic
/// link: it lies in a work directory, where a link planted by someone else would have the
/// download written over the file it names.
pub(crate) async fn open_partial(partial: &Path, resume: bool) -> Result<tokio::fs::File> {
    let mut o = tokio::fs::OpenOptions::new();
    if resume {
        o.append(true);
    } else {
        o.write(true).create(true).truncate(true);
    }
    o.custom_flags(crate::workdir::NO_FOLLOW);
    o.open(partial)
        .await
        .map_err(|e| crate::workdir::no_follow_error(partial, e))
}

/// `dest` + `.partial`.
pub(crate) fn partial_path(dest: &Path) -> PathBuf {
    let mut s = dest.as_os_str().to_owned();
    s.push(".partial");
    PathBuf::from(s)
}

/// Copies a checkpoint directory (with its marker) to `out` via a temporary sibling.
pub(crate) async fn copy_checkpoint(from: &Path, out: &Path) -> Result<()> {
    let tmp = diff::temp_path(out);
    tokio::fs::create_dir_all(&tmp)
        .await
        .map_err(|e| WeightsError::io(&tmp, e))?;
    // A link counts as the file it points to (as in a checkpoint's layout): its bytes are
    // copied; subdirectories are copied too, hidden entries not (a `.git/` of a clone, a
    // `.cache/` of a download: no part of the checkpoint).
    let files = blocking({
        let from = from.to_path_buf();
        move || crate::layout::walk(&from, true, true)
    })
    .await?;
    for f in files.into_iter().filter(|f| f.meta.is_file()) {
        let to = tmp.join(&f.name);
        if let Some(parent) = to.parent() {
            tokio::fs::create_dir_all(parent)
                .await
                .map_err(|e| WeightsError::io(parent, e))?;
        }
        tokio::fs::copy(&f.path, &to)
            .await
            .map_err(|err| WeightsError::io(&f.path, err))?;
    }
    tokio::fs::rename(&tmp, out)
        .await
        .map_err(|e| WeightsError::io(out, e))
}

/// Runs CPU-bound work off the async threads.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| WeightsError::Invalid(format!("worker thread: {e}")))?
}
