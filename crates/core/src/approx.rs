//! Predicted cache state: blocks the router itself placed, kept for a time-to-live.
//!
//! Used two ways. In approximate mode (workers that publish no KV events) every routing decision
//! inserts the request's blocks for the chosen rank and this is the only cache picture. In the
//! predicted-placement window (with events) decisions go into a short-TTL side index, so that
//! siblings arriving before the engine's first `Stored` event still find the prefix; it never
//! writes into the event-fed index.
//!
//! Entries expire `ttl` after their last insertion; re-inserting refreshes them. When the number
//! of (block, rank) entries exceeds the cap, the oldest are pruned (deepest first among equals,
//! so leaves go before their parents) down to `prune_target_ratio` × cap.

use crate::fast_map::FastMap;
use crate::hashing::BlockHashes;
use crate::ids::{SequenceHash, WorkerId, WorkerRank};
use crate::index::{OverlapScores, PrefixIndex};
use crate::time::Time;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

/// Bounds of an [`ApproxIndex`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ApproxConfig {
    /// How long an entry lives after its last insertion.
    pub ttl: Duration,
    /// The most (block, rank) entries kept.
    pub max_entries: usize,
    /// What pruning brings the size down to, as a fraction of `max_entries`.
    pub prune_target_ratio: f64,
}

impl Default for ApproxConfig {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(120),
            max_entries: 1 << 20,
            prune_target_ratio: 0.8,
        }
    }
}

type HeapEntry = Reverse<(Time, Reverse<u32>, WorkerRank, SequenceHash)>;

/// A TTL- and size-bounded index of predicted placements.
#[derive(Debug)]
pub struct ApproxIndex {
    config: ApproxConfig,
    index: PrefixIndex,
    expiry: FastMap<(WorkerRank, SequenceHash), Time>,
    heap: BinaryHeap<HeapEntry>,
}

impl ApproxIndex {
    /// An empty index for `block_size`-token blocks.
    pub fn new(block_size: usize, config: ApproxConfig) -> Self {
        Self {
            config,
            index: PrefixIndex::new(block_size),
            expiry: FastMap::default(),
            heap: BinaryHeap::new(),
        }
    }

    /// Number of (block, rank) entries.
    pub fn len(&self) -> usize {
        self.expiry.len()
    }

    /// Whether nothing is predicted.
    pub fn is_empty(&self) -> bool {
        self.expiry.is_empty()
    }

    /// Records that `rank` will hold the request's full blocks from `now` on.
    pub fn insert(&mut self, rank: WorkerRank, blocks: &BlockHashes, now: Time) {
        if blocks.sequence.is_empty() {
            return;
        }
        self.index.store_predicted(rank, &blocks.sequence);
        let until = now + self.config.ttl;
        for (depth, seq) in blocks.sequence.iter().enumerate() {
            self.expiry.insert((rank, *seq), until);
            self.heap
                .push(Reverse((until, Reverse(depth as u32), rank, *seq)));
        }
        if self.expiry.len() > self.config.max_entries {
            let target = (self.config.max_entries as f64 * self.config.prune_target_ratio) as usize;
            self.pop_until(|_, len| len <= target);
        }
        if self.heap.len() > 2 * self.expiry.len() + 1024 {
            self.rebuild_heap();
        }
    }

    /// Drops every entry whose time-to-live has passed.
    pub fn expire(&mut self, now: Time) {
        self.pop_until(|expiry, _| expiry > now);
    }

    /// The overlap of each rank with a prompt.
    pub fn find_matches(&self, query: &[SequenceHash]) -> OverlapScores {
        self.index.find_matches(query)
    }

