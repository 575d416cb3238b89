//! Reshaping the tree: splitting a node where holders diverge, merging a node into its only
//! child when they have the same holders again, and deleting empty leaves.

use super::{BlockRef, Node, NodeId, Tree};

impl Tree {
    fn replace_child(&mut self, parent: Option<NodeId>, old: NodeId, new: NodeId) {
        if let Some(p) = parent {
            let children = &mut self.node_mut(p).children;
            if let Some(slot) = children.iter_mut().find(|c| **c == old) {
                *slot = new;
            }
        }
    }

    fn detach_child(&mut self, parent: Option<NodeId>, child: NodeId) {
        if let Some(p) = parent {
            let children = &mut self.node_mut(p).children;
            if let Some(i) = children.iter().position(|c| *c == child) {
                children.swap_remove(i);
            }
        }
    }

    /// Splits `id` so that one node ends just before `depth` and another starts at it; returns
    /// (head, tail). `depth` must be strictly inside the node.
    pub(super) fn split_at(&mut self, id: NodeId, depth: u32) -> (NodeId, NodeId) {
        let (start, len) = {
            let n = self.node(id);
            (n.start, n.hashes.len() as u32)
        };
        debug_assert!(depth > start && depth < start + len);
        let k = (depth - start) as usize;
        if k <= len as usize - k {
            // Move the head into a new node; `id` keeps the tail and its children.
            let n = self.node_mut(id);
            let head = Node {
                parent: n.parent,
                start,
                hashes: n.hashes.drain(..k).collect(),
                holders: n.holders.clone(),
                engines: n
                    .engines
                    .iter_mut()
                    .map(|e| e.drain(..k).collect())
                    .collect(),
                bits: n.bits.clone(),
                children: vec![id],
            };
            n.start = depth;
            let old_parent = n.parent;
            let head_id = self.alloc(head);
            self.node_mut(id).parent = Some(head_id);
            self.replace_child(old_parent, id, head_id);
            self.point_blocks_at(head_id);
            (head_id, id)
        } else {
            let n = self.node_mut(id);
            let tail = Node {
                parent: Some(id),
                start: depth,
                hashes: n.hashes.split_off(k),
                holders: n.holders.clone(),
                engines: n.engines.iter_mut().map(|e| e.split_off(k)).collect(),
                bits: n.bits.clone(),
                children: std::mem::take(&mut n.children),
            };
            let tail_id = self.alloc(tail);
            self.node_mut(id).children = vec![tail_id];
            let grandchildren = self.node(tail_id).children.clone();
            for c in grandchildren {
                self.node_mut(c).parent = Some(tail_id);
            }
            self.point_blocks_at(tail_id);
            (id, tail_id)
        }
    }

    /// Splits as needed so that blocks `[from, to)` of node `id` form one node; returns it.
    pub(super) fn isolate(&mut self, id: NodeId, from: u32, to: u32) -> NodeId {
        let mut cur = id;
        if from > self.node(cur).start {
            cur = self.split_at(cur, from).1;
        }
        if to < self.node(cur).end() {
            cur = self.split_at(cur, to).0;
        }
        cur
    }

    /// Merges `parent` with its only child when both have the same holders. Returns the survivor.
    fn merge_down(&mut self, parent: NodeId) -> NodeId {
        let child = {
            let p = self.node(parent);
            if p.children.len() != 1 {
                return parent;
            }
            let c = p.children[0];
            if self.node(c).holders != p.holders {
                return parent;
            }
            c
        };
        if self.node(parent).hashes.len() >= self.node(child).hashes.len() {
            let c = self.release(child);
            for &g in &c.children {
                self.node_mut(g).parent = Some(parent);
            }
            let p = self.node_mut(parent);
            let first_new = p.hashes.len();
            p.hashes.extend_from_slice(&c.hashes);
            for (pe, ce) in p.engines.iter_mut().zip(&c.engines) {
                pe.extend_from_slice(ce);
            }
            p.children = c.children;
            let start = p.start;
            for (i, hash) in c.hashes.iter().enumerate() {
                let depth = start + (first_new + i) as u32;
                self.blocks.insert(
                    *hash,
                    BlockRef {
                        node: parent,
                        depth,
                    },
                );
            }
            parent
        } else {
            let p = self.release(parent);
            let c = self.node_mut(child);
            c.hashes.splice(0..0, p.hashes.iter().copied());
            for (ce, pe) in c.engines.iter_mut().zip(&p.engines) {
                ce.splice(0..0, pe.iter().copied());
            }
            c.start = p.start;
            c.parent = p.parent;
            self.replace_child(p.parent, parent, child);
            for (i, hash) in p.hashes.iter().enumerate() {
                self.blocks.insert(
                    *hash,
                    BlockRef {
                        node: child,
                        depth: p.start + i as u32,
                    },
                );
            }
            child
        }
    }

    /// Restores path compression around `id` after its holders changed.
    pub(super) fn compact(&mut self, id: NodeId) {
        let mut cur = id;
        if let Some(p) = self.node(id).parent {
            let parent = self.node(p);
            if parent.children.len() == 1 && parent.holders == self.node(id).holders {
                cur = self.merge_down(p);
            }
        }
        self.merge_down(cur);
    }

    /// Deletes `id` if it is empty and childless (and then its ancestors likewise), else
    /// restores compression around it.
    pub(super) fn tidy(&mut self, id: NodeId) {
        let mut cur = id;
        loop {
            let (empty_leaf, parent) = {
                let n = self.node(cur);
                (n.holders.is_empty() && n.children.is_empty(), n.parent)
            };
            if !empty_leaf {
                self.compact(cur);
                return;
            }
            let node = self.release(cur);
            for hash in &node.hashes {
                self.blocks.remove(hash);
            }
            self.detach_child(parent, cur);
            match parent {
                Some(p) => cur = p,
                None => return,
            }
        }
    }
}
