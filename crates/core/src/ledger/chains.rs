//! The blocks a rank's active requests hold, as a compressed trie of their block chains.
//!
//! Each active request holds the chain of its prompt's full blocks. The trie stores every chain
//! once, cut into segments where chains branch or end, and counts on each segment the requests
//! whose chain runs through it. Beginning or releasing a request walks its chain segment by
//! segment: a request that shares a prefix with active ones touches one counter per shared
//! segment and stores only the blocks it adds, so its cost does not grow with the blocks it
//! shares, nor with the number of requests it shares them with.
//!
//! The trie is canonical: no segment is empty or unheld, and a segment with one child holds more
//! requests than that child (else the two would be one segment). So it has at most two segments
//! per distinct chain, and it is a function of the multiset of active chains alone.

use crate::fast_map::FastMap;
use crate::ids::SequenceHash;
use std::hash::{Hash, Hasher};

/// A segment's index in [`ChainTrie::segments`].
type SegmentId = u32;

/// The parent of the top segments (no segment has this id).
const ROOT: SegmentId = SegmentId::MAX;

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
    /// Active requests whose chain covers the whole segment (0: the slot is free).
    refs: u32,
    /// Number of child segments.
    children: u32,
    /// XOR of the children's ids: the only child's id when there is one.
    children_xor: SegmentId,
    /// The blocks, in chain order; a free slot keeps its allocation for the next segment.
    blocks: Vec<SequenceHash>,
}

/// The chains of a rank's active requests, with each segment's request count.
#[derive(Debug, Default)]
pub(crate) struct ChainTrie {
    segments: Vec<Segment>,
    free: Vec<SegmentId>,
    edges: FastMap<Edge, SegmentId>,
    /// Blocks stored: Σ segment lengths.
    blocks: u64,
}

