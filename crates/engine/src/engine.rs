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

use crate::pool::{BlockId, BlockPool, CachedBlock};
use crate::request::{EngineError, EngineRequest, Finished, Prompt, TokenOut};
use crate::timing::{StepShape, TimingError, TimingModel};
use kvrouter_core::event::KvEvent;
use kvrouter_core::fast_map::FastMap;
use kvrouter_core::hashing::{chain, BlockHasher, HashNamespace};
use kvrouter_core::ids::{RequestId, SequenceHash, WorkerRank};
use kvrouter_core::rng::mix64 as mix;
use kvrouter_core::time::Time;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::time::Duration;

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

    fn preempt(&mut self, id: RequestId, preempted: &mut Vec<RequestId>) {
        let seq = self.seqs.get_mut(&id).expect("running request");
        self.pool.release(&seq.table);
        seq.table.clear();
        seq.computed = 0;
        seq.cached_upto = 0;
        seq.preemptions += 1;
        self.stats.preemptions_total += 1;
        self.running.retain(|r| *r != id);
        self.waiting.push_front(id);
        preempted.push(id);
    }

    /// Runs one scheduler step starting at `now`. `None` when there is nothing to do.
    pub fn step(&mut self, now: Time) -> Result<Option<StepOutcome>, TimingError> {
        if !self.has_work() {
            return Ok(None);
        }
        let bs = self.config.block_size as u32;
        let mut budget = self.config.max_num_batched_tokens;
        let mut scheduled: Vec<(RequestId, u32)> = Vec::with_capacity(self.running.len() + 4);
        let mut out = StepOutcome {
            start: now,
            ..StepOutcome::default()
        };

        // Running requests first.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let seq = &self.seqs[&id];
            let n = (seq.known() - seq.computed).min(budget);
            let need = (seq.computed + n).div_ceil(bs) as usize - seq.table.len();
            if need > self.pool.free() {
                let victim = *self.running.last().expect("non-empty");
                self.preempt(victim, &mut out.preempted);
                if victim == id {
                    break;
                }
                continue;
            }
            let seq = self.seqs.get_mut(&id).expect("running request");
            for _ in 0..need {
                seq.table
                    .push(self.pool.allocate().expect("checked free blocks"));
            }
            let upto = self.seqs[&id].computed + n;
            self.cache_full_blocks(id, upto);
            scheduled.push((id, n));
            budget -= n;
            i += 1;
        }

        // Then waiting requests, unless this step had to preempt.
        if out.preempted.is_empty() {
            while budget > 0 && self.running.len() < self.config.max_num_seqs {
                let Some(&id) = self.waiting.front() else {
                    break;
                };
                match self.admit(id, budget) {
                    Some(n) => {
                        let upto = self.seqs[&id].computed + n;
                        self.cache_full_blocks(id, upto);
                        out.admitted.push((id, self.seqs[&id].hit_tokens));
                        self.waiting.pop_front();
                        self.running.push(id);
                        scheduled.push((id, n));
                        budget -= n;
                    }
                    None => break,
                }
            }
        }

        // Time the step.
        let mut shape = StepShape {
            active_kv_tokens: (self.pool.used() * self.config.block_size) as u64,
            kv_capacity_tokens: (self.pool.capacity() * self.config.block_size) as u64,
            ..StepShape::default()
        };
        let mut context_sum = 0u64;
        for (id, n) in &scheduled {
            let seq = &self.seqs[id];
            if seq.output > 0 && seq.known() - seq.computed == 1 {
                shape.decode_seqs += 1;
                context_sum += u64::from(seq.known());
            } else {
                shape.prefill_tokens += u64::from(*n);
            }
        }
        if shape.decode_seqs > 0 {
            shape.decode_mean_context = context_sum as f64 / shape.decode_seqs as f64;
        }
        let ms = self.timing.step_ms(&shape)?;
        out.end = now + Duration::from_secs_f64(ms.max(0.0) / 1e3);
        out.prefill_tokens = shape.prefill_tokens as u32;
        out.decode_seqs = shape.decode_seqs as u32;

        // Apply the computation.
        for (id, n) in scheduled {
            self.advance(id, n, &mut out);
        }
        out.events = self.pool.take_events();
        Ok(Some(out))
    }

    /// Tries to admit the head of the waiting queue with `budget` tokens; returns the tokens it
    /// will compute this step.
    fn admit(&mut self, id: RequestId, budget: u32) -> Option<u32> {
        let bs = self.config.block_size as u32;
        let seq = &self.seqs[&id];
        let known = seq.known();
        let max_hit_blocks = ((known - 1) / bs) as usize;
        // Prefix hits: GPU blocks, then blocks still in the host tier.
        let mut gpu_hits = Vec::new();
        let mut cpu_hits = Vec::new();
        if self.config.enable_prefix_caching {
            for (b, s) in seq.block_seqs.iter().enumerate().take(max_hit_blocks) {
                if !cpu_hits.is_empty() {
                    match self.pool.cpu_lookup(*s) {
                        Some(block) => cpu_hits.push((b, block.clone())),
                        None => break,
                    }
                } else if let Some(block) = self.pool.lookup(*s) {
                    gpu_hits.push(block);
                } else if let Some(block) = self.pool.cpu_lookup(*s) {
                    cpu_hits.push((b, block.clone()));
                } else {
                    break;
                }
            }
        }
        let hit_blocks = gpu_hits.len() + cpu_hits.len();
        let hit_tokens = hit_blocks as u32 * bs;
        let n = (known - hit_tokens).min(budget);
        let total_blocks = (hit_tokens + n).div_ceil(bs) as usize;
        let fresh = total_blocks - gpu_hits.len();
        // Shared hits that sit in the free queue stop being free once taken.
        let free_hits = gpu_hits.iter().filter(|b| self.pool_is_free(**b)).count();
        if fresh + free_hits > self.pool.free() {
            return None;
        }
        let seq = self.seqs.get_mut(&id).expect("waiting request");
        for &b in &gpu_hits {
            self.pool.share(b);
            seq.table.push(b);
        }
        for (_, block) in cpu_hits {
            let b = self.pool.allocate().expect("checked free blocks");
            // Onboarded from host memory: cached on the GPU again.
            self.pool.cache(b, block);
            seq.table.push(b);
        }
        for _ in hit_blocks..total_blocks {
            seq.table
                .push(self.pool.allocate().expect("checked free blocks"));
        }
        seq.computed = hit_tokens;
        seq.cached_upto = hit_blocks;
        if !seq.admitted_once {
            // Like vLLM's `num_cached_tokens`, set at the first scheduling only: a preempted
            // request readmitted onto its own cached blocks did not find them in the cache.
            seq.hit_tokens = hit_tokens.min(seq.prompt_len);
            seq.admitted_once = true;
            self.stats.prompt_tokens_total += u64::from(seq.prompt_len);
            self.stats.cached_tokens_total += u64::from(seq.hit_tokens);
        }
        Some(n)
    }

    fn pool_is_free(&self, block: BlockId) -> bool {
        self.pool.is_free(block)
    }

    /// Registers the blocks that will be full once `upto` tokens are computed, as vLLM v1 does
    /// when it allocates them: a request scheduled later in the same step already hits them.
    fn cache_full_blocks(&mut self, id: RequestId, upto: u32) {
        if !self.config.enable_prefix_caching {
            return;
        }
        let bs = self.config.block_size;
        let seq = self.seqs.get_mut(&id).expect("scheduled request");
        let full = upto as usize / bs;
        while seq.cached_upto < full {
            let b = seq.cached_upto;
            if b == seq.block_seqs.len() {
                // A block that ends in output: token mode hashes its tokens; block mode (trace
                // replay) names it by what determines those tokens (the prompt, through
                // `output_salt`, the engine seed and the position), so it is cached, evicted
                // and announced as a real engine (and the mock engine) caches output blocks.
                let content = match (&seq.tokens, &seq.hasher) {
                    (Some(tokens), Some(hasher)) => {
                        hasher.content_hash(&tokens[b * bs..(b + 1) * bs])
                    }
                    _ => output_block_content(self.config.seed, seq.output_salt, b),
                };
                let parent = seq.block_seqs.last().copied();
                seq.content.push(content);
                seq.block_seqs.push(chain(parent, content));
            }
            let block = CachedBlock {
                seq: seq.block_seqs[b],
                parent: b.checked_sub(1).map(|p| seq.block_seqs[p]),
                content: seq.content[b],
                tokens: seq.tokens.as_ref().map(|t| t[b * bs..(b + 1) * bs].into()),
                namespace: seq.namespace.clone(),
            };
            self.pool.cache(seq.table[b], block);
            seq.cached_upto += 1;
        }
    }

    fn advance(&mut self, id: RequestId, n: u32, out: &mut StepOutcome) {
        let seq = self.seqs.get_mut(&id).expect("scheduled request");
        seq.computed += n;
        if seq.computed < seq.known() {
            return;
        }
        // Sample one token.
        let index = seq.output;
        let raw = filler_token(
            self.config.seed,
            self.config.vocab_size,
            seq.output_salt,
            index,
        );
        let token = self.token_mapper.as_ref().map_or(raw, |m| m(raw));
        if let Some(tokens) = &mut seq.tokens {
            tokens.push(token);
        }
        seq.output += 1;
        out.tokens.push(TokenOut { id, token, index });
        if seq.output >= seq.max_output {
            let seq = self.seqs.remove(&id).expect("scheduled request");
            self.pool.release(&seq.table);
            self.running.retain(|r| *r != id);
            self.stats.finished_total += 1;
            out.finished.push(Finished {
                id,
                prompt_tokens: seq.prompt_len,
                cached_tokens: seq.hit_tokens,
                output_tokens: seq.output,
                preemptions: seq.preemptions,
            });
        }
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

#[cfg(test)]
mod tests;
