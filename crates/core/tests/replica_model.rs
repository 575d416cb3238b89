//! Property test of replica sync: two routers, each placing its own requests and fed the other's
//! remote events (in order, after any delay, some finishes lost and repaired by the active
//! lists, which go round the ids in ranges of at most 3), reach the same ledger, and that ledger is the one a naive model computes from the
//! requests alone. Expiring a replica leaves exactly the other's load: no phantom load.

use kvrouter_core::hashing::{BlockHasher, HashNamespace};
use kvrouter_core::ids::{ReplicaId, RequestId, SequenceHash, WorkerId, WorkerRank};
use kvrouter_core::ledger::RankLoad;
use kvrouter_core::router::{RemoteEvent, RouterConfig};
use kvrouter_core::{RouteRequest, Router, Time, WorkerSpec};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

const BS: usize = 4;
const WORKERS: u64 = 3;

#[derive(Clone, Debug)]
enum Op {
    /// Router `on` places a request with prompt `prefix`/`len`.
    Route { on: usize, prefix: u8, len: u8 },
    /// Router `on`'s `pick`-th active request produces its first token.
    FirstToken { on: usize, pick: usize },
    /// Router `on`'s `pick`-th active request ends.
    Finish { on: usize, pick: usize },
    /// Up to `n` events from router `from` reach the other.
    Deliver { from: usize, n: usize },
    /// The next event from `from`, if it is a finish, is lost.
    LoseFinish { from: usize },
    /// Router `on` sends its active list.
    Active { on: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..2, 0u8..4, 1u8..30).prop_map(|(on, prefix, len)| Op::Route { on, prefix, len }),
        2 => (0usize..2, 0usize..8).prop_map(|(on, pick)| Op::FirstToken { on, pick }),
        2 => (0usize..2, 0usize..8).prop_map(|(on, pick)| Op::Finish { on, pick }),
        3 => (0usize..2, 1usize..6).prop_map(|(from, n)| Op::Deliver { from, n }),
        1 => (0usize..2).prop_map(|from| Op::LoseFinish { from }),
        1 => (0usize..2).prop_map(|on| Op::Active { on }),
    ]
}

/// The naive model: one entry per live request, whoever owns it.
#[derive(Clone, Debug)]
struct Live {
    rank: WorkerRank,
    prefill: u64,
    blocks: Vec<SequenceHash>,
    private: u64,
    decoding: bool,
}

fn model_loads(
    live: &BTreeMap<(usize, u64), Live>,
    owners: &[usize],
) -> BTreeMap<WorkerRank, RankLoad> {
    let mut loads: BTreeMap<WorkerRank, (RankLoad, BTreeSet<SequenceHash>)> = BTreeMap::new();
    for ((owner, _), l) in live {
        if !owners.contains(owner) {
            continue;
        }
        let (load, blocks) = loads.entry(l.rank).or_default();
        load.active_requests += 1;
        if !l.decoding {
            load.active_prefill_tokens += l.prefill;
        }
        load.active_decode_blocks += l.private;
        blocks.extend(l.blocks.iter().copied());
    }
    loads
        .into_iter()
        .map(|(r, (mut load, blocks))| {
            load.active_decode_blocks += blocks.len() as u64;
            (r, load)
        })
        .collect()
}

fn router_loads(r: &Router) -> BTreeMap<WorkerRank, RankLoad> {
    r.ranks()
        .iter()
        .map(|rank| (*rank, r.load(*rank)))
        .filter(|(_, l)| *l != RankLoad::default())
        .collect()
}

fn new_router(id: u64) -> Router {
    let config = RouterConfig {
        kv_cache_block_size: BS,
        seed: id,
        ..Default::default()
    };
    let mut r = Router::new(config).unwrap();
    for w in 0..WORKERS {
        r.add_worker(WorkerSpec::new(WorkerId(w))).unwrap();
    }
    r.enable_replica_sync(ReplicaId(id), 1 << 16);
    // Small lists: the active lists go round the ids in ranges.
    r.set_active_list_max(3);
    r
}

