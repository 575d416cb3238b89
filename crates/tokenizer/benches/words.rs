//! Routing tokenization of issue 15's realistic case: text prompts of 128 words drawn uniformly
//! from a 32,000-word `WordLevel` vocabulary behind a whitespace split (the tokenizer
//! `bench/overhead/realistic.py` writes). Every word's ids are in the piece cache after the
//! first pass, so this measures a warm cache whose 32,000 entries do not fit in the CPU's
//! nearer caches: one prompt per iteration, cycling through 4,096 prompts; and the same with
//! the CPU's caches overwritten before each prompt, as the rest of a request's work does in the
//! router.
//!
//! `cargo bench -p kvrouter-tokenizer --bench words`

#![allow(missing_docs)]

use criterion::{criterion_group, criterion_main, Criterion};
use kvrouter_tokenizer::{HfTokenizer, Tokenizer};
use serde_json::json;
use std::hint::black_box;

const VOCAB: u64 = 32_000;
const WORDS: usize = 128;
const PROMPTS: usize = 4_096;

fn bench(c: &mut Criterion) {
    let mut vocab = serde_json::Map::new();
    for (i, special) in ["<unk>", "<s>", "</s>"].into_iter().enumerate() {
        vocab.insert(special.into(), json!(i));
    }
    for i in 0..VOCAB - 3 {
        vocab.insert(format!("t{i}"), json!(i + 3));
    }
    let file = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    let path = std::env::temp_dir().join(format!("kvrouter-words-{}.json", std::process::id()));
    std::fs::write(&path, file.to_string()).unwrap();
    let tok = HfTokenizer::from_path(&path).unwrap();
    std::fs::remove_file(&path).ok();
    // The piece cache is the fast path's: measure nothing else.
    assert!(tok.has_fast_path());
    // A fixed linear congruential sequence: the same prompts every run.
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut word = || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        format!("t{}", (state >> 33) % (VOCAB - 3))
    };
    let prompts: Vec<String> = (0..PROMPTS)
        .map(|_| (0..WORDS).map(|_| word()).collect::<Vec<_>>().join(" "))
        .collect();
    for p in &prompts {
        assert_eq!(tok.encode(p).len(), WORDS);
    }
    let mut group = c.benchmark_group("tokenize_words");
    let mut next = 0;
    group.bench_function("128_words_of_32k_warm", |b| {
        b.iter(|| {
            next = (next + 1) % PROMPTS;
            black_box(tok.encode(black_box(&prompts[next])))
        })
    });
    // As in the router, where the other work of a request between two prompts pushes the
    // cache's entries out of the CPU's caches: twice the last-level cache written before each
    // prompt (64 MiB when its size cannot be read).
    let mut other = vec![0u8; 2 * last_level_cache_bytes().unwrap_or(32 << 20)];
    group.bench_function("128_words_of_32k_evicted", |b| {
        b.iter_batched(
            || {
                for line in other.chunks_mut(64) {
                    line[0] = line[0].wrapping_add(1);
                }
                black_box(&other);
                next = (next + 1) % PROMPTS;
                &prompts[next]
            },
            |prompt| black_box(tok.encode(black_box(prompt))),
            criterion::BatchSize::PerIteration,
        )
    });
    group.finish();
}

/// The size of cpu0's last cache level (`/sys/devices/system/cpu/cpu0/cache/index*/size`).
fn last_level_cache_bytes() -> Option<usize> {
    let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    let sizes = std::fs::read_dir(dir).ok()?.filter_map(|entry| {
        let size = std::fs::read_to_string(entry.ok()?.path().join("size")).ok()?;
        let size = size.trim();
        let (digits, unit) = size.split_at(size.find(|c: char| !c.is_ascii_digit())?);
        let scale = match unit {
            "K" => 1 << 10,
            "M" => 1 << 20,
            _ => return None,
        };
        Some(digits.parse::<usize>().ok()? * scale)
    });
    sizes.max()
}

criterion_group!(benches, bench);
criterion_main!(benches);
