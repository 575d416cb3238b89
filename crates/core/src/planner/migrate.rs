//! Tail consolidation: whether the requests of a worker released in an RL step's tail fit on
//! the workers that stay, and on which.
//!
//! A moved request is continued on its target as a migration after a failure is: its prompt
//! and the tokens it generated so far are prefilled again there. The rule only decides where
//! they may go: each target stays within the fair share of requests the law sizes the fleet
//! with, within its KV usage target, and within a delay bound: a decode step is timed by the KV
//! it reads (Dynamo's published model: memory-bound), so adding a long sample's context to a
//! target slows every request on it, and the step's last sample sets the step time. No
//! affected request may end later than `1 + slowdown` times its end without the moves, however
//! many tokens it may still generate ([`delay_bound_ms`]); a target's blocks after the move
//! are bounded by that decode time ([`blocks_within`]).
//! A worker is moved whole or not at all (it is released only when empty). Pure: the caller
//! reads the fleet.

use crate::timing::{StepShape, TimingModel};

/// A worker that stays: what it holds (or has on its way to it) now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Holding {
    /// Requests running, waiting or on their way to it.
    pub requests: u32,
    /// KV blocks in use, plus those of requests on their way.
    pub blocks: u64,
    /// Most KV blocks it may hold after the moves (the KV usage target and the slowdown bound).
    pub max_blocks: u64,
}

/// One worker's KV blocks and requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Load {
    /// KV blocks in use.
    pub blocks: u64,
    /// Requests.
    pub requests: u64,
}

/// Decode step time (ms) of a worker with `load`, by its timing model (`capacity` blocks of
/// `block_size` tokens).
pub fn decode_ms(m: &dyn TimingModel, block_size: u64, capacity: u64, load: Load) -> f64 {
    let shape = StepShape {
        decode_seqs: load.requests.max(1),
        active_kv_tokens: load.blocks.min(capacity) * block_size,
        kv_capacity_tokens: capacity * block_size,
        ..StepShape::default()
    };
    m.decode_ms(&shape).unwrap_or(f64::INFINITY)
}

