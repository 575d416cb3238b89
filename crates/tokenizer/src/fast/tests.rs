//! Unit tests of the fast path's configuration checks and tables.

use super::config::{ids_kept, normalizer, Normalizer};
use super::{byte_chars, FastPath, Matcher, Step};
use serde_json::json;

#[test]
fn bpe_dropout_is_refused() {
    let file = |dropout: serde_json::Value| {
        json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
               "normalizer": null, "pre_tokenizer": null, "post_processor": null,
               "decoder": null,
               "model": {"type": "BPE", "dropout": dropout, "vocab": {"a": 0, "b": 1, "ab": 2},
                         "merges": ["a b"]}})
        .to_string()
    };
    for (dropout, taken) in [(json!(null), true), (json!(0.0), true), (json!(0.5), false)] {
        let file = file(dropout);
        let tok: tokenizers::Tokenizer = file.parse().unwrap();
        assert_eq!(FastPath::new(&tok, &file).is_some(), taken, "{file}");
    }
}

#[test]
fn only_post_processors_that_keep_the_ids_are_taken() {
    let seq = |id: &str| json!({"Sequence": {"id": id, "type_id": 0}});
    let bos = json!({"SpecialToken": {"id": "<s>", "type_id": 0}});
    let template = |single: Vec<serde_json::Value>| json!({"type": "TemplateProcessing", "single": single, "pair": [], "special_tokens": {}});
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": true,
                            "trim_offsets": true, "use_regex": true});
    for (config, kept) in [
        (template(vec![bos.clone(), seq("A")]), true),
        (template(vec![seq("A"), seq("A")]), false),
        (template(vec![bos.clone()]), false),
        (template(vec![seq("B")]), false),
        (
            json!({"type": "Sequence", "processors": [byte_level.clone(),
                                                     template(vec![seq("A")])]}),
            true,
        ),
        (
            json!({"type": "Sequence", "processors": [template(vec![seq("A"), seq("A")])]}),
            false,
        ),
        (byte_level, true),
        (json!({"type": "Unknown"}), false),
    ] {
        assert_eq!(ids_kept(Some(Ok(config.clone()))), kept, "{config}");
    }
    assert!(ids_kept(None));
}

#[test]
fn deepseeks_lookahead_split_runs_rewritten() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/tokenizers/deepseek-v4/tokenizer.json");
    let file = std::fs::read_to_string(path).unwrap();
    let tok: tokenizers::Tokenizer = file.parse().unwrap();
    let fast = FastPath::new(&tok, &file).unwrap();
    let kinds: Vec<bool> = fast
        .steps
        .iter()
        .map(|s| {
            matches!(
                s,
                Step::Regex {
                    regex: Matcher::Tail(..),
                    ..
                }
            )
        })
        .collect();
    // Digits and CJK runs as compiled; the third split (with `\s+(?!\S)`) rewritten.
    assert_eq!(kinds, [false, false, true]);
}

#[test]
fn the_byte_table_is_gpt2s() {
    let t = byte_chars();
    assert_eq!(t[usize::from(b'A')], 'A');
    assert_eq!(t[usize::from(b' ')], 'Ġ');
    assert_eq!(t[usize::from(b'\n')], 'Ċ');
    assert_eq!(t[0], 'Ā');
    assert_eq!(t[0xad], 'Ń');
    assert_eq!(t[0xff], 'ÿ');
    let mut all: Vec<char> = t.to_vec();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), 256);
}

#[test]
fn nfc_and_empty_normalizers_are_taken_others_not() {
    for (config, want) in [
        (json!({"type": "NFC"}), Some(Normalizer::Nfc)),
        (
            json!({"type": "Sequence", "normalizers": []}),
            Some(Normalizer::Identity),
        ),
        (
            json!({"type": "Sequence", "normalizers": [{"type": "NFC"}]}),
            Some(Normalizer::Nfc),
        ),
        (
            json!({"type": "Sequence", "normalizers": [{"type": "Sequence", "normalizers": []}]}),
            Some(Normalizer::Identity),
        ),
        (json!({"type": "Lowercase"}), None),
        (json!({"type": "NFKC"}), None),
        (
            json!({"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Lowercase"}]}),
            None,
        ),
    ] {
        assert_eq!(normalizer(Some(Ok(config.clone()))), want, "{config}");
    }
    assert_eq!(normalizer(None), Some(Normalizer::Identity));
}
