//! Tokenization that pays only for text it has not seen.
//!
//! A rendered chat prompt is split at the tokenizer's special tokens. Text between special tokens
//! is tokenized independently by Hugging Face tokenizers (added tokens are split off before
//! normalization and pre-tokenization), so each segment's ids can be cached by the segment's
//! content hash and the prompt's ids are the concatenation. A multi-turn conversation then pays
//! only for its new turn. The cache is bounded by the number of token ids it holds, each entry
//! counted [`ENTRY_COST`] ids more for its bookkeeping, and evicts the least recently used
//! segments.

use crate::Tokenizer;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use xxhash_rust::xxh3::xxh3_128;

/// What an entry costs beside its ids, counted in ids (4 bytes): its key, tick, map slots and
/// the shared slice's header, about 100 bytes. Without it, segments of one id or none (many
/// short texts between special tokens) cost the bound little and memory a lot: 4 Mi
/// one-id entries would take about 500 MB (estimated at ~120 bytes an entry) under a bound of
/// 4 Mi ids.
pub const ENTRY_COST: usize = 25;

#[derive(Debug, Default)]
struct Lru {
    entries: HashMap<u128, (Arc<[u32]>, u64)>,
    order: BTreeMap<u64, u128>,
    tick: u64,
    /// Ids held.
    tokens: usize,
}

impl Lru {
    /// Ids held plus [`ENTRY_COST`] per entry: what the bound is on.
    fn cost(&self) -> usize {
        self.tokens + ENTRY_COST * self.entries.len()
    }
}

/// Hit and miss counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Segments served from the cache.
    pub hits: u64,
    /// Segments tokenized.
    pub misses: u64,
    /// Token ids held.
    pub tokens: usize,
}

/// A tokenizer with a bounded segment cache.
#[derive(Debug)]
pub struct CachedTokenizer {
    inner: Arc<dyn Tokenizer>,
    splitter: SpecialSplitter,
    max_tokens: usize,
    lru: Mutex<Lru>,
    stats: Mutex<CacheStats>,
}

/// Finds special tokens in text: leftmost-longest matches of every special token string.
#[derive(Debug)]
pub struct SpecialSplitter {
    automaton: Option<aho_corasick::AhoCorasick>,
}

impl SpecialSplitter {
    /// A splitter for `specials` (empty strings are ignored).
    pub fn new(specials: &[String]) -> Self {
        let patterns: Vec<&str> = specials
            .iter()
            .map(String::as_str)
            .filter(|s| !s.is_empty())
            .collect();
        let automaton = (!patterns.is_empty()).then(|| {
            aho_corasick::AhoCorasick::builder()
                .match_kind(aho_corasick::MatchKind::LeftmostLongest)
                .build(&patterns)
                .expect("special tokens form a valid automaton")
        });
        Self { automaton }
    }

    /// The segments of `text` in order, special tokens as segments of their own.
    pub fn split<'a>(&self, text: &'a str) -> Vec<&'a str> {
        let mut out = Vec::new();
        let mut start = 0;
        if let Some(ac) = &self.automaton {
            for m in ac.find_iter(text) {
                if start < m.start() {
                    out.push(&text[start..m.start()]);
                }
                out.push(&text[m.start()..m.end()]);
                start = m.end();
            }
        }
        if start < text.len() {
            out.push(&text[start..]);
        }
        out
    }
}

/// Splits `text` at any of `specials` (longest match first). Special tokens are segments of
/// their own.
pub fn split_at_specials<'a>(text: &'a str, specials: &[String]) -> Vec<&'a str> {
    SpecialSplitter::new(specials).split(text)
}

impl CachedTokenizer {
    /// Wraps `inner`, caching at most `max_tokens` token ids.
    pub fn new(inner: Arc<dyn Tokenizer>, max_tokens: usize) -> Self {
        let splitter = SpecialSplitter::new(inner.special_tokens());
        Self {
            inner,
            splitter,
            max_tokens,
            lru: Mutex::new(Lru::default()),
            stats: Mutex::new(CacheStats::default()),
        }
    }

