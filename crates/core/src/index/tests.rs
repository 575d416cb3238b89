use super::*;
use crate::event::{BlockContent, StoredBlock};
use crate::hashing::{BlockHasher, HashNamespace};
use crate::ids::WorkerId;

const BS: usize = 4;

fn rank(w: u64) -> WorkerRank {
    WorkerRank::new(WorkerId(w), 0)
}

/// Tokens of block `b` (distinct per id).
fn block_tokens(b: u32) -> Vec<u32> {
    (0..BS as u32).map(|i| b * 100 + i).collect()
}

fn eh(w: u64, b: u32) -> EngineHash {
    EngineHash(w << 32 | u64::from(b))
}

fn stored(w: u64, parent: Option<u32>, blocks: &[u32], medium: Medium) -> KvEvent {
    KvEvent::Stored {
        worker: WorkerId(w),
        dp_rank: 0,
        parent: parent.map(|p| eh(w, p)),
        blocks: blocks
            .iter()
            .map(|&b| StoredBlock {
                engine_hash: eh(w, b),
                content: BlockContent::Tokens(block_tokens(b)),
            })
            .collect(),
        block_size: BS,
        medium,
        namespace: HashNamespace::none(),
    }
}

fn removed(w: u64, blocks: &[u32], medium: Medium) -> KvEvent {
    KvEvent::Removed {
        worker: WorkerId(w),
        dp_rank: 0,
        engine_hashes: blocks.iter().map(|&b| eh(w, b)).collect(),
        medium,
    }
}

fn query(blocks: &[u32]) -> Vec<SequenceHash> {
    let tokens: Vec<u32> = blocks.iter().flat_map(|&b| block_tokens(b)).collect();
    BlockHasher::new(BS, &HashNamespace::none()).sequence_hashes(&tokens)
}

fn gpu(index: &PrefixIndex, w: u64, q: &[u32]) -> u32 {
    index.find_matches(&query(q)).get(rank(w)).gpu_blocks
}

#[test]
fn stored_chains_match_by_longest_prefix() {
    let mut index = PrefixIndex::new(BS);
    index
        .apply(&stored(1, None, &[1, 2, 3], Medium::Gpu))
        .unwrap();
    index.apply(&stored(2, None, &[1, 2], Medium::Gpu)).unwrap();
    index.apply(&stored(2, Some(2), &[7], Medium::Gpu)).unwrap();
    assert_eq!(gpu(&index, 1, &[1, 2, 3, 4]), 3);
    assert_eq!(gpu(&index, 2, &[1, 2, 3, 4]), 2);
    assert_eq!(gpu(&index, 2, &[1, 2, 7]), 3);
    assert_eq!(gpu(&index, 1, &[1, 2, 7]), 2);
    assert_eq!(gpu(&index, 1, &[9, 1, 2]), 0);
    assert!(index.find_matches(&query(&[9])).ranks.is_empty());
    index.check_invariants().unwrap();
}

#[test]
fn runs_are_path_compressed() {
    let mut index = PrefixIndex::new(BS);
    let chain: Vec<u32> = (1..=100).collect();
    index
        .apply(&stored(1, None, &chain[..50], Medium::Gpu))
        .unwrap();
    index
        .apply(&stored(1, Some(50), &chain[50..], Medium::Gpu))
        .unwrap();
    assert_eq!(index.stats().nodes, 1, "one holder, one chain: one node");
    index
        .apply(&stored(2, None, &chain[..30], Medium::Gpu))
        .unwrap();
    assert_eq!(index.stats().nodes, 2);
    index
        .apply(&KvEvent::Cleared {
            worker: WorkerId(2),
            dp_rank: 0,
        })
        .unwrap();
    assert_eq!(index.stats().nodes, 1, "clearing re-merges the run");
    assert_eq!(index.stats().entries, 100);
}

