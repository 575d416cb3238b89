//! Overlap queries: how many leading blocks of a prompt each rank already holds, per tier.

use super::tree::Tree;
use super::PrefixIndex;
use crate::ids::{SequenceHash, WorkerRank};
use crate::sorted::SortedWalk;
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

    /// [`OverlapScores::get`] for ranks asked in ascending order (as the router asks its
    /// candidates), by one forward walk.
    pub fn walk(&self) -> impl FnMut(WorkerRank) -> TierOverlap + '_ {
        let mut walk = SortedWalk::new(&self.ranks, |r| r.rank);
        move |rank| walk.find(rank).map(|r| r.overlap).unwrap_or_default()
    }

    /// Combines two results rank by rank: each tier's run is counted beyond the faster tiers, so
    /// the longer GPU prefix is kept, and each lower tier extends the longer of the two runs
    /// available down to it (an event-fed 2 on GPU + 8 on CPU and a predicted 10 on GPU make
    /// 10 on GPU, not 10 + 8).
    pub fn max_with(&self, other: &OverlapScores) -> OverlapScores {
        let mut out = Vec::with_capacity(self.ranks.len() + other.ranks.len());
        let (mut i, mut j) = (0, 0);
        while i < self.ranks.len() || j < other.ranks.len() {
            let a = self.ranks.get(i);
            let b = other.ranks.get(j);
            match (a, b) {
                (Some(a), Some(b)) if a.rank == b.rank => {
                    let (x, y) = (a.overlap, b.overlap);
                    let gpu = x.gpu_blocks.max(y.gpu_blocks);
                    let to_cpu = (x.gpu_blocks + x.cpu_blocks).max(y.gpu_blocks + y.cpu_blocks);
                    let to_disk = x.total_blocks().max(y.total_blocks());
                    let overlap = TierOverlap {
                        gpu_blocks: gpu,
                        cpu_blocks: to_cpu - gpu,
                        disk_blocks: to_disk - to_cpu,
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

impl PrefixIndex {
    /// For a prompt given as router sequence hashes, how many leading blocks each rank holds,
    /// per tier. Costs one map probe per tree node on the matched path plus a slice comparison,
    /// not one probe per block.
    pub fn find_matches(&self, query: &[SequenceHash]) -> OverlapScores {
        let tree: &Tree = &self.tree;
        // Per tier (GPU, GPU∪CPU, any), the slots still matching, as bitsets; a slot's depth in a
        // tier is the position where it dropped out of that tier's set.
        let mut alive: Vec<u64> = Vec::new();
        let mut ends: Vec<[u32; 3]> = Vec::new();
        let mut pos = 0usize;
        let mut initial: Vec<u64> = Vec::new();
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
            if pos == 0 {
                alive = node.bits.clone();
                initial = node.bits.clone();
                ends = vec![[u32::MAX; 3]; self.ranks.len()];
            }
            let mut any_alive = false;
            for (i, word) in alive.iter_mut().enumerate() {
                let keep = node.bits.get(i).copied().unwrap_or(0);
                let mut dropped = *word & !keep;
                while dropped != 0 {
                    let bit = dropped.trailing_zeros();
                    dropped &= dropped - 1;
                    let slot = (i / 3) as u32 * 64 + bit;
                    let tier = i % 3;
                    ends[slot as usize][tier] = pos as u32;
                }
                *word &= keep;
                any_alive |= *word != 0;
            }
            pos += matched;
            if !any_alive || matched < run.len() {
                break;
            }
        }
        let end_of = |slot: u32, tier: usize| -> u32 {
            let word = 3 * (slot / 64) as usize + tier;
            if initial[word] & (1u64 << (slot % 64)) == 0 {
                return 0;
            }
            match ends[slot as usize][tier] {
                u32::MAX => pos as u32,
                end => end,
            }
        };
        // Sized up front (one entry per slot holding the first block in any tier): growing by
        // pushes reallocates a few times per query.
        let holders = initial.iter().skip(2).step_by(3);
        let mut ranks = Vec::with_capacity(holders.clone().map(|w| w.count_ones() as usize).sum());
        for (w, word) in holders.enumerate() {
            let mut bits = *word;
            while bits != 0 {
                let slot = w as u32 * 64 + bits.trailing_zeros();
                bits &= bits - 1;
                let depth = [end_of(slot, 0), end_of(slot, 1), end_of(slot, 2)];
                if depth[2] == 0 {
                    continue;
                }
                let Some(state) = self.ranks[slot as usize].as_ref() else {
                    continue;
                };
                let overlap = TierOverlap {
                    gpu_blocks: depth[0],
                    cpu_blocks: depth[1] - depth[0],
                    disk_blocks: depth[2] - depth[1],
                };
                ranks.push(RankOverlap {
                    rank: state.rank,
                    overlap,
                });
            }
        }
        ranks.sort_by_key(|r| r.rank);
        OverlapScores { ranks }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::WorkerId;

    fn scores(rank: u64, gpu: u32, cpu: u32, disk: u32) -> OverlapScores {
        OverlapScores {
            ranks: vec![RankOverlap {
                rank: WorkerRank::new(WorkerId(rank), 0),
                overlap: TierOverlap {
                    gpu_blocks: gpu,
                    cpu_blocks: cpu,
                    disk_blocks: disk,
                },
            }],
        }
    }

    #[test]
    fn combined_tiers_count_each_run_beyond_the_faster_ones() {
        // Events: 2 on GPU, 8 more on CPU; predicted: 10 on GPU. Ten blocks, all on the GPU.
        let both = scores(1, 2, 8, 0).max_with(&scores(1, 10, 0, 0));
        assert_eq!(both, scores(1, 10, 0, 0));
        // Events reach further on CPU and disk than the predicted GPU run.
        let both = scores(1, 2, 8, 5).max_with(&scores(1, 4, 0, 0));
        assert_eq!(both, scores(1, 4, 6, 5));
        assert_eq!(both.ranks[0].overlap.total_blocks(), 15);
        // Ranks held by one side only pass through, in rank order.
        let mut other = scores(0, 3, 0, 0);
        other.ranks.extend(scores(2, 1, 1, 1).ranks);
        let merged = scores(1, 5, 0, 0).max_with(&other);
        let ranks: Vec<u64> = merged.ranks.iter().map(|r| r.rank.worker.0).collect();
        assert_eq!(ranks, [0, 1, 2]);
    }
}
