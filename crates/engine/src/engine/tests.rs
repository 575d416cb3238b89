use super::*;
use crate::timing::{DynamoPoly, StepShape, TimingError};
use kvrouter_core::event::{BlockContent, Medium};
use kvrouter_core::ids::WorkerId;

fn engine(config: EngineConfig) -> Engine {
    Engine::new(
        config,
        WorkerRank::new(WorkerId(1), 0),
        Box::new(DynamoPoly),
    )
}

fn small() -> EngineConfig {
    EngineConfig {
        block_size: 4,
        num_gpu_blocks: 32,
        max_num_batched_tokens: 64,
        ..Default::default()
    }
}

fn req(id: u64, tokens: Vec<u32>, out: u32) -> EngineRequest {
    EngineRequest {
        id: RequestId(id),
        prompt: Prompt::tokens(tokens),
        max_output_tokens: out,
    }
}

/// Steps until idle; returns (time of each request's first token, finished list, all events).
fn run(
    e: &mut Engine,
    mut now: Time,
) -> (FastMap<RequestId, Time>, Vec<Finished>, Vec<KvEvent>, Time) {
    let mut first = FastMap::default();
    let mut finished = Vec::new();
    let mut events = Vec::new();
    for _ in 0..100_000 {
        let Some(out) = e.step(now).unwrap() else {
            break;
        };
        e.check_invariants().unwrap();
        for t in &out.tokens {
            if t.index == 0 {
                first.insert(t.id, out.end);
            }
        }
        finished.extend(out.finished);
        events.extend(out.events);
        now = out.end;
    }
    (first, finished, events, now)
}

fn close(a: Time, b_ms: f64) -> bool {
    (a.as_micros() as f64 - b_ms * 1000.0).abs() <= 1.0
}

#[test]
fn a_lone_request_takes_the_models_prefill_time_to_its_first_token() {
    let mut e = engine(EngineConfig {
        block_size: 64,
        ..Default::default()
    });
    e.add_request(req(1, (0..1000).collect(), 1)).unwrap();
    let (first, finished, _, _) = run(&mut e, Time::ZERO);
    assert!(close(
        first[&RequestId(1)],
        DynamoPoly.prefill_ms(1000).unwrap()
    ));
    assert_eq!(finished[0].cached_tokens, 0);
}

#[test]
fn a_repeated_prompt_is_faster_by_exactly_its_cached_part() {
    let mut e = engine(EngineConfig {
        block_size: 64,
        ..Default::default()
    });
    e.add_request(req(1, (0..1000).collect(), 1)).unwrap();
    let (_, _, _, t) = run(&mut e, Time::ZERO);
    e.add_request(req(2, (0..1000).collect(), 1)).unwrap();
    let (first, finished, _, _) = run(&mut e, t);
    // 15 full blocks (960 tokens) are cached; 40 tokens remain.
    assert_eq!(finished[0].cached_tokens, 960);
    let ttft_ms = (first[&RequestId(2)].as_micros() - t.as_micros()) as f64 / 1000.0;
    assert!(
        (ttft_ms - DynamoPoly.prefill_ms(40).unwrap()).abs() < 0.002,
        "{ttft_ms}"
    );
}

#[test]
fn decode_produces_one_token_per_step_until_max_tokens() {
    let mut e = engine(small());
    e.add_request(req(1, (0..10).collect(), 5)).unwrap();
    let mut tokens = Vec::new();
    let mut now = Time::ZERO;
    while let Some(out) = e.step(now).unwrap() {
        assert!(out.tokens.len() <= 1);
        tokens.extend(out.tokens.iter().map(|t| t.index));
        now = out.end;
    }
    assert_eq!(tokens, vec![0, 1, 2, 3, 4]);
    assert_eq!(e.stats().finished_total, 1);
    assert_eq!(e.stats().used_blocks, 0);
}

