//! Dumping the index as events, and comparable snapshots.
//!
//! `dump()` returns events that rebuild an equal index when replayed into an empty one: for each
//! rank and tier, its blocks in depth order, each stored under its engine hash with its parent's.
//! A held block whose parent the rank does not hold (a hole left by an out-of-order eviction) is
//! reached through temporary stand-in blocks that a final `Removed` takes away again. Blocks are
//! carried as their router sequence hashes (`BlockContent::Sequence`), so the tree keeps no token
//! or content data.

use super::{holder_id, PrefixIndex};
use crate::event::{BlockContent, KvEvent, Medium, StoredBlock};
use crate::fast_map::{FastMap, FastSet};
use crate::hashing::HashNamespace;
use crate::ids::{EngineHash, SequenceHash, WorkerRank};
use std::collections::{BTreeMap, BTreeSet};

/// One block in a snapshot: parent, depth and the (rank, tier) pairs holding it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotBlock {
    /// The block before it.
    pub parent: Option<SequenceHash>,
    /// Its depth (0 = first block of a prompt).
    pub depth: u32,
    /// Who holds it.
    pub holders: BTreeSet<(WorkerRank, Medium)>,
}

/// A canonical, comparable picture of an index: blocks with their position and holders, and the
/// engine hashes that reach held blocks. Two indexes with equal snapshots answer every query and
/// every future event the same way.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IndexSnapshot {
    /// Every block of the tree.
    pub blocks: BTreeMap<SequenceHash, SnapshotBlock>,
    /// (rank, tier, engine hash, block) for every engine hash that reaches a held block.
    pub engine: BTreeSet<(WorkerRank, Medium, EngineHash, SequenceHash)>,
}

impl PrefixIndex {
    /// A comparable snapshot.
    pub fn snapshot(&self) -> IndexSnapshot {
        let mut snap = IndexSnapshot::default();
        for id in self.tree.node_ids() {
            let node = self.tree.node(id);
            let holders: BTreeSet<(WorkerRank, Medium)> = node
                .holders
                .iter()
                .filter_map(|&h| {
                    let state = self.ranks[super::holder_slot(h) as usize].as_ref()?;
                    Some((state.rank, super::holder_medium(h)))
                })
                .collect();
            for (i, &seq) in node.hashes.iter().enumerate() {
                let depth = node.start + i as u32;
                let at = super::tree::BlockRef { node: id, depth };
                let parent = self.tree.parent_hash(at);
                snap.blocks.insert(
                    seq,
                    SnapshotBlock {
                        parent,
                        depth,
                        holders: holders.clone(),
                    },
                );
            }
        }
        for (slot, state) in self.ranks.iter().enumerate() {
            let Some(state) = state else { continue };
            for medium in Medium::ALL {
                let holder = holder_id(slot as u32, medium);
                for (&eh, &seq) in &state.engine[medium.index()] {
                    let held = self
                        .tree
                        .lookup(seq)
                        .is_some_and(|at| self.tree.holds(at, holder));
                    if held {
                        snap.engine.insert((state.rank, medium, eh, seq));
                    }
                }
            }
        }
        snap
    }

    /// Events that rebuild this index from empty. They may stand in for ancestors a rank does
    /// not hold (removing them at the end), so replay them into an index without capacities and
    /// set those afterwards.
    pub fn dump(&self) -> Vec<KvEvent> {
        let mut events = Vec::new();
        let mut slots: Vec<(WorkerRank, u32)> = self.slots.iter().map(|(r, s)| (*r, *s)).collect();
        slots.sort();
        for (rank, slot) in slots {
            for medium in Medium::ALL {
                self.dump_holder(rank, slot, medium, &mut events);
            }
        }
        events
    }

    fn dump_holder(&self, rank: WorkerRank, slot: u32, medium: Medium, out: &mut Vec<KvEvent>) {
        let holder = holder_id(slot, medium);
        let state = self.ranks[slot as usize].as_ref().expect("live slot");
        let engine = &state.engine[medium.index()];
        let mut held: Vec<(u32, SequenceHash, EngineHash)> = engine
            .iter()
            .filter_map(|(&eh, &seq)| {
                let at = self.tree.lookup(seq)?;
                self.tree.holds(at, holder).then_some((at.depth, seq, eh))
            })
            .collect();
        if held.is_empty() {
            return;
        }
        held.sort();
        let mut used: FastSet<EngineHash> = engine.keys().copied().collect();
        let mut emitted: FastMap<SequenceHash, EngineHash> = FastMap::default();
        let mut stand_ins = Vec::new();
        let store =
            |parent: Option<EngineHash>, eh: EngineHash, seq: SequenceHash| KvEvent::Stored {
                worker: rank.worker,
                dp_rank: rank.dp_rank,
                parent,
                blocks: vec![StoredBlock {
                    engine_hash: eh,
                    content: BlockContent::Sequence(seq),
                }],
                block_size: self.block_size,
                medium,
                namespace: HashNamespace::none(),
            };
        for (_, seq, eh) in held {
            let at = self.tree.lookup(seq).expect("held block is in the tree");
            // Make sure the parent chain is reachable, standing in for blocks not held.
            let parent_eh = match self.tree.parent_hash(at) {
                None => None,
                Some(parent) => {
                    let mut missing = Vec::new();
                    let mut cur = Some(parent);
                    while let Some(p) = cur {
                        if emitted.contains_key(&p) {
                            break;
                        }
                        missing.push(p);
                        cur = self
                            .tree
                            .parent_hash(self.tree.lookup(p).expect("ancestor"));
                    }
                    for p in missing.into_iter().rev() {
                        let p_at = self.tree.lookup(p).expect("ancestor");
                        let grand = self.tree.parent_hash(p_at).map(|g| emitted[&g]);
                        let mut fake = EngineHash(p.0 ^ 0xD1B5_4A32_D192_ED03);
                        while !used.insert(fake) {
                            fake = EngineHash(fake.0.wrapping_add(1));
                        }
                        out.push(store(grand, fake, p));
                        emitted.insert(p, fake);
                        stand_ins.push(fake);
                    }
                    Some(emitted[&parent])
                }
            };
            out.push(store(parent_eh, eh, seq));
            emitted.entry(seq).or_insert(eh);
        }
        if !stand_ins.is_empty() {
            out.push(KvEvent::Removed {
                worker: rank.worker,
                dp_rank: rank.dp_rank,
                engine_hashes: stand_ins,
                medium,
            });
        }
    }
}

impl PartialEq for PrefixIndex {
    /// Indexes are equal when their block size and snapshots are.
    fn eq(&self, other: &Self) -> bool {
        self.block_size == other.block_size && self.snapshot() == other.snapshot()
    }
}
