//! Worker discovery (`kvrouter serve --discovery`): workers that come and go without being
//! listed. A source (etcd, Kubernetes) turns what it watches into [`SourceEvent`]s; the pure
//! [`membership`] decides what they change (add, drain, revive, purge after the grace period);
//! the [`driver`] carries that out through the same registry path as `--worker` and
//! `POST /admin/workers`.
//!
//! # Layout
//! - [`membership`]: the pure set of discovered workers and its decisions.
//! - [`driver`]: the task that applies events and purges drained workers on time.
//! - [`backoff`]: the pure reconnect delays of the sources.
//! - [`etcd`]: etcd's v3 JSON gateway (range, watch, leases) and the etcd source.
//! - [`kubernetes`]: the EndpointSlice source (the `kube` crate).

pub(crate) mod backoff;
pub(crate) mod driver;
pub mod etcd;
pub mod kubernetes;
pub(crate) mod membership;

use crate::config::WorkerEntry;
use crate::state::AppState;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Events a source may get ahead of the driver (which registers workers one at a time).
const EVENT_BACKLOG: usize = 1024;

/// Starts the source of `config` and its driver; abort both to stop.
pub(crate) fn spawn(state: &AppState, config: &DiscoveryConfig) -> [JoinHandle<()>; 2] {
    let (tx, rx) = mpsc::channel(EVENT_BACKLOG);
    let name = match config.source {
        DiscoverySource::Etcd { .. } => "etcd",
        DiscoverySource::Kubernetes { .. } => "kubernetes",
    };
    let inner = state.inner.clone();
    let reconnected: Arc<dyn Fn() + Send + Sync> = Arc::new(move || {
        inner.metrics.discovery_reconnects.inc(&[("source", name)]);
    });
    let source = match &config.source {
        DiscoverySource::Etcd { endpoint, prefix } => tokio::spawn(etcd::source::run(
            etcd::EtcdClient::new(endpoint),
            prefix.clone(),
            config.backoff_max,
            reconnected,
            tx,
        )),
        DiscoverySource::Kubernetes {
            selector,
            namespace,
            port_name,
        } => tokio::spawn(kubernetes::run(
            kubernetes::Settings {
                selector: selector.clone(),
                namespace: namespace.clone(),
                port_name: port_name.clone(),
                backoff_max: config.backoff_max,
            },
            reconnected,
            tx,
        )),
    };
    let driver = tokio::spawn(driver::run(state.clone(), name, config.drain_grace, rx));
    [source, driver]
}

/// What an engine registers (the JSON value of its etcd key; built from pod annotations on
/// Kubernetes). Unknown fields are ignored, so registrations can grow.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// Base URL of its OpenAI API, e.g. `http://10.0.0.5:8000`.
    pub url: String,
    /// ZeroMQ endpoint of its KV events (rank 0; rank r uses port + r); read from its
    /// `/server_info` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events_endpoint: Option<String>,
    /// ZeroMQ endpoint of its replay socket (rank 0; rank r uses port + r).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_endpoint: Option<String>,
    /// Data-parallel ranks (default: from `/server_info`, else 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp_size: Option<u32>,
    /// Model it serves (shown as the `model` label).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

impl Registration {
    /// The worker entry registered for it; `key` and `source` become labels.
    pub(crate) fn entry(&self, source: &str, key: &str) -> WorkerEntry {
        let mut labels = BTreeMap::from([
            ("discovery".to_owned(), source.to_owned()),
            ("discovery_key".to_owned(), key.to_owned()),
        ]);
        if let Some(model) = &self.model {
            labels.insert("model".into(), model.clone());
        }
        WorkerEntry {
            url: self.url.clone(),
            kv_events_endpoint: self.kv_events_endpoint.clone(),
            replay_endpoint: self.replay_endpoint.clone(),
            dp_size: self.dp_size,
            labels,
            ..WorkerEntry::default()
        }
    }
}

