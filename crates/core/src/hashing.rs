//! Block hashing: the router's own, engine-independent identity for token blocks.
//!
//! Token ids are cut into full blocks of `block_size` tokens; a trailing partial block is never
//! hashed. Each block gets a [`ContentHash`] (XXH3-64 of its tokens as little-endian `u32`) and a
//! [`SequenceHash`] that chains it to everything before it. The LoRA adapter name and the cache
//! salt are mixed into the seed, so requests that differ only in adapter or salt share no block.
//! The scheme is written down in `docs/hashing.md`.

use crate::ids::{ContentHash, SequenceHash};
use serde::{Deserialize, Serialize};
use xxhash_rust::const_xxh3::const_custom_default_secret;
use xxhash_rust::xxh3::{xxh3_64_with_secret, xxh3_64_with_seed};

/// The base XXH3 seed, shared with Dynamo's router so that hashes can be compared.
pub const BASE_SEED: u64 = 1337;

/// What separates otherwise equal token blocks: the LoRA adapter and the cache salt.
/// Empty strings count as absent.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HashNamespace {
    /// The LoRA adapter name, if the request runs on one.
    pub lora_name: Option<String>,
    /// The cache salt (tenant isolation), if any.
    pub cache_salt: Option<String>,
}

impl HashNamespace {
    /// The namespace of a plain request: no adapter, no salt.
    pub fn none() -> Self {
        Self::default()
    }

    /// The XXH3 seed for content hashes in this namespace: the base seed plus (wrapping)
    /// XXH3-64 of the adapter name with seed 0 and XXH3-64 of the salt with seed 1.
    pub fn seed(&self) -> u64 {
        let mut seed = BASE_SEED;
        if let Some(lora) = self.lora_name.as_deref().filter(|s| !s.is_empty()) {
            seed = seed.wrapping_add(xxh3_64_with_seed(lora.as_bytes(), 0));
        }
        if let Some(salt) = self.cache_salt.as_deref().filter(|s| !s.is_empty()) {
            seed = seed.wrapping_add(xxh3_64_with_seed(salt.as_bytes(), 1));
        }
        seed
    }
}

/// The hashes of a prompt's full blocks: content hashes and the chained sequence hashes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockHashes {
    /// Content hash of each full block.
    pub content: Vec<ContentHash>,
    /// Sequence hash of each full block (chained from the start).
    pub sequence: Vec<SequenceHash>,
}

impl BlockHashes {
    /// Chains precomputed content hashes (for example from a trace's block ids).
    pub fn from_content(content: Vec<ContentHash>) -> Self {
        let sequence = chain_all(None, &content);
        Self { content, sequence }
    }

    /// Number of full blocks.
    pub fn len(&self) -> usize {
        self.sequence.len()
    }

    /// Whether there is no full block.
    pub fn is_empty(&self) -> bool {
        self.sequence.is_empty()
    }
}

/// Hashes token ids into block hashes for one block size and namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockHasher {
    block_size: usize,
    seed: u64,
}

impl BlockHasher {
    /// A hasher for `block_size`-token blocks in `namespace`. A block size of 0 hashes nothing.
    pub fn new(block_size: usize, namespace: &HashNamespace) -> Self {
        Self {
            block_size,
            seed: namespace.seed(),
        }
    }

    /// The block size in tokens.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The content hash of one block of tokens (any length; callers pass full blocks).
    pub fn content_hash(&self, tokens: &[u32]) -> ContentHash {
        ContentHash(hash_block(tokens, self.seed))
    }

    /// The content hashes of every full block of `tokens`.
    pub fn content_hashes(&self, tokens: &[u32]) -> Vec<ContentHash> {
        if self.block_size == 0 {
            return Vec::new();
        }
        tokens
            .chunks_exact(self.block_size)
            .map(|block| self.content_hash(block))
            .collect()
    }

    /// Content and sequence hashes of every full block of `tokens`.
    pub fn hash_blocks(&self, tokens: &[u32]) -> BlockHashes {
        BlockHashes::from_content(self.content_hashes(tokens))
    }

    /// The sequence hashes of every full block of `tokens`, chained from the start.
    pub fn sequence_hashes(&self, tokens: &[u32]) -> Vec<SequenceHash> {
        if self.block_size == 0 {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(tokens.len() / self.block_size);
        let mut parent = None;
        for block in tokens.chunks_exact(self.block_size) {
            let seq = chain(parent, self.content_hash(block));
            out.push(seq);
            parent = Some(seq);
        }
        out
    }
}

/// The next sequence hash: the first block's sequence hash is its content hash; each later one is
/// XXH3-64 (seed 1337) of the previous sequence hash and the content hash, both little-endian.
pub fn chain(parent: Option<SequenceHash>, content: ContentHash) -> SequenceHash {
    match parent {
        None => SequenceHash(content.0),
        Some(parent) => {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&parent.0.to_le_bytes());
            bytes[8..].copy_from_slice(&content.0.to_le_bytes());
            SequenceHash(xxh3_64_with_seed(&bytes, BASE_SEED))
        }
    }
}

/// Chains a run of content hashes onto `parent`.
pub fn chain_all(parent: Option<SequenceHash>, contents: &[ContentHash]) -> Vec<SequenceHash> {
    let mut out = Vec::with_capacity(contents.len());
    let mut prev = parent;
    for &content in contents {
        let seq = chain(prev, content);
        out.push(seq);
        prev = Some(seq);
    }
    out
}

