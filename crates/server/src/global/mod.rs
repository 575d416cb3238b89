//! `kvrouter serve --global`: one router in front of several clusters' `kvrouter serve`.
//!
//! It starts no engines. A poller per cluster fetches the cluster's summary
//! (`GET URL/admin/cluster-summary`, the core's versioned bytes) every refresh period with a
//! bounded timeout and hands it to the core's [`GlobalRouter`]. Each request is tokenized and
//! hashed as the local routers do (`routing`), placed on a cluster by the global policy
//! (sessions keep their cluster under the core's hysteresis), and forwarded unchanged to that
//! cluster's router, which picks the worker; the answer streams back with `x-kvrouter-cluster`.
//!
//! With each summary the poller fetches the cluster's model list (`GET URL/v1/models`): a
//! request naming a model goes only to clusters that serve it (a model no available cluster
//! serves is a 404 naming `model`), and the global router answers `GET /v1/models` itself
//! with the available clusters' models together.
//!
//! A cluster whose summary is older than the age bound is routed around by the core. One whose
//! router fails (connection error, timeout, 5xx) is marked down at once, the request is tried
//! on the next cluster, and the cluster comes back with its next good summary. Sessions of a
//! cluster routed around move (counted: their KV stays behind, so they prefill again).
//!
//! Layout: this file (configuration, state, start), `poll.rs` (summary pollers),
//! `models.rs` (the clusters' model lists), `proxy.rs` (the HTTP surface and forwarding),
//! `metrics.rs` (per-cluster counters).

mod forward;
mod metrics;
mod models;
mod poll;
mod proxy;
mod sessions;

use crate::state::AppState;
use crate::{RunningServer, ServeConfig, StartError};
use kvrouter_core::global::{
    ClusterSpec, GlobalConfig, GlobalRouter, MAX_CLUSTER_WEIGHT, MAX_RTT_MS,
};
use kvrouter_core::time::Time;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Default time between summary fetches from each cluster (`--global-refresh-ms`).
pub const DEFAULT_REFRESH: Duration = Duration::from_millis(1000);
/// Default bound on one summary fetch (`--global-summary-timeout-ms`).
pub const DEFAULT_SUMMARY_TIMEOUT: Duration = Duration::from_millis(500);

/// A cluster behind the global router (`--cluster NAME=URL[,rtt_ms=X][,weight=Y]`).
#[derive(Clone, Debug, PartialEq)]
pub struct ClusterTarget {
    /// Its name (in `x-kvrouter-cluster` and metric labels).
    pub name: String,
    /// Base URL of its `kvrouter serve`.
    pub url: String,
    /// Network round trip to it, ms (default 0).
    pub rtt_ms: f64,
    /// Share under `static-split` (default 1).
    pub weight: f64,
}

impl ClusterTarget {
    /// Parses `NAME=URL[,rtt_ms=X][,weight=Y]`; the error says what is wrong (the caller adds
    /// the flag).
    pub fn parse(s: &str) -> Result<Self, String> {
        let (name, rest) = s
            .split_once('=')
            .ok_or("expected NAME=URL[,rtt_ms=X][,weight=Y]")?;
        let ok_name = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.';
        if name.is_empty() || name.len() > 64 || !name.chars().all(ok_name) {
            return Err(format!(
                "cluster name {name:?}: use 1 to 64 letters, digits, `_`, `-` or `.`"
            ));
        }
        let mut parts = rest.split(',');
        let url = parts.next().unwrap_or_default().trim_end_matches('/');
        match reqwest::Url::parse(url) {
            Ok(u) if matches!(u.scheme(), "http" | "https") && u.host().is_some() => {}
            _ => return Err(format!("{url:?} is not an http:// or https:// URL")),
        }
        let mut target = ClusterTarget {
            name: name.to_owned(),
            url: url.to_owned(),
            rtt_ms: 0.0,
            weight: 1.0,
        };
        let mut seen: Vec<&str> = Vec::new();
        for part in parts {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| format!("{part:?}: expected rtt_ms=X or weight=Y"))?;
            let v: f64 = value
                .parse()
                .map_err(|_| format!("{key}: {value:?} is not a number"))?;
            if seen.contains(&key) {
                return Err(format!("{key} given twice"));
            }
            seen.push(key);
            match key {
                "rtt_ms" if (0.0..=MAX_RTT_MS).contains(&v) => target.rtt_ms = v,
                "weight" if v > 0.0 && v <= MAX_CLUSTER_WEIGHT => target.weight = v,
                "rtt_ms" | "weight" => {
                    return Err(format!(
                        "{key}: {v} out of range (rtt_ms in 0..={MAX_RTT_MS}, weight above 0 \
                         and at most {MAX_CLUSTER_WEIGHT})"
                    ))
                }
                _ => return Err(format!("unknown key {key:?}: expected rtt_ms or weight")),
            }
        }
        Ok(target)
    }
}

