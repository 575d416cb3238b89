//! `source` of `POST /admin/policy/update`: where the router fetches the new version for each
//! worker before its load call (an in-region peer, `kvrouter weights serve`, else the object
//! store), into a directory the engine reads; the load call then names it as `model_path`
//! (mock engine, SGLang `update_weights_from_disk`, vLLM's load body). Fetches start with the
//! cycle, so they overlap the drain; workers sharing a directory share one fetch. Before the
//! cycle starts, the source is asked whether it has the version ([`SourceBody::check`]), so an
//! update to a version no one has is refused before any worker leaves rotation.

use crate::error::ServeError;
use futures::future::{BoxFuture, FutureExt, Shared};
use kvrouter_core::ids::WorkerId;
use kvrouter_weights::store::Store;
/// Where a version is fetched from, as [`SourceBody::validate`] reads it.
pub(crate) use kvrouter_weights::transfer::Source;
use kvrouter_weights::transfer::{fetch_version, has_version, local_versions};
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Threads a fetch uses to verify and apply deltas, unless the request says otherwise.
const DEFAULT_FETCH_THREADS: usize = 2;
/// Versions a worker's cache directory keeps, unless the request says otherwise: the one the
/// engine runs and the one it loads next. The fetch after that overwrites the older one's files.
const DEFAULT_KEEP_VERSIONS: usize = 2;
/// How long the check that the source has the version may wait for the peer, and then for the
/// store, unless the request says otherwise.
const DEFAULT_CHECK_TIMEOUT_SECS: u64 = 30;

/// The `source` field.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SourceBody {
    /// Base URL of an in-region peer.
    #[serde(default)]
    peer: Option<String>,
    /// Object store URL (`file:///…`, `s3://bucket/prefix`).
    #[serde(default)]
    store: Option<String>,
    /// Backend options of the store (`aws_endpoint`, …).
    #[serde(default)]
    store_options: BTreeMap<String, String>,
    /// Cache directory the engine reads; `{worker}` is replaced by the worker id. Version N
    /// lands in `DIR/vN`.
    dir: String,
    /// Threads per fetch.
    #[serde(default)]
    threads: Option<usize>,
    /// Versions kept in each cache directory (at least 1).
    #[serde(default)]
    keep: Option<usize>,
    /// Seconds the check that the source has the version waits for each of peer and store.
    #[serde(default)]
    check_timeout_secs: Option<u64>,
}

/// One worker's fetch: the checkpoint directory, or why there is none.
pub(crate) type Fetch = Shared<BoxFuture<'static, Result<String, String>>>;

impl SourceBody {
    /// Checks the fields, naming the bad one.
    pub(crate) fn validate(&self) -> Result<Source, ServeError> {
        if self.dir.trim().is_empty() {
            return Err(ServeError::invalid(
                "`source.dir` must name a directory",
                Some("source.dir"),
            ));
        }
        if self.threads == Some(0) {
            return Err(ServeError::invalid(
                "`source.threads` must be at least 1",
                Some("source.threads"),
            ));
        }
        if self.keep == Some(0) {
            return Err(ServeError::invalid(
                "`source.keep` must be at least 1",
                Some("source.keep"),
            ));
        }
        if self.check_timeout_secs == Some(0) {
            return Err(ServeError::invalid(
                "`source.check_timeout_secs` must be at least 1",
                Some("source.check_timeout_secs"),
            ));
        }
        if let Some(p) = &self.peer {
            if !(p.starts_with("http://") || p.starts_with("https://")) {
                return Err(ServeError::invalid(
                    "`source.peer` must be an http(s) URL",
                    Some("source.peer"),
                ));
            }
        }
        let store = match &self.store {
            Some(url) => {
                let opts: Vec<(String, String)> = self.store_options.clone().into_iter().collect();
                Some(
                    Store::open(url, &opts)
                        .map_err(|e| ServeError::invalid(e.to_string(), Some("source.store")))?,
                )
            }
            None => None,
        };
        if self.peer.is_none() && store.is_none() {
            return Err(ServeError::invalid(
                "`source` needs `peer` or `store`",
                Some("source.peer"),
            ));
        }
        Ok(Source {
            peer: self.peer.clone(),
            store,
            keep: Some(self.keep.unwrap_or(DEFAULT_KEEP_VERSIONS)),
            protect: Vec::new(),
        })
    }

    fn dir_of(&self, w: &WorkerId) -> String {
        self.dir.replace("{worker}", &w.0.to_string())
    }

    /// Whether the update may start: every target's cache directory holds `version` already,
    /// or the source has it. Refused (404 naming `version`) when no one has it; 502 when the
    /// source could not be asked.
    pub(crate) async fn check(
        &self,
        source: &Source,
        version: u64,
        workers: &[WorkerId],
    ) -> Result<(), ServeError> {
        let dirs: BTreeSet<String> = workers.iter().map(|w| self.dir_of(w)).collect();
        let cached = dirs.iter().all(|d| {
            local_versions(Path::new(d))
                .iter()
                .any(|(v, _)| *v == version)
        });
        if cached {
            return Ok(());
        }
        let timeout = Duration::from_secs(
            self.check_timeout_secs
                .unwrap_or(DEFAULT_CHECK_TIMEOUT_SECS),
        );
        let from = [
            self.peer.as_ref().map(|p| format!("peer {p}")),
            self.store.as_ref().map(|s| format!("store {s}")),
        ]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join(", ");
        match has_version(source, version, timeout).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(ServeError::Missing {
                message: format!(
                    "version {version} is not in the weight source ({from}); no worker was drained"
                ),
                param: "version",
            }),
            Err(e) => Err(ServeError::Upstream(format!(
                "checking the weight source ({from}) for version {version}: {e}; no worker was drained"
            ))),
        }
    }

    /// Starts fetching `version` for `workers` (each with the version it runs now, which its
    /// directory's fetch never recycles or deletes); one fetch per distinct directory.
    pub(crate) fn start(
        &self,
        source: Source,
        version: u64,
        workers: &[(WorkerId, u64)],
    ) -> HashMap<WorkerId, Fetch> {
        let threads = self.threads.unwrap_or(DEFAULT_FETCH_THREADS);
        let dir_of = |w: &WorkerId| self.dir_of(w);
        let mut running: HashMap<String, Vec<u64>> = HashMap::new();
        for (w, v) in workers {
            running.entry(dir_of(w)).or_default().push(*v);
        }
        let mut by_dir: HashMap<String, Fetch> = HashMap::new();
        let mut out = HashMap::new();
        for (w, _) in workers {
            let dir = dir_of(w);
            let fetch = by_dir
                .entry(dir.clone())
                .or_insert_with(|| {
                    let mut source = source.clone();
                    source.protect = running.get(&dir).cloned().unwrap_or_default();
                    let task = tokio::spawn(async move {
                        let cache = PathBuf::from(&dir);
                        fetch_version(&source, version, &cache, threads)
                            .await
                            .map(|p| p.display().to_string())
                            .map_err(|e| format!("fetching version {version} into {dir}: {e}"))
                    });
                    async move { task.await.map_err(|e| format!("fetch task: {e}"))? }
                        .boxed()
                        .shared()
                })
                .clone();
            out.insert(*w, fetch);
        }
        out
    }
}
