//! The path-compressed block tree behind the prefix index.
//!
//! A node holds a run of consecutive blocks of one chain that every holder holds entirely, so a
//! node boundary exists only where the chain branches or the set of holders changes. Lookups
//! therefore cost one map probe per node and a slice comparison inside it. A flat map from every
//! sequence hash to its node and depth lets events and queries jump straight to any block.
//!
//! Splits and merges always move the shorter side, so the map updates they cost are bounded by
//! the shorter run.
//!
//! Each node also keeps, per holder, the engine hash under which that holder stored each block of
//! the run (the reverse of the index's per-holder engine-hash map). Keeping it inline costs a
//! sequential write per stored block instead of an insert into another per-holder map.
//!
//! Layout: this file (nodes, lookups, holders, appends), `tree/reshape.rs` (splits, merges,
//! deleting empty leaves), `tree/check.rs` (the invariants).

use crate::fast_map::FastMap;
use crate::ids::{EngineHash, SequenceHash};

mod check;
mod reshape;

/// Index of a node in the arena.
pub(crate) type NodeId = u32;
/// A (rank slot, medium) pair packed as `slot << 2 | medium`.
pub(crate) type HolderId = u32;

/// Where a block sits: its node and its depth in the chain (0 = the first block of a prompt).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BlockRef {
    pub(crate) node: NodeId,
    pub(crate) depth: u32,
}

#[derive(Debug)]
pub(crate) struct Node {
    /// `None` for a child of the (implicit) root.
    pub(crate) parent: Option<NodeId>,
    /// Depth of `hashes[0]`.
    pub(crate) start: u32,
    pub(crate) hashes: Vec<SequenceHash>,
    /// Sorted, unique.
    pub(crate) holders: Vec<HolderId>,
    /// Parallel to `holders`: for each holder, the engine hash it stored each block of `hashes`
    /// under (same length as `hashes`).
    pub(crate) engines: Vec<Vec<EngineHash>>,
    /// The holders as per-tier bitsets over rank slots, for fast matching: word `i` of tier `t`
    /// (0 GPU, 1 GPU or CPU, 2 any tier) is at `3 * i + t`.
    pub(crate) bits: Vec<u64>,
    pub(crate) children: Vec<NodeId>,
}

/// The per-tier slot bitsets of a holder list (see [`Node::bits`]).
pub(crate) fn tier_bits(holders: &[HolderId]) -> Vec<u64> {
    let Some(&last) = holders.last() else {
        return Vec::new();
    };
    let words = (last >> 2) as usize / 64 + 1;
    let mut bits = vec![0u64; 3 * words];
    for &h in holders {
        let slot = (h >> 2) as usize;
        let bit = 1u64 << (slot % 64);
        let base = 3 * (slot / 64);
        let medium = h & 3;
        if medium == 0 {
            bits[base] |= bit;
        }
        if medium <= 1 {
            bits[base + 1] |= bit;
        }
        bits[base + 2] |= bit;
    }
    bits
}

impl Node {
    pub(crate) fn end(&self) -> u32 {
        self.start + self.hashes.len() as u32
    }

    pub(crate) fn holds(&self, holder: HolderId) -> bool {
        self.holders.binary_search(&holder).is_ok()
    }

    /// The engine hash `holder` stored the block at `depth` under, if it holds the node.
    pub(crate) fn engine_of(&self, depth: u32, holder: HolderId) -> Option<EngineHash> {
        let pos = self.holders.binary_search(&holder).ok()?;
        Some(self.engines[pos][(depth - self.start) as usize])
    }
}

/// The arena of nodes and the map from sequence hash to block position.
#[derive(Debug, Default)]
pub(crate) struct Tree {
    nodes: Vec<Option<Node>>,
    free: Vec<NodeId>,
    blocks: FastMap<SequenceHash, BlockRef>,
}

impl Tree {
    pub(crate) fn lookup(&self, hash: SequenceHash) -> Option<BlockRef> {
        self.blocks.get(&hash).copied()
    }

    pub(crate) fn node(&self, id: NodeId) -> &Node {
        self.nodes[id as usize].as_ref().expect("live node")
    }

    pub(super) fn node_mut(&mut self, id: NodeId) -> &mut Node {
        self.nodes[id as usize].as_mut().expect("live node")
    }

    pub(crate) fn block_count(&self) -> usize {
        self.blocks.len()
    }

