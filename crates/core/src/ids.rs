//! Identities: workers, data-parallel ranks, requests and the three kinds of block hash.
//!
//! Each identity is a newtype so that a worker id can never be passed where a block hash is
//! expected. Hash newtypes wrap the raw 64-bit pattern; engines send signed or unsigned integers
//! and the bit pattern is what matters.

use serde::{Deserialize, Serialize};
use std::fmt;

macro_rules! id_newtype {
    ($(#[$doc:meta])* $name:ident($inner:ty)) => {
        $(#[$doc])*
        #[derive(
            Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
        )]
        #[serde(transparent)]
        pub struct $name(pub $inner);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}", self.0)
            }
        }

        impl From<$inner> for $name {
            fn from(value: $inner) -> Self {
                Self(value)
            }
        }
    };
}

id_newtype!(
    /// A worker (one engine process or endpoint) known to the router.
    WorkerId(u64)
);
id_newtype!(
    /// A request the router has placed, unique while the request is active.
    RequestId(u64)
);
id_newtype!(
    /// One router replica of a logical router whose replicas share load and placements
    /// (`--replica-sync`). Remote requests are keyed by (replica, request id).
    ReplicaId(u64)
);
id_newtype!(
    /// The content hash of one full block of tokens (XXH3-64, namespaced; see `hashing`).
    ContentHash(u64)
);
id_newtype!(
    /// The router's chained hash of a block and everything before it: equal sequence hashes mean
    /// equal token prefixes. The prefix index navigates by these.
    SequenceHash(u64)
);
id_newtype!(
    /// The engine's own opaque 64-bit block id from its KV events. Never interpreted, only used to
    /// find the block again when the engine removes it.
    EngineHash(u64)
);

impl EngineHash {
    /// Reinterprets a signed engine hash (SGLang sends `i64`) as the same 64-bit pattern.
    pub fn from_signed(value: i64) -> Self {
        Self(value as u64)
    }

    /// Reduces a raw digest (vLLM with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` sends the SHA-256 or
    /// XXH3-128 bytes) to 64 bits the way vLLM's own integer form does: the last eight bytes, read
    /// big-endian. Shorter inputs are left-padded with zeros, so an empty digest is 0.
    pub fn from_digest(bytes: &[u8]) -> Self {
        let mut buf = [0u8; 8];
        let tail = &bytes[bytes.len().saturating_sub(8)..];
        buf[8 - tail.len()..].copy_from_slice(tail);
        Self(u64::from_be_bytes(buf))
    }
}

/// One schedulable unit: a worker and one of its data-parallel ranks. Load, cache state and
/// selection are all per rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct WorkerRank {
    /// The worker.
    pub worker: WorkerId,
    /// The data-parallel rank inside the worker (0 when the worker has one).
    pub dp_rank: u32,
}

impl WorkerRank {
    /// Builds a rank id.
    pub fn new(worker: WorkerId, dp_rank: u32) -> Self {
        Self { worker, dp_rank }
    }
}

impl fmt::Display for WorkerRank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.worker, self.dp_rank)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signed_hashes_keep_their_bit_pattern() {
        assert_eq!(EngineHash::from_signed(-1).0, u64::MAX);
        assert_eq!(
            EngineHash::from_signed(-3488128144981237669).0,
            0xcf97_adee_db59_e05b
        );
    }

    #[test]
    fn digests_reduce_to_their_last_eight_bytes_big_endian() {
        // vLLM 0.33 sha256 of tokens 1..4 (root), wire int 1882140585328457242.
        let digest = [
            0x52, 0xa7, 0xf1, 0x41, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            0x1a, 0x1e, 0xb4, 0xe3, 0xed, 0xd9, 0x36, 0x1a,
        ];
        assert_eq!(EngineHash::from_digest(&digest).0, 1882140585328457242);
        assert_eq!(EngineHash::from_digest(&[]).0, 0);
        assert_eq!(EngineHash::from_digest(&[1, 2]).0, 0x0102);
    }
}