/// Settings of `kvrouter serve --global`.
#[derive(Clone, Debug, PartialEq)]
pub struct GlobalServeConfig {
    /// The clusters, in id order (at least one; names unique).
    pub clusters: Vec<ClusterTarget>,
    /// The core's global policy, summary age bound, hysteresis and session TTL.
    pub router: GlobalConfig,
    /// Time between summary fetches from each cluster.
    pub refresh: Duration,
    /// Bound on one summary fetch.
    pub summary_timeout: Duration,
    /// Bearer token sent for the clusters' `/admin/cluster-summary` (their admin token).
    pub summary_token: Option<String>,
}

impl GlobalServeConfig {
    /// Checks what the core does not: clusters given, names unique, periods positive.
    pub fn validate(&self) -> Result<(), String> {
        if self.clusters.is_empty() {
            return Err("--global needs at least one --cluster NAME=URL".into());
        }
        for (i, c) in self.clusters.iter().enumerate() {
            if self.clusters[..i].iter().any(|d| d.name == c.name) {
                return Err(format!("--cluster: name {:?} given twice", c.name));
            }
        }
        if self.refresh.is_zero() {
            return Err("--global-refresh-ms must be at least 1".into());
        }
        if self.summary_timeout.is_zero() {
            return Err("--global-summary-timeout-ms must be at least 1".into());
        }
        // A summary older than the age bound makes its cluster ineligible: fetched less often
        // than that, every cluster would go stale between fetches and every request get 503.
        if self.refresh + self.summary_timeout >= self.router.max_summary_age {
            return Err(format!(
                "--global-refresh-ms ({} ms) plus --global-summary-timeout-ms ({} ms) must be \
                 shorter than --global-max-summary-age-secs ({} s): summaries fetched less often \
                 go stale between fetches",
                self.refresh.as_millis(),
                self.summary_timeout.as_millis(),
                self.router.max_summary_age.as_secs_f64()
            ));
        }
        self.router
            .validate()
            .map_err(|e| format!("--global-*: {e}"))
    }
}

/// A cluster as the server holds it: where it is and its counters.
pub(crate) struct Cluster {
    pub(crate) name: String,
    pub(crate) url: String,
}

/// State of the global router.
pub(crate) struct GlobalState {
    /// Tokenizer, chat template, block size, limits and metric prefix, shared with `serve`'s
    /// request path (its core and registry stay empty).
    pub(crate) app: AppState,
    pub(crate) config: GlobalServeConfig,
    /// The core's global router; short, await-free critical sections only.
    pub(crate) router: Mutex<GlobalRouter>,
    pub(crate) clusters: Vec<Cluster>,
    pub(crate) metrics: metrics::GlobalMetrics,
    pub(crate) http: reqwest::Client,
    /// Each cluster's model cards as its router last listed them (`models.rs`); `None` until
    /// a list came. The core gets their ids ([`GlobalRouter::set_models`]).
    pub(crate) models: Mutex<Vec<Option<Vec<serde_json::Value>>>>,
    epoch: Instant,
}

