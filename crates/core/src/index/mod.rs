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
//! Layout: `tree.rs` (path-compressed block tree), `matches.rs` (overlap queries), `dump.rs`
//! (dump as events, snapshots for comparison), `capacity.rs` (the capacity bound, eviction).

mod capacity;
mod checkpoints;
mod dump;
mod matches;
mod tree;

pub use capacity::TierCapacity;
pub use dump::{IndexSnapshot, SnapshotBlock};
pub use matches::{OverlapScores, RankOverlap, TierOverlap};

use crate::event::{BlockContent, KvEvent, Medium};
use crate::fast_map::{FastMap, FastSet};
use crate::hashing::{chain, HashNamespace, BASE_SEED};
use crate::ids::{ContentHash, EngineHash, SequenceHash, WorkerId, WorkerRank};
use capacity::Recency;
use std::collections::BTreeMap;
use std::ops::Range;
use tree::{BlockRef, HolderId, Tree};

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

    fn store(
        &mut self,
        rank: WorkerRank,
        parent: Option<EngineHash>,
        blocks: &[crate::event::StoredBlock],
        block_size: usize,
        medium: Medium,
        namespace: &HashNamespace,
    ) -> Result<(), IndexError> {
        if block_size != self.block_size {
            return Err(IndexError::BlockSizeMismatch {
                rank,
                expected: self.block_size,
                got: block_size,
            });
        }
        if let Some(p) = parent {
            if blocks.iter().any(|b| b.engine_hash == p) {
                return Err(IndexError::InvalidBlockSequence {
                    rank,
                    reason: "a block is its own parent",
                });
            }
        }
        let slot = self.slot_for(rank);
        let holder = holder_id(slot, medium);
        let parent_ref = match parent {
            None => None,
            Some(p) => {
                // The parent may sit in another tier of the same rank (an offloaded block's
                // parent is often still on the GPU); the event's own tier is tried first.
                let state = self.ranks[slot as usize].as_ref().expect("live slot");
                let tiers =
                    std::iter::once(medium).chain(Medium::ALL.into_iter().filter(|m| *m != medium));
                let found = tiers.into_iter().find_map(|m| {
                    state.engine[m.index()]
                        .get(&p)
                        .and_then(|s| self.tree.lookup(*s))
                        .filter(|at| self.tree.holds(*at, holder_id(slot, m)))
                });
                match found {
                    Some(at) => Some(at),
                    None => return Err(IndexError::ParentBlockNotFound { rank, parent: p }),
                }
            }
        };

        // Content and sequence hashes; a block of the wrong size ends the event there.
        let seed = if namespace.lora_name.is_none() && namespace.cache_salt.is_none() {
            BASE_SEED
        } else {
            namespace.seed()
        };
        let mut error = None;
        let Scratch {
            mut seqs,
            mut engines,
            mut fresh,
        } = std::mem::take(&mut self.scratch);
        seqs.reserve(blocks.len());
        engines.reserve(blocks.len());
        let mut prev = parent_ref.map(|at| self.tree.block(at));
        for block in blocks {
            let seq = match &block.content {
                BlockContent::Tokens(tokens) if tokens.len() != self.block_size => {
                    error = Some(IndexError::BlockSizeMismatch {
                        rank,
                        expected: self.block_size,
                        got: tokens.len(),
                    });
                    break;
                }
                BlockContent::Tokens(tokens) => {
                    chain(prev, ContentHash(crate::hashing::hash_block(tokens, seed)))
                }
                BlockContent::Hash(hash) => chain(prev, *hash),
                BlockContent::Sequence(seq) => *seq,
            };
            seqs.push(seq);
            engines.push(block.engine_hash);
            prev = Some(seq);
        }

        let (applied, inserted) =
            self.insert_chain(rank, parent_ref, &seqs, &engines, holder, &mut fresh);
        if let Err(e) = inserted {
            error = Some(e);
        }

        self.bookkeep(slot, medium, &engines[..applied], &seqs[..applied], &fresh);
        seqs.clear();
        engines.clear();
        fresh.clear();
        // Kept for the next event, but not at the size of one huge event for good.
        seqs.shrink_to(SCRATCH_KEPT_BLOCKS);
        engines.shrink_to(SCRATCH_KEPT_BLOCKS);
        fresh.shrink_to(SCRATCH_KEPT_BLOCKS);
        self.scratch = Scratch {
            seqs,
            engines,
            fresh,
        };
        self.evict_over_capacity(slot, medium);
        error.map_or(Ok(()), Err)
    }

    /// Engine-hash and recency bookkeeping of stored blocks, once the tree holds them all for
    /// (`slot`, `medium`) under their engine hashes; `fresh` names (by position) those it did not
    /// hold before. Block by block: its engine hash maps to it, a fresh one still held is
    /// recorded, and the block its engine hash named before, if another, is dropped.
    fn bookkeep(
        &mut self,
        slot: u32,
        medium: Medium,
        engines: &[EngineHash],
        seqs: &[SequenceHash],
        fresh: &[Range<usize>],
    ) {
        let holder = holder_id(slot, medium);
        let tier = medium.index();
        // Drops touch neither engine map, so all its inserts can go first, in order; they
        // name the blocks whose old engine hash must be dropped (`replaced`, by position).
        let mut replaced = Vec::new();
        let state = self.rank_mut(slot);
        let engine = &mut state.engine[tier];
        engine.reserve(seqs.len());
        for (k, (eh, seq)) in engines.iter().zip(seqs).enumerate() {
            if let Some(old) = engine.insert(*eh, *seq) {
                if old != *seq {
                    replaced.push((k, old));
                }
            }
        }
        // Fresh blocks count as held before any drop, which discounts them again.
        let recency = &mut state.recency[tier];
        recency.held_more(fresh.iter().map(ExactSizeIterator::len).sum());
        // Every block of the chain is held until a drop takes one away; only the chain's tip has
        // no held child, so only it is queued (if fresh).
        if replaced.is_empty() {
            if fresh.last().is_some_and(|r| r.end == seqs.len()) {
                recency.queue_youngest(seqs[seqs.len() - 1]);
            }
            return;
        }
        let mut dropped_any = false;
        let mut next = replaced.into_iter().peekable();
        // `fresh` is sorted and disjoint (pushed walking forward): a cursor, not a scan per block.
        let mut ranges = fresh.iter().peekable();
        for (k, seq) in seqs.iter().enumerate() {
            while ranges.next_if(|r| r.end <= k).is_some() {}
            let held = !dropped_any
                || self
                    .tree
                    .lookup(*seq)
                    .is_some_and(|at| self.tree.holds(at, holder));
            if held && ranges.peek().is_some_and(|r| r.contains(&k)) {
                self.rank_mut(slot).recency[tier].queue_youngest(*seq);
            }
            if let Some((_, old)) = next.next_if(|(at, _)| *at == k) {
                self.drop_block(slot, medium, old);
                dropped_any = true;
            }
        }
    }

    /// Adds `holder` to the chain `seqs` hanging off `parent`, block `k` stored under
    /// `engines[k]`. Returns how many blocks were applied and an error if the chain collides
    /// with the tree; pushes onto `fresh` the position ranges `holder` did not hold before.
    fn insert_chain(
        &mut self,
        rank: WorkerRank,
        parent: Option<BlockRef>,
        seqs: &[SequenceHash],
        engines: &[EngineHash],
        holder: HolderId,
        fresh: &mut Vec<Range<usize>>,
    ) -> (usize, Result<(), IndexError>) {
        let mut prev = parent;
        let mut prev_hash = parent.map(|at| self.tree.block(at));
        let mut i = 0;
        while i < seqs.len() {
            let expected_depth = prev.map_or(0, |at| at.depth + 1);
            let Some(at) = self.tree.lookup(seqs[i]) else {
                self.tree.append(prev, &seqs[i..], &engines[i..], holder);
                fresh.push(i..seqs.len());
                return (seqs.len(), Ok(()));
            };
            if at.depth != expected_depth || self.tree.parent_hash(at) != prev_hash {
                let reason = "sequence hash collides with a block elsewhere in the tree";
                return (i, Err(IndexError::InvalidBlockSequence { rank, reason }));
            }
            let node = self.tree.node(at.node);
            let offset = (at.depth - node.start) as usize;
            let mut j = i + 1;
            while j < seqs.len()
                && offset + (j - i) < node.hashes.len()
                && node.hashes[offset + (j - i)] == seqs[j]
            {
                j += 1;
            }
            let added = self.tree.add_holder(
                at.node,
                at.depth,
                at.depth + (j - i) as u32,
                holder,
                &engines[i..j],
            );
            if added > 0 {
                fresh.push(i..j);
            }
            prev = self.tree.lookup(seqs[j - 1]);
            prev_hash = Some(seqs[j - 1]);
            i = j;
        }
        (seqs.len(), Ok(()))
    }

    fn remove(
        &mut self,
        rank: WorkerRank,
        hashes: &[EngineHash],
        medium: Medium,
    ) -> Result<(), IndexError> {
        let Some(&slot) = self.slots.get(&rank) else {
            return match hashes.first() {
                Some(&hash) => Err(IndexError::BlockNotFound { rank, hash }),
                None => Ok(()),
            };
        };
        let mut error = None;
        for &hash in hashes {
            let state = self.rank_mut(slot);
            match state.engine[medium.index()].remove(&hash) {
                None => {
                    error.get_or_insert(IndexError::BlockNotFound { rank, hash });
                }
                Some(seq) => {
                    self.drop_block(slot, medium, seq);
                }
            }
        }
        error.map_or(Ok(()), Err)
    }

    /// Drops every block of `rank` in every tier; the rank keeps its slot.
    fn clear_rank(&mut self, rank: WorkerRank) {
        let Some(&slot) = self.slots.get(&rank) else {
            return;
        };
        for medium in Medium::ALL {
            let holder = holder_id(slot, medium);
            let state = self.ranks[slot as usize].as_mut().expect("live slot");
            let engine = std::mem::take(&mut state.engine[medium.index()]);
            state.recency[medium.index()].clear();
            let mut seen = FastSet::default();
            let mut reps = Vec::new();
            for seq in engine.values() {
                if let Some(at) = self.tree.lookup(*seq) {
                    if self.tree.holds(at, holder) && seen.insert(at.node) {
                        reps.push(*seq);
                    }
                }
            }
            self.tree.remove_holder_everywhere(&reps, holder);
        }
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

    /// Drops one block stored by [`Self::store_predicted`].
    pub(crate) fn remove_predicted(&mut self, rank: WorkerRank, seq: SequenceHash) {
        let _ = self.remove(rank, &[EngineHash(seq.0)], Medium::Gpu);
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
