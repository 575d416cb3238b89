//! Cached tokenization equals full tokenization on varied chats, with the built-in tokenizer and
//! ChatML, and with the real DeepSeek-V4 tokenizer and a template that uses its added tokens.

use kvrouter_tokenizer::{load, CachedTokenizer, ChatMessage, ChatTemplate};
use proptest::prelude::*;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

fn deepseek() -> Arc<dyn kvrouter_tokenizer::Tokenizer> {
    static TOKENIZER: OnceLock<Arc<dyn kvrouter_tokenizer::Tokenizer>> = OnceLock::new();
    TOKENIZER
        .get_or_init(|| {
            let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../../shared/tokenizers/deepseek-v4/tokenizer.json");
            load(Some(&path)).unwrap()
        })
        .clone()
}

fn template() -> ChatTemplate {
    let source = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../templates/deepseek.jinja"),
    )
    .unwrap();
    ChatTemplate::jinja(
        source,
        "deepseek.jinja".into(),
        "<｜begin▁of▁sentence｜>".into(),
        String::new(),
    )
    .unwrap()
}

fn text() -> impl Strategy<Value = String> {
    let word = prop_oneof![
        "[a-zA-Z]{1,10}",
        "[0-9]{1,6}",
        Just("  ".to_owned()),
        Just("\n".to_owned()),
        Just("\n\n".to_owned()),
        Just("\t".to_owned()),
        Just("é".to_owned()),
        Just("你好".to_owned()),
        Just("```rust\nfn main() {}\n```".to_owned()),
        Just("<|im_end|>".to_owned()),
        Just("<｜User｜>".to_owned()),
        "[ .,;:!?()'\"-]{1,3}",
    ];
    prop::collection::vec(word, 0..30).prop_map(|w| w.join(" "))
}

fn chat() -> impl Strategy<Value = Vec<ChatMessage>> {
    let role = prop_oneof![
        Just("system"),
        Just("user"),
        Just("assistant"),
        Just("tool")
    ];
    prop::collection::vec((role, text()), 1..8).prop_map(|ms| {
        ms.into_iter()
            .map(|(r, c)| ChatMessage {
                role: r.into(),
                content: c,
            })
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn builtin_cached_equals_full(chats in prop::collection::vec(chat(), 1..4)) {
        let cached = CachedTokenizer::new(load(None).unwrap(), 10_000);
        for messages in chats {
            let prompt = ChatTemplate::ChatMl.render(&messages, true).unwrap();
            prop_assert_eq!(cached.encode(&prompt), cached.inner().encode(&prompt));
        }
    }

    #[test]
    fn deepseek_cached_equals_full(chats in prop::collection::vec(chat(), 1..4)) {
        let tok = deepseek();
        let cached = CachedTokenizer::new(Arc::clone(&tok), 50_000);
        let t = template();
        // Growing conversations: each chat is re-sent with one more turn, like an agent.
        for messages in chats {
            for n in 1..=messages.len() {
                let prompt = t.render(&messages[..n], true).unwrap();
                prop_assert_eq!(cached.encode(&prompt), tok.encode(&prompt), "prompt {:?}", prompt);
            }
        }
    }
}
