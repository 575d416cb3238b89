//! Property tests of the engine: blocks are conserved, nothing is freed twice, hits come only from
//! prefixes the engine announced as cached, preemption loses no request, and the engine's KV
//! events, replayed into the router's own prefix index, always describe its cache exactly.

use kvrouter_core::event::Medium;
use kvrouter_core::hashing::{BlockHasher, HashNamespace};
use kvrouter_core::ids::{RequestId, WorkerId, WorkerRank};
use kvrouter_core::index::PrefixIndex;
use kvrouter_core::time::Time;
use kvrouter_engine::{DynamoPoly, Engine, EngineConfig, EngineRequest, Prompt};
use proptest::prelude::*;
use std::collections::BTreeMap;

const BS: usize = 4;

#[derive(Clone, Debug)]
struct Spec {
    arrive_step: usize,
    prefix: u32,
    prefix_len: u32,
    suffix_len: u32,
    output: u32,
    cancel_after: Option<usize>,
}

fn spec() -> impl Strategy<Value = Spec> {
    (
        0usize..30,
        0u32..3,
        0u32..40,
        1u32..30,
        1u32..20,
        prop::option::weighted(0.15, 0usize..20),
    )
        .prop_map(
            |(arrive_step, prefix, prefix_len, suffix_len, output, cancel_after)| Spec {
                arrive_step,
                prefix,
                prefix_len,
                suffix_len,
                output,
                cancel_after,
            },
        )
}

fn prompt(i: usize, s: &Spec) -> Vec<u32> {
    let shared = (0..s.prefix_len).map(|t| s.prefix * 1000 + t);
    let own = (0..s.suffix_len).map(|t| 100_000 + i as u32 * 1000 + t);
    shared.chain(own).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 150, ..ProptestConfig::default() })]

    #[test]
    fn engine_conserves_blocks_and_its_events_mirror_its_cache(
        specs in prop::collection::vec(spec(), 1..16),
        blocks in 24usize..64,
        budget in 8u32..64,
        max_seqs in 1usize..8,
        cpu in prop_oneof![Just(0usize), Just(16usize)],
    ) {
        let config = EngineConfig {
            block_size: BS,
            num_gpu_blocks: blocks,
            max_num_batched_tokens: budget,
            max_num_seqs: max_seqs,
            num_cpu_blocks: cpu,
            ..EngineConfig::default()
        };
        let rank = WorkerRank::new(WorkerId(1), 0);
        let mut engine = Engine::new(config, rank, Box::new(DynamoPoly));
        let mut index = PrefixIndex::new(BS);
        let hasher = BlockHasher::new(BS, &HashNamespace::none());
        let mut outstanding: BTreeMap<u64, (Spec, Vec<u32>)> = BTreeMap::new();
        let mut produced: BTreeMap<u64, u32> = BTreeMap::new();
        let mut done = 0usize;
        let mut preempted = std::collections::BTreeSet::new();
        let mut now = Time::ZERO;
        for step in 0..5_000usize {
            for (i, s) in specs.iter().enumerate() {
                if s.arrive_step == step {
                    let tokens = prompt(i, s);
                    let request = EngineRequest {
                        id: RequestId(i as u64),
                        prompt: Prompt::tokens(tokens.clone()),
                        max_output_tokens: s.output,
                    };
                    match engine.add_request(request) {
                        Ok(()) => { outstanding.insert(i as u64, (s.clone(), tokens)); }
                        Err(_) => done += 1,
                    }
                }
                if s.cancel_after.map(|c| s.arrive_step + c) == Some(step)
                    && outstanding.remove(&(i as u64)).is_some()
                {
                    prop_assert!(engine.cancel(RequestId(i as u64)));
                    done += 1;
                }
            }
            let Some(out) = engine.step(now).unwrap() else {
                if step > 40 { break } else { continue }
            };
            prop_assert!(out.end > now || out.tokens.is_empty());
            now = out.end;
            engine.check_invariants().map_err(TestCaseError::fail)?;
            preempted.extend(out.preempted.iter().map(|id| id.0));
            for e in &out.events {
                index.apply(e).map_err(|err| TestCaseError::fail(format!("{err} for {e:?}")))?;
            }
            // Blocks are announced in the step that caches them (at allocation, as vLLM v1 does),
            // so after applying this step's events the router sees every block a request hit.
            // A recomputed request may also hit its own cached output blocks; check first
            // admissions only.
            for (id, hit) in out.admitted.iter().filter(|(id, _)| !preempted.contains(&id.0)) {
                let tokens = &outstanding[&id.0].1;
                let seen = index.find_matches(&hasher.sequence_hashes(tokens)).get(rank).total_blocks() * BS as u32;
                prop_assert!(*hit <= seen, "request {} hit {} tokens, router saw {}", id, hit, seen);
                prop_assert_eq!(hit % BS as u32, 0);
            }
            let gpu_entries = index
                .snapshot()
                .blocks
                .values()
                .filter(|b| b.holders.contains(&(rank, Medium::Gpu)))
                .count();
            prop_assert_eq!(gpu_entries, engine.stats().cached_blocks);
            for t in &out.tokens {
                let n = produced.entry(t.id.0).or_default();
                prop_assert_eq!(t.index, *n, "tokens arrive in order, none twice");
                *n += 1;
            }
            for f in &out.finished {
                let (s, _) = outstanding.remove(&f.id.0).expect("finished once");
                prop_assert_eq!(f.output_tokens, s.output);
                prop_assert_eq!(produced[&f.id.0], s.output);
                done += 1;
            }
        }
        prop_assert_eq!(done, specs.len(), "every request finished, was refused or cancelled");
        prop_assert_eq!(engine.stats().used_blocks, 0);
    }
}
