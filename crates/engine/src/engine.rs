//! The engine: a vLLM-v1-style continuous-batching scheduler over the block pool, timed by a
//! [`TimingModel`]. Pure: the host passes `now` to [`Engine::step`] and gets back when the step
//! ends, what it produced and the KV events it caused.
//!
//! Each step spends a token budget (`max_num_batched_tokens`): running requests first (one decode
//! token each, or the next chunk of a prefill), then waiting requests in arrival order while
//! fewer than `max_num_seqs` run. Cached prefix blocks skip prefill. When blocks run out, the
//! newest running request is preempted: its blocks are freed (cached ones stay reusable) and it is
//! recomputed later. A step's outputs are stamped with the step's end time.
//!
//! Token model: a request knows `K = prompt + generated` tokens and has computed KV for the first
//! `computed` of them. A step computes `n ≤ K − computed` more; when `computed` reaches `K` the
//! request samples one token. Prefill, chunked prefill, decode and recompute after preemption are
//! all this one rule.
//!
//! Layout: this file (the state, requests in and out, invariants), `engine/step.rs` (the step:
//! scheduling, admission, preemption, producing tokens and caching blocks).

use crate::pool::{BlockId, BlockPool};
use crate::request::{EngineError, EngineRequest, Finished, Prompt, TokenOut};
use crate::timing::TimingModel;
use kvrouter_core::event::KvEvent;
use kvrouter_core::fast_map::FastMap;
use kvrouter_core::hashing::{BlockHasher, HashNamespace};
use kvrouter_core::ids::{RequestId, SequenceHash, WorkerRank};
use kvrouter_core::rng::mix64 as mix;
use kvrouter_core::time::Time;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// The largest KV pool an engine is built with, in blocks: the pool is allocated whole, so a
/// typo of a few digits would otherwise ask for terabytes.
pub const MAX_NUM_GPU_BLOCKS: usize = 1 << 24;
/// The slowest speed-up (`--speedup-ratio`) a mock engine runs at: a thousand times slower than
/// its profile.
pub const MIN_SPEEDUP_RATIO: f64 = 1e-3;
/// The longest step: a profile (or speed-up) that implies more is capped here rather than
/// overflowing the clock.
pub const MAX_STEP: std::time::Duration = std::time::Duration::from_secs(3600);

/// Engine sizes and limits. Defaults follow vLLM and Dynamo's mocker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV capacity in blocks.
    pub num_gpu_blocks: usize,
    /// Token budget per step.
    pub max_num_batched_tokens: u32,
    /// Most requests running at once.
    pub max_num_seqs: usize,
    /// Host-memory tier capacity in blocks (0 = no tier).
    pub num_cpu_blocks: usize,
    /// Reuse cached prefix blocks.
    pub enable_prefix_caching: bool,
    /// Seed of the generated tokens.
    pub seed: u64,
    /// Generated token ids are drawn from `0..vocab_size`.
    pub vocab_size: u32,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 64,
            num_gpu_blocks: 16_384,
            max_num_batched_tokens: 8_192,
            max_num_seqs: 256,
            num_cpu_blocks: 0,
            enable_prefix_caching: true,
            seed: 0,
            vocab_size: 32_000,
        }
    }
}

/// Live counters of an engine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineStats {
    /// Requests running.
    pub running: usize,
    /// Requests waiting (new or preempted).
    pub waiting: usize,
    /// Blocks in use by requests.
    pub used_blocks: usize,
    /// Blocks holding cached prefixes (in use or free).
    pub cached_blocks: usize,
    /// KV capacity in blocks.
    pub capacity_blocks: usize,
    /// Prompt tokens admitted so far.
    pub prompt_tokens_total: u64,
    /// Of those, tokens served from the prefix cache.
    pub cached_tokens_total: u64,
    /// Preemptions so far.
    pub preemptions_total: u64,
    /// Requests finished so far.
    pub finished_total: u64,
}