#[test]
fn repeated_stores_are_idempotent() {
    let mut index = PrefixIndex::new(BS);
    index
        .apply(&stored(1, None, &[1, 2, 3], Medium::Gpu))
        .unwrap();
    let before = index.snapshot();
    index
        .apply(&stored(1, None, &[1, 2, 3], Medium::Gpu))
        .unwrap();
    index.apply(&stored(1, None, &[1, 2], Medium::Gpu)).unwrap();
    assert_eq!(index.snapshot(), before);
}

#[test]
fn removal_from_the_middle_leaves_a_hole() {
    let mut index = PrefixIndex::new(BS);
    index
        .apply(&stored(1, None, &[1, 2, 3, 4], Medium::Gpu))
        .unwrap();
    index.apply(&removed(1, &[2], Medium::Gpu)).unwrap();
    assert_eq!(gpu(&index, 1, &[1, 2, 3, 4]), 1);
    // The tail is still known and can be removed by its engine hash.
    index.apply(&removed(1, &[4, 3], Medium::Gpu)).unwrap();
    index.apply(&removed(1, &[1], Medium::Gpu)).unwrap();
    assert_eq!(
        index.stats(),
        IndexStats {
            ranks: 1,
            ..IndexStats::default()
        }
    );
}

#[test]
fn lower_tiers_count_beyond_the_gpu_prefix() {
    let mut index = PrefixIndex::new(BS);
    index.apply(&stored(1, None, &[1, 2], Medium::Gpu)).unwrap();
    index
        .apply(&stored(1, None, &[1, 2, 3, 4], Medium::Cpu))
        .unwrap();
    index
        .apply(&stored(1, None, &[1, 2, 3, 4, 5, 6], Medium::Disk))
        .unwrap();
    let overlap = index
        .find_matches(&query(&[1, 2, 3, 4, 5, 6, 7]))
        .get(rank(1));
    assert_eq!(
        overlap,
        TierOverlap {
            gpu_blocks: 2,
            cpu_blocks: 2,
            disk_blocks: 2
        }
    );
    index.apply(&removed(1, &[2], Medium::Gpu)).unwrap();
    let overlap = index
        .find_matches(&query(&[1, 2, 3, 4, 5, 6, 7]))
        .get(rank(1));
    assert_eq!(
        overlap,
        TierOverlap {
            gpu_blocks: 1,
            cpu_blocks: 3,
            disk_blocks: 2
        }
    );
}

#[test]
fn errors_are_typed_and_leave_the_index_consistent() {
    let mut index = PrefixIndex::new(BS);
    let err = index
        .apply(&stored(1, Some(9), &[1], Medium::Gpu))
        .unwrap_err();
    assert_eq!(err.status(), "parent_block_not_found");
    let err = index.apply(&removed(1, &[9], Medium::Gpu)).unwrap_err();
    assert_eq!(err.status(), "block_not_found");
    let err = index
        .apply(&stored(1, Some(1), &[1], Medium::Gpu))
        .unwrap_err();
    assert_eq!(err.status(), "invalid_block");
    let mut bad = stored(1, None, &[1, 2, 3], Medium::Gpu);
    if let KvEvent::Stored { blocks, .. } = &mut bad {
        blocks[1].content = BlockContent::Tokens(vec![1, 2, 3]);
    }
    let err = index.apply(&bad).unwrap_err();
    assert_eq!(err.status(), "block_size_mismatch");
    assert_eq!(
        gpu(&index, 1, &[1, 2, 3]),
        1,
        "blocks before the bad one are applied"
    );
    let mut wrong_size = stored(2, None, &[1], Medium::Gpu);
    if let KvEvent::Stored { block_size, .. } = &mut wrong_size {
        *block_size = 16;
    }
    assert!(matches!(
        index.apply(&wrong_size),
        Err(IndexError::BlockSizeMismatch { .. })
    ));
    // A removal that names known and unknown hashes applies the known ones.
    index.apply(&stored(3, None, &[1, 2], Medium::Gpu)).unwrap();
    assert!(index.apply(&removed(3, &[2, 77], Medium::Gpu)).is_err());
    assert_eq!(gpu(&index, 3, &[1, 2]), 1);
    index.check_invariants().unwrap();
}

