//! Predicted cache state: blocks the router itself placed, kept for a time-to-live.
//!
//! Used two ways. In approximate mode (workers that publish no KV events) every routing decision
//! inserts the request's blocks for the chosen rank and this is the only cache picture. In the
//! predicted-placement window (with events) decisions go into a short-TTL side index, so that
//! siblings arriving before the engine's first `Stored` event still find the prefix; it never
//! writes into the event-fed index.
//!
//! Entries expire `ttl` after their last insertion; re-inserting refreshes them. When the number
//! of (block, rank) entries exceeds the cap, the oldest are pruned (deepest first within an
//! insertion, so leaves go before their parents) down to `prune_target_ratio` × cap. Expiry is
//! kept as one record per insertion, not per block, and the work of one call is bounded: what
//! expires or is pruned beyond that bound goes in the next calls.

use crate::fast_map::{FastMap, FastSet};
use crate::hashing::BlockHashes;
use crate::ids::{EngineHash, SequenceHash, WorkerId, WorkerRank};
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

/// One insertion's blocks, which expire together: `until` is the same for all of them.
#[derive(Debug)]
struct Due {
    until: Time,
    /// Insertion order, so that of two insertions due at the same time the older goes first.
    serial: u64,
    rank: WorkerRank,
    /// The blocks in chain order (root first); the last `len` are dropped first.
    seqs: Box<[SequenceHash]>,
    /// How many of `seqs` (from the front) are still to be looked at.
    len: usize,
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        (self.until, self.serial) == (other.until, other.serial)
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Due {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.until, self.serial).cmp(&(other.until, other.serial))
    }
}

/// Entries dropped per call at least, whatever was inserted (see [`ApproxIndex::expire`]).
pub const DROP_STEP: usize = 256;

/// A TTL- and size-bounded index of predicted placements.
#[derive(Debug)]
pub struct ApproxIndex {
    config: ApproxConfig,
    index: PrefixIndex,
    /// When each (rank, block) expires (its last insertion's time + the TTL), and the serial of
    /// that insertion's record: only that record drops it.
    expiry: FastMap<(WorkerRank, SequenceHash), (Time, u64)>,
    /// One record per insertion, oldest due first; a block re-inserted since belongs to the
    /// newer record, and the older ones skip it.
    queue: BinaryHeap<Reverse<Due>>,
    /// Σ blocks still to be looked at over `queue`.
    queued: usize,
    serial: u64,
    /// Entries inserted since the last drop: what the next call may drop beyond [`DROP_STEP`].
    inserted: usize,
    /// Whether a size-cap prune is under way (it goes on until the target is reached).
    pruning: bool,
    /// Whether the last expiry stopped at its budget with expired entries left.
    behind: bool,
    /// [`DROP_STEP`] (smaller in tests).
    drop_step: usize,
}

impl ApproxIndex {
    /// An empty index for `block_size`-token blocks.
    pub fn new(block_size: usize, config: ApproxConfig) -> Self {
        Self {
            config,
            index: PrefixIndex::new(block_size),
            expiry: FastMap::default(),
            queue: BinaryHeap::new(),
            queued: 0,
            serial: 0,
            inserted: 0,
            pruning: false,
            behind: false,
            drop_step: DROP_STEP,
        }
    }

    /// This index with `step` in place of [`DROP_STEP`].
    #[cfg(test)]
    fn with_drop_step(mut self, step: usize) -> Self {
        self.drop_step = step;
        self
    }

    /// Number of (block, rank) entries (expired ones not dropped yet included).
    pub fn len(&self) -> usize {
        self.expiry.len()
    }

    /// Entries within their time-to-live at `now`, per rank (O(entries): for the admin view).
    pub fn live_counts(&self, now: Time) -> FastMap<WorkerRank, usize> {
        let mut counts: FastMap<WorkerRank, usize> = FastMap::default();
        for ((rank, _), (until, _)) in &self.expiry {
            if *until > now {
                *counts.entry(*rank).or_default() += 1;
            }
        }
        counts
    }

