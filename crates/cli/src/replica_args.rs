//! `kvrouter serve`'s flags of router replicas sharing their state over NATS.

use crate::flag_values::millis;
use crate::headings as H;
use clap::Args;
use kvrouter_server::config::ReplicaSyncConfig;

/// Replica sync: where the replicas meet, who this one is, and the bounds of what they share.
#[derive(Debug, Args)]
pub(crate) struct ReplicaArgs {
    /// Share load, predicted placements, sessions, groups, policy versions, pauses and the
    /// weight-update lease with the other replicas of this router over NATS
    /// (`nats://HOST:PORT`, JetStream on). Off by default: one router alone.
    #[arg(help_heading = H::REPLICAS, long, value_name = "nats://HOST:PORT")]
    replica_sync: Option<String>,
    /// This replica's id among the replicas: a whole number, unique among them (default:
    /// random). Needs --replica-sync.
    #[arg(help_heading = H::REPLICAS, long, value_name = "N", requires = "replica_sync")]
    replica_id: Option<u64>,
    /// Name of the logical router the replicas form: the prefix of its NATS subjects and
    /// key-value buckets (letters, digits, `_`, `-`).
    #[arg(help_heading = H::REPLICAS, long, default_value = "kvrouter")]
    replica_cluster: String,
    /// Milliseconds between this replica's heartbeats (each lists its active requests).
    #[arg(help_heading = H::REPLICAS, long, default_value_t = 1000)]
    replica_heartbeat_ms: u64,
    /// A replica not heard from for this many milliseconds is gone: its load and update holds
    /// are dropped; also the life of an unrenewed weight-update lease. More than twice the
    /// heartbeat.
    #[arg(help_heading = H::REPLICAS, long, default_value_t = 5000)]
    replica_ttl_ms: u64,
    /// Events waiting to be published to the other replicas, at most; more are dropped and
    /// counted (the next heartbeat repairs lost finishes).
    #[arg(help_heading = H::REPLICAS, long, default_value_t = 65536)]
    replica_outbox_max_events: usize,
    /// Requests one heartbeat lists at most (each with its worker, prompt tokens and blocks, so
    /// the others restore a lost begin); with more active, the lists go round the requests in
    /// ranges of ids.
    #[arg(help_heading = H::REPLICAS, long, default_value_t = 4096)]
    replica_heartbeat_max_requests: usize,
    /// Entries read from each shared key-value bucket (members, sessions, policy) on joining,
    /// at most.
    #[arg(help_heading = H::REPLICAS, long, default_value_t = 100_000)]
    replica_join_max_keys: usize,
    /// Keep worker health verdicts to this replica: do not publish its ejections and
    /// recoveries, and do not apply the other replicas'.
    #[arg(help_heading = H::REPLICAS, long)]
    no_replica_share_health: bool,
}

impl ReplicaArgs {
    /// Whether `--replica-sync` was given.
    pub(crate) fn enabled(&self) -> bool {
        self.replica_sync.is_some()
    }

    /// The validated sync settings (`None` without --replica-sync).
    pub(crate) fn config(&self) -> anyhow::Result<Option<ReplicaSyncConfig>> {
        let Some(url) = &self.replica_sync else {
            return Ok(None);
        };
        // OS-seeded: a replica restarted without --replica-id is a new replica.
        let id = self.replica_id.unwrap_or_else(|| os_random() >> 11);
        let config = ReplicaSyncConfig {
            url: url.clone(),
            replica_id: id,
            instance: os_random().max(1),
            cluster: self.replica_cluster.clone(),
            heartbeat: millis(self.replica_heartbeat_ms, "--replica-heartbeat-ms")?,
            ttl: millis(self.replica_ttl_ms, "--replica-ttl-ms")?,
            outbox_max_events: self.replica_outbox_max_events,
            active_list_max: self.replica_heartbeat_max_requests,
            join_max_keys: self.replica_join_max_keys,
            share_health: !self.no_replica_share_health,
        };
        config.validate().map_err(anyhow::Error::msg)?;
        Ok(Some(config))
    }
}

/// A random number per call (std's OS-seeded hasher keys; no RNG crate needed).
fn os_random() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.finish()
}