#[test]
fn reusing_an_engine_hash_for_other_content_drops_the_old_block() {
    let mut index = PrefixIndex::new(BS);
    index.apply(&stored(1, None, &[1], Medium::Gpu)).unwrap();
    let reuse = KvEvent::Stored {
        worker: WorkerId(1),
        dp_rank: 0,
        parent: None,
        blocks: vec![StoredBlock {
            engine_hash: eh(1, 1),
            content: BlockContent::Tokens(block_tokens(5)),
        }],
        block_size: BS,
        medium: Medium::Gpu,
        namespace: HashNamespace::none(),
    };
    index.apply(&reuse).unwrap();
    assert_eq!(gpu(&index, 1, &[1]), 0);
    assert_eq!(gpu(&index, 1, &[5]), 1);
}

#[test]
fn namespaces_separate_equal_tokens() {
    let mut index = PrefixIndex::new(BS);
    let mut event = stored(1, None, &[1, 2], Medium::Gpu);
    if let KvEvent::Stored { namespace, .. } = &mut event {
        namespace.lora_name = Some("adapter".into());
    }
    index.apply(&event).unwrap();
    assert_eq!(gpu(&index, 1, &[1, 2]), 0);
    let ns = HashNamespace {
        lora_name: Some("adapter".into()),
        cache_salt: None,
    };
    let tokens: Vec<u32> = [1, 2].iter().flat_map(|&b| block_tokens(b)).collect();
    let q = BlockHasher::new(BS, &ns).sequence_hashes(&tokens);
    assert_eq!(index.find_matches(&q).get(rank(1)).gpu_blocks, 2);
}

#[test]
fn removing_a_worker_drops_all_its_ranks_and_blocks() {
    let mut index = PrefixIndex::new(BS);
    index.apply(&stored(1, None, &[1, 2], Medium::Gpu)).unwrap();
    let mut other_rank = stored(1, None, &[1, 3], Medium::Gpu);
    if let KvEvent::Stored { dp_rank, .. } = &mut other_rank {
        *dp_rank = 1;
    }
    index.apply(&other_rank).unwrap();
    index.apply(&stored(2, None, &[1, 2], Medium::Gpu)).unwrap();
    index.remove_worker(WorkerId(1));
    assert_eq!(index.stats().ranks, 1);
    assert_eq!(index.stats().entries, 2);
    assert_eq!(gpu(&index, 2, &[1, 2]), 2);
    index.check_invariants().unwrap();
}

#[test]
fn dump_replays_to_an_equal_index_even_with_holes() {
    let mut index = PrefixIndex::new(BS);
    index
        .apply(&stored(1, None, &[1, 2, 3, 4, 5], Medium::Gpu))
        .unwrap();
    index
        .apply(&stored(2, None, &[1, 2, 6], Medium::Gpu))
        .unwrap();
    index
        .apply(&stored(2, None, &[1, 2, 3], Medium::Cpu))
        .unwrap();
    index.apply(&removed(1, &[2, 4], Medium::Gpu)).unwrap();
    let mut replayed = PrefixIndex::new(BS);
    for event in index.dump() {
        replayed.apply(&event).unwrap();
    }
    assert_eq!(replayed.snapshot(), index.snapshot());
    assert!(replayed == index);
}

