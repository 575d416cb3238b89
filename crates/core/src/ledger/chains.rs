//! The blocks active requests hold, as one compressed trie of their block chains over all ranks.
//!
//! Each active request holds the chain of its prompt's full blocks on its rank. The trie stores
//! every chain once, cut into segments where chains branch or end, and keeps on each segment the
//! ranks whose requests' chains run through it, with how many requests each. Beginning a
//! request walks its chain segment by segment, and releasing it walks back up from the segment
//! its chain ends on ([`ChainEnd`], all the ledger keeps of the chain): a request that shares a
//! prefix with active ones touches one counter per shared segment and stores only the blocks it
//! adds, so its cost grows neither with the blocks it shares nor with the requests it shares
//! them with. The prefix every rank holds of a prompt is one walk down the prompt's path,
//! whatever the number of ranks.
//!
//! The trie is canonical: no segment is empty or unheld, and a segment with one child has other
//! holders than that child (else the two would be one segment). So it has at most two segments
//! per distinct chain, and it is a function of the active (rank, chain) pairs alone.

use crate::fast_map::FastMap;
use crate::ids::{SequenceHash, WorkerRank};
use std::hash::{Hash, Hasher};

/// A segment's index in [`ChainTrie::segments`].
type SegmentId = u32;

/// The parent of the top segments (no segment has this id).
const ROOT: SegmentId = SegmentId::MAX;

/// Where an active request's chain ends in the trie: what [`ChainTrie::remove`] needs of it, so
/// the ledger does not keep a copy of the chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ChainEnd(SegmentId);

/// The edge from a segment (or [`ROOT`]) to its child starting with a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Edge {
    parent: SegmentId,
    first: SequenceHash,
}

impl Hash for Edge {
    // Sequence hashes are already well mixed, and the same first block under two parents only
    // happens for chains that are not chained hashes: hashing the block alone is enough.
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.first.hash(state);
    }
}

#[derive(Debug, Default)]
struct Segment {
    /// The segment it continues, or [`ROOT`].
    parent: SegmentId,
    /// Active chains that cover the whole segment, over all ranks (0: the slot is free).
    refs: u32,
    /// Number of child segments.
    children: u32,
    /// XOR of the children's ids: the only child's id when there is one.
    children_xor: SegmentId,
    /// The ranks holding it, sorted, each with its number of chains through it (> 0).
    holders: Vec<(WorkerRank, u32)>,
    /// The blocks, in chain order. A free slot keeps both vectors' allocations for reuse.
    blocks: Vec<SequenceHash>,
}

impl Segment {
    /// One more chain of `rank` covers the segment; true if `rank` did not hold it before.
    fn hold(&mut self, rank: WorkerRank) -> bool {
        self.refs += 1;
        match self.holders.binary_search_by_key(&rank, |h| h.0) {
            Ok(i) => {
                self.holders[i].1 += 1;
                false
            }
            Err(i) => {
                self.holders.insert(i, (rank, 1));
                true
            }
        }
    }

    /// One chain of `rank` through the segment ended; true if `rank` no longer holds it.
    fn release(&mut self, rank: WorkerRank) -> bool {
        let i = self
            .holders
            .binary_search_by_key(&rank, |h| h.0)
            .expect("a released chain's rank holds its segments");
        self.refs -= 1;
        self.holders[i].1 -= 1;
        if self.holders[i].1 == 0 {
            self.holders.remove(i);
            return true;
        }
        false
    }

    fn held_by(&self, rank: WorkerRank) -> bool {
        self.holders.binary_search_by_key(&rank, |h| h.0).is_ok()
    }

    fn len(&self) -> u64 {
        self.blocks.len() as u64
    }
}

/// The chains of the active requests, each segment with the ranks holding it.
#[derive(Debug, Default)]
pub(crate) struct ChainTrie {
    segments: Vec<Segment>,
    free: Vec<SegmentId>,
    edges: FastMap<Edge, SegmentId>,
}

