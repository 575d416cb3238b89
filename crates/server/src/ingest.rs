//! KV event ingestion: one ZeroMQ SUB per worker rank feeding the core's index.
//!
//! Sequence numbers are checked: a gap is recovered through the engine's replay socket when it
//! has one, otherwise the rank's index is cleared and re-learned from new events; a sequence that
//! restarts at 0 means the engine restarted, so its index is cleared too. Malformed frames are
//! counted and dropped.

use crate::state::Inner;
use bytes::Bytes;
use kvrouter_core::event::KvEvent;
use kvrouter_core::ids::WorkerId;
use kvrouter_kv_wire::{decode_payload, decode_seq, to_kv_events, ConvertOptions};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio::time::timeout;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// Where one rank publishes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Source {
    pub(crate) worker: WorkerId,
    pub(crate) dp_rank: u32,
    pub(crate) endpoint: String,
    pub(crate) replay: Option<String>,
}

pub(crate) fn spawn(state: Arc<Inner>, source: Source) -> JoinHandle<()> {
    tokio::spawn(run(state, source))
}

async fn connect_sub(endpoint: &str) -> SubSocket {
    let mut backoff = Duration::from_millis(50);
    loop {
        let mut sub = SubSocket::new();
        if sub.connect(endpoint).await.is_ok() && sub.subscribe("").await.is_ok() {
            return sub;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

async fn run(state: Arc<Inner>, source: Source) {
    let mut sub = connect_sub(&source.endpoint).await;
    let mut last: Option<u64> = None;
    // Learn what the engine already holds.
    if let Some(replay) = &source.replay {
        last = replay_from(&state, &source, replay, 0, u64::MAX).await;
    }
    loop {
        let Ok(msg) = sub.recv().await else {
            sub = connect_sub(&source.endpoint).await;
            continue;
        };
        let frames = msg.into_vec();
        let (seq, payload) = match frames.as_slice() {
            [_, seq, payload] => match decode_seq(seq) {
                Ok(s) => (s, payload.clone()),
                Err(_) => {
                    drop_message(&state, "malformed");
                    continue;
                }
            },
            _ => {
                drop_message(&state, "malformed");
                continue;
            }
        };
        match last {
            Some(l) if seq <= l && seq != 0 => continue,
            Some(l) if seq == 0 && l > 0 => {
                drop_message(&state, "engine_restart");
                clear(&state, &source);
            }
            Some(l) if seq > l + 1 => {
                drop_message(&state, "sequence_gap");
                let recovered = match &source.replay {
                    Some(replay) => replay_from(&state, &source, replay, l + 1, seq).await,
                    None => None,
                };
                if recovered.is_none_or(|r| r + 1 < seq) {
                    drop_message(&state, "gap_cleared");
                    clear(&state, &source);
                }
            }
            _ => {}
        }
        apply_payload(&state, &source, &payload);
        last = Some(seq);
    }
}

fn drop_message(state: &Inner, reason: &str) {
    state.metrics.kv_messages_dropped.inc(&[("reason", reason)]);
}

fn clear(state: &Inner, source: &Source) {
    let event = KvEvent::Cleared {
        worker: source.worker,
        dp_rank: source.dp_rank,
    };
    let _ = state.lock_core().apply_event(&event);
}

pub(crate) fn apply_payload(state: &Inner, source: &Source, payload: &[u8]) {
    let batch = match decode_payload(payload) {
        Ok(b) => b,
        Err(_) => {
            drop_message(state, "malformed");
            return;
        }
    };
    let opts = ConvertOptions {
        worker: source.worker,
        default_dp_rank: source.dp_rank,
    };
    let converted = to_kv_events(&batch, opts);
    let mut core = state.lock_core();
    for event in converted {
        match event {
            Ok(Some(e)) => {
                let status = match core.apply_event(&e) {
                    Ok(()) => "ok",
                    Err(err) => err.status(),
                };
                state
                    .metrics
                    .kv_events
                    .inc(&[("status", status), ("event_type", e.kind())]);
            }
            Ok(None) => {}
            Err(_) => state
                .metrics
                .kv_events
                .inc(&[("status", "undecodable"), ("event_type", "unknown")]),
        }
    }
}

/// Asks the replay socket for batches from `start`, applying those below `until`. Returns the
/// last sequence number applied.
async fn replay_from(
    state: &Inner,
    source: &Source,
    endpoint: &str,
    start: u64,
    until: u64,
) -> Option<u64> {
    let mut dealer = DealerSocket::new();
    timeout(Duration::from_secs(2), dealer.connect(endpoint))
        .await
        .ok()?
        .ok()?;
    let request = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&start.to_be_bytes()),
    ])
    .ok()?;
    dealer.send(request).await.ok()?;
    let mut last = None;
    for _ in 0..1_000_000u32 {
        let reply = timeout(Duration::from_secs(5), dealer.recv())
            .await
            .ok()?
            .ok()?
            .into_vec();
        // New form [b"", topic, seq, payload]; old form [b"", seq, payload].
        let (seq, payload) = match reply.as_slice() {
            [_, _, seq, payload] | [_, seq, payload] => (decode_seq(seq).ok()?, payload),
            _ => return last,
        };
        if seq == u64::MAX {
            return last;
        }
        if seq < until {
            apply_payload(state, source, payload);
            last = Some(seq);
        }
    }
    last
}
