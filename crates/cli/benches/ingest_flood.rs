//! Routing latency while KV events flood in: `kvrouter serve` (its own process) in front of one
//! instant `kvrouter mock-engine`, whose KV events come from a fake PUB in this process instead.
//! Each phase times sequential non-streamed requests (max_tokens 1) end to end for a few seconds:
//! a baseline without events; a flood of 1,024-block `BlockStored`/`BlockRemoved` batches with a
//! 80,000-block one (≈7 MB with its removal, under the default `--kv-event-max-message-bytes`) every second;
//! and one 1,000,000-block `BlockStored` (≈76 MB on the wire, the message of issue 12, over the
//! bound: the subscriber refuses it, the stream breaks and re-syncs) followed by the same flood.
//! Prints p50/p99/max per phase, the router's own routing-overhead p99 (from its histogram),
//! its RSS, and the ingest counters.
//!
//! `cargo bench -p kvrouter --bench ingest_flood`    (bounded: about a minute)

#![allow(missing_docs)]

use bytes::Bytes;
use kvrouter_core::event::{BlockContent, KvEvent, Medium, StoredBlock};
use kvrouter_core::hashing::HashNamespace;
use kvrouter_core::ids::{EngineHash, WorkerId};
use kvrouter_kv_wire::{encode_payload, from_kv_events};
use serde_json::json;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

const BIN: &str = env!("CARGO_BIN_EXE_kvrouter");
const BS: usize = 16;
const PHASE: Duration = Duration::from_secs(6);
const BIG_BLOCKS: u64 = 80_000;

struct Proc {
    child: Child,
    base: String,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

async fn spawn(args: &[&str]) -> Proc {
    let mut child = Command::new(BIN)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let base = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap()
        .to_owned();
    Proc { child, base }
}

/// `blocks` fresh blocks of chain `chain` (distinct tokens per chain).
fn stored(chain: u64, blocks: u64) -> KvEvent {
    KvEvent::Stored {
        worker: WorkerId(0),
        dp_rank: 0,
        parent: None,
        blocks: (0..blocks)
            .map(|b| StoredBlock {
                engine_hash: EngineHash(chain << 32 | b),
                content: BlockContent::Tokens(
                    (0..BS as u64)
                        .map(|t| ((chain * 7919 + b * 31 + t) % 150_000) as u32)
                        .collect(),
                ),
            })
            .collect(),
        block_size: BS,
        medium: Medium::Gpu,
        namespace: HashNamespace::none(),
    }
}

fn removed(chain: u64, blocks: u64) -> KvEvent {
    KvEvent::Removed {
        worker: WorkerId(0),
        dp_rank: 0,
        engine_hashes: (0..blocks).map(|b| EngineHash(chain << 32 | b)).collect(),
        medium: Medium::Gpu,
    }
}

fn payload(events: &[KvEvent]) -> Bytes {
    Bytes::from(encode_payload(&from_kv_events(0.0, 0, events).unwrap()))
}

/// Publishes until `stop`: per step a 1,024-block chain stored and the one 8 steps back removed;
/// every second a [`BIG_BLOCKS`]-block chain (removed a second later). With `huge`, first one
/// 1,000,000-block message.
fn flood(
    mut socket: PubSocket,
    stop: Arc<AtomicBool>,
    huge: bool,
    sent: Arc<AtomicU64>,
    mut seq: u64,
) -> (PubSocket, u64) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        async fn send_one(socket: &mut PubSocket, seq: &mut u64, sent: &AtomicU64, p: Bytes) {
            let m = vec![Bytes::new(), Bytes::copy_from_slice(&seq.to_be_bytes()), p];
            *seq += 1;
            sent.fetch_add(1, Ordering::Relaxed);
            let _ = socket.send(ZmqMessage::try_from(m).unwrap()).await;
        }
        if huge {
            let p = payload(&[stored(1 << 20, 1_000_000)]);
            println!("  huge message: {} bytes", p.len());
            send_one(&mut socket, &mut seq, &sent, p).await;
        }
        let mut big_at = Instant::now();
        let mut big = None;
        for step in 0..u64::MAX {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            let mut events = vec![stored(step, 1024)];
            if step >= 8 {
                events.push(removed(step - 8, 1024));
            }
            send_one(&mut socket, &mut seq, &sent, payload(&events)).await;
            if big_at.elapsed() > Duration::from_secs(1) {
                big_at = Instant::now();
                let chain = (1 << 30) + step;
                let mut events = vec![stored(chain, BIG_BLOCKS)];
                if let Some(old) = big.replace(chain) {
                    events.push(removed(old, BIG_BLOCKS));
                }
                send_one(&mut socket, &mut seq, &sent, payload(&events)).await;
            }
            tokio::task::yield_now().await;
        }
        (socket, seq)
    })
}

