//! `kvrouter serve`'s flags of requests to the workers: retries, migration, stream timeouts
//! and coalescing, connection and answer timeouts.

use crate::flag_values::{at_most, positive, secs};
use crate::headings as H;
use clap::Args;
use std::time::Duration;

/// Retries, migration and the timeouts of upstream requests and streams.
#[derive(Debug, Args)]
pub(crate) struct UpstreamArgs {
    /// Retries on another worker when an upstream fails before its first byte.
    #[arg(help_heading = H::UPSTREAM, long, default_value_t = 2)]
    pub(crate) retries: u32,
    /// Times a failed stream may be continued on another worker (0 = never).
    #[arg(help_heading = H::UPSTREAM, long, default_value_t = 0)]
    pub(crate) migration_limit: u32,
    /// A stream silent for this many seconds counts as failed (its worker too; the stream is
    /// migrated or ended with an error event); 0 = never.
    #[arg(help_heading = H::UPSTREAM, long, default_value_t = 300.0)]
    stream_idle_timeout_secs: f64,
    /// Chunks of a worker's stream that are already there when one comes go to the client as
    /// one write, up to this many bytes (0 = each chunk alone; at most 16777216).
    #[arg(help_heading = H::UPSTREAM, long, default_value_t = 65536)]
    stream_coalesce_max_bytes: usize,
    /// Before passing such a batch on, yield to the scheduler (lets the worker connection hand
    /// over chunks it already read; no data is waited for) until this many turns in a row
    /// brought nothing; 0 = never; at most 64.
    #[arg(help_heading = H::UPSTREAM, long, default_value_t = 2)]
    stream_coalesce_yields: u32,
    /// The longest, in microseconds, a batch waits in those turns after its first chunk came
    /// (at most 1000000).
    #[arg(help_heading = H::UPSTREAM, long, default_value_t = 500)]
    stream_coalesce_max_hold_us: u64,
    /// A streamed answer's status and headers wait up to this many milliseconds for its first
    /// chunk, so that both reach the client in one write (0 = only a chunk already there; at
    /// most 10000). The first token comes no later; only the headers may.
    #[arg(help_heading = H::UPSTREAM, long, default_value_t = 100)]
    stream_head_hold_ms: u64,
    /// Seconds to open a connection to a worker before it counts as failed.
    #[arg(help_heading = H::UPSTREAM, long, default_value_t = 5.0)]
    upstream_connect_timeout_secs: f64,
    /// Seconds a worker gets to send a streamed request's response headers before the request
    /// is retried elsewhere and the worker counts as failed.
    #[arg(help_heading = H::UPSTREAM, long, default_value_t = 60.0)]
    upstream_first_byte_timeout_secs: f64,
    /// Seconds a worker gets to answer a non-streamed request (engines send its headers with
    /// the whole answer) before it is retried elsewhere and the worker counts as failed.
    #[arg(help_heading = H::UPSTREAM, long, default_value_t = 600.0)]
    upstream_response_timeout_secs: f64,
}

/// Largest `--stream-coalesce-max-bytes`.
const MAX_STREAM_COALESCE_BYTES: usize = 16 << 20;
/// Largest `--stream-coalesce-yields`.
const MAX_STREAM_COALESCE_YIELDS: u32 = 64;
/// Largest `--stream-coalesce-max-hold-us` (one second).
const MAX_STREAM_COALESCE_HOLD_US: u64 = 1_000_000;
/// Largest `--stream-head-hold-ms` (ten seconds).
const MAX_STREAM_HEAD_HOLD_MS: u64 = 10_000;

impl UpstreamArgs {
    /// `--stream-idle-timeout-secs` (`None` for 0: never).
    pub(crate) fn stream_idle_timeout(&self) -> anyhow::Result<Option<Duration>> {
        Ok(secs(
            Some(self.stream_idle_timeout_secs),
            "--stream-idle-timeout-secs",
        )?
        .filter(|d| !d.is_zero()))
    }

    /// `--stream-coalesce-max-bytes`, bounded.
    pub(crate) fn stream_coalesce_max_bytes(&self) -> anyhow::Result<usize> {
        at_most(
            self.stream_coalesce_max_bytes,
            MAX_STREAM_COALESCE_BYTES,
            "--stream-coalesce-max-bytes",
        )
    }

    /// `--stream-coalesce-yields`, bounded.
    pub(crate) fn stream_coalesce_yields(&self) -> anyhow::Result<u32> {
        at_most(
            self.stream_coalesce_yields,
            MAX_STREAM_COALESCE_YIELDS,
            "--stream-coalesce-yields",
        )
    }

    /// `--stream-coalesce-max-hold-us`, bounded.
    pub(crate) fn stream_coalesce_max_hold(&self) -> anyhow::Result<Duration> {
        at_most(
            self.stream_coalesce_max_hold_us,
            MAX_STREAM_COALESCE_HOLD_US,
            "--stream-coalesce-max-hold-us",
        )
        .map(Duration::from_micros)
    }

    /// `--stream-head-hold-ms`, bounded.
    pub(crate) fn stream_head_hold(&self) -> anyhow::Result<Duration> {
        at_most(
            self.stream_head_hold_ms,
            MAX_STREAM_HEAD_HOLD_MS,
            "--stream-head-hold-ms",
        )
        .map(Duration::from_millis)
    }

    /// `--upstream-connect-timeout-secs`.
    pub(crate) fn connect_timeout(&self) -> anyhow::Result<Duration> {
        positive(
            self.upstream_connect_timeout_secs,
            "--upstream-connect-timeout-secs",
        )
    }

    /// `--upstream-first-byte-timeout-secs`.
    pub(crate) fn first_byte_timeout(&self) -> anyhow::Result<Duration> {
        positive(
            self.upstream_first_byte_timeout_secs,
            "--upstream-first-byte-timeout-secs",
        )
    }

    /// `--upstream-response-timeout-secs`.
    pub(crate) fn response_timeout(&self) -> anyhow::Result<Duration> {
        positive(
            self.upstream_response_timeout_secs,
            "--upstream-response-timeout-secs",
        )
    }
}
