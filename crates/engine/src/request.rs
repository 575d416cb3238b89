//! Requests as the engine receives them, and what it reports about them.

use kvrouter_core::hashing::{BlockHasher, BlockHashes, HashNamespace};
use kvrouter_core::ids::RequestId;
use serde::{Deserialize, Serialize};

/// A prompt: real token ids (server mode) or block hashes with a length (trace replay).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    /// Token ids; the engine hashes full blocks itself, in `namespace`.
    Tokens {
        /// The ids.
        tokens: Vec<u32>,
        /// Adapter and salt, which change the block hashes.
        namespace: HashNamespace,
    },
    /// Precomputed full-block hashes (router scheme) and the prompt length in tokens.
    Blocks {
        /// Hashes of the full blocks.
        blocks: BlockHashes,
        /// Prompt length; may exceed the full blocks by a partial block.
        len_tokens: u32,
    },
}

impl Prompt {
    /// Token-id prompt without adapter or salt.
    pub fn tokens(tokens: Vec<u32>) -> Self {
        Prompt::Tokens {
            tokens,
            namespace: HashNamespace::none(),
        }
    }

    /// Prompt length in tokens.
    pub fn len_tokens(&self) -> u32 {
        match self {
            Prompt::Tokens { tokens, .. } => tokens.len() as u32,
            Prompt::Blocks { len_tokens, .. } => *len_tokens,
        }
    }

    pub(crate) fn hashes(&self, block_size: usize) -> BlockHashes {
        match self {
            Prompt::Tokens { tokens, namespace } => {
                BlockHasher::new(block_size, namespace).hash_blocks(tokens)
            }
            Prompt::Blocks { blocks, .. } => blocks.clone(),
        }
    }
}

/// A request to run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineRequest {
    /// Unique while the request lives in the engine.
    pub id: RequestId,
    /// The prompt.
    pub prompt: Prompt,
    /// Tokens to generate (at least 1).
    pub max_output_tokens: u32,
}

/// Why the engine refused or ended a request.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// The prompt plus its output can never fit in the KV cache.
    #[error("request needs {needed_blocks} KV blocks but the cache has {capacity_blocks}")]
    TooLong {
        /// Blocks the request needs at its longest.
        needed_blocks: u64,
        /// Blocks the engine has.
        capacity_blocks: u64,
    },
    /// `max_output_tokens` was 0.
    #[error("max_output_tokens must be at least 1")]
    NoOutput,
    /// The id is already in the engine.
    #[error("request {0} is already in the engine")]
    Duplicate(RequestId),
    /// The prompt is empty.
    #[error("the prompt is empty")]
    EmptyPrompt,
}

/// A request that completed, with its accounting.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Finished {
    /// The request.
    pub id: RequestId,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Prompt tokens served from the prefix cache at its first admission (vLLM's
    /// `num_cached_tokens`: a recompute after preemption does not count).
    pub cached_tokens: u32,
    /// Tokens generated.
    pub output_tokens: u32,
    /// Times it was preempted and recomputed.
    pub preemptions: u32,
}

/// One generated token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenOut {
    /// The request.
    pub id: RequestId,
    /// The token id.
    pub token: u32,
    /// Its position in the output (0 = first token).
    pub index: u32,
}
