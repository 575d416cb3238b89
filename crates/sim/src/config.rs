//! Simulation settings.

use kvrouter_core::router::RouterConfig;
use kvrouter_engine::EngineConfig;
use serde::{Deserialize, Serialize};

/// The largest fleet one simulation runs (each engine is simulated in full).
pub const MAX_WORKERS: usize = 4096;

/// Everything a run needs besides the workload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SimConfig {
    /// Label of this configuration in tables and reports.
    pub name: String,
    /// Number of engine workers.
    pub workers: usize,
    /// The router's configuration (the same tree `kvrouter serve` uses).
    pub router: RouterConfig,
    /// Engine sizes and limits (the block size is the router's).
    pub engine: EngineConfig,
    /// Timing profile per worker, cycled (`dynamo-poly`, a built-in profile or a file), so a slower
    /// group of workers can be modelled.
    pub profiles: Vec<String>,
    /// Delay from a block being cached to the router seeing its event, ms.
    pub kv_event_delay_ms: f64,
    /// One-way network delay between router and engines, ms.
    pub network_delay_ms: f64,
    /// The router's ingress time per prompt token, µs: receiving and parsing the request body,
    /// tokenizing and hashing the prompt, before the request is routed. With it, requests that
    /// arrive together are routed shortest first, as a live router's are (a long prompt's body is
    /// still being read when a short one sent just after it is placed). 0: routed on arrival.
    pub ingress_us_per_token: f64,
    /// Stop sending after this many simulated ms, as `kvrouter bench --duration-s` does: a
    /// request due later is not sent and does not count (nor do the later turns of its
    /// session). `None`: the whole workload.
    #[serde(default)]
    pub duration_ms: Option<f64>,
    /// Divides open-loop arrival times.
    pub arrival_speedup: f64,
    /// Closed-loop replay: keep this many requests in flight, ignoring arrival times.
    pub concurrency: Option<usize>,
    /// Workers that die, and when (ms): their requests fail or migrate.
    pub failures: Vec<(usize, f64)>,
    /// Workers that run slower (factor < 1) or faster (> 1) than their profile.
    pub speed: Vec<(usize, f64)>,
    /// Times a request on a dead worker may be continued elsewhere (0 = it fails).
    pub migration_limit: u32,
    /// Requests carry their RL group's size (`x-kvrouter-group-size`), which turns on
    /// fair-share group placement.
    pub group_sizes: bool,
    /// Requests carry their RL group's id (`x-kvrouter-group-id`). False: the router sees
    /// siblings only as requests with the same prompt, as behind a client that sends no group
    /// headers (`kvrouter bench` without `--group-header`).
    #[serde(default = "yes")]
    pub group_ids: bool,
    /// First-N-of-M: once this many samples of a group finished, the rest are ended
    /// (`x-kvrouter-group-need`).
    pub group_need: Option<u32>,
    /// Weight updates run by the router when an RL step's last sample finishes (`None`: the
    /// step barrier's pause only, engines keep their cache).
    pub weight_update: Option<WeightUpdate>,
    /// Router replicas; request i goes to replica i mod N (a round-robin load balancer).
    /// Replica 0 drives weight updates.
    #[serde(default = "one")]
    pub router_replicas: usize,
    /// Time before a replica sees another's events (load, placements, sessions, groups,
    /// versions, update holds), ms.
    #[serde(default)]
    pub replica_sync_delay_ms: f64,
    /// Replicas share their events (false: each sees only its own requests and the engines'
    /// KV events).
    #[serde(default = "yes")]
    pub replica_sync: bool,
    /// The planner in the loop: `workers` is the starting fleet, resized every tick.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub planner: Option<crate::sim::PlannerSim>,
}

fn one() -> usize {
    1
}

fn yes() -> bool {
    true
}

/// How the simulated router updates weights between (or, with staleness, during) RL steps.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WeightUpdate {
    /// drain, abort or rolling.
    pub mode: kvrouter_core::router::UpdateMode,
    /// Workers at a time in rolling mode.
    pub batch: usize,
    /// Time an engine takes to load weights, ms.
    pub load_ms: f64,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            name: "kv".into(),
            workers: 8,
            router: RouterConfig::default(),
            engine: EngineConfig::default(),
            profiles: vec!["dynamo-poly".into()],
            kv_event_delay_ms: 50.0,
            network_delay_ms: 0.0,
            ingress_us_per_token: 0.0,
            duration_ms: None,
            arrival_speedup: 1.0,
            concurrency: None,
            failures: Vec::new(),
            speed: Vec::new(),
            migration_limit: 0,
            group_sizes: false,
            group_ids: true,
            group_need: None,
            weight_update: None,
            router_replicas: 1,
            replica_sync_delay_ms: 0.0,
            replica_sync: true,
            planner: None,
        }
    }
}