#[test]
fn a_capped_rank_evicts_the_oldest_chain_tip_first() {
    let mut index = PrefixIndex::new(BS);
    index.set_worker_capacity(WorkerId(1), Some(TierCapacity::uniform(4)));
    index
        .apply(&stored(1, None, &[1, 2, 3], Medium::Gpu))
        .unwrap();
    index.apply(&stored(1, None, &[7], Medium::Gpu)).unwrap();
    // Two more blocks: the old chain loses its tip, then the block before it.
    index
        .apply(&stored(1, Some(7), &[8, 9], Medium::Gpu))
        .unwrap();
    assert_eq!(gpu(&index, 1, &[1, 2, 3]), 1);
    assert_eq!(gpu(&index, 1, &[7, 8, 9]), 3);
    assert_eq!(index.evictions(), vec![(WorkerId(1), 2)]);
    assert_eq!(index.stats().entries, 4);
    // The evicted blocks' engine hashes are forgotten too.
    assert_eq!(
        index.apply(&removed(1, &[3], Medium::Gpu)),
        Err(IndexError::BlockNotFound {
            rank: rank(1),
            hash: eh(1, 3)
        })
    );
    index.check_invariants().unwrap();
    // A worker that left takes its count with it (ids are not used again).
    index.remove_worker(WorkerId(1));
    assert!(index.evictions().is_empty());
}

#[test]
fn a_block_with_a_held_child_is_never_evicted_before_it() {
    let mut index = PrefixIndex::new(BS);
    index.set_worker_capacity(WorkerId(1), Some(TierCapacity::uniform(3)));
    // The root is the oldest block, but its chain keeps growing: the tip goes, not the root.
    index
        .apply(&stored(1, None, &[1, 2, 3], Medium::Gpu))
        .unwrap();
    index.apply(&stored(1, Some(3), &[4], Medium::Gpu)).unwrap();
    assert_eq!(gpu(&index, 1, &[1, 2, 3]), 3);
    assert_eq!(gpu(&index, 1, &[1, 2, 3, 4]), 3);
    index.check_invariants().unwrap();
}

#[test]
fn capacities_bound_each_worker_and_tier_separately() {
    let mut index = PrefixIndex::new(BS);
    index.set_worker_capacity(WorkerId(1), Some(TierCapacity::uniform(8)));
    for b in 0..200u32 {
        index
            .apply(&stored(1, None, &[1000 + 2 * b, 1001 + 2 * b], Medium::Gpu))
            .unwrap();
        index
            .apply(&stored(1, None, &[5000 + b], Medium::Cpu))
            .unwrap();
        index.apply(&stored(2, None, &[b], Medium::Gpu)).unwrap();
    }
    let counts = index.holder_counts();
    assert_eq!(
        counts,
        vec![
            (rank(1), Medium::Gpu, 8),
            (rank(1), Medium::Cpu, 8),
            (rank(2), Medium::Gpu, 200)
        ]
    );
    assert_eq!(index.evictions(), vec![(WorkerId(1), 400 - 8 + 200 - 8)]);
    // The newest blocks stay.
    assert_eq!(gpu(&index, 1, &[1398, 1399]), 2);
    // Lowering the capacity evicts at once; a flush keeps the capacity.
    index.set_worker_capacity(WorkerId(1), Some(TierCapacity::uniform(2)));
    assert_eq!(index.holder_counts()[0], (rank(1), Medium::Gpu, 2));
    index.remove_worker(WorkerId(1));
    assert_eq!(
        index.worker_capacity(WorkerId(1)),
        Some(TierCapacity::uniform(2))
    );
    index.check_invariants().unwrap();
}

