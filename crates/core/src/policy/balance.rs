//! Load-balancing policies that ignore cache state.

use super::Candidate;
use crate::rng::SeededRng;

/// The next index in rotation: `cursor` modulo the number of candidates.
pub fn round_robin(len: usize, cursor: usize) -> usize {
    cursor % len.max(1)
}

/// A uniformly random index.
pub fn random_pick(len: usize, rng: &mut SeededRng) -> usize {
    rng.below(len)
}

/// The candidate with the fewest active requests, ties broken uniformly at random.
pub fn least_loaded(candidates: &[Candidate], rng: &mut SeededRng) -> usize {
    let min = candidates
        .iter()
        .map(|c| c.load.active_requests)
        .min()
        .unwrap_or(0);
    let mut chosen = 0;
    let mut ties = 0;
    for (i, c) in candidates.iter().enumerate() {
        if c.load.active_requests == min {
            ties += 1;
            if rng.below(ties) == 0 {
                chosen = i;
            }
        }
    }
    chosen
}

/// Two distinct random candidates; the one with fewer active requests wins (the first on a tie).
pub fn power_of_two(candidates: &[Candidate], rng: &mut SeededRng) -> usize {
    if candidates.len() < 2 {
        return 0;
    }
    let a = rng.below(candidates.len());
    let mut b = rng.below(candidates.len() - 1);
    if b >= a {
        b += 1;
    }
    if candidates[b].load.active_requests < candidates[a].load.active_requests {
        b
    } else {
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{WorkerId, WorkerRank};
    use crate::ledger::RankLoad;

    fn cands(active: &[u32]) -> Vec<Candidate> {
        active
            .iter()
            .enumerate()
            .map(|(i, &a)| Candidate {
                rank: WorkerRank::new(WorkerId(i as u64), 0),
                load: RankLoad {
                    active_requests: a,
                    ..RankLoad::default()
                },
                overlap: Default::default(),
                new_blocks: 0,
            })
            .collect()
    }

    #[test]
    fn round_robin_cycles() {
        let picks: Vec<usize> = (0..5).map(|c| round_robin(3, c)).collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1]);
    }

    #[test]
    fn least_loaded_picks_the_minimum_and_spreads_ties() {
        let mut rng = SeededRng::new(1);
        assert_eq!(least_loaded(&cands(&[3, 1, 2]), &mut rng), 1);
        let c = cands(&[1, 0, 0]);
        let mut seen = [0; 3];
        for _ in 0..1000 {
            seen[least_loaded(&c, &mut rng)] += 1;
        }
        assert_eq!(seen[0], 0);
        assert!(seen[1] > 400 && seen[2] > 400, "{seen:?}");
    }

    #[test]
    fn power_of_two_never_picks_the_most_loaded_of_two() {
        let mut rng = SeededRng::new(9);
        let c = cands(&[5, 0]);
        for _ in 0..100 {
            assert_eq!(power_of_two(&c, &mut rng), 1);
        }
        // With three candidates the most loaded can only win if drawn against itself: never.
        let c = cands(&[9, 1, 1]);
        for _ in 0..100 {
            assert_ne!(power_of_two(&c, &mut rng), 0);
        }
        assert_eq!(power_of_two(&cands(&[4]), &mut rng), 0);
    }

    #[test]
    fn random_covers_every_candidate() {
        let mut rng = SeededRng::new(2);
        let mut seen = [false; 4];
        for _ in 0..200 {
            seen[random_pick(4, &mut rng)] = true;
        }
        assert!(seen.iter().all(|s| *s));
    }
}
