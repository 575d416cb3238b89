//! The predicted index's expiry, bounds, order and prune.

use super::*;
use crate::hashing::{BlockHasher, HashNamespace};

fn blocks(n: u32, salt: u32) -> BlockHashes {
    let tokens: Vec<u32> = (0..n * 4).map(|t| t + salt * 1000).collect();
    BlockHasher::new(4, &HashNamespace::none()).hash_blocks(&tokens)
}

fn rank(w: u64) -> WorkerRank {
    WorkerRank::new(WorkerId(w), 0)
}

#[test]
fn entries_expire_after_their_ttl_and_refresh_on_reinsert() {
    let config = ApproxConfig {
        ttl: Duration::from_secs(10),
        ..ApproxConfig::default()
    };
    let mut approx = ApproxIndex::new(4, config);
    let b = blocks(3, 0);
    approx.insert(rank(1), &b, Time::from_millis(0));
    approx.insert(rank(2), &b, Time::from_millis(5_000));
    let at = |approx: &mut ApproxIndex, ms, r| {
        let now = Time::from_millis(ms);
        approx.expire(now);
        approx
            .find_matches(&b.sequence, now)
            .get(rank(r))
            .gpu_blocks
    };
    assert_eq!(at(&mut approx, 9_999, 1), 3);
    assert_eq!(at(&mut approx, 10_000, 1), 0);
    assert_eq!(at(&mut approx, 10_000, 2), 3);
    approx.insert(rank(2), &b, Time::from_millis(12_000));
    assert_eq!(at(&mut approx, 16_000, 2), 3);
    approx.check_invariants().unwrap();
}

#[test]
fn the_size_cap_prunes_oldest_first_leaves_before_parents() {
    let config = ApproxConfig {
        max_entries: 10,
        ..ApproxConfig::default()
    };
    let mut approx = ApproxIndex::new(4, config);
    approx.insert(rank(1), &blocks(6, 1), Time::from_millis(0));
    approx.insert(rank(1), &blocks(5, 2), Time::from_millis(1));
    // 11 entries > 10: prune to 8, taking the 3 deepest blocks of the oldest chain.
    assert_eq!(approx.len(), 8);
    assert_eq!(
        approx
            .find_matches(&blocks(6, 1).sequence, Time::from_millis(1))
            .get(rank(1))
            .gpu_blocks,
        3
    );
    assert_eq!(
        approx
            .find_matches(&blocks(5, 2).sequence, Time::from_millis(1))
            .get(rank(1))
            .gpu_blocks,
        5
    );
    approx.check_invariants().unwrap();
}

#[test]
fn removing_a_worker_forgets_its_predictions() {
    let mut approx = ApproxIndex::new(4, ApproxConfig::default());
    approx.insert(rank(1), &blocks(2, 0), Time::ZERO);
    approx.insert(rank(2), &blocks(2, 0), Time::ZERO);
    approx.remove_worker(WorkerId(1));
    assert_eq!(approx.len(), 2);
    approx.clear_rank(rank(2));
    assert!(approx.is_empty());
    approx.check_invariants().unwrap();
}

#[test]
fn a_lull_drops_its_expired_entries_over_several_calls_not_at_once() {
    let config = ApproxConfig {
        ttl: Duration::from_secs(10),
        ..ApproxConfig::default()
    };
    let mut approx = ApproxIndex::new(4, config);
    // 40 chains of 400 blocks: 16,000 entries, 63 steps' worth.
    for salt in 0..40 {
        approx.insert(
            rank(1),
            &blocks(400, salt),
            Time::from_millis(u64::from(salt)),
        );
    }
    assert!(
        approx.expire(Time::from_millis(1_000)),
        "nothing is due yet"
    );
    let mut calls = 0;
    let mut before = approx.len();
    while !approx.expire(Time::from_millis(20_000)) {
        calls += 1;
        let dropped = before - approx.len();
        assert!(dropped > 0 && dropped <= DROP_STEP, "{dropped} in one call");
        before = approx.len();
        approx.check_invariants().unwrap();
    }
    assert!(approx.is_empty());
    assert_eq!(calls, 62, "16,000 entries at 256 a call");
    // Oldest first: after one bounded call the newest chain is still in the index (as seen
    // before it expired), the oldest gone.
    for salt in 0..40 {
        approx.insert(
            rank(1),
            &blocks(400, salt),
            Time::from_millis(u64::from(salt)),
        );
    }
    assert!(approx.expire(Time::from_millis(1_000)));
    assert!(!approx.expire(Time::from_millis(20_000)));
    let overlap = |salt| {
        approx
            .find_matches(&blocks(400, salt).sequence, Time::from_millis(1_000))
            .get(rank(1))
            .gpu_blocks
    };
    assert_eq!(
        (overlap(0), overlap(39)),
        (400 - DROP_STEP as u32, 400),
        "deepest first"
    );
    approx.check_invariants().unwrap();
}

