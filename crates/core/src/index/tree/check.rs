//! The tree's structural invariants, checked by tests and `check_invariants`.

use super::{tier_bits, BlockRef, Tree};

impl Tree {
    /// Checks the structural invariants; returns a description of the first violation.
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut mapped = 0usize;
        for id in self.node_ids() {
            let n = self.node(id);
            if n.hashes.is_empty() {
                return Err(format!("node {id} has an empty run"));
            }
            if n.engines.len() != n.holders.len()
                || n.engines.iter().any(|e| e.len() != n.hashes.len())
            {
                return Err(format!(
                    "node {id} engine hashes do not match its holders and run"
                ));
            }
            if !n.holders.windows(2).all(|w| w[0] < w[1]) {
                return Err(format!("node {id} holders not sorted and unique"));
            }
            if n.bits != tier_bits(&n.holders) {
                return Err(format!("node {id} tier bits are stale"));
            }
            if n.holders.is_empty() && n.children.is_empty() {
                return Err(format!("node {id} is an empty leaf"));
            }
            match n.parent {
                None if n.start != 0 => return Err(format!("root-level node {id} at depth > 0")),
                Some(p) => {
                    let pn = self.nodes.get(p as usize).and_then(Option::as_ref);
                    let Some(pn) = pn else {
                        return Err(format!("node {id} has a dead parent"));
                    };
                    if !pn.children.contains(&id) || pn.end() != n.start {
                        return Err(format!("node {id} is not attached to its parent {p}"));
                    }
                    if pn.children.len() == 1 && pn.holders == n.holders {
                        return Err(format!("node {id} should have been merged into {p}"));
                    }
                }
                None => {}
            }
            for &c in &n.children {
                if self
                    .nodes
                    .get(c as usize)
                    .and_then(Option::as_ref)
                    .map(|c| c.parent)
                    != Some(Some(id))
                {
                    return Err(format!("child {c} of {id} does not point back"));
                }
            }
            for (i, hash) in n.hashes.iter().enumerate() {
                let want = BlockRef {
                    node: id,
                    depth: n.start + i as u32,
                };
                if self.blocks.get(hash) != Some(&want) {
                    return Err(format!("block {hash} of node {id} is mis-mapped"));
                }
                mapped += 1;
            }
        }
        if mapped != self.blocks.len() {
            return Err(format!(
                "{} blocks mapped, {mapped} in nodes",
                self.blocks.len()
            ));
        }
        Ok(())
    }
}
