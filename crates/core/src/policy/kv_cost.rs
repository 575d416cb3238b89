//! The KV cost model: prefix reuse credited against projected prefill and decode work.
//!
//! Per eligible candidate, in blocks:
//! - `decay = 1 / (1 + credit_decay × excess)`, where `excess` is the candidate's active prefill
//!   tokens above the least-loaded eligible candidate's, divided by the block size and by the
//!   request's block count;
//! - `credit = overlap_credit × decay × gpu + host_weight × cpu + disk_weight × disk` (lower tiers
//!   count only beyond the GPU prefix);
//! - `prefill = prefill_load_scale × max(active prefill blocks + request blocks − credit, 0)`;
//! - `decode = active decode blocks + the request's blocks not already held by active requests`;
//! - `cost = prefill + decode + active_request_weight × active requests`.
//!
//! Temperature 0 picks the minimum (ties broken uniformly by the seeded RNG); temperature T > 0
//! samples with probability ∝ exp(−(cost − min) / ((max − min) × T)).

use super::{Candidate, CandidateScore};
use crate::rng::SeededRng;
use serde::{Deserialize, Serialize};

/// Weights of the KV cost model.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct KvCostParams {
    /// Credit per GPU-cached block (0 = load-aware only).
    pub overlap_credit: f64,
    /// How fast credit decays on a candidate with excess prefill load (0 = never).
    pub credit_decay: f64,
    /// Weight of the prefill term.
    pub prefill_load_scale: f64,
    /// Block-equivalent cost of each active request.
    pub active_request_weight: f64,
    /// Credit per block found only in host memory.
    pub host_weight: f64,
    /// Credit per block found only on disk.
    pub disk_weight: f64,
    /// Sampling temperature (0 = argmin).
    pub temperature: f64,
}

impl Default for KvCostParams {
    fn default() -> Self {
        Self {
            overlap_credit: 1.0,
            credit_decay: 0.0,
            prefill_load_scale: 1.0,
            active_request_weight: 0.0,
            host_weight: 0.75,
            disk_weight: 0.25,
            temperature: 0.0,
        }
    }
}

/// Scores every candidate. `request_tokens` is the prompt length; `block_size` > 0.
pub fn kv_scores(
    candidates: &[Candidate],
    request_tokens: u64,
    block_size: usize,
    params: &KvCostParams,
) -> Vec<CandidateScore> {
    let bs = block_size.max(1) as f64;
    let request_blocks = (request_tokens as f64 / bs).ceil();
    let min_prefill = candidates
        .iter()
        .map(|c| c.load.active_prefill_tokens)
        .min()
        .unwrap_or(0);
    candidates
        .iter()
        .map(|c| {
            let decay = if params.credit_decay > 0.0 && request_blocks > 0.0 {
                let excess = (c.load.active_prefill_tokens - min_prefill) as f64 / bs;
                1.0 / (1.0 + params.credit_decay * excess / request_blocks)
            } else {
                1.0
            };
            let credit = params.overlap_credit * decay * f64::from(c.overlap.gpu_blocks)
                + params.host_weight * f64::from(c.overlap.cpu_blocks)
                + params.disk_weight * f64::from(c.overlap.disk_blocks);
            let active_prefill_blocks = c.load.active_prefill_tokens as f64 / bs;
            let prefill = params.prefill_load_scale
                * (active_prefill_blocks + request_blocks - credit).max(0.0);
            let decode = c.load.active_decode_blocks as f64 + c.new_blocks as f64;
            let total =
                prefill + decode + params.active_request_weight * f64::from(c.load.active_requests);
            CandidateScore {
                rank: c.rank,
                overlap: c.overlap,
                credit_blocks: credit,
                prefill_blocks: prefill,
                decode_blocks: decode,
                active_requests: c.load.active_requests,
                total,
            }
        })
        .collect()
}