/// How many leading blocks of `query` equal those of `segment`, given that the first do. A
/// sequence hash stands for its whole prefix, so the equal blocks are a prefix: a binary search.
fn matched(segment: &[SequenceHash], query: &[SequenceHash]) -> usize {
    let (mut lo, mut hi) = (1usize, segment.len().min(query.len()));
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if segment[mid - 1] == query[mid - 1] {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

impl ChainTrie {
    fn child(&self, parent: SegmentId, first: SequenceHash) -> Option<SegmentId> {
        self.edges.get(&Edge { parent, first }).copied()
    }

    fn segment(&self, id: SegmentId) -> &Segment {
        &self.segments[id as usize]
    }

    fn segment_mut(&mut self, id: SegmentId) -> &mut Segment {
        &mut self.segments[id as usize]
    }

    /// A new, unheld segment under `parent` (not linked yet), in a free slot when there is one.
    fn allocate(&mut self, parent: SegmentId, blocks: &[SequenceHash]) -> SegmentId {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let id = SegmentId::try_from(self.segments.len())
                    .ok()
                    .filter(|id| *id != ROOT)
                    .expect("fewer than 2^32 - 1 segments");
                self.segments.push(Segment::default());
                id
            }
        };
        let s = self.segment_mut(id);
        s.parent = parent;
        s.blocks.extend_from_slice(blocks);
        id
    }

    /// Returns segment `id` (unlinked, unheld) to the free slots.
    fn free(&mut self, id: SegmentId) {
        let s = self.segment_mut(id);
        debug_assert_eq!(s.refs, 0);
        s.refs = 0;
        s.children = 0;
        s.children_xor = 0;
        s.holders.clear();
        s.blocks.clear();
        self.free.push(id);
    }

    /// Links `id` under `parent` by its first block.
    fn link(&mut self, parent: SegmentId, id: SegmentId) {
        let first = self.segment(id).blocks[0];
        self.edges.insert(Edge { parent, first }, id);
        if parent != ROOT {
            let p = self.segment_mut(parent);
            p.children += 1;
            p.children_xor ^= id;
        }
    }

    /// Unlinks `id` (first block `first`) from `parent`.
    fn unlink(&mut self, parent: SegmentId, id: SegmentId, first: SequenceHash) {
        self.edges.remove(&Edge { parent, first });
        if parent != ROOT {
            let p = self.segment_mut(parent);
            p.children -= 1;
            p.children_xor ^= id;
        }
    }

    /// Splits segment `id` after its first `at` blocks (`0 < at < len`): the head becomes a new
    /// segment in its place with the same holders, the tail keeps `id` (so its children's edges
    /// stay). Returns the head.
    fn split(&mut self, id: SegmentId, at: usize) -> SegmentId {
        let (parent, first) = {
            let s = self.segment(id);
            (s.parent, s.blocks[0])
        };
        let head = self.allocate(parent, &[]);
        let mut blocks = std::mem::take(&mut self.segment_mut(head).blocks);
        let mut holders = std::mem::take(&mut self.segment_mut(head).holders);
        let tail = self.segment_mut(id);
        blocks.extend_from_slice(&tail.blocks[..at]);
        tail.blocks.drain(..at);
        holders.extend_from_slice(&tail.holders);
        tail.parent = head;
        let refs = tail.refs;
        let h = self.segment_mut(head);
        h.blocks = blocks;
        h.holders = holders;
        h.refs = refs;
        self.edges.insert(Edge { parent, first }, head);
        if parent != ROOT {
            self.segment_mut(parent).children_xor ^= id ^ head;
        }
        self.link(head, id);
        head
    }

    /// Adds a chain (an active request's full blocks) on `rank`. Returns how many of its blocks
    /// `rank` did not hold before, and the chain's end: the segment its last block closes
    /// ([`ROOT`] for an empty chain), which [`ChainTrie::remove`] takes back. The end stays
    /// the same segment while the chain is held: a split keeps the id of the part that ends
    /// where the segment ended, and a segment that a chain ends on is never merged into its
    /// child (the child is held by one chain fewer).
    pub(crate) fn insert(&mut self, rank: WorkerRank, chain: &[SequenceHash]) -> (u64, ChainEnd) {
        let (mut parent, mut pos, mut added) = (ROOT, 0, 0);
        while pos < chain.len() {
            let rest = &chain[pos..];
            let Some(mut id) = self.child(parent, rest[0]) else {
                let leaf = self.allocate(parent, rest);
                self.segment_mut(leaf).hold(rank);
                self.link(parent, leaf);
                return (added + rest.len() as u64, ChainEnd(leaf));
            };
            let s = &self.segment(id).blocks;
            let (common, len) = (matched(s, rest), s.len());
            debug_assert_eq!(
                s[..common],
                rest[..common],
                "a sequence hash stands for its prefix"
            );
            if common < len {
                id = self.split(id, common);
            }
            let s = self.segment_mut(id);
            if s.hold(rank) {
                added += s.len();
            }
            parent = id;
            pos += common;
        }
        (added, ChainEnd(parent))
    }

    /// Removes a chain of `rank` by the end [`ChainTrie::insert`] returned for it (and no
    /// removal took back since), walking up from its last segment. Returns how many of its
    /// blocks `rank` no longer holds.
    pub(crate) fn remove(&mut self, rank: WorkerRank, end: ChainEnd) -> u64 {
        debug_assert!(self.holds(rank, end), "removing a chain that is not held");
        let (mut id, mut released, mut deepest_held) = (end.0, 0, None);
        while id != ROOT {
            let s = self.segment_mut(id);
            let parent = s.parent;
            if s.release(rank) {
                released += s.len();
            }
            if s.refs == 0 {
                // No chain covers it, so none covers what lay below it (freed already, or
                // merged into it in a canonical trie).
                let first = s.blocks[0];
                self.unlink(parent, id, first);
                self.free(id);
            } else if deepest_held.is_none() {
                deepest_held = Some(id);
            }
            id = parent;
        }
        // Only the deepest segment still held can have lost what kept it apart from its child.
        if let Some(d) = deepest_held {
            self.merge_only_child(d);
        }
        released
    }

    /// The blocks of the chain ending at `end`, from the root (for checks and diagnostics).
    pub(crate) fn chain(&self, end: ChainEnd) -> Vec<SequenceHash> {
        let mut segments = Vec::new();
        let mut id = end.0;
        while id != ROOT {
            segments.push(id);
            id = self.segment(id).parent;
        }
        segments
            .iter()
            .rev()
            .flat_map(|id| self.segment(*id).blocks.iter().copied())
            .collect()
    }

    /// Merges segment `id` with its only child when both have the same holders (keeps the trie
    /// canonical after a release).
    fn merge_only_child(&mut self, id: SegmentId) {
        let s = self.segment(id);
        if s.children != 1 {
            return;
        }
        let child = s.children_xor;
        let c = self.segment(child);
        if c.refs != s.refs || c.holders != s.holders {
            return;
        }
        let (parent, first, child_first) = (s.parent, s.blocks[0], c.blocks[0]);
        // The child keeps its id (so its own children's edges stay) and takes the blocks before.
        let mut blocks = std::mem::take(&mut self.segment_mut(id).blocks);
        let c = self.segment_mut(child);
        blocks.extend_from_slice(&c.blocks);
        let spare = std::mem::replace(&mut c.blocks, blocks);
        c.parent = parent;
        let s = self.segment_mut(id);
        s.blocks = spare;
        s.refs = 0;
        self.free(id);
        self.edges.remove(&Edge {
            parent: id,
            first: child_first,
        });
        self.edges.insert(Edge { parent, first }, child);
        if parent != ROOT {
            self.segment_mut(parent).children_xor ^= id ^ child;
        }
    }

    /// Whether `rank` holds every segment from `end` up to the root.
    fn holds(&self, rank: WorkerRank, end: ChainEnd) -> bool {
        let mut id = end.0;
        while id != ROOT {
            let Some(s) = self.segments.get(id as usize) else {
                return false;
            };
            if !s.held_by(rank) {
                return false;
            }
            id = s.parent;
        }
        true
    }

    /// How many leading blocks of `query` the chains held on `rank` start with.
    pub(crate) fn held_prefix(&self, rank: WorkerRank, query: &[SequenceHash]) -> usize {
        let (mut parent, mut pos) = (ROOT, 0);
        while pos < query.len() {
            let Some(id) = self.child(parent, query[pos]) else {
                return pos;
            };
            let s = self.segment(id);
            if !s.held_by(rank) {
                return pos;
            }
            let m = matched(&s.blocks, &query[pos..]);
            pos += m;
            if m < s.blocks.len() {
                return pos;
            }
            parent = id;
        }
        pos
    }

    /// For every rank holding a prefix of `query`, the length of the longest, sorted by rank.
    /// One walk: the ranks holding a segment include those holding its children.
    pub(crate) fn held_prefixes(&self, query: &[SequenceHash], out: &mut Vec<(WorkerRank, usize)>) {
        out.clear();
        let (mut parent, mut pos) = (ROOT, 0);
        while pos < query.len() {
            let Some(id) = self.child(parent, query[pos]) else {
                return;
            };
            let s = self.segment(id);
            let m = matched(&s.blocks, &query[pos..]);
            pos += m;
            if parent == ROOT {
                out.extend(s.holders.iter().map(|h| (h.0, pos)));
            } else {
                let mut i = 0;
                for (rank, _) in &s.holders {
                    // Both sorted by rank, the holders a subset of `out`'s ranks.
                    while out[i].0 < *rank {
                        i += 1;
                    }
                    out[i].1 = pos;
                }
            }
            if m < s.blocks.len() {
                return;
            }
            parent = id;
        }
    }

    /// Per rank, each held block's count of the chains through it (summed over the segments
    /// that hold it) and the number of blocks held (Σ lengths of the segments it holds).
    pub(crate) fn block_counts(&self) -> FastMap<WorkerRank, (FastMap<SequenceHash, u32>, u64)> {
        let mut counts: FastMap<WorkerRank, (FastMap<SequenceHash, u32>, u64)> = FastMap::default();
        for s in self.segments.iter().filter(|s| s.refs > 0) {
            for (rank, n) in &s.holders {
                let (blocks, held) = counts.entry(*rank).or_default();
                *held += s.len();
                for b in &s.blocks {
                    *blocks.entry(*b).or_default() += n;
                }
            }
        }
        counts
    }

    /// Checks the trie's structure: edges, parents, children, holders, canonical form.
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut children = vec![(0u32, 0 as SegmentId, 0u32); self.segments.len()];
        let mut free = vec![false; self.segments.len()];
        for id in &self.free {
            free[*id as usize] = true;
        }
        let mut live = 0usize;
        for (i, s) in self.segments.iter().enumerate() {
            let id = i as SegmentId;
            if s.refs == 0 {
                if !s.blocks.is_empty() || !s.holders.is_empty() || !free[i] {
                    return Err(format!("segment {id}: unheld but not free"));
                }
                continue;
            }
            live += 1;
            let Some(first) = s.blocks.first() else {
                return Err(format!("segment {id}: empty"));
            };
            if self.child(s.parent, *first) != Some(id) {
                return Err(format!("segment {id}: no edge from its parent"));
            }
            let sorted = s.holders.windows(2).all(|w| w[0].0 < w[1].0);
            let total: u32 = s.holders.iter().map(|h| h.1).sum();
            if !sorted || s.holders.iter().any(|h| h.1 == 0) || total != s.refs {
                return Err(format!(
                    "segment {id}: holders {:?}, refs {}",
                    s.holders, s.refs
                ));
            }
            if s.parent != ROOT {
                let p = self.segment(s.parent);
                let covered = s.holders.iter().all(|(r, n)| {
                    p.holders
                        .binary_search_by_key(r, |h| h.0)
                        .is_ok_and(|j| p.holders[j].1 >= *n)
                });
                if !covered {
                    return Err(format!("segment {id}: held more than its parent"));
                }
                let c = &mut children[s.parent as usize];
                c.0 += 1;
                c.1 ^= id;
                c.2 += s.refs;
            }
        }
        if live != self.edges.len() || live + self.free.len() != self.segments.len() {
            return Err(format!(
                "{live} segments held, {} edges, {} free of {}",
                self.edges.len(),
                self.free.len(),
                self.segments.len()
            ));
        }
        for (i, s) in self.segments.iter().enumerate().filter(|(_, s)| s.refs > 0) {
            let (n, xor, refs) = children[i];
            if (n, xor) != (s.children, s.children_xor) || refs > s.refs {
                return Err(format!("segment {i}: children do not add up"));
            }
            if n == 1 && self.segment(xor).holders == s.holders {
                return Err(format!("segment {i}: should be merged with its only child"));
            }
        }
        Ok(())
    }
}
