//! Routing tokenization of a 32k-token chat with the DeepSeek-V4 tokenizer: cold (every segment
//! new) and warm (the history was seen before; only the new turn is tokenized); and one ~2k-token
//! text prompt through `tokenizers`' own `encode_fast` beside kvrouter's encode (its fast path,
//! `src/fast.rs`), same ids.
//!
//! `cargo bench -p kvrouter-tokenizer --bench chat`

#![allow(missing_docs)]

use criterion::{criterion_group, criterion_main, Criterion};
use kvrouter_tokenizer::{load, CachedTokenizer, ChatMessage, ChatTemplate};
use std::hint::black_box;
use std::path::PathBuf;
use std::sync::Arc;

fn chat_of(turns: usize) -> Vec<ChatMessage> {
    let text =
        "The router hashes token blocks and keeps a prefix index of what every worker caches. ";
    (0..turns)
        .map(|i| ChatMessage {
            role: if i % 2 == 0 {
                "user".into()
            } else {
                "assistant".into()
            },
            content: format!("turn {i}: {}", text.repeat(20)),
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let tok = load(Some(
        &root.join("../shared/tokenizers/deepseek-v4/tokenizer.json"),
    ))
    .unwrap();
    let source = std::fs::read_to_string(root.join("templates/deepseek.jinja")).unwrap();
    let template = ChatTemplate::jinja(
        source,
        "deepseek".into(),
        "<｜begin▁of▁sentence｜>".into(),
        String::new(),
    )
    .unwrap();
    // Grow the chat until it is about 32k tokens.
    let mut turns = 2;
    while tok
        .encode(&template.render(&chat_of(turns), true).unwrap())
        .len()
        < 32_000
    {
        turns += 2;
    }
    let history = chat_of(turns);
    let prompt = template.render(&history, true).unwrap();
    let n = tok.encode(&prompt).len();
    eprintln!("chat: {turns} turns, {n} tokens");
    let mut next = history.clone();
    next.push(ChatMessage {
        role: "user".into(),
        content: "And one more short question?".into(),
    });
    let next_prompt = template.render(&next, true).unwrap();

    let mut group = c.benchmark_group(format!("tokenize_chat_{n}_tokens"));
    group.sample_size(10);
    group.bench_function("full_tokenization", |b| {
        b.iter(|| black_box(tok.encode(black_box(&prompt))))
    });
    let cached = CachedTokenizer::new(Arc::clone(&tok), 4 << 20);
    cached.encode(&prompt);
    group.bench_function("history_seen_new_turn", |b| {
        b.iter(|| black_box(cached.encode(black_box(&next_prompt))))
    });
    group.bench_function("render_template", |b| {
        b.iter(|| black_box(template.render(black_box(&next), true).unwrap()))
    });
    group.finish();

    // A text prompt of about 2,000 tokens, no added tokens: the fast path against the full one.
    let hf = tokenizers::Tokenizer::from_file(
        root.join("../shared/tokenizers/deepseek-v4/tokenizer.json"),
    )
    .unwrap();
    let words = [
        "The", "router", "hashes", "token", "blocks,", "and", "keeps", "a", "prefix", "index",
        "of", "what", "every", "worker", "caches:", "42", "requests", "in", "flight.", "\n",
    ];
    let text: String = (0..1500)
        .map(|i| words[(i * 7 + i / 3) % words.len()])
        .collect::<Vec<_>>()
        .join(" ");
    let ids = tok.encode(&text);
    assert_eq!(ids, hf.encode_fast(text.as_str(), false).unwrap().get_ids());
    let mut group = c.benchmark_group(format!("tokenize_text_{}_tokens", ids.len()));
    group.bench_function("tokenizers_encode_fast", |b| {
        b.iter(|| black_box(hf.encode_fast(black_box(text.as_str()), false).unwrap()))
    });
    group.bench_function("kvrouter_encode", |b| {
        b.iter(|| black_box(tok.encode(black_box(&text))))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
