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
pub use crate::config::{DiscoveryConfig, DiscoverySource};
use crate::state::AppState;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Starts the source of `config` and its driver; abort both to stop.
pub(crate) fn spawn(state: &AppState, config: &DiscoveryConfig) -> [JoinHandle<()>; 2] {
    let (tx, rx) = mpsc::channel(config.event_backlog.max(1));
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
            etcd::EtcdClient::with_call_timeout(endpoint, config.call_timeout),
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
                call_timeout: config.call_timeout,
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
    /// The step-time profile the `cost` policy prices it with (default
    /// `--router-cost-profile`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
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
            profile: self.profile.clone(),
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
