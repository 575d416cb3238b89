use super::*;
use kvrouter_workload::WorkloadRequest;

fn req(blocks: Vec<u64>, input_tokens: u32) -> WorkloadRequest {
    WorkloadRequest {
        arrival_ms: Some(0.0),
        after: None,
        delay_ms: 0.0,
        session: None,
        blocks,
        input_tokens,
        output_tokens: 4,
        group: None,
        step: None,
        policy_version: None,
    }
}

#[test]
fn shared_blocks_give_shared_token_prefixes() {
    let w = Workload {
        name: "t".into(),
        block_size: 4,
        requests: vec![
            req(vec![1, 2, 3], 10),
            req(vec![1, 2, 9], 12),
            req(vec![5], 6),
        ],
        barrier: None,
    };
    let (a, b, c) = (
        prompt_tokens(&w, 0, 100),
        prompt_tokens(&w, 1, 100),
        prompt_tokens(&w, 2, 100),
    );
    assert_eq!((a.len(), b.len(), c.len()), (10, 12, 6));
    assert_eq!(a[..8], b[..8]);
    assert_ne!(a[8..10], b[8..10]);
    assert_ne!(a[..4], c[..4]);
    assert!(a.iter().chain(&b).chain(&c).all(|t| *t < 100));
    // Padding beyond the blocks is unique to the request.
    let w2 = Workload {
        requests: vec![req(vec![7], 6), req(vec![5], 6)],
        ..w.clone()
    };
    let d = prompt_tokens(&w2, 1, 1 << 30);
    let c = prompt_tokens(&w, 2, 1 << 30);
    assert_eq!(c[..4], d[..4]);
    assert_ne!(c[4..], d[4..]);
}

#[test]
fn text_prompts_are_one_builtin_token_per_word() {
    use kvrouter_tokenizer::Tokenizer;
    let w = Workload {
        name: "t".into(),
        block_size: 4,
        requests: vec![req(vec![1, 2, 3], 10), req(vec![1, 2, 9], 12)],
        barrier: None,
    };
    let tok = kvrouter_tokenizer::builtin::BuiltinTokenizer::new();
    let (a, b) = (
        tok.encode(&prompt_text(&w, 0)),
        tok.encode(&prompt_text(&w, 1)),
    );
    assert_eq!((a.len(), b.len()), (10, 12));
    assert_eq!(a[..8], b[..8]);
    assert_ne!(a[8..], b[8..10]);
}
