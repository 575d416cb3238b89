//! Hit-rate ceilings of a finite cache: what the fleet's combined KV capacity, seen as one cache,
//! could serve on a workload.
//!
//! Requests are walked in a given order (arrival order); each request accesses its router blocks
//! (prefix-chained sequence hashes, as the engines cache them). Only the first
//! `(input_tokens − 1) / block_size` blocks of a request can be hits (an engine always computes
//! the last prompt token); the rest are still computed and may be cached. Rates are
//! token-weighted like the served hit rate: hit blocks × block size over all prompt tokens.
//!
//! - [`FiniteCeilings::optimal`]: Belady's MIN with bypass on one cache of `capacity_blocks`.
//!   Any hit of a real fleet (its engines' caches together hold at most that many blocks, and a
//!   block enters a cache only when some request computes it) is a block present in the union
//!   of the caches, so no routing and no eviction policy serves more, in this order: an upper
//!   bound. It counts a present block as a hit even when a block before it in the prompt is
//!   missing (engines need the whole prefix), which only makes it larger.
//! - [`FiniteCeilings::lru`]: one prefix cache of that capacity with LRU eviction (what a
//!   single engine of the fleet's size would serve). Not a bound: a fleet can beat it.
//! - [`FiniteCeilings::unbounded`]: every block ever computed stays cached (in these units).

use crate::Workload;
use std::collections::{BTreeSet, HashMap};

/// Finite-cache ceilings of a workload, as token-weighted hit rates.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FiniteCeilings {
    /// Belady-optimal cache of the fleet's capacity: an upper bound on any routing.
    pub optimal: f64,
    /// LRU prefix cache of the fleet's capacity: a reference point, not a bound.
    pub lru: f64,
    /// Unbounded cache, same units.
    pub unbounded: f64,
}

/// One block access: the block's sequence hash and whether it may count as a hit.
#[derive(Clone, Copy, Debug)]
struct Access {
    key: u64,
    counted: bool,
}

/// The unbounded ceiling alone (every computed block stays cached), token-weighted: the same
/// units as a served hit rate, which it bounds whatever the routing.
pub fn unbounded_ceiling(workload: &Workload, order: &[usize], block_size: usize) -> f64 {
    let bs = block_size.max(1);
    let mut seen: std::collections::HashSet<u64> = Default::default();
    let (mut hits, mut tokens) = (0u64, 0u64);
    for &i in order {
        let req = &workload.requests[i];
        tokens += u64::from(req.input_tokens);
        let cap = (req.input_tokens.saturating_sub(1) as usize) / bs;
        for (k, s) in workload.router_blocks(i, bs).sequence.iter().enumerate() {
            if !seen.insert(s.0) && k < cap {
                hits += 1;
            }
        }
    }
    if tokens == 0 {
        0.0
    } else {
        (hits * bs as u64) as f64 / tokens as f64
    }
}

/// Computes the ceilings for requests in `order`, router blocks of `block_size` tokens and a
/// combined capacity of `capacity_blocks` blocks.
pub fn finite_ceilings(
    workload: &Workload,
    order: &[usize],
    block_size: usize,
    capacity_blocks: u64,
) -> FiniteCeilings {
    let bs = block_size.max(1);
    let mut requests: Vec<Vec<Access>> = Vec::with_capacity(order.len());
    let mut prompt_tokens = 0u64;
    for &i in order {
        let req = &workload.requests[i];
        prompt_tokens += u64::from(req.input_tokens);
        let cap = (req.input_tokens.saturating_sub(1) as usize) / bs;
        let blocks = workload.router_blocks(i, bs);
        requests.push(
            blocks
                .sequence
                .iter()
                .enumerate()
                .map(|(k, s)| Access {
                    key: s.0,
                    counted: k < cap,
                })
                .collect(),
        );
    }
    if prompt_tokens == 0 {
        return FiniteCeilings::default();
    }
    let rate = |hits: u64| hits as f64 * bs as f64 / prompt_tokens as f64;
    let flat: Vec<Access> = requests.iter().flatten().copied().collect();
    FiniteCeilings {
        optimal: rate(belady_hits(&flat, capacity_blocks)),
        lru: rate(lru_prefix_hits(&requests, capacity_blocks)),
        unbounded: rate(belady_hits(&flat, u64::MAX)),
    }
}

/// Hits of Belady's MIN with bypass. An access that cannot count starts a new life of its block
/// (holding the old copy across it is never better than caching it again there), so a block's
/// next use is its next access only when that one counts.
fn belady_hits(accesses: &[Access], capacity: u64) -> u64 {
    const NEVER: usize = usize::MAX;
    let mut next_use = vec![NEVER; accesses.len()];
    let mut seen: HashMap<u64, usize> = HashMap::new();
    for (t, a) in accesses.iter().enumerate().rev() {
        if let Some(&n) = seen.get(&a.key) {
            if accesses[n].counted {
                next_use[t] = n;
            }
        }
        seen.insert(a.key, t);
    }
    let mut cached: HashMap<u64, usize> = HashMap::new();
    let mut by_next: BTreeSet<(usize, u64)> = BTreeSet::new();
    let mut hits = 0u64;
    for (t, a) in accesses.iter().enumerate() {
        let nu = next_use[t];
        if let Some(old) = cached.remove(&a.key) {
            by_next.remove(&(old, a.key));
            if a.counted {
                hits += 1;
            }
        } else if nu != NEVER && cached.len() as u64 >= capacity {
            // Full: keep the block needed soonest; the one needed last goes (or this one is
            // not cached).
            match by_next.last().copied() {
                Some((far, key)) if far > nu => {
                    by_next.remove(&(far, key));
                    cached.remove(&key);
                }
                _ => continue,
            }
        }
        if nu != NEVER && capacity > 0 {
            cached.insert(a.key, nu);
            by_next.insert((nu, a.key));
        }
    }
    hits
}

/// Hits of one LRU prefix cache: a request hits the longest cached prefix of its countable
/// blocks, then all its blocks become most recently used (new ones inserted, evicting the least
/// recently used).
fn lru_prefix_hits(requests: &[Vec<Access>], capacity: u64) -> u64 {
    let mut last_used: HashMap<u64, u64> = HashMap::new();
    let mut by_age: BTreeSet<(u64, u64)> = BTreeSet::new();
    let mut clock = 0u64;
    let mut hits = 0u64;
    for blocks in requests {
        hits += blocks
            .iter()
            .take_while(|a| a.counted && last_used.contains_key(&a.key))
            .count() as u64;
        for a in blocks {
            clock += 1;
            if let Some(old) = last_used.insert(a.key, clock) {
                by_age.remove(&(old, a.key));
            }
            by_age.insert((clock, a.key));
            if by_age.len() as u64 > capacity {
                let (_, key) = by_age.pop_first().expect("non-empty");
                last_used.remove(&key);
            }
        }
    }
    hits
}

#[cfg(test)]
mod tests;
