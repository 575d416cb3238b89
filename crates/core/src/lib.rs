//! kvrouter-core: the pure routing core of kvrouter.
//!
//! Events in, decisions out. Nothing here reads a clock, the environment or OS randomness, opens a
//! socket or spawns a thread: time is a value passed in (`now`), and randomized policies own a
//! seeded RNG. The HTTP server and the simulator drive this same core, so a simulated result is
//! evidence about the real router.
//!
//! # Layout
//! - [`ids`]: newtypes for workers, ranks, requests and block hashes.
//! - [`hashing`]: the router's block hashing (content and sequence hashes, namespaces).
//! - [`event`]: KV-cache events (stored, removed, cleared) and storage tiers.
//! - [`index`]: the event-fed prefix index (path-compressed tree) and overlap queries.
//! - [`approx`]: TTL-bounded predicted cache state for workers without events and for the
//!   predicted-placement window.
//! - [`ledger`]: per-rank load accounting (active requests, prefill tokens, decode blocks).
//! - [`policy`]: the selection policies and the KV cost model.
//! - [`planner`]: the planner's control law (recommended workers per pool from live signals).
//! - [`router`]: the [`Router`] façade that ties them together.
//! - [`global`]: global routing across clusters: cluster summaries (prefix sketch + load) and
//!   the global router's policies.
//! - [`rng`]: the small seeded generator randomized policies own.
//! - [`fast_map`]: the map hasher used for ids and hashes.
//! - [`time`]: the `Time` value callers pass as `now`.

pub mod approx;
pub mod event;
pub mod fast_map;
pub mod global;
pub mod hashing;
pub mod ids;
pub mod index;
pub mod ledger;
pub mod planner;
pub mod policy;
pub mod rng;
pub mod router;
mod sorted;
pub mod time;
pub mod timing;

pub use event::{BlockContent, KvEvent, Medium, StoredBlock};
pub use hashing::{BlockHasher, BlockHashes, HashNamespace};
pub use ids::{ContentHash, EngineHash, RequestId, SequenceHash, WorkerId, WorkerRank};
pub use index::{IndexError, OverlapScores, PrefixIndex, TierOverlap};
pub use router::{Decision, RouteError, RouteRequest, Router, RouterConfig, WorkerSpec};
pub use time::Time;
