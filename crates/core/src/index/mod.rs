//! The event-fed prefix index: which worker rank holds which prefix blocks, in which tier.
//!
//! Engines' KV events are the only way to change it ([`PrefixIndex::apply`]). The index
//! recomputes the router's own sequence hashes from each event's token ids, so it navigates the
//! same way whatever hash the engine uses; engine hashes are kept per (rank, tier) only to find
//! blocks again when they are removed.
//!
//! Semantics (the naive model in `tests/index_model.rs` states them independently):
//! - `Stored` adds the rank's tier to each block. Its parent, when given, must be a block that the
//!   same rank holds (in the event's tier, else in another tier of the rank), else
//!   `ParentBlockNotFound` and nothing is applied. Storing a block
//!   already held is idempotent. If an engine hash is reused for a different block, the old block
//!   is dropped for that rank and tier. A block with the wrong token count stops the event there:
//!   the blocks before it are applied and `BlockSizeMismatch` is returned.
//! - `Removed` drops each named block for the rank and tier; unknown hashes give `BlockNotFound`
//!   after the known ones are applied.
//! - `Cleared` drops every block of the rank in every tier.
//! - A worker with a capacity ([`PrefixIndex::set_worker_capacity`]) keeps at most that many
//!   blocks per rank in each tier; a `Stored` event beyond it evicts that rank and tier's oldest
//!   leaves (see `capacity.rs`), counted in [`PrefixIndex::evictions`].
//!
//! Layout: `apply.rs` (applying events), `tree.rs` (path-compressed block tree), `matches.rs`
//! (overlap queries), `dump.rs` (dump as events, snapshots for comparison), `capacity.rs` (the
//! capacity bound, eviction).

mod apply;
mod capacity;
mod checkpoints;
mod dump;
mod matches;
mod tree;

pub use capacity::TierCapacity;
pub use dump::{IndexSnapshot, SnapshotBlock};
pub use matches::{OverlapScores, RankOverlap, TierOverlap};

use crate::event::{KvEvent, Medium};
use crate::fast_map::{FastMap, FastSet};
use crate::ids::{EngineHash, SequenceHash, WorkerId, WorkerRank};
use capacity::Recency;
use std::collections::BTreeMap;
use std::ops::Range;
use tree::{HolderId, Tree};

/// Why an event could not be applied (in full). The index stays consistent either way.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    /// A `Stored` event names a parent block the rank does not hold (in that tier).
    #[error("worker {rank}: parent block {parent} not found")]
    ParentBlockNotFound {
        /// The rank the event came from.
        rank: WorkerRank,
        /// The parent's engine hash.
        parent: EngineHash,
    },
    /// A `Removed` event names a block the rank does not hold (in that tier).
    #[error("worker {rank}: block {hash} not found")]
    BlockNotFound {
        /// The rank the event came from.
        rank: WorkerRank,
        /// The unknown engine hash.
        hash: EngineHash,
    },
    /// The event's block size, or a block's token count, differs from the index's block size.
    #[error("worker {rank}: block of {got} tokens, index block size is {expected}")]
    BlockSizeMismatch {
        /// The rank the event came from.
        rank: WorkerRank,
        /// The index's block size.
        expected: usize,
        /// What the event had.
        got: usize,
    },
    /// The event comes from a worker or rank the router does not know.
    #[error("unknown worker rank {rank}")]
    UnknownWorker {
        /// The rank the event names.
        rank: WorkerRank,
    },
    /// The event contradicts itself (a block is its own parent) or the tree (hash collision).
    #[error("worker {rank}: invalid block sequence: {reason}")]
    InvalidBlockSequence {
        /// The rank the event came from.
        rank: WorkerRank,
        /// What was wrong.
        reason: &'static str,
    },
}

impl IndexError {
    /// The metrics label of this error (`kv_events_applied_total{status=...}`).
    pub fn status(&self) -> &'static str {
        match self {
            IndexError::ParentBlockNotFound { .. } => "parent_block_not_found",
            IndexError::BlockNotFound { .. } => "block_not_found",
            IndexError::BlockSizeMismatch { .. } => "block_size_mismatch",
            IndexError::InvalidBlockSequence { .. } => "invalid_block",
            IndexError::UnknownWorker { .. } => "unknown_worker",
        }
    }
}

/// Size figures of an index.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Distinct blocks in the tree (held or kept as a path to held ones).
    pub blocks: usize,
    /// (block, rank, tier) entries.
    pub entries: usize,
    /// Tree nodes (runs of blocks).
    pub nodes: usize,
    /// Ranks with a slot in the index.
    pub ranks: usize,
}

#[derive(Debug)]
struct RankState {
    rank: WorkerRank,
    /// Per medium: engine hash → router sequence hash.
    engine: [FastMap<EngineHash, SequenceHash>; 3],
    /// Per medium: the blocks held and their eviction order.
    recency: [Recency; 3],
}