#[test]
fn expired_entries_not_dropped_yet_count_for_nothing() {
    let config = ApproxConfig {
        ttl: Duration::from_secs(10),
        ..ApproxConfig::default()
    };
    let mut approx = ApproxIndex::new(4, config);
    for salt in 0..40 {
        approx.insert(rank(1), &blocks(400, salt), Time::ZERO);
    }
    // A chain whose first two blocks were sent again later: they outlive the third.
    let (long, short) = (blocks(3, 77), blocks(2, 77));
    approx.insert(rank(2), &long, Time::ZERO);
    approx.insert(rank(2), &short, Time::from_millis(5_000));
    assert!(
        approx.expire(Time::from_millis(6_000)),
        "nothing is due yet"
    );
    let now = Time::from_millis(12_000);
    assert!(
        !approx.expire(now),
        "one call drops only part of 16,003 entries"
    );
    assert!(approx.len() > 10_000);
    let scores = approx.find_matches(&blocks(400, 39).sequence, now);
    assert_eq!(scores.get(rank(1)).gpu_blocks, 0);
    assert!(scores.ranks.is_empty());
    assert_eq!(
        approx
            .find_matches(&long.sequence, now)
            .get(rank(2))
            .gpu_blocks,
        2
    );
    let later = Time::from_millis(15_000);
    assert_eq!(
        approx
            .find_matches(&long.sequence, later)
            .get(rank(2))
            .gpu_blocks,
        0
    );
    approx.check_invariants().unwrap();
}

#[test]
fn a_prune_keeps_a_parent_that_a_later_insertion_at_the_same_time_refreshed() {
    let config = ApproxConfig {
        max_entries: 3,
        prune_target_ratio: 0.8,
        ..ApproxConfig::default()
    };
    let mut approx = ApproxIndex::new(4, config);
    let t = Time::from_millis(7);
    approx.insert(rank(1), &blocks(1, 0), t);
    approx.insert(rank(1), &blocks(3, 0), t);
    approx.insert(rank(1), &blocks(1, 5), t);
    // 4 entries > 3: pruned to 2. The first record's block was refreshed by the second, so
    // the second's deepest blocks go, not the parent they hang from.
    assert_eq!(approx.len(), 2);
    let overlap = |approx: &ApproxIndex, b: &BlockHashes| {
        approx.find_matches(&b.sequence, t).get(rank(1)).gpu_blocks
    };
    assert_eq!(overlap(&approx, &blocks(3, 0)), 1);
    assert_eq!(overlap(&approx, &blocks(1, 5)), 1);
    approx.check_invariants().unwrap();
}

#[test]
fn superseded_records_ahead_do_not_stall_a_prune() {
    let config = ApproxConfig {
        max_entries: 40_000,
        prune_target_ratio: 0.8,
        ..ApproxConfig::default()
    };
    let mut approx = ApproxIndex::new(4, config);
    // A 30,000-block chain sent twice: its first record is 30,000 superseded slots, five
    // calls' worth were they counted.
    approx.insert(rank(1), &blocks(30_000, 0), Time::from_millis(1));
    approx.insert(rank(1), &blocks(30_000, 0), Time::from_millis(2));
    for salt in 1..40 {
        let now = Time::from_millis(2 + u64::from(salt));
        assert!(approx.expire(now));
        approx.insert(rank(1), &blocks(1_000, salt * 200), now);
        assert!(approx.len() <= 41_000, "{} entries", approx.len());
        approx.check_invariants().unwrap();
    }
}

#[test]
fn a_prune_over_the_cap_goes_on_over_the_next_inserts_until_the_target() {
    let config = ApproxConfig {
        max_entries: 3_072,
        prune_target_ratio: 0.25,
        ..ApproxConfig::default()
    };
    let mut approx = ApproxIndex::new(4, config);
    let mut salt = 0;
    let mut insert = |approx: &mut ApproxIndex| {
        salt += 1;
        approx.insert(
            rank(1),
            &blocks(1_000, salt),
            Time::from_millis(u64::from(salt)),
        );
        assert!(approx.expire(Time::from_millis(u64::from(salt))));
        approx.check_invariants().unwrap();
        approx.len()
    };
    let mut sizes = Vec::new();
    for _ in 0..9 {
        sizes.push(insert(&mut approx));
    }
    // Up to the cap (3,072); past it, 2,256 a call (one step and twice the call's insert)
    // until the target (768), then up again.
    let want = [
        1_000,
        2_000,
        3_000,
        4_000 - 2_256,
        768,
        1_768,
        2_768,
        3_768 - 2_256,
        768,
    ];
    assert_eq!(sizes, want);
}
