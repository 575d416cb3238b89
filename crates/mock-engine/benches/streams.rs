//! The mock engine holding 2,000 concurrent streams on loopback: how late are the engine's steps
//! against its own timing model? Reads the step-lateness histogram from `/metrics`.
//!
//! `cargo bench -p kvrouter-mock-engine --bench streams`

#![allow(missing_docs)]

use futures::StreamExt;
use kvrouter_engine::EngineConfig;
use kvrouter_mock_engine::MockEngineConfig;
use std::time::{Duration, Instant};

const STREAMS: usize = 2_000;
const MAX_TOKENS: u32 = 100;

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(run());
}

async fn run() {
    let config = MockEngineConfig {
        engine: EngineConfig {
            max_num_seqs: 2_048,
            ..EngineConfig::default()
        },
        ..MockEngineConfig::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine = kvrouter_mock_engine::start(config, listener).await.unwrap();
    let base = format!("http://{}", engine.endpoints.http);
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(STREAMS)
        .build()
        .unwrap();
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(STREAMS);
    for i in 0..STREAMS {
        let client = client.clone();
        let url = format!("{base}/v1/completions");
        tasks.push(tokio::spawn(async move {
            let body = serde_json::json!({
                "prompt": format!("stream {i}: a prompt of a few dozen tokens so that every request has real prefill work to do"),
                "max_tokens": MAX_TOKENS, "stream": true,
            });
            let r = client.post(url).json(&body).send().await.unwrap();
            let mut s = r.bytes_stream();
            let mut chunks = 0usize;
            while let Some(c) = s.next().await {
                chunks += c.unwrap().len().min(1);
            }
            chunks
        }));
    }
    let mut ok = 0;
    for t in tasks {
        if tokio::time::timeout(Duration::from_secs(300), t)
            .await
            .unwrap()
            .unwrap()
            > 0
        {
            ok += 1;
        }
    }
    let wall = started.elapsed();
    let metrics = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let buckets: Vec<(String, f64)> = metrics
        .lines()
        .filter(|l| l.starts_with("kvrouter_mock_step_lateness_seconds_bucket"))
        .map(|l| {
            let le = l
                .split("le=\"")
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap()
                .to_owned();
            (le, l.rsplit(' ').next().unwrap().parse().unwrap())
        })
        .collect();
    let total = buckets.last().unwrap().1;
    println!("{ok}/{STREAMS} streams completed, {MAX_TOKENS} tokens each, in {:.1} s; {total} engine steps", wall.as_secs_f64());
    println!("step lateness against the timing model (cumulative share of steps):");
    for (le, n) in &buckets {
        println!("  <= {le:>6} s: {:6.2} %", 100.0 * n / total);
    }
    let p99 = buckets
        .iter()
        .find(|(_, n)| *n / total >= 0.99)
        .map(|(le, _)| le.clone())
        .unwrap();
    println!("p99 lateness <= {p99} s");
    engine.stop().await;
}
