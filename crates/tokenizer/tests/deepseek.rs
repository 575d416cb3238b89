//! The real DeepSeek-V4 tokenizer from `../shared/tokenizers/` loads, round-trips text, and its
//! filler tokens encode back to themselves.

use kvrouter_tokenizer::load;
use std::path::PathBuf;

fn path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/tokenizers/deepseek-v4/tokenizer.json")
}

#[test]
fn deepseek_tokenizer_loads_and_round_trips() {
    let t = load(Some(&path())).unwrap();
    let ids = t.encode("The quick brown fox jumps over the lazy dog.");
    assert!(ids.len() > 5 && ids.len() < 15, "{ids:?}");
    assert_eq!(
        t.decode(&ids),
        "The quick brown fox jumps over the lazy dog."
    );
    assert!(!t.special_tokens().is_empty());
    let fillers: Vec<u32> = (0..30).map(|i| t.filler_token(i)).collect();
    let again = t.encode(&t.decode(&fillers));
    assert_eq!(again, fillers);
}

#[test]
fn a_missing_file_is_a_clear_error() {
    let err = load(Some(&PathBuf::from("/nonexistent/tokenizer.json"))).unwrap_err();
    assert!(err.to_string().contains("/nonexistent/tokenizer.json"));
}
