//! Physical limits of an RL step: no routing can finish step k sooner than
//! `max(longest sample alone, total work / fleet capacity)`, both from the workers' own timing
//! models.
//!
//! - **Longest sample alone**: a sample (a request, or a trajectory's chain of turns) on the
//!   fastest idle worker, its prompt cached as far as any other request of the workload shares
//!   it: per turn, both network hops, its uncached prompt in `max_num_batched_tokens` chunks,
//!   then one decode step per further output token with only its own context in the KV cache,
//!   plus the tool delay before the next turn. Other requests only add to a step (more prefill,
//!   more KV in use, a larger batch), assuming step time never falls when a batch grows or its
//!   KV usage rises (true of `dynamo-poly`, and of measured tables that are monotone).
//! - **Total work / fleet capacity**: the step's prompt tokens that one unbounded cache could
//!   not serve (each distinct block computed once, requests in index order) at the cheapest
//!   per-token prefill cost over chunk sizes, plus its decode tokens (output − 1 per request) at
//!   the cheapest per-token decode cost over batch sizes (empty KV cache), spread over all
//!   workers at once.

use crate::config::SimConfig;
use kvrouter_engine::timing::{by_name, StepShape, TimingModel};
use kvrouter_workload::Workload;
use std::collections::{BTreeMap, HashSet};

/// A distinct worker model (profile at a speed) and how many workers run it.
struct WorkerModel {
    timing: Box<dyn TimingModel>,
    count: usize,
}

/// Lower bounds of each RL step's time, seconds (`None` when a timing model cannot answer).
pub(crate) fn step_lower_bounds(
    config: &SimConfig,
    workload: &Workload,
) -> Option<BTreeMap<u32, f64>> {
    if config.workers == 0 || workload.requests.iter().all(|r| r.step.is_none()) {
        return None;
    }
    let profiles = if config.profiles.is_empty() {
        vec!["dynamo-poly".to_owned()]
    } else {
        config.profiles.clone()
    };
    let mut keys: BTreeMap<(String, u64), usize> = BTreeMap::new();
    for w in 0..config.workers {
        let speed = config
            .speed
            .iter()
            .find(|(x, _)| *x == w)
            .map_or(1.0, |(_, f)| *f);
        *keys
            .entry((profiles[w % profiles.len()].clone(), speed.to_bits()))
            .or_insert(0) += 1;
    }
    let mut models = Vec::with_capacity(keys.len());
    for ((profile, speed), count) in keys {
        models.push(WorkerModel {
            timing: by_name(&profile, f64::from_bits(speed)).ok()?,
            count,
        });
    }
    let bs = config.router.kv_cache_block_size.max(1);
    let engine = &config.engine;
    let capacity_tokens = (engine.num_gpu_blocks * bs) as u64;
    let budget = engine.max_num_batched_tokens.max(1);
    let net_ms = 2.0 * config.network_delay_ms.max(0.0);

    // Prompt tokens a sample alone must compute, and tokens the fleet must compute at least once.
    let blocks: Vec<Vec<u64>> = (0..workload.requests.len())
        .map(|i| {
            workload
                .router_blocks(i, bs)
                .sequence
                .iter()
                .map(|s| s.0)
                .collect()
        })
        .collect();
    let mut owners: std::collections::HashMap<u64, (usize, usize)> = Default::default();
    for (i, b) in blocks.iter().enumerate() {
        for s in b {
            let e = owners.entry(*s).or_insert((i, 0));
            if e.0 != i {
                e.1 += 1;
            }
        }
    }
    let mut seen: HashSet<u64> = HashSet::new();
    // Per step: (prefill tokens, decode tokens, longest sample alone ms).
    let mut steps: BTreeMap<u32, (u64, u64, f64)> = BTreeMap::new();
    let mut chain_ms = vec![0.0f64; workload.requests.len()];
    for (i, r) in workload.requests.iter().enumerate() {
        let cap = (r.input_tokens.saturating_sub(1) as usize) / bs;
        // Alone: cached as far as some other request shares the prefix.
        let shared = blocks[i]
            .iter()
            .take(cap)
            .take_while(|s| {
                owners
                    .get(s)
                    .is_some_and(|(first, others)| *first != i || *others > 0)
            })
            .count();
        let solo_prefill = r.input_tokens - (shared * bs) as u32;
        let mut best = f64::INFINITY;
        for m in &models {
            best = best.min(alone_ms(
                m.timing.as_ref(),
                solo_prefill,
                r,
                budget,
                capacity_tokens,
            )?);
        }
        chain_ms[i] = best + net_ms + r.after.map_or(0.0, |a| chain_ms[a] + r.delay_ms);
        // Fleet: each distinct block computed once.
        let new_blocks = blocks[i]
            .iter()
            .take(cap)
            .filter(|s| seen.insert(**s))
            .count();
        for s in &blocks[i] {
            seen.insert(*s);
        }
        let fleet_prefill = u64::from(r.input_tokens) - ((cap - new_blocks) * bs) as u64;
        if let Some(k) = r.step {
            let e = steps.entry(k).or_insert((0, 0, 0.0));
            e.0 += fleet_prefill;
            e.1 += u64::from(r.output_tokens.saturating_sub(1));
            e.2 = e.2.max(chain_ms[i]);
        }
    }
    // Cheapest per-token costs of each worker; rates add up over the fleet.
    let (mut prefill_rate, mut decode_rate) = (0.0f64, 0.0f64);
    for m in &models {
        let mut pf = f64::INFINITY;
        for t in 1..=u64::from(budget) {
            pf = pf.min(m.timing.prefill_ms(t).ok()? / t as f64);
        }
        let mut dc = f64::INFINITY;
        for b in 1..=engine.max_num_seqs.max(1) as u64 {
            let shape = StepShape {
                decode_seqs: b,
                decode_mean_context: 1.0,
                active_kv_tokens: 0,
                kv_capacity_tokens: capacity_tokens,
                ..StepShape::default()
            };
            dc = dc.min(m.timing.decode_ms(&shape).ok()? / b as f64);
        }
        prefill_rate += m.count as f64 / pf;
        decode_rate += m.count as f64 / dc;
    }
    let same_ratio = proportional(&models);
    Some(
        steps
            .into_iter()
            .map(|(k, (p, d, alone))| {
                // Each worker's busy time splits into prefill and decode parts; with rates that
                // differ in ratio between workers, the two parts bound separately.
                let (p, d) = (p as f64 / prefill_rate, d as f64 / decode_rate);
                let work = if same_ratio { p + d } else { p.max(d) };
                (k, alone.max(work) / 1e3)
            })
            .collect(),
    )
}

