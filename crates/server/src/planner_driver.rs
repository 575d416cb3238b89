//! The planner's drivers: the ticks that read the router's state into the advisor
//! ([`crate::planner`], `--planner-advise`) and hand its recommendations to the actuator
//! ([`crate::planner_act`], `--planner-act`). Kept apart from both so that `state`, which holds
//! the advisor and the actuator, is not reached back by them.

use crate::discovery::backoff::Backoff;
use crate::planner::{Advisor, DEFAULT_POOL};
use crate::state::Inner;
use kube::Client;
use kvrouter_core::planner::PoolSignals;
use std::sync::Arc;
use tokio::task::JoinHandle;

/// Each pool's signals now (latencies are added from the histograms).
fn signals(inner: &Inner) -> Vec<(String, PoolSignals)> {
    // The pools' members first, then the core: never both locks at once.
    let by_model: Vec<(String, Option<Vec<_>>)> = {
        let pools = inner.pools.read().expect("pools lock");
        pools
            .union()
            .into_iter()
            .filter(|c| c.parent.is_none())
            .map(|c| {
                let ws = pools.workers_for(&c.id);
                (c.id, ws)
            })
            .collect()
    };
    let core = inner.lock_core();
    let all: Vec<_> = core.workers().map(|w| w.id).collect();
    let members: Vec<(String, Vec<_>)> = if by_model.is_empty() {
        vec![(DEFAULT_POOL.to_owned(), all)]
    } else {
        by_model
            .into_iter()
            .map(|(m, ws)| (m, ws.unwrap_or_else(|| all.clone())))
            .collect()
    };
    let queued = core.queue_stats().pending_requests as u64;
    let rl = inner
        .planner
        .as_ref()
        .map(Advisor::rl_requests)
        .unwrap_or_default();
    members
        .into_iter()
        .map(|(pool, workers)| {
            let mut s = PoolSignals {
                queued_requests: queued,
                ..PoolSignals::default()
            };
            for spec in core.workers().filter(|w| workers.contains(&w.id)) {
                if core.is_available(spec.id) {
                    s.workers += 1;
                }
                s.rl_requests += rl.get(&spec.id).copied().unwrap_or(0);
                s.batched_tokens_per_worker = s.batched_tokens_per_worker.max(
                    spec.max_num_batched_tokens
                        .map(|t| t * u64::from(spec.dp_size)),
                );
                s.kv_blocks_per_worker = s
                    .kv_blocks_per_worker
                    .max(spec.kv_capacity_blocks.map(|b| b * u64::from(spec.dp_size)));
            }
            for rank in core.ranks().iter().filter(|r| workers.contains(&r.worker)) {
                let load = core.load(*rank);
                s.in_flight_requests += u64::from(load.active_requests);
                s.prefill_tokens += load.active_prefill_tokens;
                s.decode_blocks += load.active_decode_blocks;
            }
            (pool, s)
        })
        .collect()
}

/// The advisor's ticks (none without `--planner-advise`).
pub(crate) fn spawn_advisor(inner: Arc<Inner>) -> Option<JoinHandle<()>> {
    let tick = inner.planner.as_ref()?.tick_interval();
    Some(tokio::spawn(async move {
        let mut interval = tokio::time::interval(tick);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            let Some(advisor) = inner.planner.as_ref() else {
                return;
            };
            let now = inner.now();
            for (pool, s) in signals(&inner) {
                let hists = inner
                    .metrics
                    .by_model
                    .peek(&pool)
                    .map(|m| (m.ttft.snapshot(), m.itl.snapshot()));
                advisor.tick(now, &pool, s, hists);
            }
        }
    }))
}

/// The actuator's ticks (none without `--planner-act`).
pub(crate) fn spawn_actuator(inner: Arc<Inner>) -> Option<JoinHandle<()>> {
    let tick = inner.planner.as_ref()?.tick_interval();
    inner.planner_act.as_ref()?;
    Some(tokio::spawn(async move {
        let mut backoff = Backoff::new(crate::planner_act::CLIENT_BACKOFF_MAX);
        let client = loop {
            match Client::try_default().await {
                Ok(c) => break c,
                Err(e) => {
                    tracing::warn!("planner: no usable kube config: {e}");
                    if let Some(act) = inner.planner_act.as_ref() {
                        act.client_failed();
                    }
                    tokio::time::sleep(backoff.failed()).await;
                }
            }
        };
        let mut interval = tokio::time::interval(tick);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            let (Some(act), Some(advisor)) = (inner.planner_act.as_ref(), inner.planner.as_ref())
            else {
                return;
            };
            act.tick(&client, advisor, inner.now()).await;
        }
    }))
}
