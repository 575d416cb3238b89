//! Reading a pick body: `Body::from_slice` of `{"token_ids": [...]}` with 2,048 ids as the
//! picker bench sends them (ids of 4 to 6 digits, `,` between them), and of the same prompt as
//! a completion body with `, ` between ids (as Python's `json.dumps` writes them); and a
//! completion body with a 100,000-word text prompt (300 KB: the size of an agentic turn). Each
//! figure is the fastest of many rounds of the same body, so other work on the machine adds
//! little.
//!
//! `cargo bench -p kvrouter-openai --bench body`

#![allow(missing_docs)]
// A benchmark times itself; the fence on clocks is for the protocol code.
#![allow(clippy::disallowed_methods)]

use kvrouter_openai::Body;
use std::time::{Duration, Instant};

fn prompt(i: u64) -> Vec<u64> {
    let (tokens, family) = (2048, i % 32);
    let shared = tokens * 3 / 4;
    let mut ids: Vec<u64> = (0..shared).map(|t| 1000 + family * 2000 + t).collect();
    ids.extend((0..tokens - shared).map(|t| 100_000 + (i * 7919 + t) % 20_000));
    ids
}

/// The fastest of `rounds` rounds of reading each body once, per body.
fn fastest(bodies: &[Vec<u8>], rounds: usize) -> Duration {
    let mut best = Duration::MAX;
    for _ in 0..rounds {
        let started = Instant::now();
        for raw in bodies {
            let body = Body::from_slice(raw).expect("a body");
            std::hint::black_box(&body);
        }
        best = best.min(started.elapsed() / bodies.len() as u32);
    }
    best
}

fn main() {
    let compact: Vec<Vec<u8>> = (0..32)
        .map(|i| {
            let ids: Vec<String> = prompt(i).iter().map(u64::to_string).collect();
            format!("{{\"token_ids\":[{}]}}", ids.join(",")).into_bytes()
        })
        .collect();
    let spaced: Vec<Vec<u8>> = (0..32)
        .map(|i| {
            let ids: Vec<String> = prompt(i).iter().map(u64::to_string).collect();
            format!(
                "{{\"model\": \"m\", \"prompt\": [{}], \"max_tokens\": 16}}",
                ids.join(", ")
            )
            .into_bytes()
        })
        .collect();
    let text: Vec<Vec<u8>> = (0..4)
        .map(|i| {
            let words: Vec<String> = (0..100_000u64)
                .map(|t| {
                    let w = (t * 7919 + i) % 676;
                    let a = |n: u64| char::from(b'a' + n as u8);
                    format!("{}{}", a(w / 26), a(w % 26))
                })
                .collect();
            format!(
                "{{\"model\": \"m\", \"prompt\": \"{}\", \"max_tokens\": 16}}",
                words.join(" ")
            )
            .into_bytes()
        })
        .collect();
    println!(
        "Body::from_slice, 100,000-word text prompt: {:.2} µs",
        fastest(&text, 40).as_secs_f64() * 1e6
    );
    println!(
        "Body::from_slice, 2,048 token ids, `,` between: {:.2} µs",
        fastest(&compact, 400).as_secs_f64() * 1e6
    );
    println!(
        "Body::from_slice, 2,048 token ids, `, ` between: {:.2} µs",
        fastest(&spaced, 400).as_secs_f64() * 1e6
    );
}