/// Picks an index into `scores`: argmin at temperature 0 (uniform among ties), else a softmax
/// over min-max normalised costs. `scores` must not be empty.
pub fn pick_by_cost(scores: &[CandidateScore], temperature: f64, rng: &mut SeededRng) -> usize {
    assert!(!scores.is_empty(), "pick_by_cost needs a candidate");
    let min = scores.iter().map(|s| s.total).fold(f64::INFINITY, f64::min);
    let max = scores
        .iter()
        .map(|s| s.total)
        .fold(f64::NEG_INFINITY, f64::max);
    if temperature <= 0.0 || max <= min {
        if max <= min && temperature > 0.0 {
            return rng.below(scores.len());
        }
        // Reservoir sampling over the tied minimum.
        let mut chosen = 0;
        let mut ties = 0;
        for (i, s) in scores.iter().enumerate() {
            if s.total <= min {
                ties += 1;
                if rng.below(ties) == 0 {
                    chosen = i;
                }
            }
        }
        return chosen;
    }
    let weights: Vec<f64> = scores
        .iter()
        .map(|s| (-(s.total - min) / ((max - min) * temperature)).exp())
        .collect();
    let sum: f64 = weights.iter().sum();
    let mut target = rng.unit() * sum;
    for (i, w) in weights.iter().enumerate() {
        if target < *w {
            return i;
        }
        target -= w;
    }
    scores.len() - 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{WorkerId, WorkerRank};
    use crate::index::TierOverlap;
    use crate::ledger::RankLoad;

    fn cand(w: u64, prefill_tokens: u64, decode: u64, gpu: u32, new_blocks: u64) -> Candidate {
        Candidate {
            rank: WorkerRank::new(WorkerId(w), 0),
            load: RankLoad {
                active_requests: 1,
                active_prefill_tokens: prefill_tokens,
                active_decode_blocks: decode,
            },
            overlap: TierOverlap {
                gpu_blocks: gpu,
                cpu_blocks: 0,
                disk_blocks: 0,
            },
            new_blocks,
        }
    }

    #[test]
    fn the_published_worked_example_picks_the_cheapest() {
        // (prefill 8, decode 10), (5, 5), (2, 9) blocks ⇒ costs 18, 10, 11 with a 0-block request.
        let cands = [
            cand(1, 8 * 16, 10, 0, 0),
            cand(2, 5 * 16, 5, 0, 0),
            cand(3, 2 * 16, 9, 0, 0),
        ];
        let scores = kv_scores(&cands, 0, 16, &KvCostParams::default());
        let totals: Vec<f64> = scores.iter().map(|s| s.total).collect();
        assert_eq!(totals, vec![18.0, 10.0, 11.0]);
        assert_eq!(pick_by_cost(&scores, 0.0, &mut SeededRng::new(1)), 1);
    }

    #[test]
    fn cache_credit_offsets_prefill_but_not_below_zero() {
        // A 10-block request; worker 1 holds 8 blocks, worker 2 none.
        let cands = [cand(1, 0, 0, 8, 2), cand(2, 0, 0, 0, 10)];
        let scores = kv_scores(&cands, 160, 16, &KvCostParams::default());
        assert_eq!(scores[0].prefill_blocks, 2.0);
        assert_eq!(scores[0].decode_blocks, 2.0);
        assert_eq!(scores[1].prefill_blocks, 10.0);
        assert_eq!(scores[1].total, 20.0);
        let over = [cand(1, 0, 0, 30, 0)];
        assert_eq!(
            kv_scores(&over, 160, 16, &KvCostParams::default())[0].prefill_blocks,
            0.0
        );
    }

    #[test]
    fn lower_tiers_earn_their_weights() {
        let mut c = cand(1, 0, 0, 2, 0);
        c.overlap.cpu_blocks = 4;
        c.overlap.disk_blocks = 4;
        let s = kv_scores(&[c], 160, 16, &KvCostParams::default());
        assert_eq!(s[0].credit_blocks, 2.0 + 3.0 + 1.0);
    }

    #[test]
    fn decay_halves_credit_at_one_request_of_excess_prefill() {
        let params = KvCostParams {
            credit_decay: 1.0,
            ..KvCostParams::default()
        };
        // 10-block request; worker 1 carries 10 blocks more prefill than worker 2.
        let cands = [cand(1, 160, 0, 8, 0), cand(2, 0, 0, 0, 0)];
        let s = kv_scores(&cands, 160, 16, &params);
        assert_eq!(s[0].credit_blocks, 4.0);
        assert_eq!(s[1].credit_blocks, 0.0);
    }

    #[test]
    fn active_request_weight_adds_per_request_cost() {
        let params = KvCostParams {
            active_request_weight: 3.0,
            ..KvCostParams::default()
        };
        let s = kv_scores(&[cand(1, 0, 0, 0, 0)], 0, 16, &params);
        assert_eq!(s[0].total, 3.0);
    }

    #[test]
    fn ties_are_broken_by_the_seeded_rng_uniformly() {
        let cands = [
            cand(1, 0, 0, 0, 0),
            cand(2, 0, 0, 0, 0),
            cand(3, 0, 0, 0, 0),
        ];
        let scores = kv_scores(&cands, 16, 16, &KvCostParams::default());
        let mut rng = SeededRng::new(3);
        let mut counts = [0; 3];
        for _ in 0..3000 {
            counts[pick_by_cost(&scores, 0.0, &mut rng)] += 1;
        }
        assert!(counts.iter().all(|c| (800..1200).contains(c)), "{counts:?}");
    }

    #[test]
    fn temperature_prefers_cheaper_candidates_but_explores() {
        let cands = [cand(1, 0, 0, 0, 0), cand(2, 16 * 10, 0, 0, 0)];
        let scores = kv_scores(&cands, 16, 16, &KvCostParams::default());
        let mut rng = SeededRng::new(5);
        let mut counts = [0; 2];
        for _ in 0..10_000 {
            counts[pick_by_cost(&scores, 1.0, &mut rng)] += 1;
        }
        // p(cheap) = 1 / (1 + e^-1) ≈ 0.731.
        assert!((7000..7600).contains(&counts[0]), "{counts:?}");
    }
}
