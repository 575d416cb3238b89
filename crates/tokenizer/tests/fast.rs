//! The fast encode path gives the ids `tokenizers`' own `encode_fast` gives, on random text, for
//! the real DeepSeek-V4 tokenizer and for small tokenizers of every shape the path takes; shapes
//! it does not take are refused and still encode the full way.

use kvrouter_tokenizer::{HfTokenizer, Tokenizer};
use proptest::prelude::*;
use std::path::PathBuf;
use std::sync::OnceLock;

struct Pair {
    ours: HfTokenizer,
    theirs: tokenizers::Tokenizer,
    /// Every text takes the fast path (no added token makes it give up).
    always_fast: bool,
}

impl Pair {
    fn from_file(path: &std::path::Path) -> Self {
        let ours = HfTokenizer::from_path(path).unwrap();
        Self {
            always_fast: ours.has_fast_path(),
            ours,
            theirs: tokenizers::Tokenizer::from_file(path).unwrap(),
        }
    }

    /// A tokenizer from its JSON, through a file as `--tokenizer` would load it.
    fn from_json(name: &str, json: &serde_json::Value) -> Self {
        let path =
            std::env::temp_dir().join(format!("kvrouter-fast-{}-{name}.json", std::process::id()));
        std::fs::write(&path, json.to_string()).unwrap();
        let pair = Self::from_file(&path);
        std::fs::remove_file(&path).unwrap();
        pair
    }

    fn check(&self, text: &str) -> Result<(), TestCaseError> {
        let want = self.theirs.encode_fast(text, false).unwrap();
        prop_assert_eq!(
            self.ours.encode(text),
            want.get_ids().to_vec(),
            "text {:?}",
            text
        );
        Ok(())
    }
}

fn deepseek() -> &'static Pair {
    static PAIR: OnceLock<Pair> = OnceLock::new();
    PAIR.get_or_init(|| {
        Pair::from_file(
            &PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../../shared/tokenizers/deepseek-v4/tokenizer.json"),
        )
    })
}

/// The 256 byte-level characters, GPT-2's table.
fn byte_alphabet() -> Vec<String> {
    let mut bytes: Vec<u32> = (0x21..=0x7e)
        .chain(0xa1..=0xac)
        .chain(0xae..=0xff)
        .collect();
    let mut chars = bytes.clone();
    let mut n = 256;
    for b in 0..=255 {
        if !bytes.contains(&b) {
            bytes.push(b);
            chars.push(n);
            n += 1;
        }
    }
    let mut out: Vec<String> = chars
        .into_iter()
        .map(|c| char::from_u32(c).unwrap().to_string())
        .collect();
    out.sort();
    out
}

/// A BPE over the byte alphabet with a few merges (" the", "he", "ing"), `<|end|>` added.
fn byte_bpe(pre_tokenizer: serde_json::Value) -> serde_json::Value {
    let mut vocab = serde_json::Map::new();
    let mut words = byte_alphabet();
    words.extend(["Ġt", "he", "Ġthe", "in", "ing", "the", "th"].map(String::from));
    for (i, w) in words.iter().enumerate() {
        vocab.insert(w.clone(), i.into());
    }
    let end = words.len();
    serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "normalizer": null,
        "added_tokens": [{"id": end, "content": "<|end|>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "pre_tokenizer": pre_tokenizer, "post_processor": null, "decoder": {"type": "ByteLevel", "add_prefix_space": true,
                                                             "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "vocab": vocab,
                  "merges": ["Ġ t", "h e", "Ġt he", "i n", "in g", "t h", "th e"]}
    })
}

fn gpt2_style() -> &'static Pair {
    static PAIR: OnceLock<Pair> = OnceLock::new();
    PAIR.get_or_init(|| {
        let pre = serde_json::json!({"type": "ByteLevel", "add_prefix_space": true,
                                     "trim_offsets": true, "use_regex": true});
        Pair::from_json("gpt2", &byte_bpe(pre))
    })
}

fn split_sequence() -> &'static Pair {
    static PAIR: OnceLock<Pair> = OnceLock::new();
    PAIR.get_or_init(|| {
        let pre = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed", "invert": false},
            {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": "\\p{N}"}, "behavior": "Isolated",
                 "invert": false},
                {"type": "Split", "pattern": {"Regex": "[a-z]+|\\n"}, "behavior": "Removed",
                 "invert": true}]},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
             "use_regex": false}]});
        Pair::from_json("split", &byte_bpe(pre))
    })
}

/// A byte-level BPE behind a single regex split, as Llama 3 and Qwen 2 tokenizers are.
fn split_then_bytes(name: &str, pattern: &str) -> Pair {
    let pre = serde_json::json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
         "use_regex": false}]});
    let mut json = byte_bpe(pre);
    // Llama 3's post-processor: a BOS template (adds nothing without special tokens).
    json["post_processor"] = serde_json::json!({"type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|end|>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|end|>": {"id": "<|end|>", "ids": [263], "tokens": ["<|end|>"]}}});
    Pair::from_json(name, &json)
}

