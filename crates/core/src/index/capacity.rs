//! The per-(rank, tier) capacity bound of the prefix index and its eviction order.
//!
//! A worker declares how many KV blocks it can hold (`kv_capacity_blocks`); an engine that loses
//! `Removed` events, or a publisher that lies, would otherwise grow the index without bound. Each
//! (rank, tier) of a worker with a capacity keeps at most that many blocks; storing beyond it
//! evicts.
//!
//! Policy: **oldest leaf first**. Only a block with no held child (of the same rank and tier) is
//! evicted, so eviction never leaves a descendant behind whose ancestor chain is missing. Among
//! leaves, the one that became a leaf first goes first: a newly stored block is the youngest; a
//! block whose last held child goes (evicted, removed by the engine or replaced) becomes the
//! oldest, so an old chain is evicted from its tip down to its root before a younger chain is
//! touched — the order in which engines free a request's blocks.
//!
//! Cost: every newly held block that ends its stored chain is pushed once on a queue (the
//! blocks before it have a held child); every dropped block pushes its parent once; each pop
//! either evicts or discards an entry for good. So eviction is amortised O(1) queue operations
//! per stored block, plus the leaf test, which scans the children of the block's tree node (a
//! branch point) when the block ends its node.

use super::tree::HolderId;
use super::{holder_id, PrefixIndex, RankState};
use crate::event::Medium;
use crate::fast_map::{FastMap, FastSet};
use crate::ids::{EngineHash, SequenceHash, WorkerId};
use std::collections::VecDeque;

/// Most blocks each rank of a worker keeps, per tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierCapacity {
    /// The GPU tier: the engine's KV pool (`kv_capacity_blocks`).
    pub gpu_blocks: usize,
    /// Each offload tier (CPU, disk), which engines often size larger than the GPU pool.
    pub offload_blocks: usize,
}

impl TierCapacity {
    /// The same bound on every tier.
    pub fn uniform(blocks: usize) -> Self {
        Self {
            gpu_blocks: blocks,
            offload_blocks: blocks,
        }
    }

    /// The bound of one tier.
    pub fn of(self, medium: Medium) -> usize {
        match medium {
            Medium::Gpu => self.gpu_blocks,
            Medium::Cpu | Medium::Disk => self.offload_blocks,
        }
    }
}

/// How many blocks one (rank, tier) holds, and its eviction order.
///
/// Which blocks are held, and under which engine hash, is on the tree; this keeps only their
/// count and the eviction candidates (a stored chain's tip, an exposed parent), so storing a
/// block costs no insert here.
#[derive(Debug, Default)]
pub(super) struct Recency {
    /// Blocks held.
    held: usize,
    /// Every eviction candidate and the stamp of its live queue entry.
    candidates: FastMap<SequenceHash, i64>,
    /// Eviction candidates by increasing stamp; an entry whose stamp is no longer the block's
    /// candidate stamp is stale.
    queue: VecDeque<(SequenceHash, i64)>,
    /// The next stamp pushed at the back (youngest).
    next_back: i64,
    /// The next stamp pushed at the front (oldest), counting down from -1.
    next_front: i64,
}

impl Recency {
    /// Blocks held.
    pub(super) fn len(&self) -> usize {
        self.held
    }

    /// `count` more blocks are held (the tree says which).
    pub(super) fn held_more(&mut self, count: usize) {
        self.held += count;
    }

    /// A newly held block with no held child: the youngest eviction candidate.
    pub(super) fn queue_youngest(&mut self, seq: SequenceHash) {
        let stamp = self.next_back;
        self.next_back += 1;
        self.candidates.insert(seq, stamp);
        self.queue.push_back((seq, stamp));
        self.compact();
    }

    /// A held block is no longer held.
    pub(super) fn dropped(&mut self, seq: SequenceHash) {
        self.held -= 1;
        self.candidates.remove(&seq);
    }

    /// A held block may have lost its last held child: it becomes the oldest candidate.
    pub(super) fn exposed(&mut self, seq: SequenceHash) {
        let stamp = self.next_front;
        self.next_front -= 1;
        self.candidates.insert(seq, stamp);
        self.queue.push_front((seq, stamp));
        self.compact();
    }

    /// The oldest candidate still queued under its candidate stamp, taken off the queue (it is
    /// no longer a candidate).
    pub(super) fn pop_oldest(&mut self) -> Option<SequenceHash> {
        while let Some((seq, stamp)) = self.queue.pop_front() {
            if self.candidates.get(&seq) == Some(&stamp) {
                self.candidates.remove(&seq);
                return Some(seq);
            }
        }
        None
    }

    /// Forgets everything.
    pub(super) fn clear(&mut self) {
        self.held = 0;
        self.candidates = FastMap::default();
        self.queue = VecDeque::new();
    }

    /// Drops stale entries once they outnumber live ones (amortised O(1) per push).
    fn compact(&mut self) {
        if self.queue.len() > 2 * self.held + 32 {
            let candidates = &self.candidates;
            self.queue
                .retain(|(seq, stamp)| candidates.get(seq) == Some(stamp));
        }
    }

    /// Queue entries, stale ones included.
    #[cfg(test)]
    pub(super) fn queue_len(&self) -> usize {
        self.queue.len()
    }

    /// Heap bytes (capacity-based estimate).
    pub(super) fn heap_bytes(&self) -> usize {
        self.candidates.capacity() * (std::mem::size_of::<(SequenceHash, i64)>() + 1)
            + self.queue.capacity() * std::mem::size_of::<(SequenceHash, i64)>()
    }

