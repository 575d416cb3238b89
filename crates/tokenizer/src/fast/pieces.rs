//! Ids of pieces seen before: a frequent word costs one hash lookup instead of the model's merges
//! and the strings it allocates per token.
//!
//! The pieces of a text are looked up in runs under one read lock ([`PieceCache::extend_all`],
//! at most [`HELD_PER_LOCK`] pieces a run, up to the first piece not held): a lock per piece (an
//! atomic operation, which on x86 waits for every load before it) made each piece's cache misses
//! wait for the previous one's, where now the lookups of a run overlap. A piece not held is
//! given to the model with no lock held and kept at once (so it is held when it comes again in
//! the same text); the run then goes on after it.
//!
//! Bounded: at most [`MAX_ENTRIES`] pieces; a full cache first forgets one sixteenth of its
//! pieces (by key, a different sixteenth each time), so it refills with what is frequent.
//! Pieces longer than [`MAX_PIECE_BYTES`] are not kept. An entry keeps its piece's text, so a
//! hash collision is a miss, never wrong ids. A piece of at most 14 bytes and 2 ids (most words)
//! is held in its slot of the table ([`Slots`]: open addressing, a cache line per slot), so a
//! lookup reads one line of memory, and a run first loads the home slots of all its pieces
//! so their cache misses overlap (`benches/words.rs`, caches overwritten before each prompt:
//! 25.5 → 22.0 µs against a `HashMap`, whose lookup is two dependent misses behind a branch;
//! warm, 3.82 → 4.17 µs); others keep their text and ids on the heap. Memory: the table is at
//! most half full, 64 bytes a slot, so 8 MB when full (65,536 pieces; 16 MB for the moment a
//! full cache's forgetting rebuilds it), plus, for pieces over 14 bytes or 2 ids, their text
//! and ids (at most 64 bytes and 64 ids each): at most about 32 MB per tokenizer.

use super::slots::Slots;
use std::sync::{RwLock, RwLockReadGuard};
use xxhash_rust::xxh3::xxh3_64;

/// Pieces held at most.
const MAX_ENTRIES: usize = 1 << 16;
/// Pieces looked up per hold of the read lock (a writer waits at most that long).
const HELD_PER_LOCK: usize = 1024;
/// A full cache forgets one of this many parts of its keys.
const EVICTED_PARTS: u64 = 16;
/// Longest piece kept, in bytes.
const MAX_PIECE_BYTES: usize = 64;

/// Text this long or shorter is kept in the entry itself.
const INLINE_TEXT: usize = 14;

/// A piece's text (to tell a collision from a hit) and its ids, a word's in the slot itself.
#[derive(Debug)]
struct Entry {
    text: Text,
    ids: Ids,
}

#[derive(Debug)]
enum Text {
    Inline(u8, [u8; INLINE_TEXT]),
    Heap(Box<str>),
}

#[derive(Debug)]
enum Ids {
    Inline(u8, [u32; 2]),
    Heap(Box<[u32]>),
}

impl Entry {
    fn new(piece: &str, ids: &[u32]) -> Self {
        let text = match piece.len() {
            n if n <= INLINE_TEXT => {
                let mut inline = [0; INLINE_TEXT];
                inline[..n].copy_from_slice(piece.as_bytes());
                Text::Inline(n as u8, inline)
            }
            _ => Text::Heap(piece.into()),
        };
        let ids = match ids.len() {
            n if n <= 2 => {
                let mut inline = [0; 2];
                inline[..n].copy_from_slice(ids);
                Ids::Inline(n as u8, inline)
            }
            _ => Ids::Heap(ids.into()),
        };
        Self { text, ids }
    }

    fn text(&self) -> &[u8] {
        match &self.text {
            Text::Inline(n, bytes) => &bytes[..usize::from(*n)],
            Text::Heap(text) => text.as_bytes(),
        }
    }