    /// Whether nothing is predicted.
    pub fn is_empty(&self) -> bool {
        self.expiry.is_empty()
    }

    /// Records that `rank` will hold the request's full blocks from `now` on. Over the size cap,
    /// the oldest entries are pruned (deepest first within an insertion) toward
    /// `prune_target_ratio` × cap, at most [`Self::budget`] of them per call: a prune goes on over
    /// the next calls until the target is reached, so the size stays under the cap plus one
    /// insertion's blocks (records superseded by later insertions are skipped, not counted).
    pub fn insert(&mut self, rank: WorkerRank, blocks: &BlockHashes, now: Time) {
        if blocks.sequence.is_empty() {
            return;
        }
        self.index.store_predicted(rank, &blocks.sequence);
        let until = now + self.config.ttl;
        self.serial += 1;
        for seq in &blocks.sequence {
            self.expiry.insert((rank, *seq), (until, self.serial));
        }
        let n = blocks.sequence.len();
        self.queue.push(Reverse(Due {
            until,
            serial: self.serial,
            rank,
            seqs: blocks.sequence.clone().into_boxed_slice(),
            len: n,
        }));
        self.queued += n;
        self.inserted += n;
        if self.expiry.len() > self.config.max_entries {
            self.pruning = true;
        }
        if self.pruning {
            let target = (self.config.max_entries as f64 * self.config.prune_target_ratio) as usize;
            let budget = self.budget();
            self.pruning = !self.drop_until(|_, len| len <= target, budget);
        }
        // Superseded slots are bounded by a rebuild (O(live entries)), but not while expired
        // entries are being dropped over several calls: that drops their slots anyway.
        if !self.behind && self.queued > 2 * self.expiry.len() + 1024 {
            self.rebuild_queue();
        }
    }

    /// Drops entries whose time-to-live has passed, oldest first: at most [`Self::budget`] per
    /// call (twice what was inserted since the last drop, plus [`DROP_STEP`]), so a call after a
    /// lull does not drop a whole index of expired entries at once (a million took ~0.35 s under
    /// the router's lock). The rest go in the next calls, which outpace the inserts; until then
    /// they are in the index but [`Self::find_matches`] does not count them. Returns whether
    /// every expired entry is gone.
    pub fn expire(&mut self, now: Time) -> bool {
        let budget = self.budget();
        let done = self.drop_until(|until, _| until > now, budget);
        self.behind = !done;
        done
    }

    /// The overlap of each rank with a prompt at `now`: entries past their time-to-live count
    /// for nothing, also those no call has dropped yet.
    pub fn find_matches(&self, query: &[SequenceHash], now: Time) -> OverlapScores {
        let mut scores = self.index.find_matches(query);
        let expired_left = self
            .queue
            .peek()
            .is_some_and(|Reverse(oldest)| oldest.until <= now);
        if expired_left {
            for r in &mut scores.ranks {
                r.overlap.gpu_blocks = self.live_prefix(r.rank, query, r.overlap.gpu_blocks, now);
            }
            scores.ranks.retain(|r| r.overlap.total_blocks() > 0);
        }
        scores
    }

