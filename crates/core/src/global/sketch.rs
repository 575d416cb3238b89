//! The prefix sketch: a blocked Bloom filter over the sequence hashes a cluster holds at
//! checkpoints (every `checkpoint_interval_blocks`-th block of a chain) and at the ends of its
//! held runs.
//!
//! Sequence hashes are chained, so a cluster that holds block `i` of a prompt holds its whole
//! prefix (the prefix property). The sketch therefore needs only one key every K blocks to find
//! the cached prefix to within K blocks, and the ends of held runs (tree node ends) make the
//! common case exact: a session's next turn extends a run that ends where its last turn did.
//!
//! Each key sets `probes` bits inside one 64-byte block (one cache line), chosen by the key's
//! mixed hash; the number of blocks is a power of two, so two sketches of different sizes merge
//! by folding the larger one (OR of its halves) down to the smaller one before OR-ing them.

use crate::ids::SequenceHash;
use crate::rng::mix64;
use serde::{Deserialize, Serialize};

/// Words (u64) per filter block: 512 bits, one cache line.
pub(super) const WORDS_PER_BLOCK: usize = 8;
const BITS_PER_BLOCK: u64 = 512;

/// Default distance between checkpoints, in blocks.
pub const DEFAULT_CHECKPOINT_INTERVAL_BLOCKS: u32 = 16;
/// Default filter bits per key before rounding up to a power of two (12 to 24 in effect; measured
/// false-positive rate ≤ 0.6 %, see docs/global-routing.md).
pub const DEFAULT_BITS_PER_KEY: u32 = 12;
/// Largest filter accepted (blocks of 64 bytes): 2^20 blocks = 64 MiB.
pub(super) const MAX_LOG2_BLOCKS: u32 = 20;

/// How a sketch is sized and which keys it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SketchConfig {
    /// One checkpoint key every this many blocks of a chain (K ≥ 1).
    pub checkpoint_interval_blocks: u32,
    /// Filter bits per key before rounding the block count up to a power of two.
    pub bits_per_key: u32,
    /// Seed mixed into every key (all sketches that merge must share it).
    pub seed: u64,
}

impl Default for SketchConfig {
    fn default() -> Self {
        Self {
            checkpoint_interval_blocks: DEFAULT_CHECKPOINT_INTERVAL_BLOCKS,
            bits_per_key: DEFAULT_BITS_PER_KEY,
            seed: 0x6b76_726f_7574_6572,
        }
    }
}

/// Why two sketches cannot be merged, or a sketch cannot be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SketchError {
    /// Different checkpoint intervals, seeds or probe counts.
    #[error("sketches differ in {0}")]
    Incompatible(&'static str),
    /// The configuration cannot be used.
    #[error("invalid sketch configuration: {0}")]
    InvalidConfig(&'static str),
}

/// A blocked Bloom filter of prefix checkpoints. See the module documentation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixSketch {
    interval: u32,
    seed: u64,
    probes: u8,
    log2_blocks: u32,
    keys: u64,
    words: Vec<u64>,
}

/// Probes (bits set per key) for a bits-per-key budget: ≈ ln 2 · bits, within 1..=16.
fn probes_for(bits_per_key: u32) -> u8 {
    ((f64::from(bits_per_key) * std::f64::consts::LN_2).round() as u32).clamp(1, 16) as u8
}

impl PrefixSketch {
    /// An empty sketch sized for `expected_keys` keys.
    pub fn with_capacity(config: SketchConfig, expected_keys: usize) -> Result<Self, SketchError> {
        if config.checkpoint_interval_blocks == 0 {
            return Err(SketchError::InvalidConfig(
                "checkpoint interval must be ≥ 1",
            ));
        }
        if config.bits_per_key == 0 || config.bits_per_key > 64 {
            return Err(SketchError::InvalidConfig("bits per key must be in 1..=64"));
        }
        let bits = (expected_keys.max(1) as u64).saturating_mul(u64::from(config.bits_per_key));
        let blocks = bits.div_ceil(BITS_PER_BLOCK).max(1).next_power_of_two();
        let log2_blocks = blocks.trailing_zeros();
        if log2_blocks > MAX_LOG2_BLOCKS {
            return Err(SketchError::InvalidConfig("too many keys for one sketch"));
        }
        Ok(Self {
            interval: config.checkpoint_interval_blocks,
            seed: config.seed,
            probes: probes_for(config.bits_per_key),
            log2_blocks,
            keys: 0,
            words: vec![0; (blocks as usize) * WORDS_PER_BLOCK],
        })
    }