    fn ids(&self) -> &[u32] {
        match &self.ids {
            Ids::Inline(n, ids) => &ids[..usize::from(*n)],
            Ids::Heap(ids) => ids,
        }
    }
}

/// The pieces held, and which part of the keys a full cache forgets next.
#[derive(Debug, Default)]
struct Held {
    map: Slots<Entry>,
    next_evicted: u64,
}

/// See the module's documentation.
#[derive(Debug, Default)]
pub(crate) struct PieceCache {
    held: RwLock<Held>,
}

/// A piece's place in the cache.
struct Key(u64);

impl PieceCache {
    /// The key of `piece`, or `None` when it is too long to keep.
    fn key(piece: &str) -> Option<Key> {
        (piece.len() <= MAX_PIECE_BYTES).then(|| Key(xxh3_64(piece.as_bytes())))
    }

    fn read(&self) -> RwLockReadGuard<'_, Held> {
        // A panic elsewhere while holding the lock leaves a map that is still whole.
        self.held.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Appends the ids of the pieces `spans` of `text` to `out`, in order: those held from the
    /// cache, the others from `miss` (which appends a piece's ids, or fails the whole text), kept
    /// as they come.
    pub(crate) fn extend_all(
        &self,
        text: &str,
        spans: &[(usize, usize)],
        out: &mut Vec<u32>,
        mut miss: impl FnMut(&str, &mut Vec<u32>) -> Option<()>,
    ) -> Option<()> {
        let mut at = 0;
        while at < spans.len() {
            let run = &spans[at..spans.len().min(at + HELD_PER_LOCK)];
            let taken = self.extend_held(text, run, out);
            at += taken;
            if taken == run.len() {
                continue;
            }
            let (start, end) = spans[at];
            let piece = &text[start..end];
            let from = out.len();
            miss(piece, out)?;
            if let Some(key) = Self::key(piece) {
                self.insert(key, piece, &out[from..]);
            }
            at += 1;
        }
        Some(())
    }

    /// Appends the ids of the pieces of `run` from its first up to the first not held, under
    /// one read lock: how many it took. First every piece's key is hashed and its home slot's
    /// key loaded (loads that depend on nothing before them, no branch on what they read, so
    /// their cache misses overlap), then the pieces are looked up in slots now in the cache,
    /// their texts compared and their ids copied.
    fn extend_held(&self, text: &str, run: &[(usize, usize)], out: &mut Vec<u32>) -> usize {
        let held = self.read();
        let keys: Vec<(Option<Key>, u64)> = run
            .iter()
            .map(|&(start, end)| {
                let key = Self::key(&text[start..end]);
                let home = key.as_ref().map_or(0, |k| held.map.home_key(k.0));
                (key, home)
            })
            .collect();
        for (taken, (&(start, end), (key, home))) in run.iter().zip(keys).enumerate() {
            let found = key.and_then(|k| held.map.get_after(k.0, home));
            match found {
                Some(entry) if entry.text() == &text.as_bytes()[start..end] => {
                    out.extend_from_slice(entry.ids())
                }
                _ => return taken,
            }
        }
        run.len()
    }

    /// Keeps `ids` as the ids of `piece`, first forgetting a part of a full cache.
    fn insert(&self, key: Key, piece: &str, ids: &[u32]) {
        let mut held = self.held.write().unwrap_or_else(|e| e.into_inner());
        if held.map.len() >= MAX_ENTRIES {
            let part = held.next_evicted % EVICTED_PARTS;
            held.next_evicted += 1;
            held.map.retain(|k| (k >> 32) % EVICTED_PARTS != part);
        }
        held.map.insert(key.0, Entry::new(piece, ids));
    }

