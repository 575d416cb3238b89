//! What a worker advertises at `/server_info` (SGLang's shape; the mock engine's too), filled
//! into its registration where the registration leaves it out.

use super::get_json;
use crate::config::WorkerEntry;
use crate::state::AppState;
use crate::validate::{MAX_KV_CAPACITY_BLOCKS, MAX_NUM_BATCHED_TOKENS};

/// Fills in what the worker advertises. Its step budget and KV capacity are taken whatever it
/// publishes (the `cost` mode prices every worker with them; an engine without KV events was
/// priced with the router's defaults, which made it look cheaper than its peers); its event
/// endpoints, block size and DP size only from a ZeroMQ publisher. From an engine without
/// events an advertised value out of range is left out (the worker is registered as if it had
/// not said it), as it would have been before: only a publisher's values can refuse it.
pub(super) async fn discover(state: &AppState, entry: &mut WorkerEntry) {
    let url = format!("{}/server_info", entry.url.trim_end_matches('/'));
    let Some(info) = get_json(state, &url).await else {
        return;
    };
    let kv = &info["kv_events"];
    let zmq = kv["publisher"].as_str() == Some("zmq");
    if entry.max_num_batched_tokens.is_none() {
        entry.max_num_batched_tokens = info["max_num_batched_tokens"]
            .as_u64()
            .filter(|&n| zmq || (1..=MAX_NUM_BATCHED_TOKENS).contains(&n));
    }
    if entry.kv_capacity_blocks.is_none() {
        let blocks = info["num_gpu_blocks"].as_u64();
        entry.kv_capacity_blocks = if zmq {
            // In the engine's blocks, which registration then requires to be the router's.
            blocks
        } else {
            // In the router's blocks: this engine's block size need not match them.
            let router_bs = state.inner.config.router.kv_cache_block_size as u64;
            blocks
                .zip(kv["block_size"].as_u64())
                .map(|(n, bs)| n.saturating_mul(bs) / router_bs.max(1))
                .filter(|n| (1..=MAX_KV_CAPACITY_BLOCKS).contains(n))
        };
    }
    if !zmq {
        return;
    }
    let worker_host = entry
        .url
        .split("://")
        .nth(1)
        .and_then(|h| h.split([':', '/']).next())
        .unwrap_or("127.0.0.1")
        .to_owned();
    let host = match kv["endpoint_host"].as_str() {
        None | Some("*" | "0.0.0.0" | "::" | "") => worker_host,
        Some(h) => h.to_owned(),
    };
    let events_discovered = entry.kv_events_endpoint.is_none();
    if events_discovered {
        if let Some(port) = kv["endpoint_port_base"].as_u64() {
            entry.kv_events_endpoint = Some(format!("tcp://{host}:{port}"));
        }
    }
    // Endpoints given at registration win as a set: a replay endpoint is only taken from
    // `/server_info` with the events endpoint (another engine's replay socket would answer for
    // other batches, and live batches would be dropped as duplicates).
    if entry.replay_endpoint.is_none() && events_discovered {
        if let Some(port) = kv["replay_endpoint_port_base"].as_u64() {
            entry.replay_endpoint = Some(format!("tcp://{host}:{port}"));
        }
    }
    // Out-of-range advertised values saturate, so validation refuses them instead of a
    // truncated value passing.
    if entry.block_size.is_none() {
        entry.block_size = kv["block_size"]
            .as_u64()
            .map(|b| usize::try_from(b).unwrap_or(usize::MAX));
    }
    if entry.dp_size.is_none() {
        entry.dp_size = kv["dp_size"]
            .as_u64()
            .map(|d| u32::try_from(d).unwrap_or(u32::MAX));
    }
}
