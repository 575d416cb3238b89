//! The planner's search: the smallest worker count whose simulated cost (TTFT p99, RL step time)
//! meets a target. Pure: the caller evaluates a batch of counts (in parallel, with the
//! simulator) and this module decides which counts to try, never the same count twice.
//!
//! Bracketing doubles the count from `min` until one meets the target (or `max` fails), then a
//! k-ary search (k = `jobs`; binary with one job) narrows the gap between the largest failing
//! and the smallest passing count. Each batch has at most `jobs` counts, so one batch is one
//! round of parallel runs. The cost is assumed to fall (weakly) as workers are added.

use std::collections::BTreeMap;

/// What a search found.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The smallest count that meets the target, `None` if even `max` does not.
    pub workers: Option<usize>,
    /// Every count evaluated, ascending, with its cost.
    pub points: Vec<(usize, f64)>,
    /// Number of batches (rounds of parallel runs).
    pub rounds: usize,
}

/// Searches `min..=max` for the smallest count with `cost <= target`. `eval` gets a batch of
/// distinct, not yet evaluated counts (at most `jobs`) and returns their costs in order.
pub fn search<E, F>(
    min: usize,
    max: usize,
    jobs: usize,
    target: f64,
    mut eval: F,
) -> Result<Plan, E>
where
    F: FnMut(&[usize]) -> Result<Vec<f64>, E>,
{
    let min = min.max(1);
    let jobs = jobs.max(1);
    let mut cache: BTreeMap<usize, f64> = BTreeMap::new();
    let mut rounds = 0;
    let mut run = |batch: Vec<usize>, cache: &mut BTreeMap<usize, f64>| -> Result<(), E> {
        let batch: Vec<usize> = batch
            .into_iter()
            .filter(|n| !cache.contains_key(n))
            .collect();
        if batch.is_empty() {
            return Ok(());
        }
        rounds += 1;
        let costs = eval(&batch)?;
        for (n, c) in batch.into_iter().zip(costs) {
            cache.insert(n, c);
        }
        Ok(())
    };
    let meets = |c: f64| c <= target;
    // Bracketing: min, 2·min, 4·min, … capped at max, `jobs` at a time.
    let mut next = min;
    let mut hi = None;
    while hi.is_none() && next <= max {
        let mut batch = Vec::with_capacity(jobs);
        while batch.len() < jobs && next <= max {
            batch.push(next);
            next = if next == max {
                max + 1
            } else {
                (next * 2).min(max)
            };
        }
        run(batch, &mut cache)?;
        hi = cache.iter().find(|(_, &c)| meets(c)).map(|(&n, _)| n);
    }
    let Some(mut hi) = hi else {
        return Ok(finish(None, cache, rounds));
    };
    // The largest failing count below hi (min - 1 when none).
    let lo_of = |cache: &BTreeMap<usize, f64>, hi: usize| {
        cache
            .range(..hi)
            .rev()
            .find(|(_, &c)| !meets(c))
            .map_or(min - 1, |(&n, _)| n)
    };
    let mut lo = lo_of(&cache, hi);
    // Narrowing: up to `jobs` evenly spaced counts strictly inside (lo, hi).
    while hi - lo > 1 {
        let gap = hi - lo;
        let k = jobs.min(gap - 1);
        let batch: Vec<usize> = (1..=k).map(|i| lo + i * gap / (k + 1)).collect();
        run(batch, &mut cache)?;
        hi = cache
            .range(lo + 1..=hi)
            .find(|(_, &c)| meets(c))
            .map(|(&n, _)| n)
            .unwrap_or(hi);
        lo = lo_of(&cache, hi);
    }
    Ok(finish(Some(hi), cache, rounds))
}

fn finish(workers: Option<usize>, cache: BTreeMap<usize, f64>, rounds: usize) -> Plan {
    Plan {
        workers,
        points: cache.into_iter().collect(),
        rounds,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// A monotone cost: falls as 1000 / n.
    fn cost(n: usize) -> f64 {
        1000.0 / n as f64
    }

    fn plan(min: usize, max: usize, jobs: usize, target: f64) -> (Plan, Vec<usize>) {
        let mut seen = Vec::new();
        let p = search::<(), _>(min, max, jobs, target, |batch| {
            assert!(!batch.is_empty() && batch.len() <= jobs, "{batch:?}");
            seen.extend_from_slice(batch);
            Ok(batch.iter().map(|&n| cost(n)).collect())
        })
        .unwrap();
        (p, seen)
    }

    /// For every threshold, bounds and job count: the answer is the smallest count meeting the
    /// target (or none), it is evaluated, and no count is evaluated twice.
    #[test]
    fn finds_the_minimum_for_any_threshold_and_never_repeats_a_count() {
        for min in [1, 2, 3, 7] {
            for max in [min, min + 1, 10, 33, 100] {
                for jobs in [1, 2, 3, 4, 8] {
                    for t in 0..=1100 {
                        let target = t as f64 + 0.5;
                        let (p, seen) = plan(min, max, jobs, target);
                        let want = (min..=max).find(|&n| cost(n) <= target);
                        assert_eq!(
                            p.workers, want,
                            "min {min} max {max} jobs {jobs} t {target}"
                        );
                        let unique: HashSet<_> = seen.iter().collect();
                        assert_eq!(unique.len(), seen.len(), "repeated: {seen:?}");
                        assert!(seen.iter().all(|n| (min..=max).contains(n)), "{seen:?}");
                        if let Some(n) = want {
                            assert!(seen.contains(&n));
                            // The count below was evaluated and failed (unless n is min).
                            if n > min {
                                assert!(seen.contains(&(n - 1)), "{seen:?}");
                            }
                        }
                        assert_eq!(p.points.len(), seen.len());
                    }
                }
            }
        }
    }

    #[test]
    fn binary_search_is_logarithmic_and_parallel_batches_take_fewer_rounds() {
        // Target met first at 38 (1000/38 ≈ 26.3) in 1..=256.
        let (one, seen) = plan(1, 256, 1, 26.5);
        assert_eq!(one.workers, Some(38));
        assert!(seen.len() <= 2 * 9 + 1, "{seen:?}");
        let (four, _) = plan(1, 256, 4, 26.5);
        assert_eq!(four.workers, Some(38));
        assert!(
            four.rounds < one.rounds,
            "{} vs {}",
            four.rounds,
            one.rounds
        );
    }

    #[test]
    fn an_error_from_the_evaluator_stops_the_search() {
        let r = search(1, 64, 2, 10.0, |_| Err::<Vec<f64>, _>("boom"));
        assert_eq!(r, Err("boom"));
    }
}
