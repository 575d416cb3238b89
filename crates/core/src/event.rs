//! KV-cache events: what engines tell the router about the blocks they cache and evict.
//!
//! The shapes follow vLLM's and SGLang's `BlockStored` / `BlockRemoved` / `AllBlocksCleared`.
//! Engine block hashes are opaque; the index recomputes its own hashes from the token ids, so it
//! works whatever hash algorithm the engine uses.

use crate::hashing::HashNamespace;
use crate::ids::{ContentHash, EngineHash, SequenceHash, WorkerId, WorkerRank};
use serde::{Deserialize, Serialize};

/// Where a cached block lives. Lower tiers count for less when routing.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Medium {
    /// Accelerator memory: the block can be used without any transfer.
    #[default]
    Gpu,
    /// Host memory (an offload tier).
    Cpu,
    /// Disk, remote or shared storage: the slowest tier.
    Disk,
}

impl Medium {
    /// Every medium, fastest first.
    pub const ALL: [Medium; 3] = [Medium::Gpu, Medium::Cpu, Medium::Disk];

    /// Maps an engine's medium name to a tier. `None` and unknown names of the device tier mean
    /// GPU; host names (`CPU`, `CPU_PINNED`, `CPU_TIER1`) mean CPU; storage names (`CPU_TIER2`,
    /// `DISK`, `NVME`, `STORAGE`, `EXTERNAL`, `NETWORK`, `REMOTE`, `SHARED`) mean disk.
    pub fn from_engine_name(name: Option<&str>) -> Self {
        let Some(name) = name else { return Medium::Gpu };
        match name.to_ascii_uppercase().as_str() {
            "CPU" | "CPU_PINNED" | "CPU_TIER1" | "HOST" => Medium::Cpu,
            "CPU_TIER2" | "DISK" | "NVME" | "STORAGE" | "EXTERNAL" | "NETWORK" | "REMOTE"
            | "SHARED" => Medium::Disk,
            _ => Medium::Gpu,
        }
    }

    /// The engine-facing name of this tier.
    pub fn engine_name(self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
            Medium::Disk => "DISK",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// What the router knows about one stored block's content.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockContent {
    /// The block's token ids, as engines send them. The index hashes them itself.
    Tokens(Vec<u32>),
    /// A content hash computed by a trusted producer that already hashed the tokens with the
    /// router's scheme in the event's namespace (the mock engine replaying trace hashes).
    Hash(ContentHash),
    /// The router sequence hash itself, from the index's own dump: placed without rehashing. It
    /// must continue its parent's chain; a hash found elsewhere in the tree is refused.
    Sequence(SequenceHash),
}

/// One block of a `Stored` event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredBlock {
    /// The engine's id for this block.
    pub engine_hash: EngineHash,
    /// The block's content.
    pub content: BlockContent,
}

/// A KV-cache event from one worker rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum KvEvent {
    /// Consecutive blocks of one chain became cached.
    Stored {
        /// The worker.
        worker: WorkerId,
        /// Its data-parallel rank.
        dp_rank: u32,
        /// The engine hash of the block before the first one; `None` when the chain starts at
        /// token 0.
        parent: Option<EngineHash>,
        /// The blocks, in chain order.
        blocks: Vec<StoredBlock>,
        /// Tokens per block as the engine counts them.
        block_size: usize,
        /// The tier the blocks were stored in.
        medium: Medium,
        /// Adapter and salt of the blocks (they change the router hashes).
        namespace: HashNamespace,
    },
    /// Blocks were evicted from one tier.
    Removed {
        /// The worker.
        worker: WorkerId,
        /// Its data-parallel rank.
        dp_rank: u32,
        /// The engine hashes of the evicted blocks.
        engine_hashes: Vec<EngineHash>,
        /// The tier they were evicted from.
        medium: Medium,
    },
    /// Every block of the rank, in every tier, is gone.
    Cleared {
        /// The worker.
        worker: WorkerId,
        /// Its data-parallel rank.
        dp_rank: u32,
    },
}

impl KvEvent {
    /// The rank this event is about.
    pub fn rank(&self) -> WorkerRank {
        match self {
            KvEvent::Stored {
                worker, dp_rank, ..
            }
            | KvEvent::Removed {
                worker, dp_rank, ..
            }
            | KvEvent::Cleared { worker, dp_rank } => WorkerRank::new(*worker, *dp_rank),
        }
    }

    /// A short label for metrics: `stored`, `removed` or `cleared`.
    pub fn kind(&self) -> &'static str {
        match self {
            KvEvent::Stored { .. } => "stored",
            KvEvent::Removed { .. } => "removed",
            KvEvent::Cleared { .. } => "cleared",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_medium_names_map_to_tiers() {
        assert_eq!(Medium::from_engine_name(None), Medium::Gpu);
        assert_eq!(Medium::from_engine_name(Some("GPU")), Medium::Gpu);
        assert_eq!(Medium::from_engine_name(Some("cpu_pinned")), Medium::Cpu);
        assert_eq!(Medium::from_engine_name(Some("STORAGE")), Medium::Disk);
        assert_eq!(Medium::from_engine_name(Some("EXTERNAL")), Medium::Disk);
    }
}
