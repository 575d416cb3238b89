//! Fleet settings: where workers are discovered (`--discovery`) and how router replicas sync
//! (`--replica-*`).

use std::time::Duration;

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
    /// The longest wait for one call to the source (an etcd call, a watch's first answer, a
    /// pod's annotations on Kubernetes).
    pub call_timeout: Duration,
    /// Source events that may wait for the driver (which registers workers one at a time); a
    /// source that gets this far ahead waits.
    pub event_backlog: usize,
}

impl DiscoveryConfig {
    /// Default of [`DiscoveryConfig::call_timeout`].
    pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(5);
    /// Default of [`DiscoveryConfig::event_backlog`].
    pub const DEFAULT_EVENT_BACKLOG: usize = 1024;

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

/// Replica sync over NATS (`kvrouter serve --replica-sync nats://HOST:PORT`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaSyncConfig {
    /// The NATS server URL.
    pub url: String,
    /// This replica's id (unique among the replicas; random by default).
    pub replica_id: u64,
    /// This process among any that send as `replica_id`: random and not 0, drawn at start, so
    /// two processes given one id are told apart (`kvrouter_replica_id_conflicts_total`).
    pub instance: u64,
    /// Names the logical router: the prefix of its subjects and buckets (`[A-Za-z0-9_-]+`).
    pub cluster: String,
    /// How often this replica says it is alive (and lists its active requests).
    pub heartbeat: Duration,
    /// A replica not heard from for this long is gone: its load and holds are dropped. Also the
    /// life of the weight-update lease without renewal.
    pub ttl: Duration,
    /// Events waiting to be published at most; more are dropped and counted (the next
    /// heartbeat's active list repairs lost finishes).
    pub outbox_max_events: usize,
    /// Requests one heartbeat's active list holds at most; with more active, the lists go
    /// round the ids in ranges (each request is listed every ⌈active / this⌉ heartbeats).
    pub active_list_max: usize,
    /// Entries read from each key-value bucket on joining, at most.
    pub join_max_keys: usize,
    /// Publish this replica's worker health verdicts and apply the others'.
    pub share_health: bool,
}

impl ReplicaSyncConfig {
    /// Default heartbeat interval.
    pub const DEFAULT_HEARTBEAT: Duration = Duration::from_millis(1000);
    /// Default replica TTL.
    pub const DEFAULT_TTL: Duration = Duration::from_millis(5000);
    /// Default bound of the outgoing queue.
    pub const DEFAULT_OUTBOX_MAX_EVENTS: usize = 65_536;
    /// Default cluster name.
    pub const DEFAULT_CLUSTER: &'static str = "kvrouter";
    /// Default bound of one heartbeat's active list.
    pub const DEFAULT_ACTIVE_LIST_MAX: usize = kvrouter_core::router::DEFAULT_ACTIVE_LIST_MAX;
    /// Default bound of the entries read per bucket on joining.
    pub const DEFAULT_JOIN_MAX_KEYS: usize = 100_000;

    /// Sync with the replicas at `url`, defaults otherwise; the instance is the id (or 1), which
    /// tells processes apart only when each has its own id: a host that may start two
    /// processes under one id sets a random `instance` (the CLI does).
    pub fn new(url: impl Into<String>, replica_id: u64) -> Self {
        Self {
            url: url.into(),
            replica_id,
            instance: replica_id.max(1),
            cluster: Self::DEFAULT_CLUSTER.into(),
            heartbeat: Self::DEFAULT_HEARTBEAT,
            ttl: Self::DEFAULT_TTL,
            outbox_max_events: Self::DEFAULT_OUTBOX_MAX_EVENTS,
            active_list_max: Self::DEFAULT_ACTIVE_LIST_MAX,
            join_max_keys: Self::DEFAULT_JOIN_MAX_KEYS,
            share_health: true,
        }
    }

    /// Checks the values; the error names the flag.
    pub fn validate(&self) -> Result<(), String> {
        if !self.url.starts_with("nats://") {
            return Err(format!(
                "--replica-sync: expected nats://HOST:PORT, got `{}`",
                self.url
            ));
        }
        // Each server of the list must be an address: the client would retry a bad one forever.
        for server in self.url.split(',').map(str::trim) {
            let full = if server.contains("://") {
                server.to_owned()
            } else {
                format!("nats://{server}")
            };
            match reqwest::Url::parse(&full) {
                Ok(u) if u.host_str().is_some_and(|h| !h.is_empty()) => {}
                Ok(_) => return Err(format!("--replica-sync: `{server}` names no host")),
                Err(e) => return Err(format!("--replica-sync: `{server}`: {e}")),
            }
        }
        let ok = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
        if self.cluster.is_empty() || !self.cluster.chars().all(ok) {
            return Err(format!(
                "--replica-cluster: `{}` must be letters, digits, `_` or `-`",
                self.cluster
            ));
        }
        if self.heartbeat.is_zero() {
            return Err("--replica-heartbeat-ms must be at least 1".into());
        }
        if self.ttl <= self.heartbeat * 2 {
            return Err("--replica-ttl-ms must be more than twice --replica-heartbeat-ms".into());
        }
        if self.outbox_max_events == 0 {
            return Err("--replica-outbox-max-events must be at least 1".into());
        }
        if self.active_list_max == 0 {
            return Err("--replica-heartbeat-max-requests must be at least 1".into());
        }
        if self.join_max_keys == 0 {
            return Err("--replica-join-max-keys must be at least 1".into());
        }
        Ok(())
    }
}
