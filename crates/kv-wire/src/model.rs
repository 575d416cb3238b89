//! The decoded shape of a KV event batch, close to the wire.

use kvrouter_core::ids::EngineHash;

/// A block hash as it was on the wire.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RawHash {
    /// Unsigned integer (vLLM's default).
    Uint(u64),
    /// Signed integer (SGLang).
    Int(i64),
    /// Raw digest bytes (vLLM with integer hashes turned off).
    Bytes(Vec<u8>),
}

impl RawHash {
    /// The 64-bit identity the router keeps.
    pub fn engine_hash(&self) -> EngineHash {
        match self {
            RawHash::Uint(v) => EngineHash(*v),
            RawHash::Int(v) => EngineHash::from_signed(*v),
            RawHash::Bytes(b) => EngineHash::from_digest(b),
        }
    }
}

/// One event.
#[derive(Clone, Debug, PartialEq)]
pub enum WireEvent {
    /// Blocks became cached.
    BlockStored {
        /// Engine hashes of the blocks, in chain order.
        block_hashes: Vec<RawHash>,
        /// The block before the first one.
        parent_block_hash: Option<RawHash>,
        /// The blocks' tokens, concatenated.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// Deprecated vLLM adapter id.
        lora_id: Option<i64>,
        /// Tier name (`GPU`, `CPU`, …).
        medium: Option<String>,
        /// Adapter name.
        lora_name: Option<String>,
        /// Cache salt (SGLang sends it as a field; vLLM inside `extra_keys`).
        cache_salt: Option<String>,
        /// vLLM's per-block extra keys, kept only as the strings they contain.
        extra_key_strings: Vec<Vec<String>>,
        /// KV cache group (hybrid models); absent means 0.
        group_idx: Option<i64>,
        /// KV cache spec kind (`full_attention`, `sliding_window`, …).
        kv_cache_spec_kind: Option<String>,
    },
    /// Blocks were evicted.
    BlockRemoved {
        /// Engine hashes of the evicted blocks.
        block_hashes: Vec<RawHash>,
        /// Tier name.
        medium: Option<String>,
        /// KV cache group.
        group_idx: Option<i64>,
    },
    /// Everything was dropped.
    AllBlocksCleared,
    /// A tagged event of a type this decoder does not know (kept so it can be counted).
    Unknown(String),
}

/// One payload: a batch of events from one engine step.
#[derive(Clone, Debug, PartialEq)]
pub struct WireBatch {
    /// Producer wall clock, seconds.
    pub ts: f64,
    /// The events, in order.
    pub events: Vec<WireEvent>,
    /// The data-parallel rank that published the batch, if it says.
    pub dp_rank: Option<i64>,
}