/// What one step did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepOutcome {
    /// When the step started.
    pub start: Time,
    /// When it ends: its outputs are available then, and the next step may start.
    pub end: Time,
    /// New prompt tokens computed.
    pub prefill_tokens: u32,
    /// Requests that decoded one token.
    pub decode_seqs: u32,
    /// Tokens sampled (one per request that completed its computation this step).
    pub tokens: Vec<TokenOut>,
    /// Requests that finished.
    pub finished: Vec<Finished>,
    /// Requests preempted this step.
    pub preempted: Vec<RequestId>,
    /// Requests admitted this step, with the prompt tokens their prefix-cache hit covered.
    pub admitted: Vec<(RequestId, u32)>,
    /// KV events caused by the step.
    pub events: Vec<KvEvent>,
}

#[derive(Debug)]
struct Seq {
    prompt_len: u32,
    content: Vec<kvrouter_core::ids::ContentHash>,
    /// Sequence hash of each full block known so far (prompt blocks, then output blocks).
    block_seqs: Vec<SequenceHash>,
    /// Prompt and generated tokens, in token mode.
    tokens: Option<Vec<u32>>,
    hasher: Option<BlockHasher>,
    /// The adapter/salt namespace of its blocks (`None`: the plain one), announced with them.
    namespace: Option<std::sync::Arc<HashNamespace>>,
    output_salt: u64,
    max_output: u32,
    output: u32,
    computed: u32,
    table: Vec<BlockId>,
    /// Leading blocks of `table` that are cached (or were hits).
    cached_upto: usize,
    hit_tokens: u32,
    preemptions: u32,
    admitted_once: bool,
}

impl Seq {
    fn known(&self) -> u32 {
        self.prompt_len + self.output
    }
}

/// Maps the engine's raw generated token to the id it emits (a tokenizer's filler tokens).
pub type TokenMapper = Box<dyn Fn(u32) -> u32 + Send + Sync>;

/// The engine state machine.
pub struct Engine {
    config: EngineConfig,
    token_mapper: Option<TokenMapper>,
    pool: BlockPool,
    timing: Box<dyn TimingModel>,
    seqs: FastMap<RequestId, Seq>,
    running: Vec<RequestId>,
    waiting: VecDeque<RequestId>,
    stats: EngineStats,
}

/// Content hash of block `b` of a block-mode request's output: a pure function of the engine
/// seed and the prompt (as its generated tokens are), distinct from any trace block.
fn output_block_content(seed: u64, salt: u64, b: usize) -> kvrouter_core::ids::ContentHash {
    kvrouter_core::ids::ContentHash(mix(salt ^ mix(b as u64 ^ mix(seed ^ 0x6f75_7470_7574))))
}