/// The prefix index. See the module documentation for its semantics.
#[derive(Debug)]
pub struct PrefixIndex {
    block_size: usize,
    tree: Tree,
    ranks: Vec<Option<RankState>>,
    slots: FastMap<WorkerRank, u32>,
    free_slots: Vec<u32>,
    /// Per worker: most blocks per (rank, tier); absent = unbounded.
    caps: FastMap<WorkerId, TierCapacity>,
    /// Per worker: blocks evicted by the bound so far.
    evictions: BTreeMap<WorkerId, u64>,
    /// Buffers a `Stored` event is worked out in, kept to spare allocations per event.
    scratch: Scratch,
}

/// The blocks' worth of buffers a Stored event's scratch keeps between events (an event of
/// more grows them for its own time only).
const SCRATCH_KEPT_BLOCKS: usize = 4096;

/// The per-event buffers of [`PrefixIndex::apply`] (empty between events).
#[derive(Debug, Default)]
struct Scratch {
    seqs: Vec<SequenceHash>,
    engines: Vec<EngineHash>,
    fresh: Vec<Range<usize>>,
}

/// Below this many blocks, debug builds check every invariant after every event.
const DEBUG_CHECK_LIMIT: usize = 2048;

fn holder_id(slot: u32, medium: Medium) -> HolderId {
    slot << 2 | medium.index() as u32
}

fn holder_slot(holder: HolderId) -> u32 {
    holder >> 2
}

fn holder_medium(holder: HolderId) -> Medium {
    Medium::ALL[(holder & 3) as usize]
}

impl PrefixIndex {
    /// An empty index for `block_size`-token blocks.
    pub fn new(block_size: usize) -> Self {
        Self {
            block_size,
            tree: Tree::default(),
            ranks: Vec::new(),
            slots: FastMap::default(),
            free_slots: Vec::new(),
            caps: FastMap::default(),
            evictions: BTreeMap::new(),
            scratch: Scratch::default(),
        }
    }

    fn rank(&self, slot: u32) -> &RankState {
        self.ranks[slot as usize].as_ref().expect("live slot")
    }

    fn rank_mut(&mut self, slot: u32) -> &mut RankState {
        self.ranks[slot as usize].as_mut().expect("live slot")
    }

    /// The block size in tokens.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Applies one event. On error the index is still consistent; see the module docs for what
    /// part of a faulty event is applied.
    pub fn apply(&mut self, event: &KvEvent) -> Result<(), IndexError> {
        let result = match event {
            KvEvent::Stored {
                parent,
                blocks,
                block_size,
                medium,
                namespace,
                ..
            } => self.store(
                event.rank(),
                *parent,
                blocks,
                *block_size,
                *medium,
                namespace,
            ),
            KvEvent::Removed {
                engine_hashes,
                medium,
                ..
            } => self.remove(event.rank(), engine_hashes, *medium),
            KvEvent::Cleared { .. } => {
                self.clear_rank(event.rank());
                Ok(())
            }
        };
        if cfg!(debug_assertions) && self.tree.block_count() <= DEBUG_CHECK_LIMIT {
            if let Err(violation) = self.check_invariants() {
                panic!("prefix index invariant broken after {event:?}: {violation}");
            }
        }
        result
    }

