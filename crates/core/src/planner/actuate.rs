//! Acting on a recommendation (`serve --planner-act`): the pure part. How a GPU budget shared
//! between pools is split ([`split_budget`]), and whether a target is patched at a tick
//! ([`decide`]). The server's `planner_act` does the I/O.

use crate::time::Time;
use std::time::Duration;

/// One pool's claim on the budget at a tick.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Claim {
    /// Workers the law recommends.
    pub desired: u32,
    /// Workers the pool keeps whatever the budget: its min, and the in-flight need up to its
    /// current replicas (the budget never drains in-flight requests).
    pub floor: u32,
}

/// Workers granted to each claim (same order) within `budget_workers` (`None`: unbounded).
///
/// The rule (docs/planner.md): if every claim fits, each gets what it wants. Otherwise each
/// pool first gets its floor (even when the floors alone exceed the budget), and what is left
/// is split in proportion to each pool's demand above its floor, by largest remainder (ties to
/// the earlier claim), so the grants never exceed the budget unless the floors do.
pub fn split_budget(claims: &[Claim], budget_workers: Option<u32>) -> Vec<u32> {
    let want = |c: &Claim| c.desired.max(c.floor);
    let total: u64 = claims.iter().map(|c| u64::from(want(c))).sum();
    let Some(budget) = budget_workers.filter(|b| u64::from(*b) < total) else {
        return claims.iter().map(want).collect();
    };
    let floors: u64 = claims.iter().map(|c| u64::from(c.floor)).sum();
    let left = u64::from(budget).saturating_sub(floors);
    let extra: Vec<u64> = claims
        .iter()
        .map(|c| u64::from(want(c) - c.floor))
        .collect();
    let extra_total: u64 = extra.iter().sum();
    let mut grants: Vec<u64> = claims.iter().map(|c| u64::from(c.floor)).collect();
    if extra_total == 0 || left == 0 {
        return grants.into_iter().map(to_u32).collect();
    }
    // left < extra_total here, so each share is below its pool's extra.
    let mut remainders = Vec::with_capacity(claims.len());
    let mut given = 0;
    for (i, e) in extra.iter().enumerate() {
        let share = left * e / extra_total;
        grants[i] += share;
        given += share;
        remainders.push((left * e % extra_total, i));
    }
    remainders.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    for (_, i) in remainders.into_iter().take(to_usize(left - given)) {
        grants[i] += 1;
    }
    grants.into_iter().map(to_u32).collect()
}

fn to_u32(v: u64) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

fn to_usize(v: u64) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}

/// What to do with one target at a tick.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Its replicas already are the grant.
    Keep,
    /// It differs, but the last patch was less than the cool-down ago.
    CoolDown {
        /// Time left.
        left: Duration,
    },
    /// Patch its replicas to this.
    Patch(u32),
}

/// Whether to patch a target with `current` replicas to `grant` at `now`, its last patch at
/// `last_patch` (no two patches closer than `cooldown`, so the replicas do not flap).
pub fn decide(
    current: u32,
    grant: u32,
    now: Time,
    last_patch: Option<Time>,
    cooldown: Duration,
) -> Action {
    if current == grant {
        return Action::Keep;
    }
    match last_patch.map(|t| now.since(t)) {
        Some(since) if since < cooldown => Action::CoolDown {
            left: cooldown - since,
        },
        _ => Action::Patch(grant),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(desired: u32, floor: u32) -> Claim {
        Claim { desired, floor }
    }

    #[test]
    fn everything_fits_or_no_budget_grants_the_demand() {
        assert_eq!(split_budget(&[c(3, 1), c(2, 1)], None), vec![3, 2]);
        assert_eq!(split_budget(&[c(3, 1), c(2, 1)], Some(5)), vec![3, 2]);
        // The floor wins over a lower desire (in-flight need).
        assert_eq!(split_budget(&[c(1, 2)], Some(8)), vec![2]);
    }

    #[test]
    fn a_short_budget_gives_floors_first_then_splits_in_proportion_to_demand_above_them() {
        // Budget 6: floors 1 + 1, then 4 split 6:2 -> 3 + 1.
        assert_eq!(split_budget(&[c(7, 1), c(3, 1)], Some(6)), vec![4, 2]);
        // Budget 4: floors 1 + 1, 2 left split 1:1.
        assert_eq!(split_budget(&[c(5, 1), c(5, 1)], Some(4)), vec![2, 2]);
        // Largest remainder, ties to the earlier pool: 3 left over extras 2, 2 -> 2, 1.
        assert_eq!(split_budget(&[c(3, 1), c(3, 1)], Some(5)), vec![3, 2]);
        // Floors alone over the budget: floors, nothing more.
        assert_eq!(split_budget(&[c(9, 3), c(9, 3)], Some(4)), vec![3, 3]);
        for budget in 0..20 {
            let g = split_budget(&[c(9, 1), c(4, 2), c(6, 1)], Some(budget));
            let sum: u32 = g.iter().sum();
            assert!(sum <= budget.max(4), "{budget}: {g:?}");
            assert!(g[0] >= 1 && g[1] >= 2 && g[2] >= 1, "{g:?}");
            assert!(g[0] <= 9 && g[1] <= 4 && g[2] <= 6, "{g:?}");
        }
    }

    #[test]
    fn a_patch_waits_for_the_cooldown_and_nothing_is_patched_when_equal() {
        let t = Time::ZERO + Duration::from_secs(100);
        let cd = Duration::from_secs(10);
        assert_eq!(decide(2, 2, t, None, cd), Action::Keep);
        assert_eq!(decide(2, 4, t, None, cd), Action::Patch(4));
        assert_eq!(
            decide(4, 2, t, Some(t - Duration::from_secs(4)), cd),
            Action::CoolDown {
                left: Duration::from_secs(6)
            }
        );
        assert_eq!(
            decide(4, 2, t, Some(t - Duration::from_secs(10)), cd),
            Action::Patch(2)
        );
    }
}