/// What a source saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum SourceEvent {
    /// The whole set (after a list or re-list): keys it lacks are gone.
    Snapshot(Vec<(String, Registration)>),
    /// One key registered or changed.
    Put {
        /// Its key.
        key: String,
        /// Its registration.
        registration: Registration,
    },
    /// One key gone (lease expired, revoked, pod not ready or deleted).
    Delete {
        /// Its key.
        key: String,
    },
}

/// Where workers are discovered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DiscoverySource {
    /// etcd: every key under `prefix` holds a JSON [`Registration`].
    Etcd {
        /// The client URL, `http://host:port`.
        endpoint: String,
        /// Key prefix, e.g. `/kvrouter/workers/`.
        prefix: String,
    },
    /// Kubernetes EndpointSlices of the services whose pods match a label selector.
    Kubernetes {
        /// Label selector of the EndpointSlices (`app=vllm`): the service's labels.
        selector: String,
        /// Namespace (`None`: the kube config's default namespace).
        namespace: Option<String>,
        /// Name of the endpoint port to route to (`None`: the first port).
        port_name: Option<String>,
    },
}

/// `kvrouter serve --discovery ...`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiscoveryConfig {
    /// The source.
    pub source: DiscoverySource,
    /// How long a removed worker keeps its index entries (it gets no new requests meanwhile).
    pub drain_grace: Duration,
    /// The longest wait between reconnects to the source.
    pub backoff_max: Duration,
}

impl DiscoveryConfig {
    /// Reads `--discovery` (`etcd://HOST:PORT` or `kubernetes`) with its companion flags.
    pub fn parse(
        spec: &str,
        prefix: &str,
        selector: Option<&str>,
        namespace: Option<&str>,
        port_name: Option<&str>,
    ) -> Result<DiscoverySource, String> {
        if let Some(rest) = spec.strip_prefix("etcd://") {
            if rest.is_empty() || rest.contains('/') {
                return Err(format!(
                    "--discovery {spec}: expected etcd://HOST:PORT (etcd's client address)"
                ));
            }
            if prefix.is_empty() {
                return Err("--discovery-prefix must not be empty".into());
            }
            return Ok(DiscoverySource::Etcd {
                endpoint: format!("http://{rest}"),
                prefix: prefix.to_owned(),
            });
        }
        if spec == "kubernetes" {
            let selector = selector
                .filter(|s| !s.trim().is_empty())
                .ok_or("--discovery kubernetes needs --selector (e.g. app=vllm)")?;
            return Ok(DiscoverySource::Kubernetes {
                selector: selector.to_owned(),
                namespace: namespace.map(str::to_owned),
                port_name: port_name.map(str::to_owned),
            });
        }
        Err(format!(
            "--discovery {spec}: expected etcd://HOST:PORT or kubernetes"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discovery_specs_are_read_or_refused_naming_the_flag() {
        assert_eq!(
            DiscoveryConfig::parse("etcd://127.0.0.1:2379", "/p/", None, None, None),
            Ok(DiscoverySource::Etcd {
                endpoint: "http://127.0.0.1:2379".into(),
                prefix: "/p/".into()
            })
        );
        let e = DiscoveryConfig::parse("kubernetes", "/p/", None, None, None).unwrap_err();
        assert!(e.contains("--selector"), "{e}");
        let e = DiscoveryConfig::parse("zk://x", "/p/", None, None, None).unwrap_err();
        assert!(e.contains("--discovery"), "{e}");
        let e = DiscoveryConfig::parse("etcd://h:1", "", None, None, None).unwrap_err();
        assert!(e.contains("--discovery-prefix"), "{e}");
    }

    #[test]
    fn a_registration_reads_unknown_fields_and_becomes_a_labelled_entry() {
        let r: Registration = serde_json::from_str(
            r#"{"url":"http://h:1","dp_size":2,"model":"m","lease":"7","extra":1}"#,
        )
        .unwrap();
        let e = r.entry("etcd", "/p/h:1");
        assert_eq!((e.url.as_str(), e.dp_size), ("http://h:1", Some(2)));
        assert_eq!(e.labels["model"], "m");
        assert_eq!(e.labels["discovery_key"], "/p/h:1");
    }
}
