//! Applying KV events to the index: `Stored` (the chain walk, the tree inserts and the per-rank
//! bookkeeping), `Removed` and `Cleared`. [`PrefixIndex::apply`] dispatches here; the module docs
//! of `index` state the semantics.

use super::tree::{BlockRef, HolderId};
use super::{holder_id, IndexError, PrefixIndex, Scratch, SCRATCH_KEPT_BLOCKS};
use crate::event::{BlockContent, Medium, StoredBlock};
use crate::fast_map::FastSet;
use crate::hashing::{chain, HashNamespace, BASE_SEED};
use crate::ids::{ContentHash, EngineHash, SequenceHash, WorkerRank};
use std::ops::Range;

impl PrefixIndex {
    pub(super) fn store(
        &mut self,
        rank: WorkerRank,
        parent: Option<EngineHash>,
        blocks: &[StoredBlock],
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
    pub(super) fn bookkeep(
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
    pub(super) fn insert_chain(
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

    pub(super) fn remove(
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
    pub(super) fn clear_rank(&mut self, rank: WorkerRank) {
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
}
