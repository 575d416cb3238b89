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
            decode_ms_per_token_per_seq: options.decode_ms_per_token_per_seq,
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

#[cfg(test)]
mod tests {
    use crate::global::{ClusterSummary, SketchConfig, SummaryOptions};
    use crate::ids::WorkerId;
    use crate::policy::RouterMode;
    use crate::router::tests::{request, router, store_event, tokens};
    use crate::time::Time;

    fn options() -> SummaryOptions {
        SummaryOptions {
            name: "dc".into(),
            sequence: 7,
            sketch: SketchConfig::default(),
            prefill_tokens_per_s: 5000.0,
            decode_ms_per_token: 12.0,
            decode_ms_per_token_per_seq: 0.5,
            max_running_requests: 16,
        }
    }

    #[test]
    fn the_summary_holds_the_index_and_the_load() {
        let mut r = router(RouterMode::Kv, 3);
        // Worker 1 holds 37 blocks (148 tokens), worker 2 a different 5-block prompt.
        let long = tokens(1, 148);
        r.apply_event(&store_event(1, &long)).unwrap();
        r.apply_event(&store_event(2, &tokens(2, 20))).unwrap();
        let busy = tokens(3, 40);
        r.route(&request(9, &busy), Time::ZERO).unwrap();
        r.set_available(WorkerId(0), false);
        let s = r.cluster_summary(&options(), Time::from_millis(5)).unwrap();
        assert_eq!((s.name.as_str(), s.sequence, s.block_size), ("dc", 7, 4));
        assert_eq!(s.built_at, Time::from_millis(5));
        assert_eq!(s.load.workers, 2, "the unavailable worker is left out");
        assert_eq!(s.load.max_running_requests, 16);
        assert_eq!(s.load.prefill_tokens_per_s, 5000.0);
        // The request may sit on worker 0 (unavailable now): its load counts only if it is on
        // an available worker.
        let on_available =
            r.ledger().get(crate::ids::RequestId(9)).unwrap().0.worker != WorkerId(0);
        assert_eq!(s.load.active_requests, u64::from(on_available));
        // A continuation of worker 1's run is exact; a fresh prompt misses.
        let mut next = long.clone();
        next.extend(tokens(4, 40));
        let seq = request(1, &next).blocks.sequence;
        assert_eq!(s.cached_prefix_blocks(&seq), 37);
        assert_eq!(
            s.cached_prefix_blocks(&request(2, &tokens(5, 80)).blocks.sequence),
            0
        );
        let back = ClusterSummary::from_bytes(&s.to_bytes()).unwrap();
        assert_eq!(back, s);
    }
}