#[test]
fn an_engine_hash_moved_to_an_earlier_block_of_the_event_drops_the_later_block() {
    // Bookkeeping runs block by block: block 1 takes over engine hash y from block 2, which is
    // dropped, so block 2 (stored later in the same event under z) is no longer held.
    let event = |hashes: [u32; 2]| KvEvent::Stored {
        worker: WorkerId(1),
        dp_rank: 0,
        parent: None,
        blocks: [1u32, 2]
            .iter()
            .zip(hashes)
            .map(|(&b, h)| StoredBlock {
                engine_hash: eh(1, h),
                content: BlockContent::Tokens(block_tokens(b)),
            })
            .collect(),
        block_size: BS,
        medium: Medium::Gpu,
        namespace: HashNamespace::none(),
    };
    for cap in [None, Some(TierCapacity::uniform(8))] {
        let mut index = PrefixIndex::new(BS);
        index.set_worker_capacity(WorkerId(1), cap);
        index.apply(&event([10, 20])).unwrap();
        assert_eq!(gpu(&index, 1, &[1, 2]), 2);
        index.apply(&event([20, 30])).unwrap();
        assert_eq!(gpu(&index, 1, &[1, 2]), 1);
        assert_eq!(index.holder_counts(), vec![(rank(1), Medium::Gpu, 1)]);
        index.check_invariants().unwrap();
        // Both engine hashes still name their blocks: removing z finds block 2 no longer held,
        // removing x drops block 1.
        assert_eq!(index.apply(&removed(1, &[30], Medium::Gpu)), Ok(()));
        assert_eq!(gpu(&index, 1, &[1, 2]), 1);
        index.apply(&removed(1, &[10], Medium::Gpu)).unwrap();
        assert_eq!(gpu(&index, 1, &[1, 2]), 0);
        index.check_invariants().unwrap();
    }
}

#[test]
fn a_stored_chain_queues_only_its_tip_and_still_evicts_tip_first() {
    let mut index = PrefixIndex::new(BS);
    index.set_worker_capacity(WorkerId(1), Some(TierCapacity::uniform(100)));
    let chain: Vec<u32> = (1..=100).collect();
    index.apply(&stored(1, None, &chain, Medium::Gpu)).unwrap();
    let slot = index.slots[&rank(1)];
    let queue_len = |index: &PrefixIndex| index.rank(slot).recency[0].queue_len();
    assert_eq!(queue_len(&index), 1);
    // Over capacity, the chain goes from its tip down, one block per new block.
    index
        .apply(&stored(1, None, &[500, 501], Medium::Gpu))
        .unwrap();
    assert_eq!(gpu(&index, 1, &chain), 98);
    assert_eq!(gpu(&index, 1, &[500, 501]), 2);
    assert_eq!(index.evictions(), vec![(WorkerId(1), 2)]);
    index.check_invariants().unwrap();
}

#[test]
fn an_evicted_block_forgets_the_engine_hash_it_was_last_stored_under() {
    // The tree keeps, per holder, the engine hash each block was last stored under; eviction
    // forgets that one, and an earlier hash of the same block names a block no longer held.
    let under = |h: u32| KvEvent::Stored {
        worker: WorkerId(1),
        dp_rank: 0,
        parent: None,
        blocks: vec![StoredBlock {
            engine_hash: eh(1, h),
            content: BlockContent::Tokens(block_tokens(1)),
        }],
        block_size: BS,
        medium: Medium::Gpu,
        namespace: HashNamespace::none(),
    };
    let mut index = PrefixIndex::new(BS);
    index.set_worker_capacity(WorkerId(1), Some(TierCapacity::uniform(1)));
    index.apply(&under(10)).unwrap();
    index.apply(&under(20)).unwrap();
    assert_eq!(index.holder_counts(), vec![(rank(1), Medium::Gpu, 1)]);
    index.check_invariants().unwrap();
    index.apply(&stored(1, None, &[2], Medium::Gpu)).unwrap();
    assert_eq!(gpu(&index, 1, &[1]), 0);
    assert_eq!(gpu(&index, 1, &[2]), 1);
    assert_eq!(
        index.apply(&removed(1, &[20], Medium::Gpu)),
        Err(IndexError::BlockNotFound {
            rank: rank(1),
            hash: eh(1, 20)
        })
    );
    assert_eq!(index.apply(&removed(1, &[10], Medium::Gpu)), Ok(()));
    assert_eq!(gpu(&index, 1, &[2]), 1);
    index.check_invariants().unwrap();
}
