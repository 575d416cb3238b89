//! kvrouter-kv-wire: the KV-cache event wire format engines publish over ZeroMQ.
//!
//! A message has three frames: topic, an 8-byte big-endian sequence number, and a msgpack
//! payload `[ts, events, dp_rank]` (two elements in old vLLM). Events are tagged maps
//! (`{"type": "BlockStored", ...}`, vLLM ≥ 0.24, SGLang ≥ 0.5.20) or tagged arrays
//! (`["BlockStored", ...]`, older). Block hashes are unsigned (vLLM), signed (SGLang) or raw
//! digest bytes (vLLM without integer hashes). The decoder accepts all of these, ignores unknown
//! fields, and never panics on malformed input; the encoder writes vLLM 0.33's map shape.
//! Pure: no sockets here, so the router and the mock engine share it.
//!
//! # Layout
//! - [`model`]: the decoded batch and events.
//! - [`decode`]: payload bytes → model (tolerant), read by `msgpack`'s slice reader (in one pass
//!   where the payload has the usual shape).
//! - [`encode`]: model → payload bytes (vLLM map shape), and frames.
//! - [`convert`]: model ↔ the core's `KvEvent`s.

pub mod convert;
pub mod decode;
pub mod encode;
pub mod model;
mod msgpack;

pub use convert::{from_kv_events, to_kv_events, ConvertError, ConvertOptions};
pub use decode::{decode_payload, decode_seq, WireError};
pub use encode::{encode_frames, encode_payload, Frames};
pub use model::{RawHash, WireBatch, WireEvent};
