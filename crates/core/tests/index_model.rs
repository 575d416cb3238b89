//! Property tests of the prefix index against a naive model: a map from (rank, tier) to the set
//! of sequence hashes it holds, with brute-force longest-prefix matching, and a capacity bound
//! stated as "evict the held leaf with the smallest stamp": a new block is stamped youngest, a
//! block whose child was dropped is stamped oldest.

use kvrouter_core::event::{BlockContent, KvEvent, Medium, StoredBlock};
use kvrouter_core::hashing::{chain, BlockHasher, HashNamespace};
use kvrouter_core::ids::{EngineHash, SequenceHash, WorkerId, WorkerRank};
use kvrouter_core::index::{IndexError, PrefixIndex, TierCapacity, TierOverlap};
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
    /// Capacity per worker id (absent = unbounded).
    caps: BTreeMap<u64, TierCapacity>,
    /// (holder, held block) → (stamp, engine hash it was last stored under).
    stamps: BTreeMap<(Holder, SequenceHash), (i64, EngineHash)>,
    /// Every block's parent block, as the chains were stored.
    parent: BTreeMap<SequenceHash, Option<SequenceHash>>,
    next_back: i64,
    next_front: i64,
    evictions: BTreeMap<WorkerId, u64>,
}

impl Model {
    fn with_caps(caps: &[Option<TierCapacity>]) -> Self {
        Model {
            caps: (0u64..)
                .zip(caps)
                .filter_map(|(w, c)| c.map(|c| (w, c)))
                .collect(),
            next_front: -1,
            ..Model::default()
        }
    }

    /// `seq` is stored for `h` under `eh` (and is held): new blocks are stamped youngest.
    fn stamp_stored(&mut self, h: Holder, seq: SequenceHash, eh: EngineHash) {
        let next = self.next_back;
        let entry = self.stamps.entry((h, seq)).or_insert_with(|| (next, eh));
        entry.1 = eh;
        if entry.0 == next {
            self.next_back += 1;
        }
    }

    /// `seq` is no longer held by `h`; its parent, if held, is stamped oldest.
    fn unhold(&mut self, h: Holder, seq: SequenceHash) {
        let was = self.held.entry(h).or_default().remove(&seq);
        self.stamps.remove(&(h, seq));
        if !was {
            return;
        }
        if let Some(Some(p)) = self.parent.get(&seq) {
            if let Some(entry) = self.stamps.get_mut(&(h, *p)) {
                entry.0 = self.next_front;
                self.next_front -= 1;
            }
        }
    }

