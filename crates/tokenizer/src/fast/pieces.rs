//! Ids of pieces seen before: a frequent word costs one hash lookup instead of the model's merges
//! and the strings it allocates per token.
//!
//! Bounded: [`SHARDS`] shards of at most [`MAX_ENTRIES`]` / SHARDS` pieces each; a shard that
//! is full is emptied before the next insert (the cache refills with what is frequent). Pieces
//! longer than [`MAX_PIECE_BYTES`] are not kept. An entry keeps its piece's text, so a hash
//! collision is a miss, never wrong ids. Memory: an entry is at most 64 bytes of text, 64 ids
//! (one per byte) and about 64 bytes of map and allocation overhead, so the cache holds at most
//! about 25 MB per tokenizer; word-sized pieces of one or two ids take about 5 MB when full.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Mutex;
use xxhash_rust::xxh3::xxh3_64;

/// Shards (locks) of the cache.
pub(crate) const SHARDS: usize = 16;
/// Pieces held at most, over all shards.
pub(crate) const MAX_ENTRIES: usize = 1 << 16;
/// Longest piece kept, in bytes.
pub(crate) const MAX_PIECE_BYTES: usize = 64;

/// The keys are already hashes: used as they are.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `u64` keys are hashed; fold anything else rather than ignore it.
        self.0 = bytes
            .iter()
            .fold(self.0, |h, &b| h.rotate_left(8) ^ u64::from(b));
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type Shard = HashMap<u64, (Box<str>, Box<[u32]>), BuildHasherDefault<KeyHasher>>;

/// See the module's documentation.
#[derive(Debug)]
pub(crate) struct PieceCache {
    shards: Vec<Mutex<Shard>>,
}

impl Default for PieceCache {
    fn default() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
        }
    }
}

/// A piece's place in the cache.
pub(crate) struct Key(u64);

impl PieceCache {
    /// The key of `piece`, or `None` when it is too long to keep.
    pub(crate) fn key(piece: &str) -> Option<Key> {
        (piece.len() <= MAX_PIECE_BYTES).then(|| Key(xxh3_64(piece.as_bytes())))
    }

    fn shard(&self, key: &Key) -> std::sync::MutexGuard<'_, Shard> {
        // Middle bits: the map itself indexes by the low bits and tags by the high ones.
        let shard = &self.shards[(key.0 >> 32) as usize % SHARDS];
        // A panic elsewhere while holding it leaves a map that is still whole.
        shard.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends the ids of `piece` to `out` if it is held; `false` if not.
    pub(crate) fn extend(&self, key: &Key, piece: &str, out: &mut Vec<u32>) -> bool {
        match self.shard(key).get(&key.0) {
            Some((held, ids)) if **held == *piece => {
                out.extend_from_slice(ids);
                true
            }
            _ => false,
        }
    }

    /// Keeps `ids` as the ids of `piece`.
    pub(crate) fn insert(&self, key: Key, piece: &str, ids: &[u32]) {
        let mut shard = self.shard(&key);
        if shard.len() >= MAX_ENTRIES / SHARDS {
            shard.clear();
        }
        shard.insert(key.0, (piece.into(), ids.into()));
    }

    /// Pieces held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().unwrap().len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_what_it_was_given_and_stays_bounded() {
        let cache = PieceCache::default();
        let key = PieceCache::key("hello").unwrap();
        let mut out = vec![7];
        assert!(!cache.extend(&key, "hello", &mut out));
        cache.insert(key, "hello", &[1, 2]);
        let key = PieceCache::key("hello").unwrap();
        assert!(cache.extend(&key, "hello", &mut out));
        assert_eq!(out, [7, 1, 2]);
        // A different piece under the same key (a collision) is a miss.
        assert!(!cache.extend(&key, "world", &mut out));
        assert!(PieceCache::key(&"x".repeat(MAX_PIECE_BYTES + 1)).is_none());
        for i in 0..3 * MAX_ENTRIES {
            let piece = i.to_string();
            cache.insert(PieceCache::key(&piece).unwrap(), &piece, &[i as u32]);
        }
        assert!(cache.len() <= MAX_ENTRIES, "{}", cache.len());
        assert!(cache.len() >= MAX_ENTRIES / 4, "{}", cache.len());
    }
}