    /// Drops everything predicted for `worker`.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.index.remove_worker(worker);
        self.expiry.retain(|(rank, _), _| rank.worker != worker);
        self.rebuild_heap();
    }

    /// Drops everything predicted for one rank (its cache was cleared).
    pub fn clear_rank(&mut self, rank: WorkerRank) {
        self.index.clear_predicted(rank);
        self.expiry.retain(|(r, _), _| *r != rank);
        self.rebuild_heap();
    }

    /// Checks the index and that every entry has a live heap record.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.index.check_invariants()?;
        if self.index.stats().entries != self.expiry.len() {
            return Err(format!(
                "{} entries on the tree, {} with an expiry",
                self.index.stats().entries,
                self.expiry.len()
            ));
        }
        Ok(())
    }

    /// Pops heap entries (oldest first) until `stop(next expiry, live entries)` holds.
    fn pop_until(&mut self, stop: impl Fn(Time, usize) -> bool) {
        while let Some(Reverse((expiry, _, rank, seq))) = self.heap.peek().copied() {
            if stop(expiry, self.expiry.len()) {
                return;
            }
            self.heap.pop();
            if self.expiry.get(&(rank, seq)) == Some(&expiry) {
                self.expiry.remove(&(rank, seq));
                self.index.remove_predicted(rank, seq);
            }
        }
    }

    fn rebuild_heap(&mut self) {
        let mut entries: Vec<HeapEntry> = Vec::with_capacity(self.expiry.len());
        for (&(rank, seq), &expiry) in &self.expiry {
            let depth = self.index.depth_of(seq).unwrap_or(0);
            entries.push(Reverse((expiry, Reverse(depth), rank, seq)));
        }
        self.heap = BinaryHeap::from(entries);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::{BlockHasher, HashNamespace};

    fn blocks(n: u32, salt: u32) -> BlockHashes {
        let tokens: Vec<u32> = (0..n * 4).map(|t| t + salt * 1000).collect();
        BlockHasher::new(4, &HashNamespace::none()).hash_blocks(&tokens)
    }

    fn rank(w: u64) -> WorkerRank {
        WorkerRank::new(WorkerId(w), 0)
    }

    #[test]
    fn entries_expire_after_their_ttl_and_refresh_on_reinsert() {
        let config = ApproxConfig {
            ttl: Duration::from_secs(10),
            ..ApproxConfig::default()
        };
        let mut approx = ApproxIndex::new(4, config);
        let b = blocks(3, 0);
        approx.insert(rank(1), &b, Time::from_millis(0));
        approx.insert(rank(2), &b, Time::from_millis(5_000));
        approx.expire(Time::from_millis(9_999));
        assert_eq!(approx.find_matches(&b.sequence).get(rank(1)).gpu_blocks, 3);
        approx.expire(Time::from_millis(10_000));
        assert_eq!(approx.find_matches(&b.sequence).get(rank(1)).gpu_blocks, 0);
        assert_eq!(approx.find_matches(&b.sequence).get(rank(2)).gpu_blocks, 3);
        approx.insert(rank(2), &b, Time::from_millis(12_000));
        approx.expire(Time::from_millis(16_000));
        assert_eq!(approx.find_matches(&b.sequence).get(rank(2)).gpu_blocks, 3);
        approx.check_invariants().unwrap();
    }

    #[test]
    fn the_size_cap_prunes_oldest_first_leaves_before_parents() {
        let config = ApproxConfig {
            max_entries: 10,
            ..ApproxConfig::default()
        };
        let mut approx = ApproxIndex::new(4, config);
        approx.insert(rank(1), &blocks(6, 1), Time::from_millis(0));
        approx.insert(rank(1), &blocks(5, 2), Time::from_millis(1));
        // 11 entries > 10: prune to 8, taking the 3 deepest blocks of the oldest chain.
        assert_eq!(approx.len(), 8);
        assert_eq!(
            approx
                .find_matches(&blocks(6, 1).sequence)
                .get(rank(1))
                .gpu_blocks,
            3
        );
        assert_eq!(
            approx
                .find_matches(&blocks(5, 2).sequence)
                .get(rank(1))
                .gpu_blocks,
            5
        );
        approx.check_invariants().unwrap();
    }

    #[test]
    fn removing_a_worker_forgets_its_predictions() {
        let mut approx = ApproxIndex::new(4, ApproxConfig::default());
        approx.insert(rank(1), &blocks(2, 0), Time::ZERO);
        approx.insert(rank(2), &blocks(2, 0), Time::ZERO);
        approx.remove_worker(WorkerId(1));
        assert_eq!(approx.len(), 2);
        approx.clear_rank(rank(2));
        assert!(approx.is_empty());
        approx.check_invariants().unwrap();
    }
}