fn deliver(
    routers: &mut [Router; 2],
    queues: &mut [VecDeque<RemoteEvent>; 2],
    from: usize,
    n: usize,
) -> Result<(), TestCaseError> {
    for _ in 0..n {
        let Some(e) = queues[from].pop_front() else {
            break;
        };
        let applied = routers[1 - from].apply_remote(e.clone(), Time::ZERO);
        prop_assert!(applied.is_ok(), "{e:?}: {applied:?}");
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn two_replicas_reach_the_same_ledger(ops in prop::collection::vec(op(), 1..150)) {
        let mut routers = [new_router(1), new_router(2)];
        let mut queues: [VecDeque<RemoteEvent>; 2] = Default::default();
        let mut live: BTreeMap<(usize, u64), Live> = BTreeMap::new();
        // Every placement so far, finished or not.
        let mut placed: Vec<(WorkerRank, Vec<SequenceHash>)> = Vec::new();
        let mut next_id = [1u64, 1u64];
        let hasher = BlockHasher::new(BS, &HashNamespace::none());
        for op in &ops {
            match *op {
                Op::Route { on, prefix, len } => {
                    let toks: Vec<u32> = (0..u32::from(len)).map(|i| u32::from(prefix) * 1000 + i).collect();
                    let blocks = hasher.hash_blocks(&toks);
                    let id = next_id[on];
                    next_id[on] += 1;
                    let req = RouteRequest::new(RequestId(id), toks.len() as u64, blocks.clone());
                    let d = routers[on].route(&req, Time::ZERO).unwrap();
                    let full = blocks.sequence.len() as u64;
                    // No KV events: the cached prefix is what the rank's active requests hold,
                    // at least what this router's own hold there and at most what any request
                    // placed there holds (a lost finish leaves one active at the other replica).
                    let common = |b: &[SequenceHash]| {
                        b.iter().zip(&blocks.sequence).take_while(|(a, b)| a == b).count() as u64
                    };
                    let least = live
                        .iter()
                        .filter(|((o, _), l)| l.rank == d.rank && *o == on)
                        .map(|(_, l)| common(&l.blocks))
                        .max()
                        .unwrap_or(0);
                    let most = placed
                        .iter()
                        .filter(|(r, _)| *r == d.rank)
                        .map(|(_, b)| common(b))
                        .max()
                        .unwrap_or(0);
                    let bs = BS as u64;
                    prop_assert!(
                        (least * bs..=most * bs).contains(&d.cached_tokens),
                        "cached {} outside {}..={}", d.cached_tokens, least * bs, most * bs
                    );
                    placed.push((d.rank, blocks.sequence.clone()));
                    live.insert((on, id), Live {
                        rank: d.rank,
                        prefill: toks.len() as u64 - d.cached_tokens,
                        private: req.request_blocks(BS) - full,
                        blocks: blocks.sequence,
                        decoding: false,
                    });
                }
                Op::FirstToken { on, pick } | Op::Finish { on, pick } => {
                    let mine: Vec<u64> = live.keys().filter(|(o, _)| *o == on).map(|(_, id)| *id).collect();
                    if mine.is_empty() {
                        continue;
                    }
                    let id = mine[pick % mine.len()];
                    if matches!(op, Op::FirstToken { .. }) {
                        routers[on].first_token(RequestId(id)).unwrap();
                        live.get_mut(&(on, id)).unwrap().decoding = true;
                    } else {
                        let _ = routers[on].finish(RequestId(id), Time::ZERO).unwrap();
                        live.remove(&(on, id));
                    }
                }
                Op::Deliver { from, n } => deliver(&mut routers, &mut queues, from, n)?,
                Op::LoseFinish { from } => {
                    if matches!(queues[from].front(), Some(RemoteEvent::Finish { .. })) {
                        queues[from].pop_front();
                    }
                }
                Op::Active { on } => routers[on].replica_active(),
            }
            for (i, r) in routers.iter_mut().enumerate() {
                queues[i].extend(r.take_outgoing());
            }
        }
        // A round of active lists (enough of them to cover every id from wherever the last
        // one stopped) repairs any finish lost before it.
        for (i, r) in routers.iter_mut().enumerate() {
            for _ in 0..=r.ledger().active_requests() / 3 + 1 {
                r.replica_active();
            }
            queues[i].extend(r.take_outgoing());
        }
        deliver(&mut routers, &mut queues, 0, usize::MAX)?;
        deliver(&mut routers, &mut queues, 1, usize::MAX)?;
        let both = model_loads(&live, &[0, 1]);
        prop_assert_eq!(&router_loads(&routers[0]), &both);
        prop_assert_eq!(&router_loads(&routers[1]), &both);
        for r in &routers {
            prop_assert!(r.check_invariants().is_ok());
        }
        // Each side expires the other: only its own load is left.
        for (on, router) in routers.iter_mut().enumerate() {
            let other = ReplicaId(2 - on as u64);
            let _ = router
                .apply_remote(RemoteEvent::ReplicaExpired { replica: other }, Time::ZERO)
                .unwrap();
            prop_assert_eq!(router_loads(router), model_loads(&live, &[on]));
            prop_assert!(router.remote_requests().is_empty());
            prop_assert!(router.check_invariants().is_ok());
        }
    }
}
