//! The cluster summary a local router publishes for global routing.

use super::Router;
use crate::global::{ClusterLoad, ClusterSummary, PrefixSketch, SketchError, SummaryOptions};
use crate::time::Time;

impl Router {
    /// This router's cluster summary at `now`: a prefix sketch of the blocks the event-fed
    /// prefix index holds (checkpoints and run ends, any tier) and the load of its available,
    /// unpaused workers. The host adds what the router cannot know ([`SummaryOptions`]).
    pub fn cluster_summary(
        &self,
        options: &SummaryOptions,
        now: Time,
    ) -> Result<ClusterSummary, SketchError> {
        let interval = options.sketch.checkpoint_interval_blocks;
        let keys = self.index.checkpoint_keys(interval);
        let mut sketch = PrefixSketch::with_capacity(options.sketch, keys.len())?;
        keys.into_iter().for_each(|k| sketch.insert(k));
        let mut load = ClusterLoad {
            prefill_tokens_per_s: options.prefill_tokens_per_s,
            decode_ms_per_token: options.decode_ms_per_token,
            max_running_requests: options.max_running_requests,
            ..ClusterLoad::default()
        };
        let mut capacity = 0u64;
        for rank in &self.ranks {
            if !self.is_available(rank.worker) || self.paused.contains(&rank.worker) {
                continue;
            }
            let l = self.ledger.load(*rank);
            load.workers += 1;
            load.active_requests += u64::from(l.active_requests);
            load.active_prefill_tokens += l.active_prefill_tokens;
            load.active_decode_blocks += l.active_decode_blocks;
            capacity += self
                .workers
                .get(&rank.worker)
                .and_then(|w| w.kv_capacity_blocks)
                .unwrap_or(0);
        }
        load.free_kv_blocks = capacity.saturating_sub(load.active_decode_blocks);
        let queue = self.queue_stats();
        load.queue_depth = queue.pending_requests as u64;
        load.queued_prefill_tokens = queue.pending_isl_tokens;
        Ok(ClusterSummary {
            name: options.name.clone(),
            built_at: now,
            sequence: options.sequence,
            block_size: self.config.kv_cache_block_size as u32,
            sketch,
            load,
        })
    }
}
