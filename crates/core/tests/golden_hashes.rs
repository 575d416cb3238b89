//! The router's block hashes against vectors computed independently (Python `xxhash`, see
//! `golden/make_hash_vectors.py`). A change here changes every hash the router has ever stored.

use kvrouter_core::hashing::{BlockHasher, HashNamespace};
use serde_json::Value;

#[test]
fn hashes_match_the_independent_vectors() {
    let text = include_str!("golden/router_hash_vectors.json");
    let doc: Value = serde_json::from_str(text).unwrap();
    let cases = doc["cases"].as_array().unwrap();
    assert!(cases.len() >= 8);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let tokens: Vec<u32> = case["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let ns = HashNamespace {
            lora_name: case["lora_name"].as_str().map(str::to_owned),
            cache_salt: case["cache_salt"].as_str().map(str::to_owned),
        };
        let hasher = BlockHasher::new(case["block_size"].as_u64().unwrap() as usize, &ns);
        let parse = |key: &str| -> Vec<u64> {
            case[key]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap().parse().unwrap())
                .collect()
        };
        let blocks = hasher.hash_blocks(&tokens);
        let content: Vec<u64> = blocks.content.iter().map(|h| h.0).collect();
        let sequence: Vec<u64> = blocks.sequence.iter().map(|h| h.0).collect();
        assert_eq!(content, parse("content"), "{name}: content hashes");
        assert_eq!(sequence, parse("sequence"), "{name}: sequence hashes");
    }
}
