//! `kvrouter weights serve`: the in-region peer. Serves the versions in its cache directory
//! (`vN/`) over HTTP with range requests; the marker carries the SHA-256 of every segment, which
//! clients check. With a store, a version it lacks is pulled once (one pull at a time; every
//! other request for it waits and then reads the cache), so the WAN is crossed once per region.
//!
//! - `GET /v1/versions/{N}`: whether the peer can serve N (`{"version", "cached"}`; 404 when
//!   neither its cache nor its store has it), without pulling it: one or two store HEADs
//! - `GET /v1/versions/{N}/marker`: the version's `weights.json`
//! - `GET /v1/versions/{N}/files/{name}`: a file (`name` may hold `/`: `original/params.json`); `Range: bytes=A-` / `bytes=A-B` / `bytes=-N` answer 206
//! - `GET /v1/stats`: `store_pulls`, `store_reads`, `files_served`, `bytes_served`
//!
//! A version the store does not have is 404 (`param` `version`); 502 is kept for a store that
//! could not be read.

use crate::error::WeightsError;
use crate::store::Store;
use crate::transfer::{self, Source};
use axum::body::Body;
use axum::extract::{Path as UrlPath, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use futures::StreamExt;
use serde_json::json;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncSeekExt};

/// The peer's state.
#[derive(Debug)]
pub struct Peer {
    cache: PathBuf,
    store: Option<Store>,
    threads: usize,
    keep: usize,
    pull_lock: tokio::sync::Mutex<()>,
    /// Versions whose files are being sent, and during a pull the versions it may not recycle.
    reading: std::sync::Mutex<Reading>,
    store_pulls: AtomicU64,
    files_served: AtomicU64,
    bytes_served: AtomicU64,
}

impl Peer {
    /// A peer serving `cache`, pulling what it lacks from `store` (if any) and keeping the
    /// newest `keep` versions (at least 1). Does no I/O.
    pub fn new(cache: PathBuf, store: Option<Store>, threads: usize, keep: usize) -> Arc<Self> {
        Arc::new(Peer {
            cache,
            store,
            threads,
            keep: keep.max(1),
            pull_lock: tokio::sync::Mutex::new(()),
            reading: std::sync::Mutex::new(Reading::default()),
            store_pulls: AtomicU64::new(0),
            files_served: AtomicU64::new(0),
            bytes_served: AtomicU64::new(0),
        })
    }

    fn cached(&self, v: u64) -> bool {
        transfer::newest_local(&self.cache, v).is_some_and(|(h, _)| h == v)
    }

    /// Whether version `v` is in the cache (`Some(true)`) or the store (`Some(false)`).
    async fn find(&self, v: u64) -> Result<Option<bool>, ApiError> {
        if self.cached(v) {
            return Ok(Some(true));
        }
        let Some(store) = &self.store else {
            return Ok(None);
        };
        match store.has_version(v).await {
            Ok(true) => Ok(Some(false)),
            Ok(false) => Ok(None),
            Err(e) => Err(pull_failed(v, e)),
        }
    }

    /// Makes sure version `v` is in the cache.
    async fn ensure(&self, v: u64) -> Result<PathBuf, ApiError> {
        let have = |p: &Self| p.cached(v);
        if have(self) {
            return Ok(transfer::version_dir(&self.cache, v));
        }
        let Some(store) = &self.store else {
            return Err(ApiError(
                StatusCode::NOT_FOUND,
                format!("version {v} is not here and this peer has no store"),
                "version",
            ));
        };
        let _turn = self.pull_lock.lock().await;
        if !have(self) {
            // A version the store lacks is answered at once (one or two HEADs), not after
            // pulling and applying the chain below it.
            let known = store.has_version(v).await.map_err(|e| pull_failed(v, e))?;
            if !known {
                return Err(ApiError(
                    StatusCode::NOT_FOUND,
                    format!("version {v} is not in the store"),
                    "version",
                ));
            }
            // The versions being sent are kept: a pull recycles an old version's files in
            // place, which rewrote a file under a download of it (200 with bytes of no
            // version). Readers that start during the pull wait for it (`Peer::read`).
            // Ended by a guard: a pull whose request is dropped midway (the client went) must
            // not leave readers waiting for a pull that no longer runs.
            let pulling = Pulling::start(self);
            let source = Source {
                peer: None,
                store: Some(store.clone()),
                keep: Some(self.keep),
                protect: pulling.keeps.clone(),
            };
            let fetched = transfer::fetch_version(&source, v, &self.cache, self.threads).await;
            drop(pulling);
            fetched.map_err(|e| pull_failed(v, e))?;
            self.store_pulls.fetch_add(1, Ordering::Relaxed);
        }
        Ok(transfer::version_dir(&self.cache, v))
    }
}