/// The generated token at output position `index` of a request: a pure function of the engine
/// seed and the prompt, like greedy decoding, so equal prompts produce equal outputs.
fn filler_token(seed: u64, vocab_size: u32, salt: u64, index: u32) -> u32 {
    (mix(salt ^ mix(u64::from(index) ^ seed)) % u64::from(vocab_size.max(1))) as u32
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("config", &self.config)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// A new, empty engine for `rank` (the identity its KV events carry).
    pub fn new(config: EngineConfig, rank: WorkerRank, timing: Box<dyn TimingModel>) -> Self {
        let pool = BlockPool::new(
            rank,
            config.block_size,
            config.num_gpu_blocks,
            config.num_cpu_blocks,
        );
        Self {
            pool,
            timing,
            seqs: FastMap::default(),
            running: Vec::new(),
            waiting: VecDeque::new(),
            stats: EngineStats {
                capacity_blocks: config.num_gpu_blocks,
                ..Default::default()
            },
            config,
            token_mapper: None,
        }
    }

    /// Emits `mapper(raw)` instead of raw generated ids (a server maps them to its tokenizer's
    /// filler tokens, so that resent replies hash like the engine cached them).
    pub fn set_token_mapper(&mut self, mapper: TokenMapper) {
        self.token_mapper = Some(mapper);
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Live counters.
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            used_blocks: self.pool.used(),
            cached_blocks: self.pool.cached_len(),
            ..self.stats
        }
    }

    /// Whether any request is running or waiting.
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Queues a request. It is refused if it could never fit in the KV cache.
    pub fn add_request(&mut self, request: EngineRequest) -> Result<(), EngineError> {
        if self.seqs.contains_key(&request.id) {
            return Err(EngineError::Duplicate(request.id));
        }
        if request.max_output_tokens == 0 {
            return Err(EngineError::NoOutput);
        }
        let prompt_len = request.prompt.len_tokens();
        if prompt_len == 0 {
            return Err(EngineError::EmptyPrompt);
        }
        let bs = self.config.block_size as u64;
        let longest = u64::from(prompt_len) + u64::from(request.max_output_tokens) - 1;
        let needed = longest.div_ceil(bs);
        if needed > self.config.num_gpu_blocks as u64 {
            return Err(EngineError::TooLong {
                needed_blocks: needed,
                capacity_blocks: self.config.num_gpu_blocks as u64,
            });
        }
        let hashes = request.prompt.hashes(self.config.block_size);
        let (tokens, hasher, namespace) = match request.prompt {
            Prompt::Tokens { tokens, namespace } => (
                Some(tokens),
                Some(BlockHasher::new(self.config.block_size, &namespace)),
                (namespace != HashNamespace::none()).then(|| std::sync::Arc::new(namespace)),
            ),
            Prompt::Blocks { .. } => (None, None, None),
        };
        let output_salt = mix(hashes.sequence.last().map_or(0, |s| s.0) ^ u64::from(prompt_len));
        self.seqs.insert(
            request.id,
            Seq {
                prompt_len,
                content: hashes.content,
                block_seqs: hashes.sequence,
                tokens,
                hasher,
                namespace,
                output_salt,
                max_output: request.max_output_tokens,
                output: 0,
                computed: 0,
                table: Vec::new(),
                cached_upto: 0,
                hit_tokens: 0,
                preemptions: 0,
                admitted_once: false,
            },
        );
        self.waiting.push_back(request.id);
        Ok(())
    }

    /// Tokens a request has generated so far (`None` if it is not here).
    pub fn generated(&self, id: RequestId) -> Option<u32> {
        self.seqs.get(&id).map(|s| s.output)
    }

    /// Stops a request wherever it is and frees its blocks. Returns whether it was present.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        let Some(seq) = self.seqs.remove(&id) else {
            return false;
        };
        self.pool.release(&seq.table);
        self.running.retain(|r| *r != id);
        self.waiting.retain(|r| *r != id);
        true
    }

    /// Ends every request now (a weight update's abort), freeing its blocks: returns each with
    /// its accounting so far, in id order. Blocks already cached stay cached.
    pub fn abort_all(&mut self) -> Vec<Finished> {
        let mut out: Vec<Finished> = self
            .seqs
            .iter()
            .map(|(id, seq)| Finished {
                id: *id,
                prompt_tokens: seq.prompt_len,
                cached_tokens: seq.hit_tokens,
                output_tokens: seq.output,
                preemptions: seq.preemptions,
            })
            .collect();
        out.sort_by_key(|f| f.id);
        for f in &out {
            self.cancel(f.id);
        }
        out
    }

    /// Removes every request (the engine died): returns each with the tokens it had generated.
    pub fn drain(&mut self) -> Vec<(RequestId, u32)> {
        let mut out: Vec<(RequestId, u32)> =
            self.seqs.iter().map(|(id, s)| (*id, s.output)).collect();
        out.sort();
        for (id, _) in &out {
            self.cancel(*id);
        }
        out
    }

    /// Drops the whole prefix cache (announced as `Cleared`).
    pub fn clear_cache(&mut self) -> Vec<KvEvent> {
        self.pool.clear();
        for seq in self.seqs.values_mut() {
            seq.cached_upto = seq.table.len().min(seq.cached_upto);
        }
        self.pool.take_events()
    }

    /// Checks block accounting against every request's block table.
    pub fn check_invariants(&self) -> Result<(), String> {
        let tables: Vec<&[BlockId]> = self.seqs.values().map(|s| s.table.as_slice()).collect();
        self.pool.check(&tables)?;
        for id in &self.waiting {
            if !self.seqs[id].table.is_empty() {
                return Err(format!("waiting request {id} holds blocks"));
            }
        }
        for id in &self.running {
            let s = &self.seqs[id];
            let need = (s.computed as usize).div_ceil(self.config.block_size);
            if s.table.len() < need {
                return Err(format!(
                    "request {id} computed {} tokens in {} blocks",
                    s.computed,
                    s.table.len()
                ));
            }
        }
        if self.running.len() + self.waiting.len() != self.seqs.len() {
            return Err("requests lost between queues".into());
        }
        Ok(())
    }
}

mod step;
#[cfg(test)]
mod tests;