pub(crate) fn hash_block(tokens: &[u32], seed: u64) -> u64 {
    // Serialize on the stack, in a buffer sized to the common block sizes (zeroing a larger one
    // costs as much as hashing a 64-token block); fall back to the heap above that.
    match tokens.len() {
        0..=16 => hash_on_stack::<64>(tokens, seed),
        17..=64 => hash_on_stack::<256>(tokens, seed),
        65..=256 => hash_on_stack::<1024>(tokens, seed),
        _ => {
            let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
            xxh3_seeded(&bytes, seed)
        }
    }
}

/// `xxh3` of the little-endian bytes of at most `BYTES / 4` tokens.
fn hash_on_stack<const BYTES: usize>(tokens: &[u32], seed: u64) -> u64 {
    let mut buf = [0u8; BYTES];
    for (slot, token) in buf.chunks_exact_mut(4).zip(tokens) {
        slot.copy_from_slice(&token.to_le_bytes());
    }
    xxh3_seeded(&buf[..tokens.len() * 4], seed)
}

/// Inputs longer than this take XXH3's long path, where a seed only derives a secret.
const XXH3_MID_SIZE_MAX: usize = 240;

/// The secret XXH3 derives from [`BASE_SEED`], computed once at compile time.
static BASE_SECRET: [u8; 192] = const_custom_default_secret(BASE_SEED);

/// `xxh3_64_with_seed`, without re-deriving the base seed's secret for every long input
/// (XXH3 defines the seeded long hash as the hash with the seed's derived secret).
fn xxh3_seeded(bytes: &[u8], seed: u64) -> u64 {
    if seed == BASE_SEED && bytes.len() > XXH3_MID_SIZE_MAX {
        xxh3_64_with_secret(bytes, &BASE_SECRET)
    } else {
        xxh3_64_with_seed(bytes, seed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_precomputed_base_secret_hashes_like_the_seed() {
        let bytes: Vec<u8> = (0..2048u32).map(|i| (i * 7 + 3) as u8).collect();
        for len in (0..=bytes.len()).filter(|l| *l < 300 || l % 61 == 0) {
            for seed in [BASE_SEED, 0, 42] {
                assert_eq!(
                    xxh3_seeded(&bytes[..len], seed),
                    xxh3_64_with_seed(&bytes[..len], seed),
                    "len {len} seed {seed}"
                );
            }
        }
        for tokens in [16usize, 17, 60, 61, 64, 65, 256, 257, 1000] {
            let block: Vec<u32> = (0..tokens as u32)
                .map(|t| t.wrapping_mul(2_654_435_761))
                .collect();
            let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
            assert_eq!(
                hash_block(&block, BASE_SEED),
                xxh3_64_with_seed(&bytes, BASE_SEED),
                "{tokens} tokens"
            );
        }
    }

    fn ns(lora: Option<&str>, salt: Option<&str>) -> HashNamespace {
        HashNamespace {
            lora_name: lora.map(str::to_owned),
            cache_salt: salt.map(str::to_owned),
        }
    }

    #[test]
    fn partial_blocks_are_never_hashed() {
        let hasher = BlockHasher::new(64, &HashNamespace::none());
        let tokens: Vec<u32> = (0..1800).collect();
        assert_eq!(hasher.sequence_hashes(&tokens).len(), 28);
        assert!(hasher.sequence_hashes(&tokens[..63]).is_empty());
        assert!(BlockHasher::new(0, &HashNamespace::none())
            .sequence_hashes(&tokens)
            .is_empty());
    }

    #[test]
    fn first_sequence_hash_is_the_content_hash_and_later_ones_chain() {
        let hasher = BlockHasher::new(4, &HashNamespace::none());
        let tokens = [1, 2, 3, 4, 5, 6, 7, 8];
        let content = hasher.content_hashes(&tokens);
        let seq = hasher.sequence_hashes(&tokens);
        assert_eq!(seq[0].0, content[0].0);
        assert_eq!(seq[1], chain(Some(seq[0]), content[1]));
        assert_ne!(seq[1].0, content[1].0);
        assert_eq!(chain_all(None, &content), seq);
    }

    #[test]
    fn equal_blocks_after_different_prefixes_get_different_sequence_hashes() {
        let hasher = BlockHasher::new(2, &HashNamespace::none());
        let a = hasher.sequence_hashes(&[1, 2, 9, 9]);
        let b = hasher.sequence_hashes(&[3, 4, 9, 9]);
        assert_ne!(a[1], b[1]);
    }

    #[test]
    fn adapter_and_salt_each_change_every_hash() {
        let tokens: Vec<u32> = (0..16).collect();
        let plain = BlockHasher::new(4, &ns(None, None)).sequence_hashes(&tokens);
        let lora = BlockHasher::new(4, &ns(Some("a"), None)).sequence_hashes(&tokens);
        let salt = BlockHasher::new(4, &ns(None, Some("a"))).sequence_hashes(&tokens);
        let both = BlockHasher::new(4, &ns(Some("a"), Some("a"))).sequence_hashes(&tokens);
        for i in 0..4 {
            let all = [plain[i], lora[i], salt[i], both[i]];
            for x in 0..4 {
                for y in x + 1..4 {
                    assert_ne!(all[x], all[y], "block {i}: namespaces {x} and {y} collide");
                }
            }
        }
        // Empty strings mean absent.
        assert_eq!(
            BlockHasher::new(4, &ns(Some(""), Some(""))).sequence_hashes(&tokens),
            plain
        );
    }

    #[test]
    fn long_blocks_hash_like_short_ones() {
        let tokens: Vec<u32> = (0..1024).collect();
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let hasher = BlockHasher::new(1024, &HashNamespace::none());
        assert_eq!(
            hasher.content_hash(&tokens).0,
            xxh3_64_with_seed(&bytes, BASE_SEED)
        );
    }
}