impl Peer {
    fn reading(&self) -> std::sync::MutexGuard<'_, Reading> {
        self.reading.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers a transfer of version `v`'s files (until the guard drops): a pull that starts
    /// meanwhile keeps `v`. During a pull that may recycle `v`, waits for that pull first.
    async fn read(self: &Arc<Self>, v: u64) -> ReadGuard {
        loop {
            if self.reading().start_read(v) {
                return ReadGuard {
                    peer: self.clone(),
                    version: v,
                };
            }
            drop(self.pull_lock.lock().await);
        }
    }
}

/// Which versions are being read, and what a pull in progress keeps.
#[derive(Debug, Default)]
struct Reading {
    readers: std::collections::BTreeMap<u64, usize>,
    /// During a pull: the versions it keeps (read when it started).
    pull_keeps: Option<Vec<u64>>,
}

impl Reading {
    /// A read of `v` may start unless a pull that may recycle `v` is running.
    fn start_read(&mut self, v: u64) -> bool {
        if self.pull_keeps.as_ref().is_some_and(|k| !k.contains(&v)) {
            return false;
        }
        *self.readers.entry(v).or_default() += 1;
        true
    }

    fn end_read(&mut self, v: u64) {
        if let Some(n) = self.readers.get_mut(&v) {
            *n -= 1;
            if *n == 0 {
                self.readers.remove(&v);
            }
        }
    }

    /// A pull starts: the versions being read are the ones it must keep.
    fn start_pull(&mut self) -> Vec<u64> {
        let keep: Vec<u64> = self.readers.keys().copied().collect();
        self.pull_keeps = Some(keep.clone());
        keep
    }

    fn end_pull(&mut self) {
        self.pull_keeps = None;
    }
}

/// A pull in progress (taken under the pull lock): the versions it keeps, until it drops.
struct Pulling<'a> {
    peer: &'a Peer,
    keeps: Vec<u64>,
}

impl<'a> Pulling<'a> {
    fn start(peer: &'a Peer) -> Self {
        let keeps = peer.reading().start_pull();
        Pulling { peer, keeps }
    }
}

impl Drop for Pulling<'_> {
    fn drop(&mut self) {
        self.peer.reading().end_pull();
    }
}

/// One transfer of a version's files; dropped when its body is sent or the client goes.
struct ReadGuard {
    peer: Arc<Peer>,
    version: u64,
}

impl Drop for ReadGuard {
    fn drop(&mut self) {
        self.peer.reading().end_read(self.version);
    }
}

/// The answer to a pull of version `v` that failed: 404 when the store does not have it, 502
/// when the store could not be read, 500 for the peer's own failures (disk, a corrupted
/// download).
fn pull_failed(v: u64, e: WeightsError) -> ApiError {
    let status = match e {
        WeightsError::Missing(_) => StatusCode::NOT_FOUND,
        WeightsError::Transfer(_) => StatusCode::BAD_GATEWAY,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    ApiError(status, format!("pulling version {v}: {e}"), "version")
}

/// An OpenAI-shaped error answer.
#[derive(Debug)]
struct ApiError(StatusCode, String, &'static str);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = if self.0.is_client_error() {
            "invalid_request_error"
        } else {
            "server_error"
        };
        (self.0, Json(json!({"error": {"message": self.1, "type": kind, "param": self.2, "code": self.0.as_u16()}}))).into_response()
    }
}

/// The HTTP surface.
pub fn app(peer: Arc<Peer>) -> Router {
    Router::new()
        .route("/v1/versions/{version}", get(version))
        .route("/v1/versions/{version}/marker", get(marker))
        .route("/v1/versions/{version}/files/{*name}", get(file))
        .route("/v1/stats", get(stats))
        .fallback(unknown_route)
        .method_not_allowed_fallback(wrong_method)
        .with_state(peer)
}

