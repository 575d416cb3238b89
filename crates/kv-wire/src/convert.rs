//! Between wire events and the core's `KvEvent`s.

use crate::model::{RawHash, WireBatch, WireEvent};
use kvrouter_core::event::{BlockContent, KvEvent, Medium, StoredBlock};
use kvrouter_core::hashing::HashNamespace;
use kvrouter_core::ids::WorkerId;

/// Why a wire event could not become a core event (it is counted and skipped).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConvertError {
    /// `token_ids` does not hold `block_size` tokens per block hash.
    #[error("BlockStored has {tokens} tokens for {blocks} blocks of {block_size}")]
    TokenCount {
        /// Tokens sent.
        tokens: usize,
        /// Block hashes sent.
        blocks: usize,
        /// Block size sent.
        block_size: u32,
    },
    /// An event type this decoder does not know.
    #[error("unknown event type {0:?}")]
    UnknownType(String),
    /// A core event that cannot be put on the wire (no token ids).
    #[error("a stored block without token ids cannot be encoded")]
    NoTokens,
}

/// Where a batch came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvertOptions {
    /// The worker whose endpoint published it.
    pub worker: WorkerId,
    /// The rank to use when the batch names none.
    pub default_dp_rank: u32,
}

/// Whether an event belongs to the main attention group (hybrid models publish other groups too,
/// which do not describe reusable full-attention prefixes).
fn main_group(group_idx: Option<i64>, kind: Option<&str>) -> bool {
    let kind_ok = matches!(
        kind,
        None | Some("full_attention" | "mla_attention" | "sink_full_attention")
    );
    matches!(group_idx, None | Some(0)) && kind_ok
}

/// Converts a batch. Events of other KV-cache groups are skipped (`Ok(None)`).
pub fn to_kv_events(
    batch: &WireBatch,
    opts: ConvertOptions,
) -> Vec<Result<Option<KvEvent>, ConvertError>> {
    let worker = opts.worker;
    let dp_rank = batch
        .dp_rank
        .and_then(|r| u32::try_from(r).ok())
        .unwrap_or(opts.default_dp_rank);
    batch
        .events
        .iter()
        .map(|e| match e {
            WireEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                medium,
                lora_name,
                cache_salt,
                group_idx,
                kv_cache_spec_kind,
                ..
            } => {
                if !main_group(*group_idx, kv_cache_spec_kind.as_deref()) {
                    return Ok(None);
                }
                let bs = *block_size as usize;
                if bs == 0 || token_ids.len() != block_hashes.len() * bs {
                    return Err(ConvertError::TokenCount {
                        tokens: token_ids.len(),
                        blocks: block_hashes.len(),
                        block_size: *block_size,
                    });
                }
                let blocks = block_hashes
                    .iter()
                    .zip(token_ids.chunks_exact(bs))
                    .map(|(h, t)| StoredBlock {
                        engine_hash: h.engine_hash(),
                        content: BlockContent::Tokens(t.to_vec()),
                    })
                    .collect();
                Ok(Some(KvEvent::Stored {
                    worker,
                    dp_rank,
                    parent: parent_block_hash.as_ref().map(RawHash::engine_hash),
                    blocks,
                    block_size: bs,
                    medium: Medium::from_engine_name(medium.as_deref()),
                    namespace: HashNamespace {
                        lora_name: lora_name.clone().filter(|s| !s.is_empty()),
                        cache_salt: cache_salt.clone().filter(|s| !s.is_empty()),
                    },
                }))
            }
            WireEvent::BlockRemoved {
                block_hashes,
                medium,
                group_idx,
            } => {
                if !main_group(*group_idx, None) {
                    return Ok(None);
                }
                Ok(Some(KvEvent::Removed {
                    worker,
                    dp_rank,
                    engine_hashes: block_hashes.iter().map(RawHash::engine_hash).collect(),
                    medium: Medium::from_engine_name(medium.as_deref()),
                }))
            }
            WireEvent::AllBlocksCleared => Ok(Some(KvEvent::Cleared { worker, dp_rank })),
            WireEvent::Unknown(tag) => Err(ConvertError::UnknownType(tag.clone())),
        })
        .collect()
}

/// Puts core events on the wire (the mock engine's publisher). Stored blocks need token ids.
pub fn from_kv_events(
    ts: f64,
    dp_rank: u32,
    events: &[KvEvent],
) -> Result<WireBatch, ConvertError> {
    let mut out = Vec::with_capacity(events.len());
    for e in events {
        out.push(match e {
            KvEvent::Stored {
                parent,
                blocks,
                block_size,
                medium,
                namespace,
                ..
            } => {
                let mut token_ids = Vec::with_capacity(blocks.len() * block_size);
                for b in blocks {
                    match &b.content {
                        BlockContent::Tokens(t) => token_ids.extend_from_slice(t),
                        BlockContent::Hash(_) | BlockContent::Sequence(_) => {
                            return Err(ConvertError::NoTokens)
                        }
                    }
                }
                let mut first_keys = Vec::new();
                if let Some(l) = &namespace.lora_name {
                    first_keys.push(l.clone());
                }
                if let Some(salt) = &namespace.cache_salt {
                    first_keys.push(salt.clone());
                }
                WireEvent::BlockStored {
                    block_hashes: blocks
                        .iter()
                        .map(|b| RawHash::Uint(b.engine_hash.0))
                        .collect(),
                    parent_block_hash: parent.map(|p| RawHash::Uint(p.0)),
                    token_ids,
                    block_size: *block_size as u32,
                    lora_id: None,
                    medium: Some(medium.engine_name().to_owned()),
                    lora_name: namespace.lora_name.clone(),
                    cache_salt: namespace.cache_salt.clone(),
                    extra_key_strings: if first_keys.is_empty() {
                        Vec::new()
                    } else {
                        vec![first_keys]
                    },
                    group_idx: Some(0),
                    kv_cache_spec_kind: Some("full_attention".into()),
                }
            }
            KvEvent::Removed {
                engine_hashes,
                medium,
                ..
            } => WireEvent::BlockRemoved {
                block_hashes: engine_hashes.iter().map(|h| RawHash::Uint(h.0)).collect(),
                medium: Some(medium.engine_name().to_owned()),
                group_idx: Some(0),
            },
            KvEvent::Cleared { .. } => WireEvent::AllBlocksCleared,
        });
    }
    Ok(WireBatch {
        ts,
        events: out,
        dp_rank: Some(i64::from(dp_rank)),
    })
}
