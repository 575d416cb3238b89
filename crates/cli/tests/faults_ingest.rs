//! Faults on the KV event path, with real processes on loopback: an engine killed with -9 and
//! started again on the same ports is re-subscribed and its new events applied; and a raw-TCP
//! "publisher" sending random bytes, a READY command after the handshake, seq u64::MAX,
//! malformed msgpack, truncated frames and oversize messages neither kills ingestion nor stops
//! it: a valid batch sent afterwards is always applied.

mod common;

#[path = "faults_ingest/zmtp.rs"]
mod zmtp;

use kvrouter_core::event::{BlockContent, KvEvent, Medium, StoredBlock};
use kvrouter_core::hashing::HashNamespace;
use kvrouter_core::ids::{EngineHash, WorkerId};
use kvrouter_kv_wire::{encode_payload, from_kv_events};
use serde_json::json;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use zmtp::{event_message, noise, RawPub};

const BS: usize = 64;

/// Sum of the samples of `name` whose labels contain every fragment of `labels`.
fn sample(text: &str, name: &str, labels: &[&str]) -> u64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| labels.iter().all(|f| l.contains(f)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

fn cached(text: &str, worker: u64) -> u64 {
    let w = format!("worker=\"{worker}\"");
    sample(text, "kvrouter_worker_cached_blocks", &[&w])
}

/// Polls `/metrics` until `ok` holds or `within` passes; returns the last text and whether it held.
async fn until(base: &str, within: Duration, ok: impl Fn(&str) -> bool) -> (String, bool) {
    let ok = &ok;
    let held = common::poll(within, || async move {
        let text = common::metrics(base).await;
        ok(&text).then_some(text)
    })
    .await;
    match held {
        Some(text) => (text, true),
        None => (common::metrics(base).await, false),
    }
}

fn workers_file(name: &str, body: &str) -> String {
    let path = std::env::temp_dir().join(format!(
        "kvrouter-faults-ingest-{}-{name}.toml",
        std::process::id()
    ));
    std::fs::write(&path, body).unwrap();
    path.to_string_lossy().into_owned()
}

async fn engine(port: &str, kv: &str, replay: &str) -> common::Proc {
    common::spawn(&[
        "mock-engine",
        "--port",
        port,
        "--speedup-ratio",
        "20",
        "--kv-events-endpoint",
        kv,
        "--kv-events-replay-endpoint",
        replay,
    ])
    .await
}

async fn complete(url: &str, prompt: &str) {
    let body = json!({"model": "mock-model", "prompt": prompt, "max_tokens": 2});
    let r = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
}

fn port_of(endpoint: &str) -> String {
    endpoint
        .rsplit(':')
        .next()
        .unwrap()
        .trim_matches('/')
        .to_owned()
}

#[tokio::test]
async fn a_restarted_engine_is_resubscribed_and_its_new_events_applied() {
    let mut engines = Vec::new();
    for _ in 0..3 {
        engines.push(engine("0", "tcp://127.0.0.1:0", "tcp://127.0.0.1:0").await);
    }
    let mut file = String::new();
    for (i, e) in engines.iter().enumerate() {
        file.push_str(&format!(
            "[[workers]]\nid = {}\nurl = \"{}\"\nkv_events_endpoint = \"{}\"\nreplay_endpoint = \"{}\"\n",
            i + 1,
            e.http(),
            e.field("kv_events"),
            e.field("replay")
        ));
    }
    let path = workers_file("restart", &file);
    let router = common::spawn(&[
        "serve",
        "--port",
        "0",
        "--workers-file",
        &path,
        "--health-check-interval-secs",
        "0.2",
    ])
    .await;
    let base = router.http();
    let prompt = "the quick brown fox jumps over the lazy dog ".repeat(40);
    complete(&engines[1].http(), &prompt).await;
    let (_, ok) = until(&base, Duration::from_secs(10), |m| cached(m, 2) > 0).await;
    assert!(ok, "worker 2's events are applied before the fault");

    // kill -9, then the same ports again.
    let (http, kv, replay) = (
        engines[1].http(),
        engines[1].field("kv_events"),
        engines[1].field("replay"),
    );
    engines[1].child.start_kill().unwrap();
    engines[1].child.wait().await.unwrap();
    let (m, ok) = until(&base, Duration::from_secs(10), |m| {
        sample(m, "kvrouter_kv_stream_breaks_total", &["worker=\"2\""]) >= 1 && cached(m, 2) == 0
    })
    .await;
    assert!(ok, "the break is counted and the rank cleared:\n{m}");
    engines[1] = engine(&port_of(&http), &kv, &replay).await;
    let back = Instant::now();
    let (m, ok) = until(&base, Duration::from_secs(5), |m| {
        sample(
            m,
            "kvrouter_kv_stream_resyncs_total",
            &["worker=\"2\"", "reason=\"reconnect\""],
        ) >= 1
    })
    .await;
    assert!(ok, "the stream came back and was re-synced:\n{m}");
    eprintln!("re-synced {:?} after the engine came back", back.elapsed());
    complete(&engines[1].http(), &format!("another prompt {prompt}")).await;
    let (m, ok) = until(&base, Duration::from_secs(5), |m| cached(m, 2) > 0).await;
    assert!(ok, "events of the new process are applied:\n{m}");
    let _ = std::fs::remove_file(path);
}

/// A batch that clears the rank and stores `n` fresh blocks: once applied, the rank holds
/// exactly `n` blocks whatever came before.
fn probe_batch(n: usize) -> Vec<u8> {
    let stored = KvEvent::Stored {
        worker: WorkerId(0),
        dp_rank: 0,
        parent: None,
        blocks: (0..n as u32)
            .map(|b| StoredBlock {
                engine_hash: EngineHash(u64::from(n as u32 * 1000 + b)),
                content: BlockContent::Tokens(
                    (0..BS as u32)
                        .map(|t| n as u32 * 100_000 + b * 100 + t)
                        .collect(),
                ),
            })
            .collect(),
        block_size: BS,
        medium: Medium::Gpu,
        namespace: HashNamespace::none(),
    };
    let cleared = KvEvent::Cleared {
        worker: WorkerId(0),
        dp_rank: 0,
    };
    encode_payload(&from_kv_events(0.0, 0, &[cleared, stored]).unwrap())
}

/// A router following `raw` as worker 7's KV event publisher (workers file `name`), with `extra`
/// flags; and the workers file's path, to remove.
async fn router_for(raw: &RawPub, name: &str, extra: &[&str]) -> (common::Proc, String) {
    let file = format!(
        "[[workers]]\nid = 7\nurl = \"http://127.0.0.1:9\"\nkv_events_endpoint = \"{}\"\nblock_size = {BS}\nmax_num_batched_tokens = 8192\nkv_capacity_blocks = 4096\n",
        raw.endpoint()
    );
    let path = workers_file(name, &file);
    let mut args = vec![
        "serve",
        "--port",
        "0",
        "--workers-file",
        &path,
        "--model-name",
        "m",
        "--health-check-interval-secs",
        "0",
    ];
    args.extend_from_slice(extra);
    let router = common::spawn(&args).await;
    (router, path)
}

struct Fuzz {
    raw: RawPub,
    conn: TcpStream,
    base: String,
}

impl Fuzz {
    async fn reconnect(&mut self) {
        self.conn = self.raw.accept_handshaken().await;
    }

    async fn send(&mut self, bytes: &[u8]) {
        // The router may have dropped the connection already: that is allowed.
        let _ = self.conn.write_all(bytes).await;
    }

    /// Sends a valid batch of `n` blocks; it must be applied, on this connection or, when the
    /// router dropped it for a protocol error, on the next one.
    async fn probe(&mut self, seq: u64, n: u64, case: &str) {
        let msg = event_message(seq, &probe_batch(n as usize));
        self.send(&msg).await;
        let (_, ok) = until(&self.base, Duration::from_secs(3), |m| cached(m, 7) == n).await;
        if ok {
            return;
        }
        self.reconnect().await;
        self.send(&msg).await;
        let (m, ok) = until(&self.base, Duration::from_secs(10), |m| cached(m, 7) == n).await;
        assert!(ok, "ingestion continues after {case}:\n{m}");
    }
}

#[tokio::test]
async fn adversarial_publishers_never_stop_ingestion() {
    let raw = RawPub::bind().await;
    let (router, path) = router_for(&raw, "fuzz", &["--kv-event-max-message-bytes", "65536"]).await;
    // Random bytes instead of a greeting, then a greeting followed by random bytes.
    let mut conn = raw.accept().await;
    let _ = conn.write_all(&noise(1, 4096)).await;
    drop(conn);
    let mut conn = raw.accept().await;
    let _ = conn.write_all(&zmtp::greeting()).await;
    let _ = conn.write_all(&noise(2, 4096)).await;
    drop(conn);
    let conn = raw.accept_handshaken().await;
    let mut f = Fuzz {
        raw,
        conn,
        base: router.http(),
    };
    f.probe(0, 1, "garbage handshakes").await;
    // Commands after the handshake (READY again, an unknown one).
    f.send(&zmtp::ready()).await;
    f.send(&zmtp::command("FOO", b"bar")).await;
    f.probe(1, 2, "a READY command after the handshake").await;
    // A jump to u64::MAX, then the real numbering again.
    f.send(&event_message(u64::MAX, &probe_batch(3))).await;
    f.probe(2, 4, "seq u64::MAX").await;
    // Not msgpack, a 7-byte sequence frame, two frames, random msgpack-ish bytes.
    f.send(&event_message(3, &noise(3, 300))).await;
    f.send(&zmtp::message(&[b"", &[0; 7], &probe_batch(9)]))
        .await;
    f.send(&zmtp::message(&[b"", &4u64.to_be_bytes()])).await;
    let mut mutated = probe_batch(2);
    mutated.truncate(mutated.len() / 2);
    f.send(&event_message(4, &mutated)).await;
    f.probe(5, 5, "malformed messages").await;
    // Over --kv-event-max-message-bytes (counted), then over libzmq's hard bound (dropped).
    f.send(&event_message(6, &noise(4, 100_000))).await;
    f.probe(7, 6, "an oversize message").await;
    f.send(&[0x02]).await;
    f.send(&(1u64 << 40).to_be_bytes()).await;
    f.send(&noise(5, 1000)).await;
    f.probe(8, 7, "a frame over the hard bound").await;
    // A truncated frame, then the connection closes.
    f.send(&[0x00, 200]).await;
    f.send(&noise(6, 10)).await;
    f.conn.shutdown().await.unwrap();
    f.reconnect().await;
    f.probe(0, 8, "a truncated frame").await;
    let m = common::metrics(&f.base).await;
    for reason in ["oversize", "seq_backwards", "malformed"] {
        let label = format!("reason=\"{reason}\"");
        assert!(
            sample(&m, "kvrouter_kv_event_messages_dropped_total", &[&label]) >= 1,
            "{reason} is counted:\n{m}"
        );
    }
    let _ = std::fs::remove_file(path);
}

#[tokio::test]
async fn a_publisher_ending_each_connection_after_its_handshake_is_retried_at_a_bounded_pace() {
    // Each connection ends as soon as it is up (a crash-looping engine): the subscriber waits
    // 100 ms, doubling to 1 s, before the next, instead of reconnecting (and re-syncing) at
    // once in a loop.
    let raw = RawPub::bind().await;
    let (_router, path) = router_for(&raw, "flap", &[]).await;
    drop(raw.accept_handshaken().await);
    let started = Instant::now();
    let mut connections = 0;
    while started.elapsed() < Duration::from_secs(2) {
        match tokio::time::timeout(Duration::from_millis(500), raw.accept_handshaken()).await {
            Ok(conn) => {
                connections += 1;
                drop(conn);
            }
            Err(_) => continue,
        }
    }
    // Pauses of 100, 200, 400, 800, 1,000 ms: at most 5 in 2 s (a loop without them makes
    // hundreds); at least 2 (it does come back).
    assert!(
        (2..=6).contains(&connections),
        "{connections} connections in 2 s"
    );
    let _ = std::fs::remove_file(path);
}

#[tokio::test]
async fn bad_ingest_bounds_are_a_clear_error_naming_the_flag() {
    for (flag, value) in [
        ("--kv-event-max-message-bytes", "0"),
        ("--kv-event-apply-slice-blocks", "0"),
        ("--kv-event-replay-timeout-secs", "-1"),
        // 0 failed every replay at once (found by a probe).
        ("--kv-event-replay-timeout-secs", "0"),
        ("--kv-event-replay-timeout-secs", "1e-9"),
        ("--trace-capture", "18446744073709551615"),
    ] {
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_kvrouter"))
            .args(["serve", "--port", "0", "--mock-workers", "1"])
            .arg(format!("{flag}={value}"))
            .output()
            .await
            .unwrap();
        assert!(!out.status.success(), "{flag} {value} is refused");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(flag), "{flag}: {stderr}");
    }
}