async fn unknown_route(uri: axum::http::Uri) -> ApiError {
    ApiError(
        StatusCode::NOT_FOUND,
        format!(
            "no route {}: this peer serves /v1/versions/{{N}}[/marker|/files/NAME] and /v1/stats",
            uri.path()
        ),
        "url",
    )
}

async fn wrong_method(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{method} is not allowed on {}: only GET", uri.path()),
        "method",
    )
}

fn parse_version(v: &str) -> Result<u64, ApiError> {
    v.parse().map_err(|_| {
        ApiError(
            StatusCode::BAD_REQUEST,
            format!("`{v}` is not a version number"),
            "version",
        )
    })
}

async fn version(
    State(peer): State<Arc<Peer>>,
    UrlPath(v): UrlPath<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let v = parse_version(&v)?;
    match peer.find(v).await? {
        Some(cached) => Ok(Json(json!({"version": v, "cached": cached}))),
        None => Err(ApiError(
            StatusCode::NOT_FOUND,
            match &peer.store {
                Some(s) => format!("version {v} is neither here nor in the store {}", s.url()),
                None => format!("version {v} is not here and this peer has no store"),
            },
            "version",
        )),
    }
}

async fn marker(
    State(peer): State<Arc<Peer>>,
    UrlPath(v): UrlPath<String>,
) -> Result<Response, ApiError> {
    let dir = peer.ensure(parse_version(&v)?).await?;
    let bytes = tokio::fs::read(dir.join(crate::layout::MARKER))
        .await
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), "version"))?;
    Ok(([(header::CONTENT_TYPE, "application/json")], bytes).into_response())
}

/// What a `Range` header asks of a file, as RFC 9110 reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wanted {
    /// No header, or one that is not a single well-formed byte range: it is ignored (200).
    Whole,
    /// The half-open byte range to send (206).
    Part(u64, u64),
    /// Well-formed but outside the file (416).
    Unsatisfiable,
}

/// `bytes=A-`, `bytes=A-B` or `bytes=-N` (the last N bytes) against a file of `size` bytes.
fn parse_range(value: Option<&str>, size: u64) -> Wanted {
    let Some(spec) = value.and_then(|v| v.trim().strip_prefix("bytes=")) else {
        return Wanted::Whole;
    };
    let Some((a, b)) = spec.split_once('-').filter(|_| !spec.contains(',')) else {
        return Wanted::Whole;
    };
    let (a, b) = (a.trim(), b.trim());
    let number = |t: &str| t.parse::<u64>().ok();
    match (a.is_empty(), number(a), b.is_empty(), number(b)) {
        // The last N bytes.
        (true, _, false, Some(0)) => Wanted::Unsatisfiable,
        (true, _, false, Some(n)) if size > 0 => Wanted::Part(size.saturating_sub(n), size),
        (true, _, false, Some(_)) => Wanted::Unsatisfiable,
        (false, Some(start), true, _) if start < size => Wanted::Part(start, size),
        (false, Some(_), true, _) => Wanted::Unsatisfiable,
        (false, Some(start), false, Some(last)) if last >= start => {
            if start < size {
                Wanted::Part(start, last.saturating_add(1).min(size))
            } else {
                Wanted::Unsatisfiable
            }
        }
        _ => Wanted::Whole,
    }
}

