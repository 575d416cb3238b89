//! One scheduler step: running requests first, then waiting ones while the token budget and
//! `max_num_seqs` allow; admission against the block pool (cached prefix blocks skip prefill),
//! preemption of the newest running request when blocks run out, and what each step produced.

use super::{filler_token, output_block_content, Engine, StepOutcome};
use crate::pool::{BlockId, CachedBlock};
use crate::request::{Finished, TokenOut};
use crate::timing::{StepShape, TimingError};
use kvrouter_core::hashing::chain;
use kvrouter_core::ids::RequestId;
use kvrouter_core::time::Time;
use std::time::Duration;

impl Engine {
    pub(super) fn preempt(&mut self, id: RequestId, preempted: &mut Vec<RequestId>) {
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
        let step = Duration::try_from_secs_f64(ms.max(0.0) / 1e3).unwrap_or(super::MAX_STEP);
        out.end = now + step.min(super::MAX_STEP);
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
}
