//! KV-cache events: what engines tell the router about the blocks they cache and evict.
//!
//! The shapes follow vLLM's and SGLang's `BlockStored` / `BlockRemoved` / `AllBlocksCleared`.
//! Engine block hashes are opaque; the index recomputes its own hashes from the token ids, so it
//! works whatever hash algorithm the engine uses.

use crate::hashing::{BlockHasher, HashNamespace};
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

    /// Hashes a `Stored` event's token contents ahead of the index, in the event's namespace:
    /// each block of `block_size` tokens (the index's block size) becomes
    /// [`BlockContent::Hash`], up to the first block of another size, which stays as it is for
    /// the index to refuse there. Applying the event afterwards changes the index exactly as
    /// applying it before would (and fails the same way); what moves is where the hashing runs.
    /// The server's ingest threads call this before they take the router's lock, so the lock
    /// is held for the tree work only and the hashing of several engines' events runs in
    /// parallel. Other events, and events of another block size, are left unchanged.
    pub fn hash_contents(&mut self, block_size: usize) {
        let KvEvent::Stored {
            blocks,
            block_size: event_block_size,
            namespace,
            ..
        } = self
        else {
            return;
        };
        if *event_block_size != block_size {
            return;
        }
        let hasher = BlockHasher::new(block_size, namespace);
        for block in blocks {
            match &block.content {
                BlockContent::Tokens(tokens) if tokens.len() == block_size => {
                    block.content = BlockContent::Hash(hasher.content_hash(tokens));
                }
                BlockContent::Tokens(_) => return,
                BlockContent::Hash(_) | BlockContent::Sequence(_) => {}
            }
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

    fn stored(blocks: Vec<BlockContent>, namespace: HashNamespace) -> KvEvent {
        KvEvent::Stored {
            worker: WorkerId(1),
            dp_rank: 0,
            parent: None,
            blocks: (0u64..)
                .zip(blocks)
                .map(|(h, content)| StoredBlock {
                    engine_hash: EngineHash(h),
                    content,
                })
                .collect(),
            block_size: 4,
            medium: Medium::Gpu,
            namespace,
        }
    }

    fn contents(event: &KvEvent) -> Vec<BlockContent> {
        match event {
            KvEvent::Stored { blocks, .. } => blocks.iter().map(|b| b.content.clone()).collect(),
            _ => Vec::new(),
        }
    }

    #[test]
    fn hashing_contents_ahead_stops_at_a_block_of_another_size() {
        let lora = HashNamespace {
            lora_name: Some("adapter".into()),
            cache_salt: None,
        };
        let tokens = |t: u32| BlockContent::Tokens(vec![t; 4]);
        let mut event = stored(
            vec![
                tokens(1),
                tokens(2),
                BlockContent::Tokens(vec![3]),
                tokens(4),
            ],
            lora.clone(),
        );
        event.hash_contents(4);
        let hasher = BlockHasher::new(4, &lora);
        assert_eq!(
            contents(&event),
            vec![
                BlockContent::Hash(hasher.content_hash(&[1; 4])),
                BlockContent::Hash(hasher.content_hash(&[2; 4])),
                BlockContent::Tokens(vec![3]),
                tokens(4),
            ],
            "hashed in the event's namespace, up to the short block"
        );
        assert_ne!(
            hasher.content_hash(&[1; 4]),
            BlockHasher::new(4, &HashNamespace::none()).content_hash(&[1; 4]),
            "the namespace changes the hash"
        );
        // The index's block size differs from the event's: the index refuses it whole.
        let mut other = stored(vec![tokens(1)], HashNamespace::none());
        other.hash_contents(8);
        assert_eq!(contents(&other), vec![tokens(1)]);
    }

    #[test]
    fn engine_medium_names_map_to_tiers() {
        assert_eq!(Medium::from_engine_name(None), Medium::Gpu);
        assert_eq!(Medium::from_engine_name(Some("GPU")), Medium::Gpu);
        assert_eq!(Medium::from_engine_name(Some("cpu_pinned")), Medium::Cpu);
        assert_eq!(Medium::from_engine_name(Some("STORAGE")), Medium::Disk);
        assert_eq!(Medium::from_engine_name(Some("EXTERNAL")), Medium::Disk);
    }
}