#[test]
fn long_prompts_are_prefilled_in_chunks_of_the_token_budget() {
    let mut e = engine(EngineConfig {
        num_gpu_blocks: 64,
        ..small()
    });
    e.add_request(req(1, (0..150).collect(), 1)).unwrap();
    let mut chunks = Vec::new();
    let mut now = Time::ZERO;
    while let Some(out) = e.step(now).unwrap() {
        chunks.push(out.prefill_tokens);
        now = out.end;
    }
    assert_eq!(chunks, vec![64, 64, 22]);
}

#[test]
fn cached_blocks_are_announced_and_evictions_removed() {
    let mut e = engine(EngineConfig {
        num_gpu_blocks: 4,
        ..small()
    });
    e.add_request(req(1, (0..8).collect(), 1)).unwrap();
    let (_, _, events, t) = run(&mut e, Time::ZERO);
    // Two full prompt blocks, one event chaining both, with their tokens.
    assert_eq!(events.len(), 1);
    let KvEvent::Stored {
        parent,
        blocks,
        medium,
        ..
    } = &events[0]
    else {
        panic!()
    };
    assert_eq!((*parent, blocks.len(), *medium), (None, 2, Medium::Gpu));
    assert_eq!(blocks[1].content, BlockContent::Tokens(vec![4, 5, 6, 7]));
    // A different prompt needing every block evicts the cached ones.
    e.add_request(req(2, (100..116).collect(), 1)).unwrap();
    let (_, _, events, _) = run(&mut e, t);
    let removed: usize = events
        .iter()
        .map(|ev| match ev {
            KvEvent::Removed { engine_hashes, .. } => engine_hashes.len(),
            _ => 0,
        })
        .sum();
    assert_eq!(removed, 2);
}

#[test]
fn impossible_requests_are_refused() {
    let mut e = engine(small());
    assert!(matches!(
        e.add_request(req(1, (0..200).collect(), 1)),
        Err(EngineError::TooLong { .. })
    ));
    assert_eq!(
        e.add_request(req(1, vec![1], 0)),
        Err(EngineError::NoOutput)
    );
    assert_eq!(
        e.add_request(req(1, vec![], 1)),
        Err(EngineError::EmptyPrompt)
    );
    e.add_request(req(1, vec![1], 1)).unwrap();
    assert_eq!(
        e.add_request(req(1, vec![1], 1)),
        Err(EngineError::Duplicate(RequestId(1)))
    );
}

#[test]
fn block_pressure_preempts_the_newest_and_everything_still_finishes() {
    // 12 blocks of 4 tokens; three requests that each grow to 5 blocks cannot all run at once.
    let mut e = engine(EngineConfig {
        num_gpu_blocks: 12,
        ..small()
    });
    for i in 0..3 {
        e.add_request(req(i, (i as u32 * 100..i as u32 * 100 + 8).collect(), 12))
            .unwrap();
    }
    let (_, finished, _, _) = run(&mut e, Time::ZERO);
    assert_eq!(finished.len(), 3);
    assert!(finished.iter().all(|f| f.output_tokens == 12));
    assert!(
        e.stats().preemptions_total > 0,
        "the test must exercise preemption"
    );
    assert_eq!(e.stats().used_blocks, 0);
}

#[test]
fn the_cpu_tier_keeps_evicted_blocks_and_onboards_them() {
    let mut e = engine(EngineConfig {
        num_gpu_blocks: 4,
        num_cpu_blocks: 8,
        ..small()
    });
    e.add_request(req(1, (0..9).collect(), 1)).unwrap();
    let (_, _, _, t) = run(&mut e, Time::ZERO);
    e.add_request(req(2, (100..116).collect(), 1)).unwrap();
    let (_, _, events, t) = run(&mut e, t);
    assert!(events.iter().any(|ev| matches!(
        ev,
        KvEvent::Stored {
            medium: Medium::Cpu,
            ..
        }
    )));
    e.add_request(req(3, (0..9).collect(), 1)).unwrap();
    let (_, finished, _, _) = run(&mut e, t);
    assert_eq!(
        finished[0].cached_tokens, 8,
        "both blocks came back from the CPU tier"
    );
}

