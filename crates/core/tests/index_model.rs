//! Property tests of the prefix index against a naive model: a map from (rank, tier) to the set
//! of sequence hashes it holds, with brute-force longest-prefix matching.

use kvrouter_core::event::{BlockContent, KvEvent, Medium, StoredBlock};
use kvrouter_core::hashing::{chain, BlockHasher, HashNamespace};
use kvrouter_core::ids::{EngineHash, SequenceHash, WorkerId, WorkerRank};
use kvrouter_core::index::{IndexError, PrefixIndex, TierOverlap};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

const BS: usize = 2;

fn block_tokens(id: u8) -> Vec<u32> {
    vec![u32::from(id) * 7 + 1, u32::from(id) * 7 + 2]
}

fn seqs(path: &[u8]) -> Vec<SequenceHash> {
    let tokens: Vec<u32> = path.iter().flat_map(|&b| block_tokens(b)).collect();
    BlockHasher::new(BS, &HashNamespace::none()).sequence_hashes(&tokens)
}

/// Engines derive their hash from the whole chain, like vLLM and SGLang do.
fn engine_hash(path: &[u8], salt: u64) -> EngineHash {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ salt;
    for &b in path {
        h = (h ^ u64::from(b) ^ 0x100).wrapping_mul(0x1000_0000_01b3);
    }
    EngineHash(h)
}

#[derive(Clone, Debug)]
enum Op {
    Store {
        w: u64,
        dp: u32,
        medium: Medium,
        path: Vec<u8>,
        split: usize,
        salt: u64,
        bad_at: Option<usize>,
    },
    Remove {
        w: u64,
        dp: u32,
        medium: Medium,
        paths: Vec<Vec<u8>>,
        salt: u64,
    },
    Clear {
        w: u64,
        dp: u32,
    },
    RemoveWorker {
        w: u64,
    },
}

fn medium() -> impl Strategy<Value = Medium> {
    prop_oneof![4 => Just(Medium::Gpu), 1 => Just(Medium::Cpu), 1 => Just(Medium::Disk)]
}

fn path() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(0u8..3, 1..7)
}

fn op() -> impl Strategy<Value = Op> {
    let salt = prop_oneof![9 => Just(0u64), 1 => 1u64..3];
    prop_oneof![
        6 => (0u64..3, 0u32..2, medium(), path(), 0usize..7, salt.clone(), prop::option::weighted(0.1, 0usize..6))
            .prop_map(|(w, dp, medium, path, split, salt, bad_at)| {
                let split = split.min(path.len() - 1);
                Op::Store { w, dp, medium, path, split, salt, bad_at }
            }),
        4 => (0u64..3, 0u32..2, medium(), prop::collection::vec(path(), 1..4), salt)
            .prop_map(|(w, dp, medium, paths, salt)| Op::Remove { w, dp, medium, paths, salt }),
        1 => (0u64..3, 0u32..2).prop_map(|(w, dp)| Op::Clear { w, dp }),
        1 => (0u64..3).prop_map(|w| Op::RemoveWorker { w }),
    ]
}

fn to_event(op: &Op) -> Option<KvEvent> {
    Some(match op {
        Op::Store {
            w,
            dp,
            medium,
            path,
            split,
            salt,
            bad_at,
        } => KvEvent::Stored {
            worker: WorkerId(*w),
            dp_rank: *dp,
            parent: (*split > 0).then(|| engine_hash(&path[..*split], 0)),
            blocks: (*split..path.len())
                .map(|i| StoredBlock {
                    engine_hash: engine_hash(&path[..=i], *salt),
                    content: if Some(i) == *bad_at {
                        BlockContent::Tokens(vec![1])
                    } else {
                        BlockContent::Tokens(block_tokens(path[i]))
                    },
                })
                .collect(),
            block_size: BS,
            medium: *medium,
            namespace: HashNamespace::none(),
        },
        Op::Remove {
            w,
            dp,
            medium,
            paths,
            salt,
        } => KvEvent::Removed {
            worker: WorkerId(*w),
            dp_rank: *dp,
            engine_hashes: paths.iter().map(|p| engine_hash(p, *salt)).collect(),
            medium: *medium,
        },
        Op::Clear { w, dp } => KvEvent::Cleared {
            worker: WorkerId(*w),
            dp_rank: *dp,
        },
        Op::RemoveWorker { .. } => return None,
    })
}

type Holder = (WorkerRank, Medium);

/// The naive reference: sets of held sequence hashes and engine-hash maps, nothing shared with
/// the index but the hashing scheme (pinned separately by golden vectors).
#[derive(Default)]
struct Model {
    held: BTreeMap<Holder, BTreeSet<SequenceHash>>,
    engine: BTreeMap<Holder, BTreeMap<EngineHash, SequenceHash>>,
}

