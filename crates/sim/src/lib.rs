//! kvrouter-sim: a discrete-event simulator that replays workloads through the real routing core
//! ([`kvrouter_core::Router`]) and the real engine model ([`kvrouter_engine::Engine`]), so its
//! results are evidence about kvrouter itself.
//!
//! A run is a pure function of (configuration, workload): events are ordered by (time, sequence),
//! so ties are first-in first-out, and every random choice comes from seeded generators.
//!
//! # Layout
//! - [`config`]: simulation settings.
//! - `queue`: the (time, sequence) event queue.
//! - [`sim`]: the simulation: `step`, `step_until`, `run`; `sim/setup`, `sim/worker`,
//!   `sim/engines` (deliveries, engine steps, worker deaths), `sim/results`; `sim/fleet`: the
//!   planner in the loop.
//! - [`summary`]: what a run reports (`summary.json`); `summary/build`: how a run's records
//!   become one.
//! - [`global`]: the global (multi-datacenter) simulation behind `--clusters`.
//! - [`report`]: the self-contained `report.html`; `fleet_report`: its planner section.
//! - [`plan`]: the planner's search for the smallest fleet meeting a target.
//! - [`plan_report`]: the planner's `report.html`.

mod bounds;
pub mod config;
mod fleet_report;
pub mod global;
pub mod perfetto;
pub mod plan;
pub mod plan_report;
mod queue;
pub mod report;
pub mod sim;
pub mod summary;

pub use config::{SimConfig, MAX_WORKERS};
pub use sim::{PlannerSim, SimError, Simulation};
pub use summary::{sent_only, summarize, Record, Summary};
