//! Discovery flags: `kvrouter serve --discovery ...` (where the router finds workers) and
//! `kvrouter mock-engine --register ...` (an engine registering itself).

use crate::flag_values::{non_negative, positive};
use crate::headings as H;
use anyhow::{bail, Context};
use clap::Args;
use kvrouter_server::discovery::etcd::{EtcdClient, Registered};
use kvrouter_server::discovery::{DiscoveryConfig, Registration};
use std::time::Duration;

/// The default etcd key prefix of worker registrations.
const DEFAULT_PREFIX: &str = "/kvrouter/workers/";

/// `kvrouter serve`'s discovery flags.
#[derive(Debug, Args)]
pub(crate) struct DiscoveryArgs {
    /// Discover workers: `etcd://HOST:PORT` (keys under --discovery-prefix, each a JSON
    /// registration under a lease) or `kubernetes` (EndpointSlices matching --selector).
    #[arg(help_heading = H::DISCOVERY, long)]
    discovery: Option<String>,
    /// etcd key prefix of worker registrations.
    #[arg(help_heading = H::DISCOVERY, long, default_value = DEFAULT_PREFIX)]
    discovery_prefix: String,
    /// Kubernetes label selector of the EndpointSlices to watch, e.g. app=vllm.
    #[arg(help_heading = H::DISCOVERY, long)]
    selector: Option<String>,
    /// Kubernetes namespace (default: the kube config's).
    #[arg(help_heading = H::DISCOVERY, long)]
    namespace: Option<String>,
    /// Name of the EndpointSlice port to route to (default: the first port).
    #[arg(help_heading = H::DISCOVERY, long)]
    port_name: Option<String>,
    /// Seconds a removed worker keeps its index entries (it gets no new requests meanwhile;
    /// requests in flight finish).
    #[arg(help_heading = H::DISCOVERY, long, default_value_t = 30.0)]
    discovery_drain_grace_secs: f64,
    /// Longest wait in seconds between reconnects to the discovery source (waits double from
    /// 0.1 s up to this).
    #[arg(help_heading = H::DISCOVERY, long, default_value_t = 5.0)]
    discovery_backoff_max_secs: f64,
    /// Longest wait in milliseconds for one call to the discovery source (an etcd call or a
    /// watch's first answer; a pod's annotations on Kubernetes); a call that takes longer
    /// counts as a failure and the source reconnects.
    #[arg(help_heading = H::DISCOVERY, long, default_value_t = 5000)]
    discovery_call_timeout_ms: u64,
    /// Discovered changes that may wait to be applied (workers are registered one at a time);
    /// beyond this the source waits before reading more.
    #[arg(help_heading = H::DISCOVERY, long, default_value_t = 1024)]
    discovery_event_backlog: usize,
}

impl DiscoveryArgs {
    /// Whether a discovery source is set.
    pub(crate) fn enabled(&self) -> bool {
        self.discovery.is_some()
    }

    /// The validated discovery settings (`None` without --discovery).
    pub(crate) fn config(&self) -> anyhow::Result<Option<DiscoveryConfig>> {
        let Some(spec) = &self.discovery else {
            return Ok(None);
        };
        let source = DiscoveryConfig::parse(
            spec,
            &self.discovery_prefix,
            self.selector.as_deref(),
            self.namespace.as_deref(),
            self.port_name.as_deref(),
        )
        .map_err(anyhow::Error::msg)?;
        let backoff_max = positive(
            self.discovery_backoff_max_secs,
            "--discovery-backoff-max-secs",
        )?;
        if self.discovery_call_timeout_ms == 0 {
            bail!("--discovery-call-timeout-ms must be at least 1");
        }
        if self.discovery_event_backlog == 0 {
            bail!("--discovery-event-backlog must be at least 1");
        }
        Ok(Some(DiscoveryConfig {
            source,
            drain_grace: non_negative(
                self.discovery_drain_grace_secs,
                "--discovery-drain-grace-secs",
            )?,
            backoff_max,
            call_timeout: crate::flag_values::millis(
                self.discovery_call_timeout_ms,
                "--discovery-call-timeout-ms",
            )?,
            event_backlog: self.discovery_event_backlog,
        }))
    }
}

/// `kvrouter mock-engine`'s registration flags.
#[derive(Debug, Args)]
pub(crate) struct RegisterArgs {
    /// Register this engine for discovery: `etcd://HOST:PORT`.
    #[arg(long)]
    register: Option<String>,
    /// etcd key prefix to register under (the key is PREFIX + host:port of the HTTP address).
    #[arg(long, default_value = DEFAULT_PREFIX)]
    register_prefix: String,
    /// Lease TTL in whole seconds: how long the registration outlives a crashed engine.
    #[arg(long, default_value_t = 10)]
    register_ttl_secs: u64,
}

impl RegisterArgs {
    /// Checks the flags before the engine starts.
    pub(crate) fn validate(&self) -> anyhow::Result<()> {
        if let Some(r) = &self.register {
            self.endpoint(r)?;
            if self.register_ttl_secs == 0 {
                bail!("--register-ttl-secs must be at least 1");
            }
            if self.register_prefix.is_empty() {
                bail!("--register-prefix must not be empty");
            }
        }
        Ok(())
    }

    fn endpoint(&self, spec: &str) -> anyhow::Result<String> {
        match spec.strip_prefix("etcd://") {
            Some(rest) if !rest.is_empty() && !rest.contains('/') => Ok(format!("http://{rest}")),
            _ => bail!("--register {spec}: expected etcd://HOST:PORT"),
        }
    }

    /// Registers `registration` (when --register is set) and keeps it alive.
    pub(crate) async fn start(
        &self,
        registration: &Registration,
        http_addr: &str,
    ) -> anyhow::Result<Option<Registered>> {
        let Some(spec) = &self.register else {
            return Ok(None);
        };
        let client = EtcdClient::new(&self.endpoint(spec)?);
        let key = format!("{}{http_addr}", self.register_prefix);
        let ttl = crate::flag_values::bounded(
            Duration::from_secs(self.register_ttl_secs),
            &format!("{} seconds", self.register_ttl_secs),
            "--register-ttl-secs",
        )?;
        let registered = Registered::start(client, key, registration, ttl)
            .await
            .with_context(|| format!("--register {spec}"))?;
        Ok(Some(registered))
    }
}
