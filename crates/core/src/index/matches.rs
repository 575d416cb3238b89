//! Overlap queries: how many leading blocks of a prompt each rank already holds, per tier.

use super::tree::Tree;
use super::{holder_medium, holder_slot, PrefixIndex};
use crate::event::Medium;
use crate::ids::{SequenceHash, WorkerRank};
use serde::{Deserialize, Serialize};

/// How much of a prompt's prefix a rank can reuse, in blocks.
///
/// `gpu_blocks` is the number of leading blocks held on the GPU. `cpu_blocks` counts the blocks
/// that continue that prefix in host memory (held on CPU or GPU, beyond the GPU prefix), and
/// `disk_blocks` those that continue it further in any tier. So the leading run available in
/// some tier is `gpu_blocks + cpu_blocks + disk_blocks`, and lower tiers count only beyond the
/// faster ones.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierOverlap {
    /// Leading blocks on the GPU.
    pub gpu_blocks: u32,
    /// Blocks beyond the GPU prefix available from host memory.
    pub cpu_blocks: u32,
    /// Blocks beyond that available from disk or remote storage.
    pub disk_blocks: u32,
}

impl TierOverlap {
    /// Leading blocks available in some tier.
    pub fn total_blocks(&self) -> u32 {
        self.gpu_blocks + self.cpu_blocks + self.disk_blocks
    }
}

/// One rank's overlap.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankOverlap {
    /// The rank.
    pub rank: WorkerRank,
    /// Its overlap.
    pub overlap: TierOverlap,
}

/// The result of [`PrefixIndex::find_matches`]: every rank holding at least the first block,
/// sorted by rank.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OverlapScores {
    /// Ranks with a non-empty overlap, sorted by rank.
    pub ranks: Vec<RankOverlap>,
}

impl OverlapScores {
    /// The overlap of `rank` (zero when it holds nothing).
    pub fn get(&self, rank: WorkerRank) -> TierOverlap {
        self.ranks
            .binary_search_by(|r| r.rank.cmp(&rank))
            .map(|i| self.ranks[i].overlap)
            .unwrap_or_default()
    }

    /// Combines two results rank by rank, keeping the larger value of each tier.
    pub fn max_with(&self, other: &OverlapScores) -> OverlapScores {
        let mut out = Vec::with_capacity(self.ranks.len() + other.ranks.len());
        let (mut i, mut j) = (0, 0);
        while i < self.ranks.len() || j < other.ranks.len() {
            let a = self.ranks.get(i);
            let b = other.ranks.get(j);
            match (a, b) {
                (Some(a), Some(b)) if a.rank == b.rank => {
                    let overlap = TierOverlap {
                        gpu_blocks: a.overlap.gpu_blocks.max(b.overlap.gpu_blocks),
                        cpu_blocks: a.overlap.cpu_blocks.max(b.overlap.cpu_blocks),
                        disk_blocks: a.overlap.disk_blocks.max(b.overlap.disk_blocks),
                    };
                    out.push(RankOverlap {
                        rank: a.rank,
                        overlap,
                    });
                    i += 1;
                    j += 1;
                }
                (Some(a), Some(b)) if a.rank < b.rank => {
                    out.push(*a);
                    i += 1;
                }
                (Some(a), None) => {
                    out.push(*a);
                    i += 1;
                }
                (_, Some(b)) => {
                    out.push(*b);
                    j += 1;
                }
                (None, None) => break,
            }
        }
        OverlapScores { ranks: out }
    }
}

/// A rank still matching during the walk: prefix depths for GPU, GPU∪CPU and any tier.
#[derive(Clone, Copy)]
struct Walker {
    slot: u32,
    depth: [u32; 3],
    alive: [bool; 3],
}

impl Walker {
    /// Extends by `blocks` given the tiers present at this node (`mask` bit per medium).
    fn advance(&mut self, mask: u8, blocks: u32) {
        let gpu = mask & 1 != 0;
        let host = mask & 0b11 != 0;
        let any = mask != 0;
        for (k, present) in [gpu, host, any].into_iter().enumerate() {
            if self.alive[k] {
                if present {
                    self.depth[k] += blocks;
                } else {
                    self.alive[k] = false;
                }
            }
        }
    }

    fn overlap(&self) -> TierOverlap {
        TierOverlap {
            gpu_blocks: self.depth[0],
            cpu_blocks: self.depth[1] - self.depth[0],
            disk_blocks: self.depth[2] - self.depth[1],
        }
    }
}

fn medium_bit(medium: Medium) -> u8 {
    1 << medium.index()
}

impl PrefixIndex {
    /// For a prompt given as router sequence hashes, how many leading blocks each rank holds,
    /// per tier. Costs one map probe per tree node on the matched path plus a slice comparison,
    /// not one probe per block.
    pub fn find_matches(&self, query: &[SequenceHash]) -> OverlapScores {
        let mut walkers: Vec<Walker> = Vec::new();
        let mut done: Vec<Walker> = Vec::new();
        let tree: &Tree = &self.tree;
        let mut pos = 0usize;
        let mut first = true;
        while pos < query.len() {
            let Some(at) = tree.lookup(query[pos]) else {
                break;
            };
            if at.depth as usize != pos {
                break;
            }
            let node = tree.node(at.node);
            let offset = (at.depth - node.start) as usize;
            let run = &node.hashes[offset..];
            let rest = &query[pos..];
            let matched = run.iter().zip(rest).take_while(|(a, b)| a == b).count();
            if first {
                first = false;
                for &h in &node.holders {
                    let slot = holder_slot(h);
                    if walkers.last().map(|w| w.slot) != Some(slot) {
                        walkers.push(Walker {
                            slot,
                            depth: [0; 3],
                            alive: [true; 3],
                        });
                    }
                }
            }
            // Both lists are sorted by slot: merge them.
            let holders = &node.holders;
            let mut hi = 0;
            walkers.retain_mut(|w| {
                while hi < holders.len() && holder_slot(holders[hi]) < w.slot {
                    hi += 1;
                }
                let mut mask = 0u8;
                while hi < holders.len() && holder_slot(holders[hi]) == w.slot {
                    mask |= medium_bit(holder_medium(holders[hi]));
                    hi += 1;
                }
                w.advance(mask, matched as u32);
                if w.alive[2] {
                    true
                } else {
                    done.push(*w);
                    false
                }
            });
            pos += matched;
            if walkers.is_empty() || matched < run.len() {
                break;
            }
        }
        done.extend(walkers);
        let mut ranks: Vec<RankOverlap> = done
            .into_iter()
            .filter(|w| w.depth[2] > 0)
            .filter_map(|w| {
                let state = self.ranks[w.slot as usize].as_ref()?;
                Some(RankOverlap {
                    rank: state.rank,
                    overlap: w.overlap(),
                })
            })
            .collect();
        ranks.sort_by_key(|r| r.rank);
        OverlapScores { ranks }
    }
}
