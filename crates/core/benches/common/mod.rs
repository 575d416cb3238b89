//! Shared bench input: the Mooncake conversation trace expanded to router blocks.
#![allow(dead_code, unreachable_pub)]

use kvrouter_core::event::{BlockContent, KvEvent, Medium, StoredBlock};
use kvrouter_core::hashing::{BlockHasher, BlockHashes, HashNamespace};
use kvrouter_core::ids::{EngineHash, RequestId, WorkerId, WorkerRank};
use kvrouter_core::policy::RouterMode;
use kvrouter_core::router::{RouteRequest, Router, RouterConfig, WorkerSpec};
use kvrouter_core::time::Time;
use std::collections::HashSet;

/// Router block size used by the benches.
pub const BLOCK_SIZE: usize = 64;
/// Router blocks per 512-token trace block.
pub const SUB_BLOCKS: u64 = 8;

const TRACE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../../shared/traces/mooncake_conversation/conversation_trace.jsonl"
);

/// One request of the trace: its prompt as router block ids (trace id × 8 + sub-block).
pub struct TraceRequest {
    pub blocks: Vec<u64>,
    pub input_length: u64,
}

pub fn load_trace() -> Vec<TraceRequest> {
    let text = std::fs::read_to_string(TRACE).unwrap_or_else(|e| panic!("reading {TRACE}: {e}"));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).expect("trace line");
            let ids: Vec<u64> = v["hash_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect();
            let input_length = v["input_length"].as_u64().unwrap();
            // Only blocks fully covered by the prompt become router blocks.
            let full = (input_length / BLOCK_SIZE as u64) as usize;
            let blocks = ids
                .iter()
                .flat_map(|id| (0..SUB_BLOCKS).map(move |j| id * SUB_BLOCKS + j))
                .take(full)
                .collect();
            TraceRequest {
                blocks,
                input_length,
            }
        })
        .collect()
}

/// The tokens of router block `id`: distinct per id.
pub fn block_tokens(id: u64) -> Vec<u32> {
    (0..BLOCK_SIZE as u64)
        .map(|t| (id * BLOCK_SIZE as u64 + t) as u32)
        .collect()
}

pub fn prompt_tokens(blocks: &[u64]) -> Vec<u32> {
    blocks.iter().flat_map(|b| block_tokens(*b)).collect()
}

pub fn hasher() -> BlockHasher {
    BlockHasher::new(BLOCK_SIZE, &HashNamespace::none())
}

/// Engine-style events: each request goes to worker `i % workers`, which announces only the
/// blocks it did not hold yet, chained to the last block it held (as vLLM does).
pub fn engine_events(trace: &[TraceRequest], workers: u64) -> (Vec<KvEvent>, usize) {
    let mut held: Vec<HashSet<Vec<u64>>> = vec![HashSet::new(); workers as usize];
    let mut events = Vec::new();
    let mut blocks_total = 0;
    for (i, req) in trace.iter().enumerate() {
        let w = i as u64 % workers;
        let cache = &mut held[w as usize];
        let mut start = 0;
        while start < req.blocks.len() && cache.contains(&req.blocks[..=start]) {
            start += 1;
        }
        if start == req.blocks.len() {
            continue;
        }
        let eh = |end: usize| EngineHash(chain_id(&req.blocks[..end]));
        let blocks: Vec<StoredBlock> = (start..req.blocks.len())
            .map(|j| StoredBlock {
                engine_hash: eh(j + 1),
                content: BlockContent::Tokens(block_tokens(req.blocks[j])),
            })
            .collect();
        for j in start..req.blocks.len() {
            cache.insert(req.blocks[..=j].to_vec());
        }
        blocks_total += blocks.len();
        events.push(KvEvent::Stored {
            worker: WorkerId(w),
            dp_rank: 0,
            parent: (start > 0).then(|| eh(start)),
            blocks,
            block_size: BLOCK_SIZE,
            medium: Medium::Gpu,
            namespace: HashNamespace::none(),
        });
    }
    (events, blocks_total)
}

/// A stand-in engine hash for a chain of block ids (FNV-1a over the ids).
pub fn chain_id(blocks: &[u64]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in blocks {
        h = (h ^ b).wrapping_mul(0x1000_0000_01b3);
    }
    h
}