#[test]
fn cancel_frees_everything_and_the_same_seed_gives_the_same_tokens() {
    let mut e = engine(small());
    e.add_request(req(1, (0..10).collect(), 5)).unwrap();
    e.step(Time::ZERO).unwrap();
    assert!(e.cancel(RequestId(1)));
    assert!(!e.cancel(RequestId(1)));
    assert_eq!(e.stats().used_blocks, 0);
    e.check_invariants().unwrap();
    let tokens = |seed| {
        let mut e = engine(EngineConfig { seed, ..small() });
        e.add_request(req(1, (0..10).collect(), 5)).unwrap();
        let mut all = Vec::new();
        let mut now = Time::ZERO;
        while let Some(out) = e.step(now).unwrap() {
            all.extend(out.tokens.iter().map(|t| t.token));
            now = out.end;
        }
        all
    };
    assert_eq!(tokens(1), tokens(1));
    assert_ne!(tokens(1), tokens(2));
}

#[test]
fn hash_prompts_from_traces_hit_the_cache_too() {
    let mut e = engine(small());
    let hashes = BlockHasher::new(4, &Default::default()).hash_blocks(&(0..16).collect::<Vec<_>>());
    let r = |id| EngineRequest {
        id: RequestId(id),
        prompt: Prompt::Blocks {
            blocks: hashes.clone(),
            len_tokens: 18,
        },
        max_output_tokens: 2,
    };
    e.add_request(r(1)).unwrap();
    let (_, _, events, t) = run(&mut e, Time::ZERO);
    assert!(
        matches!(&events[0], KvEvent::Stored { blocks, .. } if matches!(blocks[0].content, BlockContent::Hash(_)))
    );
    e.add_request(r(2)).unwrap();
    let (_, finished, _, _) = run(&mut e, t);
    assert_eq!(finished[0].cached_tokens, 16);
}

/// A request on a LoRA adapter announces its blocks in the adapter's namespace (a router that
/// re-hashes the tokens gets the adapter's hashes), and shares no cache with the base model.
#[test]
fn adapter_blocks_are_announced_in_their_namespace() {
    let mut e = engine(small());
    let lora = HashNamespace {
        lora_name: Some("sql".into()),
        ..HashNamespace::none()
    };
    e.add_request(EngineRequest {
        id: RequestId(1),
        prompt: Prompt::Tokens {
            tokens: (0..8).collect(),
            namespace: lora.clone(),
        },
        max_output_tokens: 1,
    })
    .unwrap();
    let (_, _, events, t) = run(&mut e, Time::ZERO);
    let KvEvent::Stored { namespace, .. } = &events[0] else {
        panic!("{events:?}")
    };
    assert_eq!(namespace, &lora);
    // The same tokens on the base model: announced again, in the plain namespace.
    e.add_request(req(2, (0..8).collect(), 1)).unwrap();
    let (_, _, events, _) = run(&mut e, t);
    let stored: Vec<&HashNamespace> = events
        .iter()
        .filter_map(|ev| match ev {
            KvEvent::Stored { namespace, .. } => Some(namespace),
            _ => None,
        })
        .collect();
    assert_eq!(
        stored,
        vec![&HashNamespace::none()],
        "no cache shared with the adapter"
    );
}

/// Stored blocks announced by a run, in chain order.
fn stored(events: &[KvEvent]) -> usize {
    events
        .iter()
        .map(|e| match e {
            KvEvent::Stored { blocks, .. } => blocks.len(),
            _ => 0,
        })
        .sum()
}