fn llama3_like() -> &'static Pair {
    static PAIR: OnceLock<Pair> = OnceLock::new();
    PAIR.get_or_init(|| {
        split_then_bytes(
            "llama3",
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        )
    })
}

fn qwen2_like() -> &'static Pair {
    static PAIR: OnceLock<Pair> = OnceLock::new();
    PAIR.get_or_init(|| {
        split_then_bytes(
            "qwen2",
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        )
    })
}

/// Qwen's shape: NFC, then the Qwen 2 split and the byte-level step; an added token whose
/// string is not in NFC is found by its NFC form.
fn qwen_nfc() -> &'static Pair {
    static PAIR: OnceLock<Pair> = OnceLock::new();
    PAIR.get_or_init(|| {
        let pre = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"},
             "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
             "use_regex": false}]});
        let mut json = byte_bpe(pre);
        json["normalizer"] = serde_json::json!({"type": "NFC"});
        let next = json["added_tokens"][0]["id"].as_u64().unwrap() + 1;
        json["added_tokens"].as_array_mut().unwrap().push(serde_json::json!({
            "id": next, "content": "e\u{301}x", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": true, "special": false}));
        let mut pair = Pair::from_json("qwen-nfc", &json);
        // Text NFC would change takes the full way.
        pair.always_fast = false;
        pair
    })
}

#[test]
fn nfc_text_takes_the_fast_path_and_other_text_the_full_way() {
    let pair = qwen_nfc();
    assert!(pair.ours.has_fast_path());
    for text in [
        "plain ascii",
        "caf\u{e9} \u{e9}x 数字",
        "\u{1ebf}\u{301}",
        "\u{915}\u{93c}",
    ] {
        assert!(pair.ours.fast_encode(text).is_some(), "{text:?}");
        pair.check(text).unwrap();
    }
    for text in ["cafe\u{301}", "e\u{301}x", "\u{212b}"] {
        assert!(pair.ours.fast_encode(text).is_none(), "{text:?}");
        pair.check(text).unwrap();
    }
}

fn word_level() -> &'static Pair {
    static PAIR: OnceLock<Pair> = OnceLock::new();
    PAIR.get_or_init(|| {
        let mut vocab = serde_json::Map::new();
        for (i, w) in ["<unk>", "the", "a", "1", "é", "你好", "."]
            .iter()
            .enumerate()
        {
            vocab.insert((*w).into(), i.into());
        }
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "normalizer": {"type": "Sequence", "normalizers": []},
            "added_tokens": [{"id": 7, "content": "<s>", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true},
                             // Found only where the raw pass left it whole.
                             {"id": 8, "content": "a<s>b", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": true, "special": false},
                             {"id": 9, "content": "the end", "single_word": false,
                              "lstrip": false, "rstrip": false, "normalized": true,
                              "special": false}],
            "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
            "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
        });
        Pair::from_json("wordlevel", &json)
    })
}

fn text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        "[a-zA-Z]{1,8}",
        "[0-9]{1,7}",
        "[ \t\n\r]{1,4}",
        Just("\u{a0}".to_owned()),
        Just("\u{3000}".to_owned()),
        Just("\r\n".to_owned()),
        Just("the".to_owned()),
        Just(" the".to_owned()),
        Just("'s".to_owned()),
        Just("'ll".to_owned()),
        Just("ing".to_owned()),
        Just("é".to_owned()),
        Just("e\u{301}".to_owned()),
        Just("\u{e9}x".to_owned()),
        Just("\u{301}".to_owned()),
        Just("你好世界".to_owned()),
        Just("ひらがなカタカナ".to_owned()),
        Just("🦀".to_owned()),
        Just("\u{0}".to_owned()),
        Just("<|end|>".to_owned()),
        Just("<s>".to_owned()),
        Just("<｜User｜>".to_owned()),
        Just("<think>".to_owned()),
        Just("<dsml:".to_owned()),
        Just("a<s>b".to_owned()),
        Just("the end".to_owned()),
        "[!-/:-@\\[-`{-~]{1,3}",
        "\\PC{1,3}",
    ];
    prop::collection::vec(piece, 0..24).prop_map(|p| p.concat())
}

#[test]
fn every_supported_shape_takes_the_fast_path() {
    assert!(llama3_like().ours.has_fast_path());
    assert!(qwen2_like().ours.has_fast_path());
    assert!(deepseek().ours.has_fast_path());
    assert!(gpt2_style().ours.has_fast_path());
    assert!(split_sequence().ours.has_fast_path());
    assert!(word_level().ours.has_fast_path());
}

#[test]
fn fixed_texts_match() {
    for pair in [deepseek(), gpt2_style(), split_sequence(), word_level()] {
        for text in [
            "",
            " ",
            "the",
            "  the  end\n\n",
            "Hello, world! 12345 ing'll 's",
            "a\u{a0}b\u{3000}c \t\r\n",
            "数字123和汉字",
            "<|end|>the<s> a",
        ] {
            pair.check(text).unwrap();
        }
    }
}