    /// How many of the `held` leading blocks of `query` on `rank` are still within their
    /// time-to-live. Every insertion stores a chain from its first block, so a block expires no
    /// later than its parent: the live blocks are a prefix, found by bisection.
    fn live_prefix(&self, rank: WorkerRank, query: &[SequenceHash], held: u32, now: Time) -> u32 {
        let live = |n: u32| {
            self.expiry
                .get(&(rank, query[n as usize - 1]))
                .is_some_and(|(until, _)| *until > now)
        };
        if held == 0 || live(held) {
            return held;
        }
        if !live(1) {
            return 0;
        }
        // live(lo), !live(hi)
        let (mut lo, mut hi) = (1, held);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if live(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// Drops everything predicted for `worker`.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.index.remove_worker(worker);
        self.expiry.retain(|(rank, _), _| rank.worker != worker);
        self.rebuild_queue();
    }

    /// Drops everything predicted for one rank (its cache was cleared).
    pub fn clear_rank(&mut self, rank: WorkerRank) {
        self.index.clear_predicted(rank);
        self.expiry.retain(|(r, _), _| *r != rank);
        self.rebuild_queue();
    }

    /// Checks the index, that every entry has a live queue record, and the queued count.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.index.check_invariants()?;
        if self.index.stats().entries != self.expiry.len() {
            return Err(format!(
                "{} entries on the tree, {} with an expiry",
                self.index.stats().entries,
                self.expiry.len()
            ));
        }
        let queued: usize = self.queue.iter().map(|Reverse(d)| d.len).sum();
        if queued != self.queued {
            return Err(format!("{queued} blocks queued, {} counted", self.queued));
        }
        let live: FastSet<(WorkerRank, SequenceHash, (Time, u64))> = self
            .queue
            .iter()
            .flat_map(|Reverse(d)| {
                d.seqs[..d.len]
                    .iter()
                    .map(|s| (d.rank, *s, (d.until, d.serial)))
            })
            .collect();
        if let Some(((rank, seq), _)) = self
            .expiry
            .iter()
            .find(|((rank, seq), due)| !live.contains(&(*rank, *seq, **due)))
        {
            return Err(format!(
                "{rank:?} {seq:?} has no queue record of its expiry"
            ));
        }
        Ok(())
    }

    /// Most entries one call may drop.
    fn budget(&self) -> usize {
        self.inserted
            .saturating_mul(2)
            .saturating_add(self.drop_step)
    }

    /// Drops entries, oldest insertion first and deepest block first within one, until
    /// `stop(next expiry, live entries)` holds (returns true) or `budget` entries were dropped
    /// (returns false). Slots of blocks re-inserted since are skipped without counting: there
    /// are at most about as many as live entries (see the rebuild in [`Self::insert`]).
    fn drop_until(&mut self, stop: impl Fn(Time, usize) -> bool, budget: usize) -> bool {
        self.inserted = 0;
        let mut dropped = 0;
        let mut gone: Vec<EngineHash> = Vec::new();
        while let Some(Reverse(top)) = self.queue.peek() {
            if stop(top.until, self.expiry.len()) {
                return true;
            }
            if dropped >= budget {
                return false;
            }
            let Some(Reverse(mut due)) = self.queue.pop() else {
                break;
            };
            gone.clear();
            while due.len > 0 && dropped < budget && !stop(due.until, self.expiry.len()) {
                due.len -= 1;
                self.queued -= 1;
                let key = (due.rank, due.seqs[due.len]);
                if self.expiry.get(&key) == Some(&(due.until, due.serial)) {
                    self.expiry.remove(&key);
                    gone.push(EngineHash(key.1 .0));
                    dropped += 1;
                }
            }
            self.index.remove_predicted(due.rank, &gone);
            if due.len > 0 {
                self.queue.push(Reverse(due));
            }
        }
        true
    }

    /// One record per (expiry, rank) of the live entries, blocks in depth order; each entry
    /// then belongs to its new record.
    fn rebuild_queue(&mut self) {
        let mut groups: FastMap<(Time, WorkerRank), Vec<(u32, SequenceHash)>> = FastMap::default();
        for (&(rank, seq), &(until, _)) in &self.expiry {
            let depth = self.index.depth_of(seq).unwrap_or(0);
            groups.entry((until, rank)).or_default().push((depth, seq));
        }
        let mut records: Vec<Reverse<Due>> = Vec::with_capacity(groups.len());
        for ((until, rank), mut blocks) in groups {
            blocks.sort_unstable();
            self.serial += 1;
            let seqs: Box<[SequenceHash]> = blocks.into_iter().map(|(_, s)| s).collect();
            for seq in seqs.iter() {
                self.expiry.insert((rank, *seq), (until, self.serial));
            }
            records.push(Reverse(Due {
                until,
                serial: self.serial,
                rank,
                len: seqs.len(),
                seqs,
            }));
        }
        self.queued = self.expiry.len();
        self.queue = BinaryHeap::from(records);
    }
}

#[cfg(test)]
mod model_tests;
#[cfg(test)]
mod tests;
