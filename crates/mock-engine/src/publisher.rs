//! KV events over ZeroMQ: a PUB socket sending `[topic, seq, payload]` in vLLM's wire format, and
//! a ROUTER socket that replays buffered batches to a DEALER asking `[b"", start_seq]`, ending
//! with `[b"", b"", ff×8, b""]`, as vLLM ≥ 0.26 does.

use crate::config::MockEngineConfig;
use crate::StartError;
use bytes::Bytes;
use kvrouter_core::event::KvEvent;
use kvrouter_kv_wire::{encode_payload, from_kv_events};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// Sends event batches to the publisher task.
#[derive(Clone, Debug)]
pub(crate) struct PublisherHandle {
    tx: mpsc::UnboundedSender<Vec<KvEvent>>,
}

impl PublisherHandle {
    /// Queues one step's events; returns whether they were queued.
    pub(crate) fn publish(&self, events: Vec<KvEvent>) -> bool {
        self.tx.send(events).is_ok()
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
    let buffer: Buffer = Arc::new(Mutex::new(VecDeque::new()));
    let mut replay_bound = None;
    if let Some(replay) = &config.kv_events_replay_endpoint {
        let mut router = RouterSocket::new();
        let b = router
            .bind(replay)
            .await
            .map_err(|e| bind_error("kv events replay", replay, e))?;
        replay_bound = Some(b.to_string());
        tokio::spawn(serve_replay(router, buffer.clone(), config.topic.clone()));
    }
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(publish_loop(pub_socket, rx, buffer, config.clone()));
    Ok((
        Some(PublisherHandle { tx }),
        Some(bound.to_string()),
        replay_bound,
    ))
}

async fn publish_loop(
    mut socket: PubSocket,
    mut rx: mpsc::UnboundedReceiver<Vec<KvEvent>>,
    buffer: Buffer,
    config: MockEngineConfig,
) {
    let topic = Bytes::from(config.topic.clone().into_bytes());
    let mut seq: u64 = 0;
    while let Some(events) = rx.recv().await {
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
        {
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
        seq += 1;
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