/// Length of the common prefix of `a` and `b`.
fn common_prefix(a: &[SequenceHash], b: &[SequenceHash]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl ChainTrie {
    /// Distinct blocks held: a block shared by several chains counts once.
    pub(crate) fn blocks(&self) -> u64 {
        self.blocks
    }

    /// Whether no chain is held.
    pub(crate) fn is_empty(&self) -> bool {
        self.edges.is_empty()
    }

    fn child(&self, parent: SegmentId, first: SequenceHash) -> Option<SegmentId> {
        self.edges.get(&Edge { parent, first }).copied()
    }

    fn segment(&self, id: SegmentId) -> &Segment {
        &self.segments[id as usize]
    }

    fn segment_mut(&mut self, id: SegmentId) -> &mut Segment {
        &mut self.segments[id as usize]
    }

    /// A new segment under `parent` (not linked yet), in a free slot when there is one.
    fn allocate(&mut self, parent: SegmentId, refs: u32, blocks: &[SequenceHash]) -> SegmentId {
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
        s.refs = refs;
        s.children = 0;
        s.children_xor = 0;
        s.blocks.clear();
        s.blocks.extend_from_slice(blocks);
        id
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

    /// Splits segment `id` after its first `at` blocks (`0 < at < len`): the head becomes a new
    /// segment in its place, the tail keeps `id` (so its children's edges stay). Returns the head.
    fn split(&mut self, id: SegmentId, at: usize) -> SegmentId {
        let (parent, refs, first) = {
            let s = self.segment(id);
            (s.parent, s.refs, s.blocks[0])
        };
        let head = self.allocate(parent, refs, &[]);
        let mut blocks = std::mem::take(&mut self.segment_mut(head).blocks);
        let tail = self.segment_mut(id);
        blocks.extend_from_slice(&tail.blocks[..at]);
        tail.blocks.drain(..at);
        tail.parent = head;
        self.segment_mut(head).blocks = blocks;
        self.edges.insert(Edge { parent, first }, head);
        if parent != ROOT {
            self.segment_mut(parent).children_xor ^= id ^ head;
        }
        self.link(head, id);
        head
    }

    /// Adds a chain (an active request's full blocks).
    pub(crate) fn insert(&mut self, chain: &[SequenceHash]) {
        let (mut parent, mut pos) = (ROOT, 0);
        while pos < chain.len() {
            let rest = &chain[pos..];
            let Some(mut id) = self.child(parent, rest[0]) else {
                let leaf = self.allocate(parent, 1, rest);
                self.link(parent, leaf);
                self.blocks += rest.len() as u64;
                return;
            };
            let s = &self.segment(id).blocks;
            let (matched, len) = (common_prefix(s, rest), s.len());
            if matched < len {
                id = self.split(id, matched);
            }
            self.segment_mut(id).refs += 1;
            parent = id;
            pos += matched;
        }
    }

    /// Removes a chain [`ChainTrie::insert`] added. Returns false, changing nothing, if the trie
    /// does not hold it.
    pub(crate) fn remove(&mut self, chain: &[SequenceHash]) -> bool {
        if !self.holds(chain) {
            return false;
        }
        // The deepest segment still held after the release, and the first one that is not.
        let (mut parent, mut pos) = (ROOT, 0);
        let mut dropped = None;
        while pos < chain.len() {
            let id = self.child(parent, chain[pos]).expect("held chain");
            let s = self.segment_mut(id);
            s.refs -= 1;
            pos += s.blocks.len();
            if s.refs == 0 {
                dropped = Some(id);
                break;
            }
            parent = id;
        }
        if let Some(top) = dropped {
            // Every segment below an unheld one is unheld too: drop the branch.
            let first = self.segment(top).blocks[0];
            self.edges.remove(&Edge { parent, first });
            if parent != ROOT {
                let p = self.segment_mut(parent);
                p.children -= 1;
                p.children_xor ^= top;
            }
            self.drop_branch(top, chain, pos);
        }
        if parent != ROOT {
            self.merge_only_child(parent);
        }
        true
    }

    /// Frees segment `top` (its edge already removed) and the unheld chain below it: the rest of
    /// `chain` from `pos`. (In a canonical trie there is none: a segment held by one request with
    /// one child held by the same request would have been merged with it.)
    fn drop_branch(&mut self, top: SegmentId, chain: &[SequenceHash], mut pos: usize) {
        let mut id = top;
        loop {
            let child = chain.get(pos).and_then(|first| self.child(id, *first));
            if let Some(c) = child {
                self.edges.remove(&Edge {
                    parent: id,
                    first: chain[pos],
                });
                let s = self.segment_mut(c);
                s.refs -= 1;
                pos += s.blocks.len();
            }
            let s = self.segment_mut(id);
            debug_assert_eq!(s.refs, 0, "a segment is held by no more than its parent");
            let len = s.blocks.len() as u64;
            s.blocks.clear();
            s.children = 0;
            s.children_xor = 0;
            self.blocks -= len;
            self.free.push(id);
            match child {
                Some(c) => id = c,
                None => break,
            }
        }
    }

    /// Merges segment `id` with its only child when both are held by the same requests (keeps
    /// the trie canonical after a release).
    fn merge_only_child(&mut self, id: SegmentId) {
        let s = self.segment(id);
        if s.children != 1 {
            return;
        }
        let child = s.children_xor;
        if self.segment(child).refs != s.refs {
            return;
        }
        let (parent, first) = (s.parent, s.blocks[0]);
        let child_first = self.segment(child).blocks[0];
        // The child keeps its id (so its own children's edges stay) and takes the blocks before.
        let mut blocks = std::mem::take(&mut self.segment_mut(id).blocks);
        let c = self.segment_mut(child);
        blocks.extend_from_slice(&c.blocks);
        let mut spare = std::mem::replace(&mut c.blocks, blocks);
        c.parent = parent;
        spare.clear();
        let s = self.segment_mut(id);
        s.blocks = spare;
        s.refs = 0;
        s.children = 0;
        s.children_xor = 0;
        self.free.push(id);
        self.edges.remove(&Edge {
            parent: id,
            first: child_first,
        });
        self.edges.insert(Edge { parent, first }, child);
        if parent != ROOT {
            self.segment_mut(parent).children_xor ^= id ^ child;
        }
    }

    /// Whether the trie holds `chain` as the chain of an active request (it ends on a segment
    /// boundary, every segment on the way matching).
    fn holds(&self, chain: &[SequenceHash]) -> bool {
        let (mut parent, mut pos) = (ROOT, 0);
        while pos < chain.len() {
            let Some(id) = self.child(parent, chain[pos]) else {
                return false;
            };
            let s = &self.segment(id).blocks;
            if chain.len() - pos < s.len() || chain[pos..pos + s.len()] != s[..] {
                return false;
            }
            parent = id;
            pos += s.len();
        }
        true
    }

    /// How many leading blocks of `query` some held chain starts with. A sequence hash stands for
    /// its whole prefix, so within a segment the matching blocks are a prefix: a binary search.
    pub(crate) fn held_prefix(&self, query: &[SequenceHash]) -> usize {
        let (mut parent, mut pos) = (ROOT, 0);
        while pos < query.len() {
            let Some(id) = self.child(parent, query[pos]) else {
                return pos;
            };
            let s = &self.segment(id).blocks;
            let rest = &query[pos..];
            let n = s.len().min(rest.len());
            // Blocks 0..lo match (block 0 found the edge); hi is the last candidate length.
            let (mut lo, mut hi) = (1usize, n);
            while lo < hi {
                let mid = lo + (hi - lo).div_ceil(2);
                if s[mid - 1] == rest[mid - 1] {
                    lo = mid;
                } else {
                    hi = mid - 1;
                }
            }
            pos += lo;
            if lo < s.len() {
                return pos;
            }
            parent = id;
        }
        pos
    }

    /// Each block's count of the chains through it, summed over the segments that hold it.
    pub(crate) fn block_counts(&self) -> FastMap<SequenceHash, u32> {
        let mut counts = FastMap::default();
        for s in self.segments.iter().filter(|s| s.refs > 0) {
            for b in &s.blocks {
                *counts.entry(*b).or_default() += s.refs;
            }
        }
        counts
    }

    /// Checks the trie's structure: edges, parents, child counts, stored blocks, canonical form.
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut blocks = 0u64;
        let mut children = vec![(0u32, 0 as SegmentId, 0u32); self.segments.len()];
        let mut free = vec![false; self.segments.len()];
        for id in &self.free {
            free[*id as usize] = true;
        }
        let mut live = 0usize;
        for (i, s) in self.segments.iter().enumerate() {
            let id = i as SegmentId;
            if s.refs == 0 {
                if !s.blocks.is_empty() || !free[i] {
                    return Err(format!("segment {id}: unheld but not free"));
                }
                continue;
            }
            live += 1;
            let Some(first) = s.blocks.first() else {
                return Err(format!("segment {id}: empty"));
            };
            blocks += s.blocks.len() as u64;
            if self.child(s.parent, *first) != Some(id) {
                return Err(format!("segment {id}: no edge from its parent"));
            }
            if s.parent != ROOT {
                let p = self.segment(s.parent);
                if p.refs < s.refs {
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
            if n == 1 && refs == s.refs {
                return Err(format!("segment {i}: should be merged with its only child"));
            }
        }
        if blocks != self.blocks {
            return Err(format!("{} blocks counted, {blocks} stored", self.blocks));
        }
        Ok(())
    }
}