/// A trace (block-hash) prompt caches the blocks its output fills, as a token prompt (and a real
/// engine) does: same blocks stored, announced and left in the cache, so the simulator sees
/// the mock engine's cache pressure and KV events.
#[test]
fn hash_prompts_cache_their_output_blocks_like_token_prompts() {
    let tokens: Vec<u32> = (0..18).collect();
    let hashes = BlockHasher::new(4, &Default::default()).hash_blocks(&tokens[..16]);
    let mut by_tokens = engine(small());
    by_tokens.add_request(req(1, tokens, 11)).unwrap();
    let (_, _, tok_events, _) = run(&mut by_tokens, Time::ZERO);
    let mut by_hash = engine(small());
    by_hash
        .add_request(EngineRequest {
            id: RequestId(1),
            prompt: Prompt::Blocks {
                blocks: hashes,
                len_tokens: 18,
            },
            max_output_tokens: 11,
        })
        .unwrap();
    let (_, _, hash_events, _) = run(&mut by_hash, Time::ZERO);
    // 18 prompt + 10 computed output tokens = 28 = 7 full blocks: 4 prompt, 3 with output.
    assert_eq!(stored(&tok_events), 7);
    assert_eq!(stored(&hash_events), 7);
    assert_eq!(
        by_hash.stats().cached_blocks,
        by_tokens.stats().cached_blocks
    );
}

/// A preempted trace request recomputes its context from the cache, output blocks included.
#[test]
fn a_preempted_hash_request_hits_its_own_output_blocks() {
    let mut e = engine(small());
    let hashes = BlockHasher::new(4, &Default::default()).hash_blocks(&(0..8).collect::<Vec<_>>());
    e.add_request(EngineRequest {
        id: RequestId(1),
        prompt: Prompt::Blocks {
            blocks: hashes,
            len_tokens: 8,
        },
        max_output_tokens: 20,
    })
    .unwrap();
    let mut now = Time::ZERO;
    // Prefill, then decode until 3 output blocks are full (8 + 12 computed tokens).
    for _ in 0..13 {
        now = e.step(now).unwrap().expect("work").end;
    }
    let mut preempted = Vec::new();
    e.preempt(RequestId(1), &mut preempted);
    let out = e.step(now).unwrap().expect("work");
    // 8 prompt + 13 output tokens known, 5 full blocks: all hits on readmission, so only the
    // last token is computed again (a decode step), not 13 tokens of prefill.
    assert_eq!(e.seqs[&RequestId(1)].computed, 21);
    assert_eq!((out.prefill_tokens, out.decode_seqs), (0, 1));
}

/// A request preempted and readmitted onto its own cached blocks reports the cache hits of its
/// first admission (vLLM's `num_cached_tokens`), not its own recomputed prefix: served hit rates
/// stay below what any cache could serve.
#[test]
fn a_preempted_request_reports_the_hits_of_its_first_admission() {
    let mut e = engine(small());
    e.add_request(req(1, (0..16).collect(), 20)).unwrap();
    let mut now = Time::ZERO;
    for _ in 0..5 {
        now = e.step(now).unwrap().expect("work").end;
    }
    let mut preempted = Vec::new();
    e.preempt(RequestId(1), &mut preempted);
    let (_, finished, _, _) = run(&mut e, now);
    assert_eq!(finished[0].preemptions, 1);
    assert_eq!(finished[0].cached_tokens, 0);
    assert_eq!(e.stats().cached_tokens_total, 0);
}

/// A model whose steps take longer than a clock can hold.
#[derive(Debug)]
struct Endless;

impl TimingModel for Endless {
    fn prefill_ms(&self, _: u64) -> Result<f64, TimingError> {
        Ok(1e300)
    }
    fn decode_ms(&self, _: &StepShape) -> Result<f64, TimingError> {
        Ok(f64::INFINITY)
    }
}

#[test]
fn a_step_longer_than_the_clock_holds_is_capped_not_a_panic() {
    let mut e = Engine::new(small(), WorkerRank::new(WorkerId(1), 0), Box::new(Endless));
    e.add_request(req(1, (0..8).collect(), 2)).unwrap();
    let now = Time::from_micros(5);
    let step = e.step(now).unwrap().expect("a step");
    assert_eq!(step.end, now + MAX_STEP);
    let next = e.step(step.end).unwrap().expect("a decode step");
    assert_eq!(next.end, step.end + MAX_STEP);
}
