//! Shared bench input: the Mooncake conversation trace expanded to router blocks.
#![allow(dead_code, unreachable_pub)]

use kvrouter_core::event::{BlockContent, KvEvent, Medium, StoredBlock};
use kvrouter_core::hashing::{BlockHasher, BlockHashes, HashNamespace};
use kvrouter_core::ids::{EngineHash, RequestId, WorkerId, WorkerRank};
use kvrouter_core::router::{RouteRequest, Router};
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
    let req = RouteRequest::new(RequestId(id), isl_tokens, blocks.clone());
    let d = r.route(&req, Time::from_micros(id)).unwrap();
    let _ = r.finish(RequestId(id), Time::from_micros(id)).unwrap();
    d.rank
}
