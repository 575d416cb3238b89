//! `kvrouter serve`'s bounds of KV event ingestion (the message size, the index lock's hold,
//! replays).

use crate::headings as H;
use anyhow::bail;
use clap::Args;
use kvrouter_server::{IngestConfig, KvTransport};

/// Bounds of reading and applying the workers' KV events.
#[derive(Debug, Args)]
pub(crate) struct KvEventArgs {
    /// KV event messages larger than this many bytes are dropped (counted as `oversize`) and
    /// the rank re-synced; a frame over 4× this ends the connection.
    #[arg(help_heading = H::KV_EVENTS, long, default_value_t = 8 << 20)]
    kv_event_max_message_bytes: usize,
    /// Blocks of a KV event applied per hold of the index lock (larger events are applied in
    /// slices, letting requests route in between).
    #[arg(help_heading = H::KV_EVENTS, long, default_value_t = 512)]
    kv_event_apply_slice_blocks: usize,
    /// Seconds one replay request to an engine's replay socket may take in all.
    #[arg(help_heading = H::KV_EVENTS, long, default_value_t = 5.0)]
    kv_event_replay_timeout_secs: f64,
    /// What reads the engines' KV event PUB sockets: `zmtp` (each rank's subscriber thread
    /// speaks ZMTP 3.0 on the connection itself: one thread woken per message) or `libzmq` (a
    /// libzmq SUB socket, whose I/O thread reads the connection and wakes the subscriber).
    #[arg(help_heading = H::KV_EVENTS, long, value_enum, default_value_t = Transport::Zmtp)]
    kv_event_transport: Transport,
}

/// `--kv-event-transport`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Transport {
    Libzmq,
    Zmtp,
}

impl KvEventArgs {
    /// The validated ingestion settings.
    pub(crate) fn config(&self) -> anyhow::Result<IngestConfig> {
        if self.kv_event_max_message_bytes == 0 {
            bail!("--kv-event-max-message-bytes must be at least 1");
        }
        if self.kv_event_apply_slice_blocks == 0 {
            bail!("--kv-event-apply-slice-blocks must be at least 1");
        }
        let replay_timeout = crate::flag_values::positive(
            self.kv_event_replay_timeout_secs,
            "--kv-event-replay-timeout-secs",
        )?;
        // 0 (or a nanosecond) would fail every replay at once (found by a probe).
        if replay_timeout < std::time::Duration::from_millis(1) {
            bail!(
                "--kv-event-replay-timeout-secs must be at least 0.001 (a millisecond), got {}",
                self.kv_event_replay_timeout_secs
            );
        }
        Ok(IngestConfig {
            max_message_bytes: self.kv_event_max_message_bytes,
            apply_slice_blocks: self.kv_event_apply_slice_blocks,
            replay_timeout,
            transport: match self.kv_event_transport {
                Transport::Libzmq => KvTransport::Libzmq,
                Transport::Zmtp => KvTransport::Zmtp,
            },
        })
    }
}