#[test]
fn duplicate_added_tokens_split_as_tokenizers_does() {
    let mut vocab = serde_json::Map::new();
    for (i, w) in ["<unk>", "<", "x", "y", "the"].iter().enumerate() {
        vocab.insert((*w).into(), i.into());
    }
    let added = |id: u32, content: &str, special: bool, normalized: bool| {
        serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                           "rstrip": false, "normalized": normalized, "special": special})
    };
    let file = |added_tokens: Vec<serde_json::Value>| {
        serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "normalizer": null,
            "added_tokens": added_tokens, "pre_tokenizer": null, "post_processor": null,
            "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
        })
    };
    // Listed twice alike: found as one token.
    let alike = Pair::from_json(
        "duplicates-alike",
        &file(vec![
            added(5, "<a>", true, false),
            added(5, "<a>", true, false),
            added(6, "a>", false, false),
        ]),
    );
    // Listed twice with different flags: `tokenizers` keeps the special entry's flags and drops
    // the plain one, so "<a>" is only found in the normalized pass, after "a>" in the raw one.
    let mut differing = Pair::from_json(
        "duplicates-differing",
        &file(vec![
            added(5, "<a>", true, true),
            added(5, "<a>", false, false),
            added(6, "a>", false, false),
        ]),
    );
    differing.always_fast = false;
    assert!(differing.ours.fast_encode("<a>").is_none());
    for pair in [&alike, &differing] {
        for text in ["<a>", "x<a>y", "<a>a>", "the"] {
            pair.check(text).unwrap();
        }
    }
}

#[test]
fn a_piece_past_the_rewrites_limit_splits_as_tokenizers_does() {
    // 200,000 characters no alternative matches: fancy-regex gives up on the search, and
    // `tokenizers` leaves the whole piece as one word. The fast path runs such a piece as
    // `tokenizers` compiles it, so it gives up the same way.
    let text = format!("{}\t \u{0}", "\u{0}".repeat(200_000));
    deepseek().check(&text).unwrap();
}

#[test]
fn long_runs_match() {
    // Whitespace runs long enough to stress a backtracking matcher, then text after them.
    for run in [" ", "\n", "\t ", "\u{3000}"] {
        let text = format!(
            "a{}b {} c{}",
            run.repeat(20_000),
            run.repeat(3),
            run.repeat(5_000)
        );
        for pair in [deepseek(), gpt2_style(), split_sequence(), word_level()] {
            pair.check(&text).unwrap();
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn deepseek_fast_equals_full(text in text()) {
        deepseek().check(&text)?;
    }

    #[test]
    fn byte_level_shapes_equal_full(text in text()) {
        gpt2_style().check(&text)?;
        split_sequence().check(&text)?;
        llama3_like().check(&text)?;
        qwen2_like().check(&text)?;
        qwen_nfc().check(&text)?;
    }

    #[test]
    fn any_characters_equal_full(chars in prop::collection::vec(any::<char>(), 0..40)) {
        // Every Unicode scalar value, controls and marks included, not only the pieces above.
        let text: String = chars.into_iter().collect();
        deepseek().check(&text)?;
        llama3_like().check(&text)?;
        gpt2_style().check(&text)?;
        qwen_nfc().check(&text)?;
    }

    #[test]
    fn word_level_equals_full(text in text()) {
        word_level().check(&text)?;
    }
}

#[test]
fn other_shapes_are_refused_and_encode_the_full_way() {
    let normalized = {
        let mut json = byte_bpe(
            serde_json::json!({"type": "ByteLevel", "add_prefix_space": true,
                                                           "trim_offsets": true, "use_regex": true}),
        );
        json["normalizer"] = serde_json::json!({"type": "Lowercase"});
        Pair::from_json("lowercase", &json)
    };
    let metaspace = Pair::from_json(
        "metaspace",
        &byte_bpe(serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
             "use_regex": false},
            {"type": "WhitespaceSplit"}]})),
    );
    let merged = Pair::from_json(
        "merged",
        &byte_bpe(
            serde_json::json!({"type": "Split", "pattern": {"String": " "},
                                      "behavior": "MergedWithNext", "invert": false}),
        ),
    );
    for pair in [&normalized, &metaspace, &merged] {
        assert!(!pair.ours.has_fast_path());
        pair.check("The THE the  end").unwrap();
    }
    // An added token that strips spaces: text holding it takes the full way, other text not.
    let mut json = byte_bpe(
        serde_json::json!({"type": "ByteLevel", "add_prefix_space": true,
                                               "trim_offsets": true, "use_regex": true}),
    );
    json["added_tokens"][0]["rstrip"] = true.into();
    let mut stripping = Pair::from_json("rstrip", &json);
    assert!(stripping.ours.has_fast_path());
    stripping.always_fast = false;
    assert!(stripping.ours.fast_encode("the end").is_some());
    assert!(stripping.ours.fast_encode("the <|end|>").is_none());
    for text in ["", "the end", "the <|end|>  the", "<|end|>\n x"] {
        stripping.check(text).unwrap();
    }
}
