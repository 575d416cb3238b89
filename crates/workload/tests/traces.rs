//! The shared traces load, with the numbers their provenance files state.

use kvrouter_workload::readers::ReadOptions;
use kvrouter_workload::{load_trace, Workload};
use std::path::PathBuf;

fn traces() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/traces")
}

fn ceiling(w: &Workload) -> f64 {
    w.hit_rate_ceiling(&(0..w.requests.len()).collect::<Vec<_>>())
}

#[test]
fn mooncake_conversation_has_its_published_ceiling() {
    let w = load_trace(
        &traces().join("mooncake_conversation/conversation_trace.jsonl"),
        ReadOptions::default(),
    )
    .unwrap();
    assert_eq!(w.requests.len(), 12_031);
    assert_eq!(w.block_size, 512);
    let c = ceiling(&w);
    assert!((c - 0.366).abs() < 0.001, "ceiling {c}");
    w.validate(64).unwrap();
}

#[test]
fn mooncake_synthetic_and_sessions_load() {
    let w = load_trace(
        &traces().join("mooncake_synthetic/synthetic_trace.jsonl"),
        ReadOptions::default(),
    )
    .unwrap();
    assert_eq!(w.requests.len(), 3_993);
    assert!((ceiling(&w) - 0.640).abs() < 0.002, "{}", ceiling(&w));
    let s = load_trace(
        &traces().join("claude_code_sessions_dev"),
        ReadOptions::default(),
    )
    .unwrap();
    assert_eq!(s.requests.len(), 2_913);
    assert_eq!(s.block_size, 64);
    assert!((ceiling(&s) - 0.962).abs() < 0.002, "{}", ceiling(&s));
    s.validate(64).unwrap();
    assert_eq!(
        s.requests.iter().filter(|r| r.arrival_ms.is_some()).count(),
        35,
        "one start per session"
    );
}

#[test]
fn unreadable_lines_are_named() {
    let dir = std::env::temp_dir().join(format!("kvrouter-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("bad.jsonl");
    std::fs::write(&f, "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n{oops\n").unwrap();
    let e = load_trace(&f, ReadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("bad.jsonl:2"), "{e}");
    std::fs::write(&f, "{\"what\": 1}\n").unwrap();
    assert!(load_trace(&f, ReadOptions::default())
        .unwrap_err()
        .to_string()
        .contains("unknown trace format"));
    let r = dir.join("r.jsonl");
    std::fs::write(&r, "{\"step\":0,\"group\":1,\"trajectory\":1,\"turn\":0,\"prompt_blocks\":[1,2],\"prompt_tokens\":128,\"output_tokens\":5,\"tool_latency_ms\":300}\n{\"step\":0,\"group\":1,\"trajectory\":1,\"turn\":1,\"prompt_blocks\":[1,2,3],\"prompt_tokens\":192,\"output_tokens\":5}\n").unwrap();
    let w = load_trace(&r, ReadOptions::default()).unwrap();
    assert_eq!(w.requests[1].after, Some(0));
    assert_eq!(w.requests[1].delay_ms, 300.0);
    // A block size of 0, or one that changes from line to line, is named with its line.
    let rollout = |bs: &str| {
        format!(
            "{{\"step\":0,\"group\":1,\"trajectory\":1,\"turn\":0,\"prompt_blocks\":[1],\"prompt_tokens\":64,\"output_tokens\":5,\"block_size\":64}}\n\
             {{\"step\":0,\"group\":1,\"trajectory\":2,\"turn\":0,\"prompt_blocks\":[1],\"prompt_tokens\":64,\"output_tokens\":5,\"block_size\":{bs}}}\n"
        )
    };
    for (bs, says) in [("0", "at least 1"), ("16", "earlier lines said 64")] {
        std::fs::write(&r, rollout(bs)).unwrap();
        let e = load_trace(&r, ReadOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("r.jsonl:2") && e.contains(says), "{e}");
    }
    // Lengths no request has: `bench` built a 2^32 − 1-token prompt in memory and aborted.
    let line = |input: &str, output: &str| {
        format!(
            "{{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}}\n\
             {{\"timestamp\": 1, \"input_length\": {input}, \"output_length\": {output}, \"hash_ids\": [1]}}\n"
        )
    };
    for (input, output, says) in [
        ("4294967295", "10", "input_length"),
        ("0", "10", "input_length"),
        ("10", "0", "output_length"),
        ("10", "2000000", "output_length"),
    ] {
        std::fs::write(&f, line(input, output)).unwrap();
        let e = load_trace(&f, ReadOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("bad.jsonl:2") && e.contains(says), "{e}");
    }
    let s = dir.join("session.json");
    std::fs::write(
        &s,
        r#"{"block_size": 64, "requests": [{"in": 1e12, "out": 3, "hash_ids": [1]}]}"#,
    )
    .unwrap();
    let e = load_trace(&s, ReadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("`in`"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
