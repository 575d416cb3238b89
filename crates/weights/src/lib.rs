//! Delta weight sync: ship each new policy version as a compressed XOR delta against the
//! previous one, verified and versioned, through object storage, with in-region peer fan-out.
//! No dependency on the router; `kvrouter weights` and the router's update cycle call it.
//!
//! Layout:
//! - `layout`: a checkpoint directory as files cut into segments (safetensors headers, tensors,
//!   other files).
//! - `checkpoint`: the version marker (`weights.json`): version id and SHA-256 of every segment.
//! - `codec`: one chunk to one zstd frame and back (XOR, byte planes); `sparse`: the changed
//!   elements of an XOR chunk.
//! - `delta`: the delta file format and its manifest.
//! - `map`: read-only memory maps of checkpoint chunks (the crate's one `unsafe`).
//! - `diff`, `apply`: building and applying deltas, streaming in chunks on a thread pool
//!   (`parallel`).
//! - `gen`: test checkpoints (BF16) and the RL-step / adversarial update models.
//! - `store`: object-storage layout (`base/vK/`, `delta/vK-vK+1/`, `latest`); `publish`: a
//!   version into it, continuing the chain; `pull`:
//!   walking the chain down to this machine (recycling superseded versions' files).
//! - `transfer`: resumable, verified downloads from a store or a peer.
//! - `serve`: the in-region peer server.
//! - `workdir`: a pull's work directory: claimed only when new, empty or a pull's, removed after.
//! - `bench`: the throughput / size / memory benchmark.

mod apply;
pub mod bench;

pub mod checkpoint;
mod codec;
pub mod delta;
mod diff;
pub mod digest;
mod error;
pub mod gen;
pub mod layout;
mod map;
mod parallel;
mod publish;
mod pull;
pub mod serve;
mod sparse;
pub mod store;
pub mod transfer;
pub mod workdir;

pub use apply::{apply, apply_recycling};
pub use diff::{diff, CodecOptions, DEFAULT_CHUNK_BYTES, DEFAULT_ZSTD_LEVEL};
pub use error::{Result, WeightsError};