    /// The wrapped tokenizer.
    pub fn inner(&self) -> &Arc<dyn Tokenizer> {
        &self.inner
    }

    /// Counters.
    pub fn stats(&self) -> CacheStats {
        let mut s = *self.stats.lock().expect("stats lock");
        s.tokens = self.lru.lock().expect("cache lock").tokens;
        s
    }

    /// The ids of `text`, equal to `inner.encode(text)`.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 8);
        let (mut hits, mut misses) = (0, 0);
        for segment in self.splitter.split(text) {
            let key = xxh3_128(segment.as_bytes());
            let cached = {
                let mut lru = self.lru.lock().expect("cache lock");
                lru.tick += 1;
                let tick = lru.tick;
                match lru.entries.get_mut(&key) {
                    Some((ids, last)) => {
                        let old = std::mem::replace(last, tick);
                        let ids = ids.clone();
                        lru.order.remove(&old);
                        lru.order.insert(tick, key);
                        Some(ids)
                    }
                    None => None,
                }
            };
            let ids = match cached {
                Some(ids) => {
                    hits += 1;
                    ids
                }
                None => {
                    misses += 1;
                    let ids: Arc<[u32]> = self.inner.encode(segment).into();
                    self.insert(key, ids.clone());
                    ids
                }
            };
            out.extend_from_slice(&ids);
        }
        let mut s = self.stats.lock().expect("stats lock");
        s.hits += hits;
        s.misses += misses;
        out
    }

    fn insert(&self, key: u128, ids: Arc<[u32]>) {
        if ids.len() + ENTRY_COST > self.max_tokens {
            return;
        }
        let mut lru = self.lru.lock().expect("cache lock");
        lru.tick += 1;
        let tick = lru.tick;
        lru.tokens += ids.len();
        if let Some((old_ids, old_tick)) = lru.entries.insert(key, (ids, tick)) {
            lru.tokens -= old_ids.len();
            lru.order.remove(&old_tick);
        }
        lru.order.insert(tick, key);
        while lru.cost() > self.max_tokens {
            let Some((_, victim)) = lru.order.pop_first() else {
                break;
            };
            if let Some((ids, _)) = lru.entries.remove(&victim) {
                lru.tokens -= ids.len();
            }
        }
    }

    /// Entries held (tests).
    #[cfg(test)]
    fn entries(&self) -> usize {
        self.lru.lock().expect("cache lock").entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BuiltinTokenizer;

    #[test]
    fn splits_keep_specials_as_their_own_segments() {
        let specials = vec!["<|im_start|>".to_owned(), "<|im_end|>".to_owned()];
        let segs = split_at_specials("<|im_start|>user\nhi<|im_end|>\n", &specials);
        assert_eq!(segs, vec!["<|im_start|>", "user\nhi", "<|im_end|>", "\n"]);
        assert_eq!(split_at_specials("plain", &specials), vec!["plain"]);
    }

    #[test]
    fn a_second_turn_pays_only_for_new_segments_and_memory_is_bounded() {
        let t = CachedTokenizer::new(Arc::new(BuiltinTokenizer::new()), 1_000);
        let turn1 = "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n";
        t.encode(turn1);
        let before = t.stats();
        let turn2 = format!("{turn1}ok<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n");
        assert_eq!(t.encode(&turn2), t.inner().encode(&turn2));
        let after = t.stats();
        assert!(after.hits - before.hits >= 5);
        let big = "x ".repeat(3000);
        t.encode(&big);
        assert!(t.stats().tokens <= 1_000);
    }

    #[test]
    fn short_segments_count_their_bookkeeping() {
        // Many one-word texts between special tokens: each was an entry costing one id of the
        // bound, so a bound of 1,000 ids held 1,000 entries of ~100 bytes each.
        let t = CachedTokenizer::new(Arc::new(BuiltinTokenizer::new()), 1_000);
        let text: String = (0..5_000).map(|i| format!("<|im_start|>w{i}")).collect();
        assert_eq!(t.encode(&text), t.inner().encode(&text));
        assert!(t.entries() <= 1_000 / ENTRY_COST, "{} entries", t.entries());
        assert!(t.entries() > 0);
    }
}
