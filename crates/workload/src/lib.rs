//! kvrouter-workload: what the simulator and the bench replay.
//!
//! A [`Workload`] is a list of requests whose prompts are sequences of block ids of the
//! workload's block size, with arrival rules: an absolute arrival time (open loop), a previous
//! request plus a delay (closed loop: multi-turn sessions, tool calls), or a step of a
//! synchronous RL loop that starts when the previous step has finished. Block ids map to router
//! blocks so the router's block size may be smaller than the trace's (one 512-token Mooncake block
//! is eight 64-token router blocks). Documented in `docs/workloads.md`.
//!
//! # Layout
//! - [`model`]: the workload and its requests; block-id → router-block mapping; the cache ceiling.
//! - [`ceiling`]: hit-rate ceilings of a finite cache (Belady-optimal bound, LRU reference).
//! - [`readers`]: Mooncake JSONL, agentic session JSON, our RL rollout JSONL; format detection.
//! - [`generators`]: GRPO, multi-turn agentic and the seed-001 scenario (seeded).
//! - [`replay`]: when each request starts (arrival times, turns, RL steps, closed loop).
//! - [`seed002`]: seed 002's global-routing scenario (RL steps of agentic rollouts).
//! - [`dist`]: the seeded log-normal and exponential draws the generators use.
//! - [`bounds`]: the ranges of the generators' parameters, checked before generating.

pub mod bounds;
pub mod ceiling;
pub mod dist;
pub mod generators;
pub mod model;
pub mod readers;
pub mod replay;
pub mod seed002;

pub use model::{Barrier, Workload, WorkloadRequest};
pub use readers::{load_trace, LoadError};