    pub(crate) fn node_count(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    /// Every live node id.
    pub(crate) fn node_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| n.as_ref().map(|_| i as NodeId))
    }

    /// Heap bytes held by the tree (capacity-based estimate).
    pub(crate) fn heap_bytes(&self) -> usize {
        let map = self.blocks.capacity() * (std::mem::size_of::<(SequenceHash, BlockRef)>() + 1);
        let arena = self.nodes.capacity() * std::mem::size_of::<Option<Node>>();
        let runs: usize = self
            .nodes
            .iter()
            .flatten()
            .map(|n| {
                n.hashes.capacity() * 8
                    + n.holders.capacity() * 4
                    + n.children.capacity() * 4
                    + n.engines.capacity() * std::mem::size_of::<Vec<EngineHash>>()
                    + n.engines.iter().map(|e| e.capacity() * 8).sum::<usize>()
            })
            .sum();
        map + arena + runs + self.free.capacity() * 4
    }

    /// The sequence hash of a block.
    pub(crate) fn block(&self, at: BlockRef) -> SequenceHash {
        let node = self.node(at.node);
        node.hashes[(at.depth - node.start) as usize]
    }

    /// The sequence hash of the block before `at`, `None` at depth 0.
    pub(crate) fn parent_hash(&self, at: BlockRef) -> Option<SequenceHash> {
        let node = self.node(at.node);
        if at.depth > node.start {
            Some(node.hashes[(at.depth - node.start - 1) as usize])
        } else {
            node.parent
                .map(|p| *self.node(p).hashes.last().expect("non-empty node"))
        }
    }

    pub(crate) fn holds(&self, at: BlockRef, holder: HolderId) -> bool {
        self.node(at.node).holds(holder)
    }

    pub(super) fn alloc(&mut self, node: Node) -> NodeId {
        if let Some(id) = self.free.pop() {
            self.nodes[id as usize] = Some(node);
            id
        } else {
            self.nodes.push(Some(node));
            (self.nodes.len() - 1) as NodeId
        }
    }

    pub(super) fn release(&mut self, id: NodeId) -> Node {
        self.free.push(id);
        self.nodes[id as usize].take().expect("live node")
    }

    pub(super) fn point_blocks_at(&mut self, id: NodeId) {
        let node = self.nodes[id as usize].as_ref().expect("live node");
        self.blocks.reserve(node.hashes.len());
        for (i, hash) in node.hashes.iter().enumerate() {
            self.blocks.insert(
                *hash,
                BlockRef {
                    node: id,
                    depth: node.start + i as u32,
                },
            );
        }
    }

    /// Adds `holder` to blocks `[from, to)` of node `id`, stored under `engines` (one per
    /// block). Returns how many of them `holder` did not hold before (0 or all of them); for
    /// blocks it already held, only their engine hashes are updated.
    pub(crate) fn add_holder(
        &mut self,
        id: NodeId,
        from: u32,
        to: u32,
        holder: HolderId,
        engines: &[EngineHash],
    ) -> usize {
        debug_assert_eq!(engines.len(), (to - from) as usize);
        let node = self.node_mut(id);
        if let Ok(pos) = node.holders.binary_search(&holder) {
            let offset = (from - node.start) as usize;
            node.engines[pos][offset..offset + engines.len()].copy_from_slice(engines);
            return 0;
        }
        let target = self.isolate(id, from, to);
        let node = self.node_mut(target);
        let pos = node.holders.binary_search(&holder).unwrap_err();
        node.holders.insert(pos, holder);
        node.engines.insert(pos, engines.to_vec());
        node.bits = tier_bits(&node.holders);
        self.compact(target);
        engines.len()
    }

    /// Removes `holder` from one block; returns the engine hash it held the block under.
    pub(crate) fn remove_holder(&mut self, at: BlockRef, holder: HolderId) -> Option<EngineHash> {
        if !self.holds(at, holder) {
            return None;
        }
        let target = self.isolate(at.node, at.depth, at.depth + 1);
        let node = self.node_mut(target);
        let pos = node.holders.binary_search(&holder).ok()?;
        node.holders.remove(pos);
        let engine = node.engines.remove(pos)[0];
        node.bits = tier_bits(&node.holders);
        self.tidy(target);
        Some(engine)
    }

    /// Removes `holder` from every node it is on. `nodes` names those nodes by one of their
    /// blocks' hashes, which stays valid while earlier nodes are merged or freed.
    pub(crate) fn remove_holder_everywhere(&mut self, nodes: &[SequenceHash], holder: HolderId) {
        for hash in nodes {
            if let Some(at) = self.lookup(*hash) {
                let node = self.node_mut(at.node);
                if let Ok(pos) = node.holders.binary_search(&holder) {
                    node.holders.remove(pos);
                    node.engines.remove(pos);
                    node.bits = tier_bits(&node.holders);
                }
            }
        }
        for hash in nodes {
            if let Some(at) = self.lookup(*hash) {
                self.tidy(at.node);
            }
        }
    }

    /// Appends new blocks (none of them in the tree) after `parent`, held by `holder` under
    /// `engines` (one per block).
    pub(crate) fn append(
        &mut self,
        parent: Option<BlockRef>,
        hashes: &[SequenceHash],
        engines: &[EngineHash],
        holder: HolderId,
    ) {
        debug_assert_eq!(hashes.len(), engines.len());
        if hashes.is_empty() {
            return;
        }
        let (parent_node, start) = match parent {
            None => (None, 0),
            Some(at) => {
                let mut pid = at.node;
                if at.depth + 1 < self.node(pid).end() {
                    pid = self.split_at(pid, at.depth + 1).0;
                }
                let p = self.node(pid);
                if p.children.is_empty() && p.holders.len() == 1 && p.holders[0] == holder {
                    // Leaf extension: the run simply grows.
                    let first = p.hashes.len();
                    let base = p.start;
                    self.blocks.reserve(hashes.len());
                    let p = self.nodes[pid as usize].as_mut().expect("live node");
                    p.hashes.extend_from_slice(hashes);
                    p.engines[0].extend_from_slice(engines);
                    for (i, hash) in hashes.iter().enumerate() {
                        let depth = base + (first + i) as u32;
                        self.blocks.insert(*hash, BlockRef { node: pid, depth });
                    }
                    return;
                }
                (Some(pid), at.depth + 1)
            }
        };
        let id = self.alloc(Node {
            parent: parent_node,
            start,
            hashes: hashes.to_vec(),
            holders: vec![holder],
            engines: vec![engines.to_vec()],
            bits: tier_bits(&[holder]),
            children: Vec::new(),
        });
        if let Some(p) = parent_node {
            self.node_mut(p).children.push(id);
        }
        self.point_blocks_at(id);
    }
}
