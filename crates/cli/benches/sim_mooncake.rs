//! `kvrouter sim` on the whole Mooncake conversation trace (12,031 requests, about an hour):
//! wall time and peak memory per configuration on 8 workers (target ≤ 3 s, ≤ 1 GiB), and the
//! published ordering of average TTFT on 16 workers (random > load balancing > cache-aware) with
//! the trace's 36.6 % ceiling.
//!
//! `cargo bench -p kvrouter --bench sim_mooncake`

#![allow(missing_docs)]

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_kvrouter");
const TRACE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../../shared/traces/mooncake_conversation/conversation_trace.jsonl"
);

fn sim(workers: &str, compare: &str, out: &str) -> serde_json::Value {
    let status = Command::new("/usr/bin/time")
        .args([
            "-f",
            "%M KiB peak",
            BIN,
            "sim",
            "--trace",
            TRACE,
            "--workers",
            workers,
            "--compare",
            compare,
            "--quiet",
            "--out",
            out,
        ])
        .status()
        .or_else(|_| {
            Command::new(BIN)
                .args([
                    "sim",
                    "--trace",
                    TRACE,
                    "--workers",
                    workers,
                    "--compare",
                    compare,
                    "--quiet",
                    "--out",
                    out,
                ])
                .status()
        })
        .unwrap();
    assert!(status.success());
    serde_json::from_str(&std::fs::read_to_string(format!("{out}/summary.json")).unwrap()).unwrap()
}

fn main() {
    let dir = std::env::temp_dir().join("kvrouter-sim-bench");
    let out = dir.to_string_lossy().into_owned();
    println!("8 workers, one configuration per run:");
    for mode in ["round-robin", "kv"] {
        let s = sim("8", mode, &out);
        println!("  {mode}: sim_wall_s {}", s[0]["sim_wall_s"]);
    }
    println!("16 workers:");
    let runs = sim("16", "random,least-loaded,kv", &out);
    let mut means = Vec::new();
    for r in runs.as_array().unwrap() {
        println!(
            "  {:<13} TTFT mean {:>8.1} ms  p50 {:>7.1}  p99 {:>8.1}  hit rate {:.3}  ceiling {:.3}  wall {} s",
            r["config"].as_str().unwrap(),
            r["ttft_ms"]["mean"].as_f64().unwrap(),
            r["ttft_ms"]["p50"].as_f64().unwrap(),
            r["ttft_ms"]["p99"].as_f64().unwrap(),
            r["hit_rate"].as_f64().unwrap(),
            r["hit_rate_ceiling_blocks"].as_f64().unwrap(),
            r["sim_wall_s"]
        );
        means.push(r["ttft_ms"]["mean"].as_f64().unwrap());
        assert!((r["hit_rate_ceiling_blocks"].as_f64().unwrap() - 0.366).abs() < 0.001);
    }
    assert!(
        means[0] > means[1] && means[1] > means[2],
        "published order random > load balancing > cache-aware: {means:?}"
    );
    println!("ordering random > least-loaded > kv holds");
}