impl GlobalState {
    /// Now, as the core counts time: microseconds since the server started.
    pub(crate) fn now(&self) -> Time {
        Time::from_micros(self.epoch.elapsed().as_micros() as u64)
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, GlobalRouter> {
        self.router.lock().expect("global router lock")
    }
}

/// Why the global router could not start.
#[derive(Debug, thiserror::Error)]
pub enum GlobalStartError {
    /// The settings are invalid.
    #[error("{0}")]
    Config(String),
    /// The shared server state could not be built.
    #[error(transparent)]
    Start(#[from] StartError),
}

/// Starts the global router on `listener`: a summary poller per cluster and the HTTP surface.
/// `serve` gives the tokenizer, template, block size, upstream timeouts and HTTP limits.
pub async fn start(
    global: GlobalServeConfig,
    serve: ServeConfig,
    listener: TcpListener,
) -> Result<RunningServer, GlobalStartError> {
    global.validate().map_err(GlobalStartError::Config)?;
    let addr = listener
        .local_addr()
        .map_err(|e| GlobalStartError::Start(StartError::Listener(e)))?;
    let app = AppState::new(serve.clone()).map_err(StartError::from)?;
    let block_size = serve.router.kv_cache_block_size as u32;
    let mut router = GlobalRouter::new(global.router.clone(), block_size)
        .map_err(|e| GlobalStartError::Config(format!("--global-*: {e}")))?;
    for c in &global.clusters {
        router
            .add_cluster(ClusterSpec {
                name: c.name.clone(),
                rtt_ms: c.rtt_ms,
                weight: c.weight,
            })
            .map_err(|e| GlobalStartError::Config(format!("--cluster: {e}")))?;
    }
    let http = reqwest::Client::builder()
        .connect_timeout(serve.upstream_connect_timeout)
        .tcp_nodelay(true)
        .build()
        .map_err(|e| GlobalStartError::Config(format!("HTTP client: {e}")))?;
    let clusters: Vec<Cluster> = global
        .clusters
        .iter()
        .map(|c| Cluster {
            name: c.name.clone(),
            url: c.url.clone(),
        })
        .collect();
    let state = Arc::new(GlobalState {
        metrics: metrics::GlobalMetrics::new(global.clusters.len()),
        app: app.clone(),
        config: global,
        router: Mutex::new(router),
        models: Mutex::new(vec![None; clusters.len()]),
        clusters,
        http,
        epoch: Instant::now(),
    });
    let pollers = poll::spawn(&state);
    let (shutdown, mut rx) = watch::channel(false);
    let routes = proxy::app(state);
    let (limits, lifecycle) = (serve.http.clone(), app.inner.lifecycle.clone());
    let server = tokio::spawn(async move {
        kvrouter_http::serve(listener, routes, limits, lifecycle, async move {
            let _ = rx.wait_for(|stop| *stop).await;
        })
        .await;
        for task in pollers {
            task.abort();
        }
    });
    Ok(RunningServer {
        addr,
        state: app,
        shutdown,
        server,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_flags_parse_or_say_what_is_wrong() {
        let t = ClusterTarget::parse("eu-1=http://10.0.0.1:8000/,rtt_ms=12.5,weight=2").unwrap();
        assert_eq!(t.name, "eu-1");
        assert_eq!(t.url, "http://10.0.0.1:8000");
        assert_eq!((t.rtt_ms, t.weight), (12.5, 2.0));
        let d = ClusterTarget::parse("a=https://x").unwrap();
        assert_eq!((d.rtt_ms, d.weight), (0.0, 1.0));
        for (bad, says) in [
            ("http://x", "NAME=URL"),
            ("=http://x", "cluster name"),
            ("a b=http://x", "cluster name"),
            ("a=ftp://x", "not an http"),
            ("a=x:1", "not an http"),
            ("a=http://x,rtt_ms=-1", "out of range"),
            ("a=http://x,weight=0", "out of range"),
            ("a=http://x,speed=3", "unknown key"),
            ("a=http://x,rtt_ms", "expected rtt_ms"),
            ("a=http://x,weight=abc", "not a number"),
        ] {
            let e = ClusterTarget::parse(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn duplicate_names_and_no_clusters_are_refused() {
        let c = ClusterTarget::parse("a=http://x").unwrap();
        let mut g = GlobalServeConfig {
            clusters: vec![],
            router: GlobalConfig::default(),
            refresh: DEFAULT_REFRESH,
            summary_timeout: DEFAULT_SUMMARY_TIMEOUT,
            summary_token: None,
        };
        assert!(g.validate().unwrap_err().contains("at least one --cluster"));
        g.clusters = vec![c.clone(), c];
        assert!(g.validate().unwrap_err().contains("given twice"));
    }
}
