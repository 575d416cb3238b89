//! kvrouter-engine: the mock inference engine's pure state machine.
//!
//! A paged KV cache with prefix caching and LRU eviction, a vLLM-v1-style continuous-batching
//! scheduler with chunked prefill and recompute preemption, and a pluggable timing model. Time is
//! passed in; the engine emits the core's KV events as blocks are cached and evicted. The
//! real-time server (`kvrouter-mock-engine`) and the simulator (`kvrouter-sim`) both drive it.
//!
//! # Layout
//! - [`engine`]: the scheduler and the step loop.
//! - `pool`: the block pool, free queue, CPU tier and event emission.
//! - [`request`]: requests, prompts, outputs and errors.
//! - [`timing`]: timing models (Dynamo's polynomial, table profiles, speed-up).

pub mod engine;
mod pool;
pub mod request;
pub mod timing;

pub use engine::{
    Engine, EngineConfig, EngineStats, StepOutcome, TokenMapper, MAX_NUM_GPU_BLOCKS, MAX_STEP,
    MIN_SPEEDUP_RATIO,
};
pub use request::{EngineError, EngineRequest, Finished, Prompt, TokenOut};
pub use timing::{DynamoPoly, SpeedUp, TableProfile, TimingModel};
