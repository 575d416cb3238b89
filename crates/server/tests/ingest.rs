//! KV event ingestion against a scripted publisher: live frames, a sequence gap recovered through
//! the replay socket, a gap without replay clearing the worker's index, a sequence jump to
//! u64::MAX that must not stop ingestion, an oversize message dropped and counted, and a removed
//! worker's subscriber closing its connection.

use bytes::Bytes;
use kvrouter_core::event::{BlockContent, KvEvent, Medium, StoredBlock};
use kvrouter_core::hashing::HashNamespace;
use kvrouter_core::ids::{EngineHash, WorkerId};
use kvrouter_core::router::RouterConfig;
use kvrouter_kv_wire::{encode_payload, from_kv_events};
use kvrouter_server::{ServeConfig, WorkerEntry};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const BS: usize = 4;

type Buffer = Arc<Mutex<Vec<(u64, Bytes)>>>;

/// A batch storing one chain of `blocks` fresh blocks starting at `base`.
fn batch(base: u32, blocks: u32) -> Bytes {
    let event = KvEvent::Stored {
        worker: WorkerId(0),
        dp_rank: 0,
        parent: None,
        blocks: (0..blocks)
            .map(|b| StoredBlock {
                engine_hash: EngineHash(u64::from(base * 100 + b)),
                content: BlockContent::Tokens(
                    (0..BS as u32).map(|t| base * 1000 + b * 10 + t).collect(),
                ),
            })
            .collect(),
        block_size: BS,
        medium: Medium::Gpu,
        namespace: HashNamespace::none(),
    };
    Bytes::from(encode_payload(&from_kv_events(0.0, 0, &[event]).unwrap()))
}

struct FakeEngine {
    publisher: PubSocket,
    buffer: Buffer,
    endpoint: String,
    replay: String,
}

async fn fake_engine() -> FakeEngine {
    let mut publisher = PubSocket::new();
    let endpoint = publisher
        .bind("tcp://127.0.0.1:0")
        .await
        .unwrap()
        .to_string();
    let mut router = RouterSocket::new();
    let replay = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let buffer: Buffer = Arc::new(Mutex::new(Vec::new()));
    let buf = buffer.clone();
    tokio::spawn(async move {
        loop {
            let frames = router.recv().await.unwrap().into_vec();
            let start = u64::from_be_bytes(frames[2].as_ref().try_into().unwrap());
            let batches: Vec<(u64, Bytes)> = buf
                .lock()
                .unwrap()
                .iter()
                .filter(|(s, _)| *s >= start)
                .cloned()
                .collect();
            for (seq, payload) in batches {
                let m = vec![
                    frames[0].clone(),
                    Bytes::new(),
                    Bytes::new(),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload,
                ];
                router.send(ZmqMessage::try_from(m).unwrap()).await.unwrap();
            }
            let end = vec![
                frames[0].clone(),
                Bytes::new(),
                Bytes::new(),
                Bytes::from_static(&[0xff; 8]),
                Bytes::new(),
            ];
            router
                .send(ZmqMessage::try_from(end).unwrap())
                .await
                .unwrap();
        }
    });
    FakeEngine {
        publisher,
        buffer,
        endpoint,
        replay,
    }
}