/// The router's routing-overhead histogram: (upper bound in s, cumulative count).
async fn overhead_buckets(client: &reqwest::Client, base: &str) -> Vec<(f64, u64)> {
    let m = metrics(client, base).await;
    m.lines()
        .filter_map(|l| l.strip_prefix("kvrouter_routing_overhead_seconds_bucket{le=\""))
        .filter_map(|l| {
            let (le, n) = l.split_once("\"} ")?;
            Some((le.parse().unwrap_or(f64::INFINITY), n.parse().ok()?))
        })
        .collect()
}

/// The upper bucket bound holding quantile `q` of the observations between two snapshots.
fn bucket_quantile(before: &[(f64, u64)], after: &[(f64, u64)], q: f64) -> f64 {
    let total = after.last().map_or(0, |b| b.1) - before.last().map_or(0, |b| b.1);
    let want = (total as f64 * q).ceil() as u64;
    for (i, (le, n)) in after.iter().enumerate() {
        if n - before.get(i).map_or(0, |b| b.1) >= want {
            return *le;
        }
    }
    f64::INFINITY
}

async fn phase(client: &reqwest::Client, base: &str, name: &str) {
    let before = overhead_buckets(client, base).await;
    let mut ms = Vec::new();
    let start = Instant::now();
    for i in 0..1_000_000 {
        if start.elapsed() > PHASE {
            break;
        }
        let body = json!({"model": "mock-model", "prompt": format!("request {i} about the flood"), "max_tokens": 1});
        let t = Instant::now();
        let r = client
            .post(format!("{base}/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{}", r.status());
        let _ = r.bytes().await.unwrap();
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let after = overhead_buckets(client, base).await;
    ms.sort_by(f64::total_cmp);
    let q = |p: f64| ms[((ms.len() as f64 * p) as usize).min(ms.len() - 1)];
    println!(
        "{name:<30} requests {:>5}  p50 {:>6.2} ms  p99 {:>6.2} ms  max {:>7.2} ms  routing overhead p99 <= {} ms",
        ms.len(),
        q(0.5),
        q(0.99),
        ms[ms.len() - 1],
        bucket_quantile(&before, &after, 0.99) * 1e3
    );
}

async fn metrics(client: &reqwest::Client, base: &str) -> String {
    client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

fn rss_mib(pid: u32) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |k: &str| {
        status
            .lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map_or("?".into(), |kb| format!("{:.0} MiB", kb as f64 / 1024.0))
    };
    format!("rss {} (peak {})", field("VmRSS:"), field("VmHWM:"))
}

async fn counters(client: &reqwest::Client, base: &str) -> String {
    let m = metrics(client, base).await;
    m.lines()
        .filter(|l| {
            l.starts_with("kvrouter_kv_event_messages_dropped_total{")
                || l.starts_with("kvrouter_kv_stream_")
                || l.starts_with("kvrouter_kv_events_applied_total{")
        })
        .collect::<Vec<_>>()
        .join("\n  ")
}

#[tokio::main]
async fn main() {
    let engine = spawn(&[
        "mock-engine",
        "--port",
        "0",
        "--block-size",
        &BS.to_string(),
        "--speedup-ratio",
        "1000",
    ])
    .await;
    let mut socket = PubSocket::new();
    let endpoint = socket.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let file =
        std::env::temp_dir().join(format!("kvrouter-ingest-flood-{}.toml", std::process::id()));
    std::fs::write(
        &file,
        format!(
            "[[workers]]\nid = 0\nurl = \"{}\"\nkv_events_endpoint = \"{endpoint}\"\n",
            engine.base
        ),
    )
    .unwrap();
    let router = spawn(&[
        "serve",
        "--port",
        "0",
        "--workers-file",
        file.to_str().unwrap(),
        "--kv-cache-block-size",
        &BS.to_string(),
    ])
    .await;
    let pid = router.child.id().unwrap();
    let client = reqwest::Client::new();
    let base = router.base.clone();
    phase(&client, &base, "baseline (no events)").await;
    println!("  {}", rss_mib(pid));

    let mut seq = 0;
    for (name, huge) in [("flood", false), ("76 MB message, then flood", true)] {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let (s, n) = (stop.clone(), sent.clone());
        let publisher = std::thread::spawn(move || flood(socket, s, huge, n, seq));
        // Let the subscription arrive and the flood start.
        while sent.load(Ordering::Relaxed) < 20 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        phase(&client, &base, name).await;
        stop.store(true, Ordering::Relaxed);
        (socket, seq) = publisher.join().unwrap();
        println!(
            "  messages published {}; {}\n  {}",
            sent.load(Ordering::Relaxed),
            rss_mib(pid),
            counters(&client, &base).await
        );
    }
    let _ = std::fs::remove_file(file);
}
