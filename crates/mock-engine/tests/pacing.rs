//! The driver keeps the timing model's pace and does not spin while it waits for a step's end.
//! (Its own test binary: it reads the process's CPU time.)

use kvrouter_mock_engine::{start_on_loopback, MockEngineConfig};
use serde_json::{json, Value};
use std::time::Instant;

/// CPU seconds this process has used (user + system), from `/proc/self/stat` (Linux, 100 ticks/s).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat (Linux)");
    // Fields after the command name (which may hold spaces) start at the state (field 3);
    // utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')').expect("stat has a command") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    ticks as f64 / 100.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_decode_keeps_the_model_pace_without_spinning() {
    // dynamo-poly at speed-up 10: a decode step with the KV nearly empty takes ~0.574 ms, less
    // than the timer's 1 ms tick.
    let config = MockEngineConfig {
        speedup_ratio: 10.0,
        ..MockEngineConfig::default()
    };
    let engines = start_on_loopback(&config, 1).await.unwrap();
    let url = format!("http://{}/v1/completions", engines[0].endpoints.http);
    let client = reqwest::Client::new();
    let tokens = 1_000u64;
    let (cpu0, t0) = (cpu_seconds(), Instant::now());
    let r: Value = client
        .post(&url)
        .json(&json!({"model": "mock-model", "prompt": "pace", "max_tokens": tokens}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let (wall, cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - cpu0);
    assert_eq!(r["usage"]["completion_tokens"], tokens, "{r}");
    // The model: one prefill step (≥ 1.65 ms), then a decode step per further token.
    let model = (tokens - 1) as f64 * 5.74e-3 / 10.0;
    assert!(
        wall >= model,
        "faster than the model: {wall:.3} s < {model:.3} s"
    );
    assert!(
        wall <= model * 1.25 + 0.1,
        "steps stretched by the host: {wall:.3} s for {model:.3} s of model time"
    );
    assert!(
        cpu < 0.4 * wall,
        "the driver spins: {cpu:.2} CPU s in {wall:.2} s"
    );
    for e in engines {
        e.stop().await;
    }
}
