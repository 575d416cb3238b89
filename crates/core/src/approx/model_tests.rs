//! Naive model: a (rank, block) is predicted while its last insertion is younger than the TTL,
//! and a rank's overlap with a prompt is its run of predicted blocks from the first. The index
//! answers exactly that, also while a call's bound leaves expired entries in it (a drop step of
//! 2 here, so the bound binds).

use super::*;
use crate::hashing::{BlockHasher, HashNamespace};
use proptest::prelude::*;
use std::collections::HashMap;

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn the_index_predicts_what_was_inserted_within_the_ttl(
        ops in prop::collection::vec((0u8..3, 1u32..12, 0u64..4, 0u64..6, any::<bool>()), 1..60),
    ) {
        let ttl = Duration::from_millis(10);
        let mut approx =
            ApproxIndex::new(2, ApproxConfig { ttl, ..ApproxConfig::default() }).with_drop_step(2);
        let hasher = BlockHasher::new(2, &HashNamespace::none());
        // A prompt is a family's first `len` blocks: families share their prefixes.
        let prompt = |family: u8, len: u32| {
            let tokens: Vec<u32> = (0..len * 2).map(|t| u32::from(family) * 7 + t / 5).collect();
            hasher.hash_blocks(&tokens)
        };
        let mut model: HashMap<(WorkerRank, SequenceHash), Time> = HashMap::new();
        let mut now = Time::ZERO;
        for (family, len, r, step, expire_only) in ops {
            now = now + Duration::from_millis(step * 2);
            approx.expire(now);
            model.retain(|_, until| *until > now);
            let rank = WorkerRank::new(WorkerId(r), 0);
            let blocks = prompt(family, len);
            if !expire_only {
                approx.insert(rank, &blocks, now);
                for s in &blocks.sequence {
                    model.insert((rank, *s), now + ttl);
                }
            }
            approx.check_invariants().map_err(TestCaseError::fail)?;
            prop_assert!(approx.len() >= model.len());
            for f in 0..3 {
                let query = prompt(f, 12).sequence;
                let scores = approx.find_matches(&query, now);
                for w in 0..4 {
                    let rank = WorkerRank::new(WorkerId(w), 0);
                    let want = query.iter().take_while(|s| model.contains_key(&(rank, **s))).count();
                    prop_assert_eq!(scores.get(rank).gpu_blocks as usize, want);
                }
            }
        }
        // Calls drop at least a step each: the expired entries all go in the end.
        while !approx.expire(now) {}
        prop_assert_eq!(approx.len(), model.len());
        approx.check_invariants().map_err(TestCaseError::fail)?;
    }
}