    fn slot_for(&mut self, rank: WorkerRank) -> u32 {
        if let Some(&slot) = self.slots.get(&rank) {
            return slot;
        }
        let state = RankState {
            rank,
            engine: Default::default(),
            recency: Default::default(),
        };
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.ranks[slot as usize] = Some(state);
                slot
            }
            None => {
                self.ranks.push(Some(state));
                (self.ranks.len() - 1) as u32
            }
        };
        self.slots.insert(rank, slot);
        slot
    }

    /// Stores a chain from the root for `rank` on the GPU tier, with each block's sequence hash
    /// standing in as its engine hash (the approximate index's own bookkeeping).
    pub(crate) fn store_predicted(&mut self, rank: WorkerRank, seqs: &[SequenceHash]) {
        let slot = self.slot_for(rank);
        let holder = holder_id(slot, Medium::Gpu);
        let engines: Vec<EngineHash> = seqs.iter().map(|s| EngineHash(s.0)).collect();
        let mut fresh = Vec::new();
        let (applied, _) = self.insert_chain(rank, None, seqs, &engines, holder, &mut fresh);
        self.bookkeep(
            slot,
            Medium::Gpu,
            &engines[..applied],
            &seqs[..applied],
            &fresh,
        );
    }

    /// Drops blocks stored by [`Self::store_predicted`] (given as their engine hashes, which
    /// are their sequence hashes), in the order given.
    pub(crate) fn remove_predicted(&mut self, rank: WorkerRank, blocks: &[EngineHash]) {
        let _ = self.remove(rank, blocks, Medium::Gpu);
    }

    /// Drops every block of one rank.
    pub(crate) fn clear_predicted(&mut self, rank: WorkerRank) {
        self.clear_rank(rank);
    }

    /// The depth of a block in the tree.
    pub(crate) fn depth_of(&self, seq: SequenceHash) -> Option<u32> {
        self.tree.lookup(seq).map(|at| at.depth)
    }

    /// Drops every block of every rank of `worker` and forgets its ranks.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        let mut ranks: Vec<WorkerRank> = self
            .slots
            .keys()
            .filter(|r| r.worker == worker)
            .copied()
            .collect();
        ranks.sort();
        for rank in ranks {
            self.clear_rank(rank);
            if let Some(slot) = self.slots.remove(&rank) {
                self.ranks[slot as usize] = None;
                self.free_slots.push(slot);
            }
        }
        self.evictions.remove(&worker);
    }

    /// Size figures.
    pub fn stats(&self) -> IndexStats {
        let entries = self
            .tree
            .node_ids()
            .map(|id| {
                let n = self.tree.node(id);
                n.hashes.len() * n.holders.len()
            })
            .sum();
        IndexStats {
            blocks: self.tree.block_count(),
            entries,
            nodes: self.tree.node_count(),
            ranks: self.slots.len(),
        }
    }

    /// Blocks held per (rank, tier), sorted.
    pub fn holder_counts(&self) -> Vec<(WorkerRank, Medium, usize)> {
        let mut counts: FastMap<HolderId, usize> = FastMap::default();
        for id in self.tree.node_ids() {
            let n = self.tree.node(id);
            for &h in &n.holders {
                *counts.entry(h).or_default() += n.hashes.len();
            }
        }
        let mut out: Vec<(WorkerRank, Medium, usize)> = counts
            .into_iter()
            .filter_map(|(h, c)| {
                let state = self.ranks.get(holder_slot(h) as usize)?.as_ref()?;
                Some((state.rank, holder_medium(h), c))
            })
            .collect();
        out.sort();
        out
    }

    /// Approximate heap bytes held by the index (map capacities and runs).
    pub fn heap_bytes(&self) -> usize {
        let per_engine_entry = std::mem::size_of::<(EngineHash, SequenceHash)>() + 1;
        let engine: usize = self
            .ranks
            .iter()
            .flatten()
            .flat_map(|r| r.engine.iter())
            .map(|m| m.capacity() * per_engine_entry)
            .sum::<usize>()
            + self
                .ranks
                .iter()
                .flatten()
                .flat_map(|r| r.recency.iter())
                .map(Recency::heap_bytes)
                .sum::<usize>();
        let scratch = self.scratch.seqs.capacity() * 8
            + self.scratch.engines.capacity() * 8
            + self.scratch.fresh.capacity() * std::mem::size_of::<Range<usize>>();
        self.tree.heap_bytes() + engine + scratch
    }

    /// Checks every structural invariant; returns the first violation found.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.tree.check()?;
        // Every holder on the tree is a live slot, and every held block is reachable through at
        // least one of that holder's engine hashes.
        let mut held: FastMap<HolderId, usize> = FastMap::default();
        for id in self.tree.node_ids() {
            let n = self.tree.node(id);
            for &h in &n.holders {
                let live = self
                    .ranks
                    .get(holder_slot(h) as usize)
                    .is_some_and(Option::is_some);
                if !live {
                    return Err(format!("node {id} held by dead slot {}", holder_slot(h)));
                }
                *held.entry(h).or_default() += n.hashes.len();
            }
        }
        for (slot, state) in self.ranks.iter().enumerate() {
            let Some(state) = state else { continue };
            if self.slots.get(&state.rank) != Some(&(slot as u32)) {
                return Err(format!("slot {slot} of {} is not registered", state.rank));
            }
            for medium in Medium::ALL {
                let holder = holder_id(slot as u32, medium);
                let reachable: FastSet<SequenceHash> = state.engine[medium.index()]
                    .values()
                    .filter(|s| {
                        self.tree
                            .lookup(**s)
                            .is_some_and(|at| self.tree.holds(at, holder))
                    })
                    .copied()
                    .collect();
                // The engine hash each held block is stored under names it.
                for id in self.tree.node_ids() {
                    let n = self.tree.node(id);
                    for (i, seq) in n.hashes.iter().enumerate() {
                        let Some(eh) = n.engine_of(n.start + i as u32, holder) else {
                            break;
                        };
                        if state.engine[medium.index()].get(&eh) != Some(seq) {
                            return Err(format!(
                                "{} {medium:?}: block {seq} is held under {eh}, which names another",
                                state.rank
                            ));
                        }
                    }
                }
                let on_tree = held.get(&holder).copied().unwrap_or(0);
                if reachable.len() != on_tree {
                    return Err(format!(
                        "{} {:?}: {on_tree} blocks held on the tree, {} reachable by engine hash",
                        state.rank,
                        medium,
                        reachable.len()
                    ));
                }
                self.check_recency(state, holder, medium, on_tree)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