    /// The candidates, each checked to have its live queue entry.
    fn queued(&self) -> Result<FastSet<SequenceHash>, String> {
        let live: FastSet<(SequenceHash, i64)> = self.queue.iter().copied().collect();
        for (seq, stamp) in &self.candidates {
            if !live.contains(&(*seq, *stamp)) {
                return Err(format!("candidate {seq} has no live queue entry"));
            }
        }
        Ok(self.candidates.keys().copied().collect())
    }
}

impl PrefixIndex {
    /// Bounds every rank of `worker`, per tier (`None`: unbounded), evicting at once if one holds
    /// more. Kept across [`PrefixIndex::remove_worker`] (a cache flush), until set again.
    pub fn set_worker_capacity(&mut self, worker: WorkerId, blocks: Option<TierCapacity>) {
        match blocks {
            Some(b) => self.caps.insert(worker, b),
            None => self.caps.remove(&worker),
        };
        let slots: Vec<u32> = self
            .slots
            .iter()
            .filter(|(r, _)| r.worker == worker)
            .map(|(_, s)| *s)
            .collect();
        for slot in slots {
            for medium in Medium::ALL {
                self.evict_over_capacity(slot, medium);
            }
        }
    }

    /// The capacity of a worker's ranks, if bounded.
    pub fn worker_capacity(&self, worker: WorkerId) -> Option<TierCapacity> {
        self.caps.get(&worker).copied()
    }

    /// Blocks evicted by the capacity bound so far, per worker, sorted.
    pub fn evictions(&self) -> Vec<(WorkerId, u64)> {
        let mut out: Vec<(WorkerId, u64)> = self.evictions.iter().map(|(w, n)| (*w, *n)).collect();
        out.sort();
        out
    }

    /// Removes `holder` from a held block and makes its parent (if held) the oldest candidate.
    /// Returns the engine hash the block was held under.
    pub(super) fn drop_block(
        &mut self,
        slot: u32,
        medium: Medium,
        seq: SequenceHash,
    ) -> Option<EngineHash> {
        let holder = holder_id(slot, medium);
        let at = self.tree.lookup(seq)?;
        let parent = self.tree.parent_hash(at);
        let engine = self.tree.remove_holder(at, holder)?;
        let parent_held = parent.filter(|p| {
            self.tree
                .lookup(*p)
                .is_some_and(|at| self.tree.holds(at, holder))
        });
        let recency = &mut self.rank_mut(slot).recency[medium.index()];
        recency.dropped(seq);
        if let Some(p) = parent_held {
            recency.exposed(p);
        }
        Some(engine)
    }

    /// Evicts oldest leaves of (`slot`, `medium`) until it is within its worker's capacity.
    pub(super) fn evict_over_capacity(&mut self, slot: u32, medium: Medium) {
        let (worker, cap) = {
            let state = self.rank(slot);
            let worker = state.rank.worker;
            match self.caps.get(&worker) {
                Some(cap) => (worker, cap.of(medium)),
                None => return,
            }
        };
        let holder = holder_id(slot, medium);
        let mut evicted = 0u64;
        while self.rank(slot).recency[medium.index()].len() > cap {
            let recency = &mut self.rank_mut(slot).recency[medium.index()];
            let Some(seq) = recency.pop_oldest() else {
                debug_assert!(false, "a held leaf is missing from the eviction queue");
                break;
            };
            if self.has_held_child(seq, holder) {
                continue;
            }
            if let Some(engine) = self.drop_block(slot, medium, seq) {
                let map = &mut self.rank_mut(slot).engine[medium.index()];
                if map.get(&engine) == Some(&seq) {
                    map.remove(&engine);
                }
                evicted += 1;
            }
        }
        if evicted > 0 {
            *self.evictions.entry(worker).or_default() += evicted;
        }
    }

    /// Whether `holder` holds a child of the (held) block `seq`.
    pub(super) fn has_held_child(&self, seq: SequenceHash, holder: HolderId) -> bool {
        let Some(at) = self.tree.lookup(seq) else {
            return false;
        };
        let node = self.tree.node(at.node);
        // Every block of a node has the same holders, so the next block in the run is held.
        at.depth + 1 < node.end()
            || node
                .children
                .iter()
                .any(|c| self.tree.node(*c).holds(holder))
    }

    /// Checks one (rank, tier)'s bookkeeping: it names exactly the `on_tree` blocks the tree
    /// holds for it, stays within its capacity, and every held leaf is an eviction candidate.
    pub(super) fn check_recency(
        &self,
        state: &RankState,
        holder: HolderId,
        medium: Medium,
        on_tree: usize,
    ) -> Result<(), String> {
        let recency = &state.recency[medium.index()];
        let name = format!("{} {medium:?}", state.rank);
        if recency.len() != on_tree {
            return Err(format!(
                "{name}: {on_tree} blocks held on the tree, {} in the eviction bookkeeping",
                recency.len()
            ));
        }
        if let Some(cap) = self.caps.get(&state.rank.worker) {
            let cap = cap.of(medium);
            if recency.len() > cap {
                return Err(format!(
                    "{name}: {} blocks over capacity {cap}",
                    recency.len()
                ));
            }
        }
        let queued = recency.queued().map_err(|e| format!("{name}: {e}"))?;
        for seq in &queued {
            let held = self
                .tree
                .lookup(*seq)
                .is_some_and(|at| self.tree.holds(at, holder));
            if !held {
                return Err(format!("{name}: candidate {seq} is not held"));
            }
        }
        for id in self.tree.node_ids() {
            let node = self.tree.node(id);
            if !node.holds(holder) {
                continue;
            }
            for &seq in &node.hashes {
                if !self.has_held_child(seq, holder) && !queued.contains(&seq) {
                    return Err(format!("{name}: leaf {seq} is not an eviction candidate"));
                }
            }
        }
        Ok(())
    }
}