impl Model {
    fn apply(&mut self, op: &Op) -> Result<(), &'static str> {
        match op {
            Op::Store {
                w,
                dp,
                medium,
                path,
                split,
                salt,
                bad_at,
            } => {
                let h = (WorkerRank::new(WorkerId(*w), *dp), *medium);
                let mut parent_seq = None;
                if *split > 0 {
                    let parent = engine_hash(&path[..*split], 0);
                    // The event's tier first, then the rank's other tiers.
                    let tiers = std::iter::once(*medium)
                        .chain(Medium::ALL.into_iter().filter(|m| m != medium));
                    let found = tiers.into_iter().find_map(|m| {
                        let t = (h.0, m);
                        let seq = self
                            .engine
                            .get(&t)
                            .and_then(|map| map.get(&parent))
                            .copied();
                        seq.filter(|s| self.held.get(&t).is_some_and(|set| set.contains(s)))
                    });
                    let Some(found) = found else {
                        return Err("parent_block_not_found");
                    };
                    parent_seq = Some(found);
                }
                // Sequence hashes chain from whatever block the parent's engine hash names.
                let hasher = BlockHasher::new(BS, &HashNamespace::none());
                let mut all = seqs(&path[..*split]);
                let mut prev = parent_seq;
                for &b in &path[*split..] {
                    let s = chain(prev, hasher.content_hash(&block_tokens(b)));
                    all.push(s);
                    prev = Some(s);
                }
                let end = bad_at
                    .filter(|b| *b >= *split && *b < path.len())
                    .unwrap_or(path.len());
                let applied: Vec<usize> = (*split..end).collect();
                for &i in &applied {
                    self.held.entry(h).or_default().insert(all[i]);
                }
                for &i in &applied {
                    let old = self
                        .engine
                        .entry(h)
                        .or_default()
                        .insert(engine_hash(&path[..=i], *salt), all[i]);
                    if let Some(old) = old.filter(|o| *o != all[i]) {
                        self.held.entry(h).or_default().remove(&old);
                    }
                }
                if end < path.len() {
                    return Err("block_size_mismatch");
                }
                Ok(())
            }
            Op::Remove {
                w,
                dp,
                medium,
                paths,
                salt,
            } => {
                let h = (WorkerRank::new(WorkerId(*w), *dp), *medium);
                let mut result = Ok(());
                for p in paths {
                    match self
                        .engine
                        .entry(h)
                        .or_default()
                        .remove(&engine_hash(p, *salt))
                    {
                        None => result = Err("block_not_found"),
                        Some(s) => {
                            self.held.entry(h).or_default().remove(&s);
                        }
                    }
                }
                result
            }
            Op::Clear { w, dp } => {
                for m in Medium::ALL {
                    let h = (WorkerRank::new(WorkerId(*w), *dp), m);
                    self.held.remove(&h);
                    self.engine.remove(&h);
                }
                Ok(())
            }
            Op::RemoveWorker { w } => {
                self.held.retain(|(r, _), _| r.worker != WorkerId(*w));
                self.engine.retain(|(r, _), _| r.worker != WorkerId(*w));
                Ok(())
            }
        }
    }

    fn leading(&self, rank: WorkerRank, tiers: &[Medium], query: &[SequenceHash]) -> u32 {
        let holds = |s: &SequenceHash| {
            tiers.iter().any(|m| {
                self.held
                    .get(&(rank, *m))
                    .is_some_and(|set| set.contains(s))
            })
        };
        query.iter().take_while(|s| holds(s)).count() as u32
    }

    fn find_matches(&self, query: &[SequenceHash]) -> BTreeMap<WorkerRank, TierOverlap> {
        let ranks: BTreeSet<WorkerRank> = self.held.keys().map(|(r, _)| *r).collect();
        let mut out = BTreeMap::new();
        for rank in ranks {
            let gpu = self.leading(rank, &[Medium::Gpu], query);
            let host = self.leading(rank, &[Medium::Gpu, Medium::Cpu], query);
            let any = self.leading(rank, &Medium::ALL, query);
            if any > 0 {
                let overlap = TierOverlap {
                    gpu_blocks: gpu,
                    cpu_blocks: host - gpu,
                    disk_blocks: any - host,
                };
                out.insert(rank, overlap);
            }
        }
        out
    }
}

fn apply(index: &mut PrefixIndex, op: &Op) -> Result<(), &'static str> {
    match (op, to_event(op)) {
        (Op::RemoveWorker { w }, _) => {
            index.remove_worker(WorkerId(*w));
            Ok(())
        }
        (_, Some(event)) => index.apply(&event).map_err(|e: IndexError| e.status()),
        (_, None) => unreachable!(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn index_agrees_with_the_naive_model(
        ops in prop::collection::vec(op(), 1..60),
        queries in prop::collection::vec(path(), 1..8),
    ) {
        let mut index = PrefixIndex::new(BS);
        let mut model = Model::default();
        for op in &ops {
            let got = apply(&mut index, op);
            let want = model.apply(op);
            prop_assert_eq!(got, want, "op {:?}", op);
            index.check_invariants().map_err(TestCaseError::fail)?;
            for q in &queries {
                let query = seqs(q);
                let got: BTreeMap<WorkerRank, TierOverlap> =
                    index.find_matches(&query).ranks.into_iter().map(|r| (r.rank, r.overlap)).collect();
                prop_assert_eq!(got, model.find_matches(&query), "query {:?} after {:?}", q, op);
            }
        }
        let entries: usize = model.held.values().map(BTreeSet::len).sum();
        prop_assert_eq!(index.stats().entries, entries);
    }

    #[test]
    fn dump_replays_into_an_equal_index(ops in prop::collection::vec(op(), 1..60)) {
        let mut index = PrefixIndex::new(BS);
        for op in &ops {
            let _ = apply(&mut index, op);
        }
        let mut replayed = PrefixIndex::new(BS);
        for event in index.dump() {
            prop_assert!(replayed.apply(&event).is_ok(), "dump event {:?} failed", event);
        }
        prop_assert_eq!(replayed.snapshot(), index.snapshot());
        replayed.check_invariants().map_err(TestCaseError::fail)?;
    }
}
