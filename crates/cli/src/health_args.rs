//! `kvrouter serve`'s flags of worker health: active checks and passive outlier detection.

use crate::flag_values::secs;
use crate::headings as H;
use clap::Args;
use kvrouter_server::HealthConfig;

/// Health checks, the thresholds of a worker's state, and the grace of its index entries.
#[derive(Debug, Args)]
pub(crate) struct HealthArgs {
    /// Seconds between active health checks (GET /health); 0 turns them off.
    #[arg(help_heading = H::HEALTH, long, default_value_t = 5.0)]
    health_check_interval_secs: f64,
    /// Consecutive failed health checks that make a worker unhealthy.
    #[arg(help_heading = H::HEALTH, long, default_value_t = 3)]
    health_failure_threshold: u32,
    /// Consecutive passed checks or requests that make it healthy again.
    #[arg(help_heading = H::HEALTH, long, default_value_t = 2)]
    health_recovery_threshold: u32,
    /// Consecutive failed requests (connection errors, 5xx, broken streams) that make a worker
    /// unhealthy.
    #[arg(help_heading = H::HEALTH, long, default_value_t = 3)]
    outlier_consecutive_failures: u32,
    /// Seconds an unhealthy worker keeps its cache entries in the index.
    #[arg(help_heading = H::HEALTH, long, default_value_t = 30.0)]
    unhealthy_index_grace_secs: f64,
}

impl HealthArgs {
    /// The validated health settings.
    pub(crate) fn config(&self) -> anyhow::Result<HealthConfig> {
        Ok(HealthConfig {
            interval: secs(
                Some(self.health_check_interval_secs),
                "--health-check-interval-secs",
            )?
            .filter(|d| !d.is_zero()),
            failure_threshold: self.health_failure_threshold.max(1),
            recovery_threshold: self.health_recovery_threshold.max(1),
            outlier_failures: self.outlier_consecutive_failures.max(1),
            index_grace: secs(
                Some(self.unhealthy_index_grace_secs),
                "--unhealthy-index-grace-secs",
            )?
            .unwrap_or_default(),
        })
    }
}