    /// Rebuilds a sketch from its parts (the decoder's entry point); checks their consistency.
    pub(crate) fn from_parts(
        interval: u32,
        seed: u64,
        probes: u8,
        log2_blocks: u32,
        keys: u64,
        words: Vec<u64>,
    ) -> Result<Self, &'static str> {
        if interval == 0 {
            return Err("checkpoint interval is 0");
        }
        if probes == 0 || probes > 16 {
            return Err("probes outside 1..=16");
        }
        if log2_blocks > MAX_LOG2_BLOCKS {
            return Err("filter too large");
        }
        if words.len() != (1usize << log2_blocks) * WORDS_PER_BLOCK {
            return Err("filter length does not match its block count");
        }
        Ok(Self {
            interval,
            seed,
            probes,
            log2_blocks,
            keys,
            words,
        })
    }

    /// Distance between checkpoints, in blocks.
    pub fn checkpoint_interval_blocks(&self) -> u32 {
        self.interval
    }

    /// The seed mixed into keys.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Bits set per key.
    pub fn probes(&self) -> u8 {
        self.probes
    }

    /// log2 of the number of 64-byte filter blocks.
    pub fn log2_blocks(&self) -> u32 {
        self.log2_blocks
    }

    /// Keys inserted (an upper bound after merges: the sum of both sides).
    pub fn keys(&self) -> u64 {
        self.keys
    }

    /// The filter's words.
    pub fn words(&self) -> &[u64] {
        &self.words
    }

    /// Size of the filter in bytes.
    pub fn filter_bytes(&self) -> usize {
        self.words.len() * 8
    }

    /// The expected false-positive rate per probe from the fill (fraction of bits set, to the
    /// power of the probe count): a rough figure; the bench measures the real one.
    pub fn estimated_false_positive_rate(&self) -> f64 {
        let set: u64 = self.words.iter().map(|w| u64::from(w.count_ones())).sum();
        let fill = set as f64 / (self.words.len() as f64 * 64.0);
        fill.powi(i32::from(self.probes))
    }

    /// The key's block (first word index) and its in-block bit mask, 8 words.
    #[inline]
    fn locate(&self, key: SequenceHash) -> (usize, [u64; WORDS_PER_BLOCK]) {
        let h = mix64(key.0 ^ self.seed);
        let block = (h & ((1u64 << self.log2_blocks) - 1)) as usize;
        // Independent 9-bit positions, seven from each 64-bit mix (double hashing inside so
        // small a block correlates keys' patterns and raises false positives).
        let mut mask = [0u64; WORDS_PER_BLOCK];
        let mut g = h;
        for i in 0..usize::from(self.probes) {
            if i % 7 == 0 {
                g = mix64(g);
            }
            let bit = (g >> (9 * (i % 7))) & (BITS_PER_BLOCK - 1);
            mask[(bit / 64) as usize] |= 1 << (bit % 64);
        }
        (block * WORDS_PER_BLOCK, mask)
    }

    /// Adds a key.
    pub fn insert(&mut self, key: SequenceHash) {
        let (base, mask) = self.locate(key);
        for (w, m) in self.words[base..base + WORDS_PER_BLOCK]
            .iter_mut()
            .zip(mask)
        {
            *w |= m;
        }
        self.keys += 1;
    }

    /// Whether the key may be present (false positives at the stated rate, no false negatives).
    #[inline]
    pub fn contains(&self, key: SequenceHash) -> bool {
        let (base, mask) = self.locate(key);
        self.words[base..base + WORDS_PER_BLOCK]
            .iter()
            .zip(mask)
            .all(|(w, m)| w & m == m)
    }

    /// The cached prefix, in blocks, of a prompt with these sequence hashes: walks checkpoints
    /// while they hit, then looks in the gap before the first missing checkpoint for the last
    /// held block (a run end). Never below the true prefix when every held key was inserted;
    /// above it only through a false positive.
    pub fn cached_prefix_blocks(&self, blocks: &[SequenceHash]) -> usize {
        let k = self.interval as usize;
        let mut confirmed = 0;
        let mut pos = k - 1;
        while pos < blocks.len() && self.contains(blocks[pos]) {
            confirmed = pos + 1;
            pos += k;
        }
        let end = pos.min(blocks.len());
        (confirmed..end)
            .rev()
            .find(|&p| self.contains(blocks[p]))
            .map_or(confirmed, |p| p + 1)
    }

    /// Folds the filter down to `log2_blocks` blocks (OR of halves): keeps every key, at a
    /// higher false-positive rate.
    fn fold_to(&mut self, log2_blocks: u32) {
        while self.log2_blocks > log2_blocks {
            let half = self.words.len() / 2;
            let (low, high) = self.words.split_at_mut(half);
            for (l, h) in low.iter_mut().zip(high.iter()) {
                *l |= *h;
            }
            self.words.truncate(half);
            self.log2_blocks -= 1;
        }
    }

    /// Merges another sketch into this one (the union of their keys). Both must share interval,
    /// seed and probes; the larger filter is folded to the smaller size first.
    pub fn merge(&mut self, other: &PrefixSketch) -> Result<(), SketchError> {
        if self.interval != other.interval {
            return Err(SketchError::Incompatible("checkpoint interval"));
        }
        if self.seed != other.seed {
            return Err(SketchError::Incompatible("seed"));
        }
        if self.probes != other.probes {
            return Err(SketchError::Incompatible("probes"));
        }
        let target = self.log2_blocks.min(other.log2_blocks);
        self.fold_to(target);
        let mut theirs = other.clone();
        theirs.fold_to(target);
        for (a, b) in self.words.iter_mut().zip(theirs.words.iter()) {
            *a |= *b;
        }
        self.keys += other.keys;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(seed: u64, n: usize) -> Vec<SequenceHash> {
        (0..n as u64)
            .map(|i| SequenceHash(mix64(seed ^ mix64(i))))
            .collect()
    }

    fn sketch_of(chains: &[(Vec<SequenceHash>, usize)], k: u32) -> PrefixSketch {
        let config = SketchConfig {
            checkpoint_interval_blocks: k,
            ..SketchConfig::default()
        };
        let mut s = PrefixSketch::with_capacity(config, 1000).unwrap();
        for (c, held) in chains {
            for (d, h) in c[..*held].iter().enumerate() {
                if (d + 1) % k as usize == 0 || d + 1 == *held {
                    s.insert(*h);
                }
            }
        }
        s
    }

    #[test]
    fn run_ends_are_exact_and_mid_run_divergence_is_within_one_interval() {
        let a = chain(1, 100);
        let s = sketch_of(&[(a.clone(), 37)], 16);
        // Continuation of the held run: exact.
        assert_eq!(s.cached_prefix_blocks(&a), 37);
        assert_eq!(
            s.cached_prefix_blocks(&a[..20]),
            16,
            "rounded down to the checkpoint"
        );
        // Diverging at 40 inside a run held to 70: rounded down to a checkpoint (32).
        let s = sketch_of(&[(a.clone(), 70)], 16);
        let mut b = a[..40].to_vec();
        b.extend(chain(2, 30));
        assert_eq!(s.cached_prefix_blocks(&b), 32);
        assert_eq!(s.cached_prefix_blocks(&chain(3, 50)), 0);
        assert_eq!(s.cached_prefix_blocks(&[]), 0);
    }

    #[test]
    fn merge_of_different_sizes_keeps_every_key() {
        let config = SketchConfig::default();
        let mut small = PrefixSketch::with_capacity(config, 10).unwrap();
        let mut big = PrefixSketch::with_capacity(config, 10_000).unwrap();
        let a = chain(5, 64);
        let b = chain(6, 64);
        a.iter().for_each(|h| small.insert(*h));
        b.iter().for_each(|h| big.insert(*h));
        small.merge(&big).unwrap();
        assert!(a.iter().chain(b.iter()).all(|h| small.contains(*h)));
        assert_eq!(small.keys(), 128);
        let other = PrefixSketch::with_capacity(SketchConfig { seed: 1, ..config }, 10).unwrap();
        assert_eq!(small.merge(&other), Err(SketchError::Incompatible("seed")));
    }

    #[test]
    fn measured_false_positive_rate_is_below_one_percent_at_the_default() {
        let n = 50_000;
        let mut s = PrefixSketch::with_capacity(SketchConfig::default(), n).unwrap();
        chain(7, n).into_iter().for_each(|h| s.insert(h));
        let fp = chain(8, 100_000)
            .into_iter()
            .filter(|h| s.contains(*h))
            .count();
        let rate = fp as f64 / 100_000.0;
        assert!(rate < 0.01, "false-positive rate {rate}");
        assert!(s.estimated_false_positive_rate() < 0.01);
    }
}
