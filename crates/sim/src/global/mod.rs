//! The global simulation (`kvrouter sim --clusters FILE`): several datacenters, each with its
//! own local router (the same core as `kvrouter serve`) and engines, behind one global router
//! ([`kvrouter_core::global::GlobalRouter`]) that sees each datacenter only through the
//! summaries it publishes every refresh period, delayed by the network.
//!
//! Layout: `config.rs` (the clusters file), `dc.rs` (one datacenter), `replay.rs` (RL steps
//! with sessions in flight), `run.rs` (the event loop), `summary.rs` (`summary.json`), `critical.rs` (the rollout that ends each step),
//! `report.rs` (`report.html`).

pub mod config;
mod critical;
mod dc;
mod replay;
pub mod report;
mod run;
pub mod summary;
#[cfg(test)]
mod tests;

pub use config::{ClustersFile, GlobalSimConfig};
pub use critical::CriticalRollout;
pub use run::GlobalSimulation;
pub use summary::GlobalSummary;