/// The most KV blocks (at most `cap`) a target holding `target` may reach with
/// `moved_requests` more requests on it while its decode step stays within `bound_ms`;
/// `target.blocks` when even one more block is too slow. Decode time is taken as
/// non-decreasing in the blocks held.
///
/// The caller sets the bound as `(1 + slowdown) ×` the slower of the source's decode time and
/// the target's before its first move in the step's tail (fixed for the tail: a bound relative
/// to the state before each move would compound over moves). A target's own requests then
/// decode at most `slowdown` slower than the slower of the two; moved requests may go from a
/// fast source to a slower target (the measured cost is in docs/planner.md).
pub fn blocks_within(
    model: &dyn TimingModel,
    block_size: u64,
    capacity: u64,
    cap: u64,
    target: Load,
    moved_requests: u64,
    bound_ms: f64,
) -> u64 {
    let requests = target.requests + moved_requests;
    let t = |blocks: u64| decode_ms(model, block_size, capacity, Load { blocks, requests });
    let (mut lo, mut hi) = (target.blocks, cap.max(target.blocks));
    if t(lo) > bound_ms {
        return target.blocks;
    }
    // The largest b in [lo, hi] with t(b) ≤ bound.
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if t(mid) <= bound_ms {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

/// A request a move would slow: what it may still generate (its `max_tokens` less the tokens
/// it has), its age, and what earlier moves of this tail already committed it to.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Affected {
    /// Tokens it may still generate, at most.
    pub remaining_tokens: u64,
    /// Time since it arrived, ms.
    pub age_ms: f64,
    /// Delay committed by earlier moves' prefill stalls, ms.
    pub committed_ms: f64,
    /// Decode time per step added by earlier moves, ms.
    pub committed_step_ms: f64,
}

/// The highest decode step time (ms) a worker may reach while every affected request, decoding
/// at `base_ms` a step now, still ends within `1 + slowdown` times the time it would have
/// taken without the moves, however many of the tokens it may still generate it generates.
///
/// `base_ms` includes the step time earlier moves added (`committed_step`), so a request of
/// age `a` that still generates `x ≤ remaining` tokens ends at `a + x·(base − committed_step)`
/// without the moves and `a + x·(base + Δ) + stall + committed` with them (Δ: this move's
/// addition). Both are linear in `x`, so the bound holds for every `x` when it holds at
/// `x = 0` (`stall + committed ≤ slowdown·a`) and at `x = remaining`: `Δ ≤
/// slowdown·(base − committed_step) − committed_step + (slowdown·a − stall − committed) /
/// remaining`. A step's time is its
/// last sample's end, so no step takes longer than `1 + slowdown` times (the sim's runs in
/// docs/planner.md measure it). `f64::NEG_INFINITY` when some request has no room left (nothing
/// may be added); unbounded without requests.
pub fn delay_bound_ms(base_ms: f64, affected: &[Affected], stall_ms: f64, slowdown: f64) -> f64 {
    affected
        .iter()
        .map(|a| {
            let room = slowdown * a.age_ms - a.committed_ms - stall_ms;
            if room < 0.0 {
                f64::NEG_INFINITY
            } else if a.remaining_tokens == 0 {
                f64::INFINITY
            } else {
                let without = (base_ms - a.committed_step_ms).max(0.0);
                base_ms + slowdown * without + room / a.remaining_tokens as f64
                    - a.committed_step_ms
            }
        })
        .fold(f64::INFINITY, f64::min)
}

/// Places the moved requests (each given by the KV blocks of its prompt and the tokens it
/// generated so far) on `targets`: the largest first, each on the target with the most blocks
/// free that still takes it (then fewer requests, then the lower index). `None` unless every
/// one fits; otherwise each moved request's target index, in the order given.
pub fn place_moves(targets: &[Holding], moved: &[u64], max_requests: u32) -> Option<Vec<usize>> {
    let mut held: Vec<Holding> = targets.to_vec();
    let mut order: Vec<usize> = (0..moved.len()).collect();
    // Largest first; equal sizes in the order given (deterministic).
    order.sort_by(|a, b| moved[*b].cmp(&moved[*a]).then(a.cmp(b)));
    let mut plan = vec![0; moved.len()];
    for i in order {
        let need = moved[i];
        let best = held
            .iter()
            .enumerate()
            .filter(|(_, h)| {
                h.requests < max_requests
                    && h.blocks
                        .checked_add(need)
                        .is_some_and(|b| b <= h.max_blocks)
            })
            .min_by_key(|(t, h)| (std::cmp::Reverse(h.max_blocks - h.blocks), h.requests, *t))
            .map(|(t, _)| t)?;
        held[best].requests += 1;
        held[best].blocks += need;
        plan[i] = best;
    }
    Some(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timing::DynamoPoly;
    use proptest::prelude::*;

    const MAX: u32 = 4;

    fn h(requests: u32, blocks: u64) -> Holding {
        Holding {
            requests,
            blocks,
            max_blocks: 100,
        }
    }

    #[test]
    fn moves_spread_over_the_freest_targets() {
        // 30 to the freer (90 free → 60), the next 30 too (60 free against 50).
        let plan = place_moves(&[h(1, 50), h(1, 10)], &[30, 30], MAX).unwrap();
        assert_eq!(plan, vec![1, 1]);
        let plan = place_moves(&[h(1, 50), h(1, 10)], &[45, 30], MAX).unwrap();
        assert_eq!(plan, vec![1, 0]);
    }

    #[test]
    fn nothing_moves_unless_every_request_fits() {
        assert_eq!(place_moves(&[h(0, 70)], &[35], MAX), None);
        assert!(place_moves(&[h(0, 70), h(0, 65)], &[35, 30], MAX).is_some());
        // Each target's own bound.
        let tight = Holding {
            max_blocks: 80,
            ..h(0, 50)
        };
        assert_eq!(place_moves(&[tight], &[35], MAX), None);
        // The fair share: a target at its requests per worker takes none.
        assert_eq!(place_moves(&[h(4, 0)], &[1], MAX), None);
        assert_eq!(place_moves(&[h(3, 0)], &[1, 1], MAX), None);
        // No target: nothing fits; nothing to move: an empty plan.
        assert_eq!(place_moves(&[], &[1], MAX), None);
        assert_eq!(place_moves(&[h(4, 100)], &[], MAX), Some(vec![]));
    }

    #[test]
    fn the_largest_go_first() {
        // In the order given (10 to the freer first) the 62 would no longer fit anywhere.
        let plan = place_moves(&[h(0, 40), h(0, 35)], &[10, 62], MAX).unwrap();
        assert_eq!(plan, vec![0, 1]);
    }

    #[test]
    fn a_long_context_added_to_a_target_is_bounded_by_the_slowdown() {
        // 16,384 blocks of 16 tokens; a target with one 20k-token sample (1,280 blocks):
        // 9.8 ms a decode step (Dynamo's polynomial). Within 10 %: up to ~1,600 blocks, so a
        // second such sample (13.5 ms) does not fit, a short one does.
        let (bs, cap) = (16, 16_384);
        let one = Load {
            blocks: 1_280,
            requests: 1,
        };
        let bound = 1.1 * decode_ms(&DynamoPoly, bs, cap, one);
        let b = blocks_within(&DynamoPoly, bs, cap, cap, one, 1, bound);
        assert!((1_280 + 64..2_560).contains(&b), "{b}");
        // No slowdown allowed: nothing fits.
        let exact = decode_ms(&DynamoPoly, bs, cap, one);
        assert_eq!(
            blocks_within(&DynamoPoly, bs, cap, cap, one, 1, exact),
            1_280
        );
        // The KV cap bounds it too; a target already over the bound takes nothing.
        assert_eq!(
            blocks_within(&DynamoPoly, bs, cap, 1_300, one, 1, 2.0 * bound),
            1_300
        );
        assert_eq!(blocks_within(&DynamoPoly, bs, cap, cap, one, 1, 1.0), 1_280);
    }

    #[test]
    fn the_delay_bound_reads_what_may_remain_and_the_age() {
        let a = |remaining_tokens, age_ms, committed_ms, committed_step_ms| Affected {
            remaining_tokens,
            age_ms,
            committed_ms,
            committed_step_ms,
        };
        // 150 s old, up to 7,500 tokens left, 10 %: 10 % of its step (1 ms) and 15 s of room
        // over 7,500 steps (2 ms).
        let b = delay_bound_ms(10.0, &[a(7_500, 150_000.0, 0.0, 0.0)], 0.0, 0.1);
        assert!((b - 13.0).abs() < 1e-9, "{b}");
        // The tightest request decides; committed delay, committed step time and the stall
        // use up room: 10 + 0.95 + (15,000 − 3,000 − 1,500) / 15,000 − 0.5 = 11.15.
        let b = delay_bound_ms(
            10.0,
            &[
                a(7_500, 150_000.0, 0.0, 0.0),
                a(15_000, 150_000.0, 3_000.0, 0.5),
            ],
            1_500.0,
            0.1,
        );
        assert!((b - 11.15).abs() < 1e-9, "{b}");
        // Stalls past its share of the age: no room; no request: unbounded; none left to
        // generate: only the stall counts.
        assert_eq!(
            delay_bound_ms(10.0, &[a(100, 1_000.0, 200.0, 0.0)], 0.0, 0.1),
            f64::NEG_INFINITY
        );
        assert_eq!(delay_bound_ms(10.0, &[], 0.0, 0.1), f64::INFINITY);
        assert_eq!(
            delay_bound_ms(10.0, &[a(0, 1_000.0, 0.0, 0.0)], 50.0, 0.1),
            f64::INFINITY
        );
    }

    proptest! {
        /// Against the definition: at the bound, every request of a random set ends within
        /// 1 + slowdown times its end without the moves for every count of tokens it may
        /// still generate (checked at 0, remaining and a few in between).
        #[test]
        fn at_the_delay_bound_no_request_ends_later_than_the_slowdown_allows(
            reqs in prop::collection::vec((0u64..20_000, 1.0f64..300_000.0, 0.0f64..5_000.0, 0.0f64..2.0), 1..6),
            base in 5.0f64..40.0,
            stall in 0.0f64..3_000.0,
            slowdown in 0.0f64..0.5,
        ) {
            let affected: Vec<Affected> = reqs
                .iter()
                .map(|&(r, age, c, cs)| a4(r, age, c, cs))
                .collect();
            let bound = delay_bound_ms(base, &affected, stall, slowdown);
            let delta = bound - base;
            for x in &affected {
                let fits_at = |tokens: f64| {
                    let without = x.age_ms + tokens * (base - x.committed_step_ms).max(0.0);
                    let with = x.age_ms + tokens * (base + delta)
                        + stall + x.committed_ms;
                    with <= (1.0 + slowdown) * without + 1e-6 * without.max(1.0)
                };
                if bound.is_finite() {
                    let r = x.remaining_tokens as f64;
                    for k in 0..=4 {
                        prop_assert!(fits_at(r * f64::from(k) / 4.0), "{x:?} {bound}");
                    }
                } else if bound == f64::NEG_INFINITY {
                    // Some request had no room at all.
                    prop_assert!(affected.iter().any(|y| slowdown * y.age_ms < y.committed_ms + stall));
                }
            }
        }
    }

    fn a4(
        remaining_tokens: u64,
        age_ms: f64,
        committed_ms: f64,
        committed_step_ms: f64,
    ) -> Affected {
        Affected {
            remaining_tokens,
            age_ms,
            committed_ms,
            committed_step_ms,
        }
    }

    /// Whether some assignment of the moved requests fits (every one tried).
    fn naive_fits(targets: &[Holding], moved: &[u64], max: u32) -> bool {
        fn go(held: &mut Vec<Holding>, moved: &[u64], max: u32) -> bool {
            let Some((&need, rest)) = moved.split_first() else {
                return true;
            };
            for t in 0..held.len() {
                let h = held[t];
                if h.requests < max && h.blocks + need <= h.max_blocks {
                    held[t] = Holding {
                        requests: h.requests + 1,
                        blocks: h.blocks + need,
                        ..h
                    };
                    if go(held, rest, max) {
                        return true;
                    }
                    held[t] = h;
                }
            }
            false
        }
        go(&mut targets.to_vec(), moved, max)
    }

    proptest! {
        #[test]
        fn a_plan_keeps_every_target_within_its_room(
            targets in prop::collection::vec((0u32..5, 0u64..100, 50u64..120), 0..4),
            moved in prop::collection::vec(1u64..60, 0..6),
        ) {
            let targets: Vec<Holding> = targets
                .into_iter()
                .map(|(r, b, m)| Holding { requests: r, blocks: b, max_blocks: m })
                .collect();
            let plan = place_moves(&targets, &moved, MAX);
            let possible = naive_fits(&targets, &moved, MAX);
            match plan {
                Some(plan) => {
                    prop_assert!(possible, "a plan where no assignment fits");
                    prop_assert_eq!(plan.len(), moved.len());
                    let mut held = targets.clone();
                    for (i, t) in plan.iter().enumerate() {
                        held[*t].requests += 1;
                        held[*t].blocks += moved[i];
                    }
                    for (t, after) in held.iter().enumerate() {
                        // Within its room, or untouched (it may have been over before).
                        prop_assert!(
                            after == &targets[t]
                                || (after.requests <= MAX && after.blocks <= after.max_blocks),
                            "{:?}", held
                        );
                    }
                }
                None => {
                    // Largest-first never fails where one target alone could take them all.
                    let total: u64 = moved.iter().sum();
                    let easy = targets.iter().any(|t| {
                        t.requests as usize + moved.len() <= MAX as usize
                            && t.blocks + total <= t.max_blocks
                    });
                    prop_assert!(!easy, "refused an easy move: {:?} {:?}", targets, moved);
                }
            }
        }

        #[test]
        fn the_slowdown_bound_is_the_largest_within_it(
            target in (0u64..8_000, 1u64..64),
            cap in 0u64..16_384,
            bound in 0.0f64..40.0,
        ) {
            let (bs, capacity) = (16, 16_384);
            let t = Load { blocks: target.0, requests: target.1 };
            let got = blocks_within(&DynamoPoly, bs, capacity, cap, t, 1, bound);
            // The naive model: every block count from the target's own up to the cap, timed.
            let time = |blocks: u64| decode_ms(&DynamoPoly, bs, capacity, Load { blocks, requests: t.requests + 1 });
            let want = (t.blocks..=cap.max(t.blocks))
                .take_while(|b| time(*b) <= bound)
                .last()
                .unwrap_or(t.blocks);
            prop_assert_eq!(got, want);
        }
    }
}
