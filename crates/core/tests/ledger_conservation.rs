//! Property test of the load ledger: whatever order requests begin, reach their first token and
//! end in, every unit begun is released exactly once.

use kvrouter_core::ids::{RequestId, SequenceHash, WorkerId, WorkerRank};
use kvrouter_core::ledger::{LedgerError, LoadLedger, RankLoad, RequestLoad};
use proptest::prelude::*;
use std::collections::BTreeMap;

#[derive(Clone, Debug)]
enum Op {
    Begin {
        id: u64,
        w: u64,
        prefill: u64,
        prefix: u8,
        len: u8,
    },
    FirstToken {
        id: u64,
    },
    Release {
        id: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u64..20, 0u64..3, 0u64..500, 0u8..3, 0u8..6).prop_map(|(id, w, prefill, prefix, len)| {
            Op::Begin {
                id,
                w,
                prefill,
                prefix,
                len,
            }
        }),
        (0u64..20).prop_map(|id| Op::FirstToken { id }),
        (0u64..20).prop_map(|id| Op::Release { id }),
    ]
}

fn load(w: u64, prefill: u64, prefix: u8, len: u8) -> RequestLoad {
    RequestLoad {
        rank: WorkerRank::new(WorkerId(w), 0),
        prefill_tokens: prefill,
        // Chains that share prefixes: block i of prefix p is the same for every request.
        blocks: (0..len)
            .map(|i| SequenceHash(u64::from(prefix) << 8 | u64::from(i)))
            .collect(),
        private_blocks: u64::from(len % 2),
    }
}

proptest! {
    #[test]
    fn everything_begun_is_released_exactly_once(ops in prop::collection::vec(op(), 1..200)) {
        let mut ledger = LoadLedger::new();
        // Naive model: active requests by id with their phase.
        let mut active: BTreeMap<u64, (RequestLoad, bool)> = BTreeMap::new();
        for op in &ops {
            match *op {
                Op::Begin { id, w, prefill, prefix, len } => {
                    let l = load(w, prefill, prefix, len);
                    let got = ledger.begin(RequestId(id), l.clone());
                    match active.entry(id) {
                        std::collections::btree_map::Entry::Occupied(_) => {
                            prop_assert_eq!(got, Err(LedgerError::DuplicateRequest(RequestId(id))));
                        }
                        std::collections::btree_map::Entry::Vacant(slot) => {
                            prop_assert!(got.is_ok());
                            slot.insert((l, false));
                        }
                    }
                }
                Op::FirstToken { id } => {
                    let got = ledger.first_token(RequestId(id));
                    prop_assert_eq!(got.is_ok(), active.contains_key(&id));
                    if let Some(a) = active.get_mut(&id) { a.1 = true; }
                }
                Op::Release { id } => {
                    let got = ledger.release(RequestId(id));
                    prop_assert_eq!(got.is_ok(), active.remove(&id).is_some());
                }
            }
            ledger.check_invariants().map_err(TestCaseError::fail)?;
            for w in 0..3 {
                let rank = WorkerRank::new(WorkerId(w), 0);
                let mine: Vec<_> = active.values().filter(|(l, _)| l.rank == rank).collect();
                let prefill: u64 = mine.iter().filter(|(_, started)| !started).map(|(l, _)| l.prefill_tokens).sum();
                let l = ledger.load(rank);
                prop_assert_eq!(l.active_requests as usize, mine.len());
                prop_assert_eq!(l.active_prefill_tokens, prefill);
            }
        }
        let ids: Vec<u64> = active.keys().copied().collect();
        for id in ids {
            ledger.release(RequestId(id)).unwrap();
        }
        for w in 0..3 {
            prop_assert_eq!(ledger.load(WorkerRank::new(WorkerId(w), 0)), RankLoad::default());
        }
        prop_assert_eq!(ledger.active_requests(), 0);
    }
}

/// A chained block id (FNV-1a step): equal ids mean equal prefixes, as with sequence hashes.
fn chain(tokens: &[u8]) -> Vec<SequenceHash> {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    tokens
        .iter()
        .map(|t| {
            h = (h ^ u64::from(*t)).wrapping_mul(0x1000_0000_01b3);
            SequenceHash(h)
        })
        .collect()
}

#[derive(Clone, Debug)]
enum ChainOp {
    Begin { id: u64, w: u64, tokens: Vec<u8> },
    FirstToken { id: u64 },
    Release { id: u64 },
}

fn chain_op() -> impl Strategy<Value = ChainOp> {
    // Three tokens and short prompts: chains share prefixes, branch and end inside each other.
    let tokens = prop::collection::vec(0u8..3, 0..9);
    prop_oneof![
        3 => (0u64..34, 0u64..2, tokens).prop_map(|(id, w, tokens)| ChainOp::Begin { id, w, tokens }),
        1 => (0u64..24).prop_map(|id| ChainOp::FirstToken { id }),
        2 => (0u64..24).prop_map(|id| ChainOp::Release { id }),
    ]
}

proptest! {
    /// The ledger's held blocks and held prefixes against a naive per-block reference count
    /// (block → number of active requests holding it, per rank).
    #[test]
    fn held_blocks_and_prefixes_match_a_naive_block_count(
        ops in prop::collection::vec(chain_op(), 1..250),
        queries in prop::collection::vec(prop::collection::vec(0u8..3, 0..10), 1..12),
    ) {
        let mut ledger = LoadLedger::new();
        let mut active: BTreeMap<u64, RequestLoad> = BTreeMap::new();
        let queries: Vec<Vec<SequenceHash>> = queries.iter().map(|q| chain(q)).collect();
        for op in &ops {
            match op {
                ChainOp::Begin { id, w, tokens } => {
                    let l = RequestLoad {
                        rank: WorkerRank::new(WorkerId(*w), 0),
                        prefill_tokens: 0,
                        blocks: chain(tokens),
                        private_blocks: u64::from(tokens.len() as u8 % 2),
                    };
                    let fresh = !active.contains_key(id);
                    prop_assert_eq!(ledger.begin(RequestId(*id), l.clone()).is_ok(), fresh);
                    if fresh {
                        active.insert(*id, l);
                    }
                }
                ChainOp::FirstToken { id } => {
                    prop_assert_eq!(ledger.first_token(RequestId(*id)).is_ok(), active.contains_key(id));
                }
                ChainOp::Release { id } => {
                    prop_assert_eq!(ledger.release(RequestId(*id)).is_ok(), active.remove(id).is_some());
                }
            }
            ledger.check_invariants().map_err(TestCaseError::fail)?;
            for w in 0..3 {
                let rank = WorkerRank::new(WorkerId(w), 0);
                let mut counts: BTreeMap<SequenceHash, u32> = BTreeMap::new();
                let mut private = 0;
                for l in active.values().filter(|l| l.rank == rank) {
                    private += l.private_blocks;
                    for b in &l.blocks {
                        *counts.entry(*b).or_default() += 1;
                    }
                }
                prop_assert_eq!(ledger.load(rank).active_decode_blocks, private + counts.len() as u64);
                prop_assert_eq!(&ledger.held_block_counts(rank), &counts);
                for q in queries.iter().chain(active.values().map(|l| &l.blocks)) {
                    let naive = q.iter().take_while(|b| counts.contains_key(b)).count();
                    prop_assert_eq!(ledger.held_prefix_blocks(rank, q), naive, "query {:?}", q);
                    prop_assert_eq!(ledger.held_prefixes(q).get(rank), naive, "query {:?}", q);
                }
            }
        }
    }
}
