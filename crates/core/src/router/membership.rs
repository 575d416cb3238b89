//! Membership: registering and removing workers, taking them out of (and back into) the
//! eligible set, and forgetting what they cached.

use super::{RouteError, Router, WorkerSpec, MAX_DP_SIZE};
use crate::approx::ApproxIndex;
use crate::ids::{WorkerId, WorkerRank};
use crate::index::TierCapacity;

impl Router {
    /// Registers a worker and its ranks. Refuses impossible specs (no ranks, more than
    /// [`MAX_DP_SIZE`] ranks, a zero token budget or capacity) with
    /// [`RouteError::InvalidWorker`].
    pub fn add_worker(&mut self, spec: WorkerSpec) -> Result<(), RouteError> {
        if self.workers.contains_key(&spec.id) {
            return Err(RouteError::DuplicateWorker(spec.id));
        }
        let invalid = |why| Err(RouteError::InvalidWorker(spec.id, why));
        if spec.dp_size == 0 {
            return invalid("dp_size must be at least 1");
        }
        if spec.dp_size > MAX_DP_SIZE {
            return invalid("dp_size is over the limit (kvrouter_core::router::MAX_DP_SIZE)");
        }
        if spec.max_num_batched_tokens == Some(0) {
            return invalid("max_num_batched_tokens must be at least 1");
        }
        if spec.kv_capacity_blocks == Some(0) {
            return invalid("kv_capacity_blocks must be at least 1");
        }
        // The declared capacity is the GPU pool's; offload tiers get at least the default.
        let default = self.config.router_index_max_blocks_per_worker;
        let gpu = spec
            .kv_capacity_blocks
            .map_or(default, |c| usize::try_from(c).unwrap_or(usize::MAX));
        let capacity = TierCapacity {
            gpu_blocks: gpu,
            offload_blocks: gpu.max(default),
        };
        self.index.set_worker_capacity(spec.id, Some(capacity));
        if !spec.kv_events && self.predicted.is_none() {
            // Its cache is predicted from routing, beside the event-fed index of the others.
            let ttl = self.config.router_ttl_secs;
            self.predicted = Some(ApproxIndex::new(
                self.config.kv_cache_block_size,
                self.config.approx_config(ttl),
            ));
        }
        self.workers.insert(spec.id, spec);
        self.rebuild_ranks();
        Ok(())
    }

    /// Forgets a worker and drops all its cached blocks. Its active requests stay in the ledger
    /// until the host finishes or cancels them.
    pub fn remove_worker(&mut self, id: WorkerId) -> Result<WorkerSpec, RouteError> {
        let spec = self
            .workers
            .remove(&id)
            .ok_or(RouteError::UnknownWorker(id))?;
        self.unavailable.remove(&id);
        self.paused.remove(&id);
        self.paused_by_update.remove(&id);
        self.index.remove_worker(id);
        self.index.set_worker_capacity(id, None);
        if let Some(p) = &mut self.predicted {
            p.remove_worker(id);
        }
        self.cost_worker_removed(id);
        self.rebuild_ranks();
        Ok(spec)
    }

    /// Takes a worker out of (false) or back into (true) the eligible set without touching its
    /// load accounting or cache state. Returns whether the worker is known.
    pub fn set_available(&mut self, id: WorkerId, available: bool) -> bool {
        if !self.workers.contains_key(&id) {
            return false;
        }
        if available {
            self.unavailable.remove(&id);
        } else {
            self.unavailable.insert(id);
        }
        true
    }

    /// Whether a worker is in the eligible set (known, not unavailable, not paused).
    pub fn is_available(&self, id: WorkerId) -> bool {
        self.workers.contains_key(&id) && !self.excluded(id)
    }

    /// Forgets everything cached on a worker (event-fed and predicted), e.g. after it was
    /// unhealthy for a while or came back under the same id.
    pub fn clear_worker_cache(&mut self, id: WorkerId) {
        self.index.remove_worker(id);
        if let Some(p) = &mut self.predicted {
            p.remove_worker(id);
        }
    }

    fn rebuild_ranks(&mut self) {
        self.ranks = self
            .workers
            .values()
            .flat_map(|w| (0..w.dp_size).map(move |r| WorkerRank::new(w.id, r)))
            .collect();
    }
}