impl FakeEngine {
    /// Records batch `seq` for replay and, when `live`, publishes it.
    async fn emit(&mut self, seq: u64, payload: Bytes, live: bool) {
        self.buffer.lock().unwrap().push((seq, payload.clone()));
        if live {
            let m = vec![
                Bytes::new(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ];
            self.publisher
                .send(ZmqMessage::try_from(m).unwrap())
                .await
                .unwrap();
        }
    }
}

async fn router_for(engine: &FakeEngine, with_replay: bool) -> kvrouter_server::RunningServer {
    let replay = with_replay.then(|| engine.replay.clone());
    router_with(&engine.endpoint, replay, ServeConfig::default()).await
}

async fn router_with(
    endpoint: &str,
    replay: Option<String>,
    base: ServeConfig,
) -> kvrouter_server::RunningServer {
    let entry = WorkerEntry {
        url: "http://127.0.0.1:9".into(),
        kv_events_endpoint: Some(endpoint.to_owned()),
        replay_endpoint: replay,
        block_size: Some(BS),
        max_num_batched_tokens: Some(8192),
        kv_capacity_blocks: Some(1024),
        ..WorkerEntry::default()
    };
    let config = ServeConfig {
        router: RouterConfig {
            kv_cache_block_size: BS,
            ..RouterConfig::default()
        },
        workers: vec![entry],
        model_names: vec!["m".into()],
        ..base
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    kvrouter_server::start(config, listener).await.unwrap()
}

/// Waits (bounded) until the index holds `want` blocks of worker 0.
async fn until_blocks(
    server: &kvrouter_server::RunningServer,
    want: usize,
    engine: &mut FakeEngine,
    resend: Option<(u64, Bytes)>,
) -> usize {
    let mut seen = 0;
    for _ in 0..400 {
        seen = server.state.cached_gpu_blocks(WorkerId(0));
        if seen == want {
            return seen;
        }
        // A PUB drops messages until the subscription arrives: re-send the probe while waiting.
        if let Some((seq, payload)) = &resend {
            let m = vec![
                Bytes::new(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload.clone(),
            ];
            engine
                .publisher
                .send(ZmqMessage::try_from(m).unwrap())
                .await
                .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    seen
}

#[tokio::test]
async fn a_gap_is_recovered_through_the_replay_socket() {
    let mut engine = fake_engine().await;
    engine.emit(0, batch(1, 2), false).await;
    let server = router_for(&engine, true).await;
    // Seq 0 was never published live: the initial replay brings it.
    assert_eq!(until_blocks(&server, 2, &mut engine, None).await, 2);
    engine.emit(1, batch(2, 3), true).await;
    assert_eq!(
        until_blocks(&server, 5, &mut engine, Some((1, batch(2, 3)))).await,
        5
    );
    // Seqs 2 and 3 are lost on the wire; seq 4 reveals the gap.
    engine.emit(2, batch(3, 1), false).await;
    engine.emit(3, batch(4, 1), false).await;
    engine.emit(4, batch(5, 2), true).await;
    assert_eq!(
        until_blocks(&server, 9, &mut engine, None).await,
        9,
        "the gap was replayed"
    );
    server.stop().await;
}

#[tokio::test]
async fn a_gap_without_replay_clears_and_relearns() {
    let mut engine = fake_engine().await;
    let server = router_for(&engine, false).await;
    engine.emit(0, batch(1, 2), true).await;
    assert_eq!(
        until_blocks(&server, 2, &mut engine, Some((0, batch(1, 2)))).await,
        2
    );
    engine.emit(1, batch(2, 1), false).await;
    engine.emit(2, batch(3, 3), true).await;
    assert_eq!(
        until_blocks(&server, 3, &mut engine, None).await,
        3,
        "cleared, then seq 2 applied"
    );
    server.stop().await;
}

async fn metrics(server: &kvrouter_server::RunningServer) -> String {
    reqwest::get(format!("http://{}/metrics", server.addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

#[tokio::test]
async fn a_sequence_jump_to_u64_max_does_not_stop_ingestion() {
    let mut engine = fake_engine().await;
    let server = router_for(&engine, false).await;
    engine.emit(0, batch(1, 2), true).await;
    assert_eq!(
        until_blocks(&server, 2, &mut engine, Some((0, batch(1, 2)))).await,
        2
    );
    // A broken publisher jumps to the top, then numbers from 1 again.
    engine.emit(u64::MAX, batch(2, 1), true).await;
    engine.emit(1, batch(3, 3), true).await;
    engine.emit(2, batch(4, 1), true).await;
    assert_eq!(
        until_blocks(&server, 4, &mut engine, None).await,
        4,
        "re-synced at seq 1 (cleared), then seqs 1 and 2 applied"
    );
    let m = metrics(&server).await;
    assert!(m.contains("reason=\"seq_backwards\"} 1"), "{m}");
    assert!(
        m.contains("kvrouter_kv_stream_resyncs_total{worker=\"0\",reason=\"seq_backwards\"} 1"),
        "{m}"
    );
    server.stop().await;
}

#[tokio::test]
async fn an_oversize_message_is_dropped_counted_and_the_rank_resynced() {
    let mut engine = fake_engine().await;
    let base = ServeConfig {
        kv_ingest: kvrouter_server::IngestConfig {
            max_message_bytes: 1000,
            ..Default::default()
        },
        ..ServeConfig::default()
    };
    let server = router_with(&engine.endpoint, None, base).await;
    engine.emit(0, batch(1, 2), true).await;
    assert_eq!(
        until_blocks(&server, 2, &mut engine, Some((0, batch(1, 2)))).await,
        2
    );
    assert!(batch(2, 100).len() > 1000);
    engine.emit(1, batch(2, 100), true).await;
    engine.emit(2, batch(3, 1), true).await;
    assert_eq!(
        until_blocks(&server, 1, &mut engine, None).await,
        1,
        "the oversize batch is not applied; the rank was cleared, then seq 2 applied"
    );
    let m = metrics(&server).await;
    assert!(m.contains("reason=\"oversize\"} 1"), "{m}");
    server.stop().await;
}

#[tokio::test]
async fn removing_a_worker_closes_its_subscriber_connection() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    let base = ServeConfig {
        admin_token: Some("t".into()),
        ..ServeConfig::default()
    };
    let server = router_with(&endpoint, None, base).await;
    let (mut conn, _) = tokio::time::timeout(Duration::from_secs(10), listener.accept())
        .await
        .expect("the subscriber connects")
        .unwrap();
    let r = reqwest::Client::new()
        .delete(format!("http://{}/admin/workers/0", server.addr))
        .bearer_auth("t")
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    // Whatever the subscriber sent (its greeting), the connection ends.
    assert!(
        closes(&mut conn).await,
        "the removed worker's subscriber closed its socket"
    );
    server.stop().await;
}

/// Reads from `conn` until the peer closes it (bounded); whether it did.
async fn closes(conn: &mut tokio::net::TcpStream) -> bool {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 256];
    tokio::time::timeout(Duration::from_secs(5), async {
        for _ in 0..1000 {
            match conn.read(&mut buf).await {
                Ok(0) | Err(_) => return true,
                Ok(_) => {}
            }
        }
        false
    })
    .await
    .unwrap_or(false)
}

#[tokio::test]
async fn every_removal_closes_its_subscriber_and_ingestion_goes_on() {
    // Closing a monitored SUB sends its last events to the monitor; a monitor closed first made
    // that send block one of libzmq's threads for good: the next removals left their sockets
    // open and the other workers' streams stalled.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    let base = ServeConfig {
        admin_token: Some("t".into()),
        ..ServeConfig::default()
    };
    let server = router_with(&endpoint, None, base).await;
    let client = reqwest::Client::new();
    let mut id = 0u64;
    for round in 0..4 {
        if round > 0 {
            let added: serde_json::Value = client
                .post(format!("http://{}/admin/workers", server.addr))
                .bearer_auth("t")
                .json(&serde_json::json!({
                    "url": "http://127.0.0.1:9", "kv_events_endpoint": endpoint,
                    "block_size": BS, "max_num_batched_tokens": 8192, "kv_capacity_blocks": 1024}))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            id = added["id"].as_u64().expect("an id");
        }
        let (mut conn, _) = tokio::time::timeout(Duration::from_secs(10), listener.accept())
            .await
            .unwrap_or_else(|_| panic!("round {round}: the subscriber connects"))
            .unwrap();
        let r = client
            .delete(format!("http://{}/admin/workers/{id}", server.addr))
            .bearer_auth("t")
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{}", r.status());
        assert!(
            closes(&mut conn).await,
            "round {round}: the removed worker's subscriber closed its socket"
        );
    }
    server.stop().await;
}

/// A replay that takes longer than the publisher's heartbeat timeout (a libzmq XPUB pinging every
/// 100 ms, dropping a peer silent for 300 ms) keeps the live connection: the subscriber reads it
/// while it waits for the replay, answering the pings, and a message published meanwhile is
/// applied once the replay ends. Before, the connection went unread for the whole replay, the
/// publisher dropped it, and the rank was cleared.
#[tokio::test]
async fn a_long_replay_keeps_the_live_connection_answered() {
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::XPUB).unwrap();
    publisher.set_heartbeat_ivl(100).unwrap();
    publisher.set_heartbeat_timeout(300).unwrap();
    publisher.set_rcvtimeo(10_000).unwrap();
    publisher.bind("tcp://127.0.0.1:*").unwrap();
    let endpoint = publisher.get_last_endpoint().unwrap().unwrap();
    let replayer = ctx.socket(zmq::ROUTER).unwrap();
    replayer.set_rcvtimeo(10_000).unwrap();
    replayer.bind("tcp://127.0.0.1:*").unwrap();
    let replay = replayer.get_last_endpoint().unwrap().unwrap();
    let engine = std::thread::spawn(move || {
        // The subscription, then the replay request; a live message, then the replay's end
        // (nothing to replay) 1.5 s later.
        let subscription = publisher.recv_bytes(0).unwrap();
        assert_eq!(subscription, [1]);
        let request = replayer.recv_multipart(0).unwrap();
        let seq: u64 = 0;
        publisher
            .send_multipart([&b""[..], &seq.to_be_bytes()[..], &batch(1, 3)[..]], 0)
            .unwrap();
        std::thread::sleep(Duration::from_millis(1500));
        let end: [&[u8]; 5] = [&request[0], b"", b"", &[0xff; 8], b""];
        replayer.send_multipart(end, 0).unwrap();
        std::thread::sleep(Duration::from_millis(500));
        (publisher, replayer)
    });
    let server = router_with(&endpoint, Some(replay), ServeConfig::default()).await;
    let mut applied = 0;
    for _ in 0..300 {
        applied = server.state.cached_gpu_blocks(WorkerId(0));
        if applied == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(applied, 3, "the message held during the replay was applied");
    let sockets = tokio::task::spawn_blocking(move || engine.join().unwrap())
        .await
        .unwrap();
    let m = metrics(&server).await;
    assert!(
        !m.contains("kvrouter_kv_stream_breaks_total{"),
        "the connection was kept through the replay:\n{}",
        m.lines()
            .filter(|l| l.contains("kv_stream"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    drop(sockets);
    server.stop().await;
}