/// Whether all workers share one profile (possibly at different speeds): their prefill and
/// decode rates are then in the same ratio, and the two parts of the work add up.
fn proportional(models: &[WorkerModel]) -> bool {
    let ratio = |m: &WorkerModel| {
        let shape = StepShape {
            decode_seqs: 1,
            decode_mean_context: 1.0,
            kv_capacity_tokens: 1,
            ..StepShape::default()
        };
        Some(m.timing.prefill_ms(1024).ok()? / m.timing.decode_ms(&shape).ok()?)
    };
    let first = models.first().and_then(ratio);
    models
        .iter()
        .all(|m| matches!((ratio(m), first), (Some(a), Some(b)) if (a - b).abs() <= 1e-9 * b.abs()))
}

/// One request alone on an idle worker: its uncached prompt in chunks, then its decode steps.
fn alone_ms(
    timing: &dyn TimingModel,
    prefill_tokens: u32,
    r: &kvrouter_workload::WorkloadRequest,
    budget: u32,
    capacity_tokens: u64,
) -> Option<f64> {
    let mut ms = 0.0;
    let mut left = prefill_tokens.max(1);
    while left > 0 {
        let n = left.min(budget);
        ms += timing.prefill_ms(u64::from(n)).ok()?;
        left -= n;
    }
    for k in 1..r.output_tokens {
        let context = u64::from(r.input_tokens) + u64::from(k);
        let shape = StepShape {
            decode_seqs: 1,
            decode_mean_context: context as f64,
            active_kv_tokens: context,
            kv_capacity_tokens: capacity_tokens,
            ..StepShape::default()
        };
        ms += timing.decode_ms(&shape).ok()?;
    }
    Some(ms)
}

#[cfg(test)]
mod tests;