/// One timed decision of the route benches: request `id` (`isl_tokens`, a clone of `blocks`)
/// routed and then finished at `id` µs; the rank it went to.
pub fn route_and_finish(
    r: &mut Router,
    id: u64,
    isl_tokens: u64,
    blocks: &BlockHashes,
) -> WorkerRank {
    route_and_finish_in(r, id, None, isl_tokens, blocks)
}

/// [`route_and_finish`] for a request of `session` (which is then resident on its worker).
pub fn route_and_finish_in(
    r: &mut Router,
    id: u64,
    session: Option<u64>,
    isl_tokens: u64,
    blocks: &BlockHashes,
) -> WorkerRank {
    let mut req = RouteRequest::new(RequestId(id), isl_tokens, blocks.clone());
    req.session = session;
    let d = r.route(&req, Time::from_micros(id)).unwrap();
    let _ = r.finish(RequestId(id), Time::from_micros(id)).unwrap();
    d.rank
}

/// The cost bench's fleet: 64 workers (16,384 blocks, 8,192-token steps each) fed `trace`'s KV
/// events, with its first 256 requests in flight (ids from 2^40).
pub fn cost_bench_router(mode: RouterMode, trace: &[TraceRequest]) -> Router {
    let config = RouterConfig {
        router_mode: mode,
        kv_cache_block_size: BLOCK_SIZE,
        ..RouterConfig::default()
    };
    let mut router = Router::new(config).unwrap();
    for w in 0..64 {
        let mut spec = WorkerSpec::new(WorkerId(w));
        spec.kv_capacity_blocks = Some(16_384);
        spec.max_num_batched_tokens = Some(8_192);
        router.add_worker(spec).unwrap();
    }
    let (events, _) = engine_events(trace, 64);
    for e in &events {
        let _ = router.apply_event(e);
    }
    for (i, r) in trace.iter().take(256).enumerate() {
        let tokens = prompt_tokens(&r.blocks);
        let req = RouteRequest::new(
            RequestId(1 << 40 | i as u64),
            tokens.len() as u64,
            hasher().hash_blocks(&tokens),
        );
        router.route(&req, Time::ZERO).unwrap();
    }
    router
}

/// A long prompt (the route and cost benches'): the trace's longest, cut or padded with fresh
/// blocks to `blocks` router blocks; its tokens and block hashes.
pub fn long_trace_prompt(trace: &[TraceRequest], blocks: usize) -> (Vec<u32>, BlockHashes) {
    let mut ids = trace
        .iter()
        .max_by_key(|r| r.blocks.len())
        .unwrap()
        .blocks
        .clone();
    ids.truncate(blocks);
    ids.extend((ids.len() as u64..blocks as u64).map(|i| 1 << 42 | i));
    let tokens = prompt_tokens(&ids);
    let hashed = hasher().hash_blocks(&tokens);
    assert_eq!(hashed.len(), blocks);
    (tokens, hashed)
}

/// The deep-queue state: [`cost_bench_router`] without a trace and with 64 × 256 requests in
/// flight, each a 16-block system prompt and 112 blocks of its own; and a `blocks`-block prompt
/// that shares only the system prompt (its token count and block hashes).
pub fn deep_queue_state(mode: RouterMode, blocks: usize) -> (Router, u64, BlockHashes) {
    let system: Vec<u64> = (0..16).map(|i| 1 << 43 | i).collect();
    let prompt = |n: u64, len: u64| -> Vec<u64> {
        let mut b = system.clone();
        b.extend((0..len).map(|j| 1 << 44 | n << 16 | j));
        b
    };
    let mut r = cost_bench_router(mode, &[]);
    for n in 0..64 * 256u64 {
        let t = prompt_tokens(&prompt(n, 112));
        let req = RouteRequest::new(
            RequestId(1 << 41 | n),
            t.len() as u64,
            hasher().hash_blocks(&t),
        );
        r.route(&req, Time::ZERO).unwrap();
    }
    let tokens = prompt_tokens(&prompt(1 << 20, blocks as u64 - 16));
    (r, tokens.len() as u64, hasher().hash_blocks(&tokens))
}
