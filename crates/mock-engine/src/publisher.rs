//! KV events over ZeroMQ: a PUB socket sending `[topic, seq, payload]` in vLLM's wire format, and
//! a ROUTER socket that replays buffered batches to a DEALER asking `[b"", start_seq]`, ending
//! with `[b"", b"", ff×8, b""]`, as vLLM ≥ 0.26 does.
//!
//! The engine hands each step's events to the publisher task through a queue of at most
//! [`QUEUE_BATCHES`] batches (vLLM's `max_queue_size`). A batch that finds it full is dropped
//! and counted, and its sequence number is spent all the same, so subscribers see the gap (as
//! for a message lost past the high-water mark) and re-sync. The queue had no bound: a publisher
//! slower than the engine held every batch not yet sent.

use crate::config::MockEngineConfig;
use crate::StartError;
use bytes::Bytes;
use kvrouter_core::event::KvEvent;
use kvrouter_kv_wire::{encode_payload, from_kv_events};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// Batches waiting for the publisher task at most (vLLM's `max_queue_size`).
pub(crate) const QUEUE_BATCHES: usize = 100_000;

/// Sends event batches to the publisher task.
#[derive(Clone, Debug)]
pub(crate) struct PublisherHandle {
    tx: mpsc::Sender<(u64, Vec<KvEvent>)>,
    /// The next batch's sequence number (one per batch queued or dropped).
    seq: Arc<AtomicU64>,
}

/// What became of a batch handed to the publisher.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Published {
    /// Queued for sending.
    Queued,
    /// The queue was full: dropped, its sequence number spent (subscribers see a gap).
    Dropped,
    /// The publisher task is gone.
    Closed,
}

impl PublisherHandle {
    /// A handle and the receiving end of a queue of `capacity` batches.
    fn queue(capacity: usize) -> (Self, mpsc::Receiver<(u64, Vec<KvEvent>)>) {
        let (tx, rx) = mpsc::channel(capacity);
        let seq = Arc::new(AtomicU64::new(0));
        (Self { tx, seq }, rx)
    }

    /// Queues one step's events under the next sequence number.
    pub(crate) fn publish(&self, events: Vec<KvEvent>) -> Published {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        match self.tx.try_send((seq, events)) {
            Ok(()) => Published::Queued,
            Err(mpsc::error::TrySendError::Full(_)) => Published::Dropped,
            Err(mpsc::error::TrySendError::Closed(_)) => Published::Closed,
        }
    }
}

fn bind_error(what: &'static str, endpoint: &str, e: impl std::fmt::Display) -> StartError {
    StartError::Bind {
        what,
        endpoint: endpoint.to_owned(),
        reason: e.to_string(),
    }
}

/// Binds the sockets and spawns their tasks. Returns the handle and the bound endpoints.
pub(crate) async fn start(
    config: &MockEngineConfig,
) -> Result<(Option<PublisherHandle>, Option<String>, Option<String>), StartError> {
    let Some(endpoint) = &config.kv_events_endpoint else {
        return Ok((None, None, None));
    };
    let mut pub_socket = PubSocket::new();
    let bound = pub_socket
        .bind(endpoint)
        .await
        .map_err(|e| bind_error("kv events", endpoint, e))?;
    // Batches are kept for replay only when something can ask for them.
    let buffer: Option<Buffer> = config
        .kv_events_replay_endpoint
        .as_ref()
        .map(|_| Arc::new(Mutex::new(VecDeque::new())));
    let mut replay_bound = None;
    if let (Some(replay), Some(buffer)) = (&config.kv_events_replay_endpoint, &buffer) {
        let mut router = RouterSocket::new();
        let b = router
            .bind(replay)
            .await
            .map_err(|e| bind_error("kv events replay", replay, e))?;
        replay_bound = Some(b.to_string());
        tokio::spawn(serve_replay(router, buffer.clone(), config.topic.clone()));
    }
    let (handle, rx) = PublisherHandle::queue(QUEUE_BATCHES);
    tokio::spawn(publish_loop(pub_socket, rx, buffer, config.clone()));
    Ok((Some(handle), Some(bound.to_string()), replay_bound))
}

async fn publish_loop(
    mut socket: PubSocket,
    mut rx: mpsc::Receiver<(u64, Vec<KvEvent>)>,
    buffer: Option<Buffer>,
    config: MockEngineConfig,
) {
    let topic = Bytes::from(config.topic.clone().into_bytes());
    while let Some((seq, events)) = rx.recv().await {
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let batch = match from_kv_events(ts, config.dp_rank, &events) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!("dropping an event batch that cannot be encoded: {e}");
                continue;
            }
        };
        let payload = Bytes::from(encode_payload(&batch));
        if let Some(buffer) = &buffer {
            let mut buf = buffer.lock().expect("replay buffer lock");
            buf.push_back((seq, payload.clone()));
            while buf.len() > config.replay_buffer_steps.max(1) {
                buf.pop_front();
            }
        }
        let frames = vec![
            topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ];
        if let Ok(msg) = ZmqMessage::try_from(frames) {
            if let Err(e) = socket.send(msg).await {
                tracing::warn!("publishing KV events: {e}");
            }
        }
    }
}

async fn serve_replay(mut socket: RouterSocket, buffer: Buffer, topic: String) {
    let topic = Bytes::from(topic.into_bytes());
    loop {
        let Ok(msg) = socket.recv().await else {
            continue;
        };
        let frames = msg.into_vec();
        // [identity, b"", start_seq]; anything else is ignored, as vLLM does.
        let [identity, empty, start] = frames.as_slice() else {
            continue;
        };
        if !empty.is_empty() {
            continue;
        }
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()) else {
            continue;
        };
        let start = u64::from_be_bytes(start);
        let batches: Vec<(u64, Bytes)> = {
            let buf = buffer.lock().expect("replay buffer lock");
            buf.iter().filter(|(s, _)| *s >= start).cloned().collect()
        };
        for (seq, payload) in batches {
            let reply = vec![
                identity.clone(),
                Bytes::new(),
                topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ];
            if let Ok(m) = ZmqMessage::try_from(reply) {
                let _ = socket.send(m).await;
            }
        }
        let end = vec![
            identity.clone(),
            Bytes::new(),
            Bytes::new(),
            Bytes::from_static(&[0xff; 8]),
            Bytes::new(),
        ];
        if let Ok(m) = ZmqMessage::try_from(end) {
            let _ = socket.send(m).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_full_queue_drops_the_batch_and_spends_its_sequence_number() {
        let (handle, mut rx) = PublisherHandle::queue(2);
        let batch = || {
            vec![KvEvent::Cleared {
                worker: kvrouter_core::ids::WorkerId(0),
                dp_rank: 0,
            }]
        };
        assert_eq!(handle.publish(batch()), Published::Queued);
        assert_eq!(handle.publish(batch()), Published::Queued);
        assert_eq!(handle.publish(batch()), Published::Dropped);
        assert_eq!(rx.recv().await.map(|(seq, _)| seq), Some(0));
        assert_eq!(handle.publish(batch()), Published::Queued);
        let seqs = [rx.recv().await, rx.recv().await].map(|b| b.map(|(seq, _)| seq));
        // The subscriber sees 0, 1, 3: the gap says a batch was lost.
        assert_eq!(seqs, [Some(1), Some(3)]);
        drop(rx);
        assert_eq!(handle.publish(batch()), Published::Closed);
    }
}