    fn evict(&mut self, h: Holder) {
        let Some(caps) = self.caps.get(&h.0.worker.0) else {
            return;
        };
        let cap = if h.1 == Medium::Gpu {
            caps.gpu_blocks
        } else {
            caps.offload_blocks
        };
        loop {
            let held = self.held.get(&h).cloned().unwrap_or_default();
            if held.len() <= cap {
                return;
            }
            let is_leaf =
                |s: &SequenceHash| !held.iter().any(|c| self.parent.get(c) == Some(&Some(*s)));
            let victim = held
                .iter()
                .filter(|s| is_leaf(s))
                .min_by_key(|s| self.stamps[&(h, **s)].0)
                .copied()
                .expect("a finite held set has a leaf");
            let eh = self.stamps[&(h, victim)].1;
            self.unhold(h, victim);
            let engine = self.engine.entry(h).or_default();
            if engine.get(&eh) == Some(&victim) {
                engine.remove(&eh);
            }
            *self.evictions.entry(h.0.worker).or_default() += 1;
        }
    }

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
                    let p = if i == *split {
                        parent_seq
                    } else {
                        Some(all[i - 1])
                    };
                    self.parent.insert(all[i], p);
                    self.held.entry(h).or_default().insert(all[i]);
                }
                for &i in &applied {
                    let eh = engine_hash(&path[..=i], *salt);
                    let old = self.engine.entry(h).or_default().insert(eh, all[i]);
                    if self.held[&h].contains(&all[i]) {
                        self.stamp_stored(h, all[i], eh);
                    }
                    if let Some(old) = old.filter(|o| *o != all[i]) {
                        self.unhold(h, old);
                    }
                }
                self.evict(h);
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
                        Some(s) => self.unhold(h, s),
                    }
                }
                result
            }
            Op::Clear { w, dp } => {
                for m in Medium::ALL {
                    let h = (WorkerRank::new(WorkerId(*w), *dp), m);
                    self.held.remove(&h);
                    self.engine.remove(&h);
                    self.stamps.retain(|(holder, _), _| *holder != h);
                }
                Ok(())
            }
            Op::RemoveWorker { w } => {
                self.held.retain(|(r, _), _| r.worker != WorkerId(*w));
                self.engine.retain(|(r, _), _| r.worker != WorkerId(*w));
                self.stamps
                    .retain(|((r, _), _), _| r.worker != WorkerId(*w));
                // Its eviction count goes with it (ids are not used again).
                self.evictions.remove(&WorkerId(*w));
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

/// Capacities of workers 0, 1 and 2 (`None` = unbounded), small enough to evict often.
fn caps() -> impl Strategy<Value = Vec<Option<TierCapacity>>> {
    let cap = (1usize..8, 1usize..8).prop_map(|(gpu_blocks, offload_blocks)| TierCapacity {
        gpu_blocks,
        offload_blocks,
    });
    prop::collection::vec(prop::option::weighted(0.7, cap), 3)
}

fn capped_index(caps: &[Option<TierCapacity>]) -> PrefixIndex {
    let mut index = PrefixIndex::new(BS);
    for (w, cap) in (0u64..).zip(caps) {
        index.set_worker_capacity(WorkerId(w), *cap);
    }
    index
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn index_agrees_with_the_naive_model(
        ops in prop::collection::vec(op(), 1..60),
        queries in prop::collection::vec(path(), 1..8),
        caps in caps(),
    ) {
        let mut index = capped_index(&caps);
        let mut model = Model::with_caps(&caps);
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
        let evictions: Vec<(WorkerId, u64)> = model.evictions.into_iter().collect();
        prop_assert_eq!(index.evictions(), evictions);
    }

    #[test]
    fn contents_hashed_ahead_change_the_index_as_tokens_do(
        ops in prop::collection::vec((op(), 0usize..4, prop::bool::weighted(0.1)), 1..60),
        caps in caps(),
    ) {
        // Each event also in another namespace (adapter, salt, an empty salt), some with a
        // block size the index refuses whole.
        let namespaces = [
            HashNamespace::none(),
            HashNamespace { lora_name: Some("adapter".into()), cache_salt: None },
            HashNamespace { lora_name: None, cache_salt: Some("tenant".into()) },
            HashNamespace { lora_name: None, cache_salt: Some(String::new()) },
        ];
        let mut tokens = capped_index(&caps);
        let mut hashed = capped_index(&caps);
        for (op, ns, wrong_size) in &ops {
            let (want, got) = match to_event(op) {
                Some(mut event) => {
                    if let KvEvent::Stored { namespace, block_size, .. } = &mut event {
                        *namespace = namespaces[*ns].clone();
                        if *wrong_size {
                            *block_size = BS + 1;
                        }
                    }
                    let want = tokens.apply(&event).map_err(|e: IndexError| e.status());
                    event.hash_contents(BS);
                    (want, hashed.apply(&event).map_err(|e: IndexError| e.status()))
                }
                None => (apply(&mut tokens, op), apply(&mut hashed, op)),
            };
            prop_assert_eq!(got, want, "op {:?}", op);
        }
        prop_assert_eq!(hashed.snapshot(), tokens.snapshot());
        prop_assert_eq!(hashed.evictions(), tokens.evictions());
    }

    #[test]
    fn dump_replays_into_an_equal_index(ops in prop::collection::vec(op(), 1..60), caps in caps()) {
        let mut index = capped_index(&caps);
        for op in &ops {
            let _ = apply(&mut index, op);
        }
        // A dump may stand in for ancestors a rank does not hold (then removes them), so it is
        // replayed unbounded and bounded afterwards, which must evict nothing.
        let mut replayed = PrefixIndex::new(BS);
        for event in index.dump() {
            prop_assert!(replayed.apply(&event).is_ok(), "dump event {:?} failed", event);
        }
        for (w, cap) in (0u64..).zip(&caps) {
            replayed.set_worker_capacity(WorkerId(w), *cap);
        }
        prop_assert!(replayed.evictions().is_empty());
        prop_assert_eq!(replayed.snapshot(), index.snapshot());
        replayed.check_invariants().map_err(TestCaseError::fail)?;
    }
}
