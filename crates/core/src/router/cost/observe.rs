//! What the `cost` policy learns as requests end and first tokens arrive: output lengths (per
//! RL group, prompt and overall) and, with `router_cost_fit`, each worker's step times.

use crate::ids::{RequestId, WorkerId};
use crate::router::profiles::FittedProfile;
use crate::router::Router;
use crate::time::Time;

impl Router {
    /// A request's output length, known when it finishes: the `cost` policy learns per RL group,
    /// per prompt and overall. Call before [`Router::finish`]; unknown ids are ignored.
    pub fn observe_output(&mut self, id: RequestId, output_tokens: u64, now: Time) {
        let window = self.session_window();
        let Some(a) = self.cost.forget_request(id, output_tokens, window, now) else {
            return;
        };
        let output_tokens = a.counted(output_tokens);
        if a.samples {
            self.cost.outputs.observe(output_tokens, a.group, a.prompt);
        }
        if self.config.router_cost_fit && a.fits && output_tokens > 1 {
            let spec = self.workers.get(&a.rank.worker);
            let cap = spec.and_then(|s| s.kv_capacity_blocks).unwrap_or(1).max(1) as f64
                * self.config.kv_cache_block_size as f64;
            let kv = self.ledger.load(a.rank).active_decode_blocks as f64
                * self.config.kv_cache_block_size as f64;
            let itl = now.since(a.routed).as_secs_f64() * 1e3 / output_tokens as f64;
            let fit = self.cost.fitted.entry(a.rank.worker).or_default();
            fit.profile.decode.add(kv / cap, itl);
            fit.points += 1;
        }
    }

    /// The request's first token arrived at `now`: its prefill is done (the next request's on
    /// its rank begins), and with `router_cost_fit` its TTFT feeds the worker's prefill line.
    pub fn observe_first_token(&mut self, id: RequestId, now: Time) {
        let Some(a) = self.cost.active.get(&id).copied() else {
            return;
        };
        self.cost.prefill.left(a.rank, id, now);
        if self.config.router_cost_fit && a.fits {
            let ttft = now.since(a.routed).as_secs_f64() * 1e3;
            let fit = self.cost.fitted.entry(a.rank.worker).or_default();
            fit.profile.prefill.add(a.prefill_work, ttft);
            fit.points += 1;
        }
    }

    /// The fitted profile of a worker, if any observation arrived.
    pub fn fitted_profile(&self, worker: WorkerId) -> Option<FittedProfile> {
        self.cost.fitted.get(&worker).map(|f| f.profile)
    }
}