async fn file(
    State(peer): State<Arc<Peer>>,
    UrlPath((v, name)): UrlPath<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let version = parse_version(&v)?;
    let guard = peer.read(version).await;
    let dir = peer.ensure(version).await?;
    let marker = crate::checkpoint::read_marker(&dir).ok().flatten();
    if !marker.is_some_and(|m| m.files.iter().any(|f| f.name == name)) {
        return Err(ApiError(
            StatusCode::NOT_FOUND,
            format!("version {version} has no file `{name}`"),
            "name",
        ));
    }
    let path = dir.join(&name);
    let mut f = tokio::fs::File::open(&path)
        .await
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), "name"))?;
    let size = f
        .metadata()
        .await
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), "name"))?
        .len();
    let range = headers.get(header::RANGE).and_then(|r| r.to_str().ok());
    let (status, start, end) = match parse_range(range, size) {
        Wanted::Whole => (StatusCode::OK, 0, size),
        Wanted::Part(a, b) => (StatusCode::PARTIAL_CONTENT, a, b),
        Wanted::Unsatisfiable => {
            let mut r = ApiError(
                StatusCode::RANGE_NOT_SATISFIABLE,
                format!(
                    "the range {} is outside `{name}` ({size} bytes)",
                    range.unwrap_or("")
                ),
                "range",
            )
            .into_response();
            r.headers_mut().insert(
                header::CONTENT_RANGE,
                header::HeaderValue::from_str(&format!("bytes */{size}")).expect("ascii"),
            );
            return Ok(r);
        }
    };
    f.seek(std::io::SeekFrom::Start(start))
        .await
        .map_err(|e| ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), "name"))?;
    peer.files_served.fetch_add(1, Ordering::Relaxed);
    peer.bytes_served.fetch_add(end - start, Ordering::Relaxed);
    // The guard goes with the body: the version is kept until its last byte is sent.
    let body = Body::from_stream(
        tokio_util::io::ReaderStream::with_capacity(f.take(end - start), 1 << 20).map(
            move |chunk| {
                let _ = &guard;
                chunk
            },
        ),
    );
    let mut response = (status, body).into_response();
    let h = response.headers_mut();
    h.insert(header::CONTENT_LENGTH, (end - start).into());
    h.insert(
        header::ACCEPT_RANGES,
        header::HeaderValue::from_static("bytes"),
    );
    if status == StatusCode::PARTIAL_CONTENT {
        h.insert(
            header::CONTENT_RANGE,
            header::HeaderValue::from_str(&format!("bytes {start}-{}/{size}", end - 1))
                .expect("ascii"),
        );
    }
    Ok(response)
}

async fn stats(State(peer): State<Arc<Peer>>) -> Json<serde_json::Value> {
    Json(json!({
        "store_pulls": peer.store_pulls.load(Ordering::Relaxed),
        "store_reads": peer.store.as_ref().map_or(0, |s| s.reads()),
        "files_served": peer.files_served.load(Ordering::Relaxed),
        "bytes_served": peer.bytes_served.load(Ordering::Relaxed),
    }))
}

#[cfg(test)]
mod tests {
    use super::{parse_range, Peer, Pulling, Wanted};

    #[test]
    fn a_pull_keeps_what_is_being_read_and_a_dropped_pull_holds_no_reader() {
        let peer = Peer::new(std::path::PathBuf::from("/nonexistent"), None, 1, 2);
        assert!(peer.reading().start_read(1));
        let pulling = Pulling::start(&peer);
        assert_eq!(pulling.keeps, vec![1]);
        // During the pull: another read of 1 may start; a read of 2, which it may recycle, waits.
        assert!(peer.reading().start_read(1));
        assert!(!peer.reading().start_read(2));
        // The pull's request is dropped midway (its client went): readers are not held.
        drop(pulling);
        assert!(peer.reading().start_read(2));
        for v in [1, 1, 2] {
            peer.reading().end_read(v);
        }
        assert!(peer.reading().readers.is_empty());
        assert!(Pulling::start(&peer).keeps.is_empty());
    }

    #[test]
    fn ranges_as_rfc_9110_reads_them() {
        let r = |v: &str| parse_range(Some(v), 100);
        assert_eq!(parse_range(None, 100), Wanted::Whole);
        assert_eq!(r("bytes=10-"), Wanted::Part(10, 100));
        assert_eq!(r("bytes=10-19"), Wanted::Part(10, 20));
        assert_eq!(r("bytes=10-500"), Wanted::Part(10, 100));
        // Suffixes: the last N bytes, all of a shorter file; N = 0 cannot be satisfied.
        assert_eq!(r("bytes=-10"), Wanted::Part(90, 100));
        assert_eq!(r("bytes=-500"), Wanted::Part(0, 100));
        assert_eq!(r("bytes=-0"), Wanted::Unsatisfiable);
        assert_eq!(parse_range(Some("bytes=-5"), 0), Wanted::Unsatisfiable);
        // Well-formed but past the end.
        assert_eq!(r("bytes=100-"), Wanted::Unsatisfiable);
        assert_eq!(r("bytes=150-160"), Wanted::Unsatisfiable);
        // Not a single well-formed byte range: ignored, the whole file.
        for v in [
            "items=1-2",
            "bytes=abc",
            "bytes=5-2",
            "bytes=1-2,4-5",
            "bytes=-",
            "bytes=x-",
        ] {
            assert_eq!(r(v), Wanted::Whole, "{v}");
        }
    }
}