    /// Pieces held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.read().map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ids of `words` (spans of single-space-separated text) with `miss` giving each
    /// missed word's ids as its length; the words missed.
    fn encode(cache: &PieceCache, text: &str) -> (Vec<u32>, Vec<String>) {
        let mut spans = Vec::new();
        let mut at = 0;
        for word in text.split(' ') {
            spans.push((at, at + word.len()));
            at += word.len() + 1;
        }
        let (mut out, mut missed) = (Vec::new(), Vec::new());
        cache
            .extend_all(text, &spans, &mut out, |piece, out| {
                missed.push(piece.to_owned());
                out.extend([piece.len() as u32, 0]);
                Some(())
            })
            .unwrap();
        (out, missed)
    }

    #[test]
    fn holds_what_it_was_given_in_order_and_stays_bounded() {
        let cache = PieceCache::default();
        // A new piece is kept at once: its second occurrence in the same text is held.
        let (ids, missed) = encode(&cache, "hello hi hello");
        assert_eq!(ids, [5, 0, 2, 0, 5, 0]);
        assert_eq!(missed, ["hello", "hi"]);
        let (ids, missed) = encode(&cache, "hi world hello");
        assert_eq!(ids, [2, 0, 5, 0, 5, 0]);
        assert_eq!(missed, ["world"]);
        // A piece too long to keep is asked for every time.
        let long = "x".repeat(MAX_PIECE_BYTES + 1);
        for _ in 0..2 {
            assert_eq!(encode(&cache, &long).1, std::slice::from_ref(&long));
        }
        // A miss that fails fails the text, and keeps nothing after it.
        let before = cache.len();
        let fails = cache.extend_all("new", &[(0, 3)], &mut Vec::new(), |_, _| None);
        assert_eq!((fails, cache.len()), (None, before));
        // Runs longer than one lock's hold: every piece in order.
        let words: Vec<String> = (0..3 * HELD_PER_LOCK + 5)
            .map(|i| format!("w{i}"))
            .collect();
        let text = words.join(" ");
        let want: Vec<u32> = words.iter().flat_map(|w| [w.len() as u32, 0]).collect();
        assert_eq!(encode(&cache, &text), (want.clone(), words.clone()));
        assert_eq!(encode(&cache, &text), (want, Vec::new()));
        // Full (in the second round): a part is forgotten, the newest pieces are held.
        for round in 0..2 {
            let words: Vec<String> = (0..MAX_ENTRIES / 2 + 10)
                .map(|i| format!("r{round}-{i}"))
                .collect();
            encode(&cache, &words.join(" "));
            assert!(cache.len() <= MAX_ENTRIES, "{}", cache.len());
            assert!(cache.len() >= MAX_ENTRIES / 2, "{}", cache.len());
            let last = words.last().unwrap();
            assert!(encode(&cache, last).1.is_empty(), "round {round}");
        }
    }

    /// An entry fills one 64-byte slot of the table (the memory bound above counts on it).
    #[test]
    fn an_entry_takes_one_cache_line() {
        assert_eq!(super::super::slots::slot_bytes::<Entry>(), 64);
    }

    /// An entry gives back the text and ids it was made of, held in its slot or not.
    #[test]
    fn entries_keep_any_text_and_ids() {
        for len in 0..=MAX_PIECE_BYTES {
            let text: String = (0..len)
                .map(|i| char::from(b'a' + (i % 26) as u8))
                .collect();
            for n in 0..6u32 {
                let ids: Vec<u32> = (0..n).map(|i| u32::MAX - i).collect();
                let entry = Entry::new(&text, &ids);
                assert_eq!((entry.text(), entry.ids()), (text.as_bytes(), &ids[..]));
            }
        }
    }

    /// A hash collision (two pieces under one key) is a miss, never the other piece's ids.
    #[test]
    fn a_collision_is_a_miss() {
        let cache = PieceCache::default();
        let key = PieceCache::key("hello").unwrap().0;
        cache
            .held
            .write()
            .unwrap()
            .map
            .insert(key, Entry::new("world", &[9]));
        assert_eq!(cache.len(), 1);
        let (ids, missed) = encode(&cache, "hello");
        assert_eq!((ids, missed), (vec![5, 0], vec!["hello".to_owned()]));
    }
}
