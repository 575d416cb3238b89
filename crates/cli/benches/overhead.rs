//! Router overhead measured the way users compare routers: instant engines (the mock engine at a
//! huge speed-up), a load generator in this process, the router as its own process pinned to one
//! core (`taskset -c 0`) when `taskset` exists. Reports requests/s at concurrency 64, added latency
//! p50/p99 at concurrency 1 against calling the engine directly, and router CPU time per request
//! (from /proc), for round-robin and kv, streaming and not, keep-alive and not.
//!
//! `cargo bench -p kvrouter --bench overhead`    (bounded: a few thousand loopback requests)

#![allow(missing_docs)]

use futures::StreamExt;
use serde_json::json;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const BIN: &str = env!("CARGO_BIN_EXE_kvrouter");

struct Proc {
    child: Child,
    base: String,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

fn taskset() -> bool {
    std::process::Command::new("taskset")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success())
}

async fn spawn(core: &str, args: &[&str]) -> Proc {
    let mut cmd = if taskset() {
        let mut c = Command::new("taskset");
        c.args(["-c", core, BIN]);
        c
    } else {
        Command::new(BIN)
    };
    let mut child = cmd
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

fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let ticks: f64 = fields.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
        + fields
            .get(12)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0);
    ticks / 100.0
}

fn body(stream: bool, prompt_tokens: usize) -> serde_json::Value {
    let prompt: Vec<u32> = (0..prompt_tokens as u32).map(|t| 1000 + t).collect();
    json!({"model": "mock-model", "prompt": prompt, "max_tokens": 16, "stream": stream})
}

async fn one(client: &reqwest::Client, url: &str, body: &serde_json::Value) -> Duration {
    let t = Instant::now();
    let r = client.post(url).json(body).send().await.unwrap();
    assert!(r.status().is_success());
    let mut s = r.bytes_stream();
    while let Some(c) = s.next().await {
        c.unwrap();
    }
    t.elapsed()
}

fn client(keep_alive: bool) -> reqwest::Client {
    let b = reqwest::Client::builder().tcp_nodelay(true);
    let b = if keep_alive {
        b.pool_max_idle_per_host(256)
    } else {
        b.pool_max_idle_per_host(0)
    };
    b.build().unwrap()
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1e6
}

async fn latencies(
    client: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
    n: usize,
) -> Vec<Duration> {
    for _ in 0..50 {
        one(client, url, body).await;
    }
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(one(client, url, body).await);
    }
    v.sort();
    v
}

async fn throughput(
    client: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
    total: usize,
    concurrency: usize,
) -> f64 {
    let t = Instant::now();
    let per = total / concurrency;
    let tasks: Vec<_> = (0..concurrency)
        .map(|_| {
            let (c, u, b) = (client.clone(), url.to_owned(), body.clone());
            tokio::spawn(async move {
                for _ in 0..per {
                    one(&c, &u, &b).await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    (per * concurrency) as f64 / t.elapsed().as_secs_f64()
}

fn overhead_mean_us(metrics: &str) -> (f64, f64) {
    let get = |name: &str| -> f64 {
        metrics
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0.0)
    };
    (
        get("kvrouter_routing_overhead_seconds_sum"),
        get("kvrouter_routing_overhead_seconds_count"),
    )
}

/// Long prompts in kv mode: 4k-token token-id prompts, new 4k-token chats (tokenized from
/// scratch) and a continued 4k-token chat (history seen before), with the DeepSeek-V4 tokenizer.
async fn long_prompts(engine: &Proc) {
    let tokenizer = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/tokenizers/deepseek-v4/tokenizer.json"
    );
    let template = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../templates/deepseek.jinja"
    );
    let router = spawn(
        "0",
        &[
            "serve",
            "--port",
            "0",
            "--worker",
            &engine.base,
            "--router-mode",
            "kv",
            "--tokenizer",
            tokenizer,
            "--chat-template",
            template,
        ],
    )
    .await;
    let pid = router.child.id().unwrap();
    let c = client(true);
    let text =
        "The router hashes token blocks and keeps a prefix index of what every worker caches. ";
    println!();
    println!("| 4k-token prompt, kv, keep-alive | router p50 µs | added p50 µs | router overhead mean µs (parse+tokenize+hash+route) | router CPU µs/req |");
    println!("|---|---|---|---|---|");
    let direct = latencies(
        &c,
        &format!("{}/v1/completions", engine.base),
        &body(false, 4096),
        200,
    )
    .await;
    for scenario in ["token ids", "new chats", "continued chat"] {
        let metrics0 = c
            .get(format!("{}/metrics", router.base))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let cpu0 = cpu_seconds(pid);
        let n = 200;
        let mut lat = Vec::with_capacity(n);
        for i in 0..n {
            let b = match scenario {
                "token ids" => body(false, 4096),
                "new chats" => json!({"model": "mock-model", "max_tokens": 16, "messages": [
                    {"role": "user", "content": format!("conversation {i}: {}", text.repeat(250))}]}),
                _ => json!({"model": "mock-model", "max_tokens": 16, "messages": [
                    {"role": "user", "content": text.repeat(250)},
                    {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": format!("follow-up {i}")}]}),
            };
            let path = if scenario == "token ids" {
                "/v1/completions"
            } else {
                "/v1/chat/completions"
            };
            lat.push(one(&c, &format!("{}{path}", router.base), &b).await);
        }
        lat.sort();
        let cpu = (cpu_seconds(pid) - cpu0) / n as f64 * 1e6;
        let metrics1 = c
            .get(format!("{}/metrics", router.base))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let (s0, c0) = overhead_mean_us(&metrics0);
        let (s1, c1) = overhead_mean_us(&metrics1);
        println!(
            "| {scenario} | {:.0} | {:.0} | {:.0} | {cpu:.0} |",
            pct(&lat, 0.5),
            pct(&lat, 0.5) - pct(&direct, 0.5),
            (s1 - s0) / (c1 - c0).max(1.0) * 1e6,
        );
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let engine = spawn(
        "1",
        &[
            "mock-engine",
            "--port",
            "0",
            "--speedup-ratio",
            "1000000",
            "--max-num-seqs",
            "1024",
        ],
    )
    .await;
    println!("| mode | stream | keep-alive | req/s @64 | direct p50 µs | router p50 µs | added p50 µs | added p99 µs | router CPU µs/req |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for mode in ["round-robin", "kv"] {
        let router = spawn(
            "0",
            &[
                "serve",
                "--port",
                "0",
                "--worker",
                &engine.base,
                "--router-mode",
                mode,
            ],
        )
        .await;
        let pid = router.child.id().unwrap();
        for stream in [false, true] {
            for keep_alive in [true, false] {
                let c = client(keep_alive);
                let b = body(stream, 128);
                let direct =
                    latencies(&c, &format!("{}/v1/completions", engine.base), &b, 400).await;
                let via = latencies(&c, &format!("{}/v1/completions", router.base), &b, 400).await;
                let cpu0 = cpu_seconds(pid);
                let total = 3200;
                let rps = throughput(
                    &c,
                    &format!("{}/v1/completions", router.base),
                    &b,
                    total,
                    64,
                )
                .await;
                let cpu = (cpu_seconds(pid) - cpu0) / total as f64 * 1e6;
                println!(
                    "| {mode} | {stream} | {keep_alive} | {rps:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {cpu:.0} |",
                    pct(&direct, 0.5),
                    pct(&via, 0.5),
                    pct(&via, 0.5) - pct(&direct, 0.5),
                    pct(&via, 0.99) - pct(&direct, 0.99),
                );
            }
        }
    }
    long_prompts(&engine).await;
}
