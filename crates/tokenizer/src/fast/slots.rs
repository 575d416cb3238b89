//! An open-addressing table of `u64` keys (hashes already) with linear probing and one cache
//! line per slot, for [`super::pieces::PieceCache`]: a key's home slot is a plain index, so a
//! caller can load the home slots of many keys before it looks at any of them
//! ([`Slots::home_key`]) and their cache misses overlap; a lookup then reads one line, not the
//! control bytes and the bucket of a `HashMap` (two dependent misses, behind branches on the
//! first).
//!
//! At most half full (it doubles as it fills); keys are stored with 0 meaning an empty slot, so
//! a key of 0 is kept as 1 (a caller that keeps the key's text tells the two apart).

/// One slot, on a cache line of its own.
#[repr(align(64))]
#[derive(Debug)]
struct Slot<V> {
    /// The stored key; 0: empty.
    key: u64,
    value: Option<V>,
}

impl<V> Slot<V> {
    const EMPTY: Self = Slot {
        key: 0,
        value: None,
    };
}

/// Slots a new table starts with.
const MIN_SLOTS: usize = 64;

/// See the module's documentation.
#[derive(Debug)]
pub(crate) struct Slots<V> {
    /// A power of two long.
    slots: Vec<Slot<V>>,
    len: usize,
}

impl<V> Default for Slots<V> {
    fn default() -> Self {
        Self::with_slots(MIN_SLOTS)
    }
}

/// The key as stored (0 marks an empty slot).
fn stored(key: u64) -> u64 {
    key.max(1)
}

impl<V> Slots<V> {
    fn with_slots(n: usize) -> Self {
        Slots {
            slots: std::iter::repeat_with(|| Slot::EMPTY).take(n).collect(),
            len: 0,
        }
    }

    fn home(&self, key: u64) -> usize {
        stored(key) as usize & (self.slots.len() - 1)
    }

    /// The key now in `key`'s home slot (0: empty, so `key` is not held). One load that depends
    /// on nothing before it: a pass of these over a text's pieces brings their slots into the
    /// cache together.
    pub(crate) fn home_key(&self, key: u64) -> u64 {
        self.slots[self.home(key)].key
    }

    /// The value kept under `key`, given what [`Slots::home_key`] read for it (with no change to
    /// the table since): its home slot's when that holds it, none when that is empty, else
    /// probed for.
    pub(crate) fn get_after(&self, key: u64, home_key: u64) -> Option<&V> {
        if home_key == stored(key) {
            return self.slots[self.home(key)].value.as_ref();
        }
        if home_key == 0 {
            return None;
        }
        self.get(key)
    }

    /// The value kept under `key`.
    pub(crate) fn get(&self, key: u64) -> Option<&V> {
        self.slots[self.probe(key)].value.as_ref()
    }

    /// The slot holding `key`, or the empty slot that ends its probe.
    fn probe(&self, key: u64) -> usize {
        let (key, mask) = (stored(key), self.slots.len() - 1);
        let mut i = self.home(key);
        while self.slots[i].key != key && self.slots[i].key != 0 {
            i = (i + 1) & mask;
        }
        i
    }

    /// Keeps `value` under `key` (in place of the value there).
    pub(crate) fn insert(&mut self, key: u64, value: V) {
        let mut i = self.probe(key);
        if self.slots[i].key == 0 {
            if (self.len + 1) * 2 > self.slots.len() {
                self.rebuild(self.slots.len() * 2, |_| true);
                i = self.probe(key);
            }
            self.len += 1;
        }
        self.slots[i] = Slot {
            key: stored(key),
            value: Some(value),
        };
    }

    /// Keeps only the values whose (stored) key `keep` accepts.
    pub(crate) fn retain(&mut self, keep: impl FnMut(u64) -> bool) {
        self.rebuild(self.slots.len(), keep);
    }

    /// Moves the kept values into `n` new slots (removing from a linear-probing table leaves
    /// holes that break later probes; a rebuild leaves none).
    fn rebuild(&mut self, n: usize, mut keep: impl FnMut(u64) -> bool) {
        let old = std::mem::replace(self, Self::with_slots(n));
        for slot in old.slots {
            if let (Some(value), true) = (slot.value, slot.key != 0 && keep(slot.key)) {
                self.insert(slot.key, value);
            }
        }
    }

    /// Values kept.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

/// The bytes a slot holding a `V` takes (one cache line for a piece's entry).
#[cfg(test)]
pub(crate) fn slot_bytes<V>() -> usize {
    std::mem::size_of::<Slot<V>>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[test]
    fn a_slot_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<Slot<[u64; 5]>>(), 64);
        assert_eq!(std::mem::align_of::<Slot<u8>>(), 64);
    }

    #[test]
    fn grows_and_keeps_every_key_through_rebuilds() {
        let mut table = Slots::default();
        // Keys whose home is the table's last slot at every size (probes wrap around), and
        // spread ones.
        let keys: Vec<u64> = (0..3000u64)
            .map(|i| {
                if i % 3 == 0 {
                    (i << 20) | 0xf_ffff
                } else {
                    i.wrapping_mul(0x9e37_79b9_7f4a_7c15)
                }
            })
            .collect();
        for (n, &k) in keys.iter().enumerate() {
            table.insert(k, n);
        }
        assert_eq!(table.len(), keys.len());
        assert_eq!(
            table.slots.len(),
            8192,
            "doubled from 64 as it filled, at most half full"
        );
        for (n, &k) in keys.iter().enumerate() {
            assert_eq!(table.get(k), Some(&n), "{k:x}");
        }
        // Replacing a value at exactly half full does not grow the table.
        let mut half = Slots::default();
        for k in 1..=32u64 {
            half.insert(k, 0);
        }
        half.insert(32, 1);
        assert_eq!(
            (half.slots.len(), half.len(), half.get(32)),
            (64, 32, Some(&1))
        );
        table.retain(|k| k % 2 == 0);
        for (n, &k) in keys.iter().enumerate() {
            assert_eq!(table.get(k), (k % 2 == 0).then_some(&n), "{k:x}");
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u64, u32),
        Get(u64),
        Retain(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Few distinct keys (collisions in home slots and replacements), 0 and 1 among them.
        let key = prop_oneof![0u64..4, 0u64..300, any::<u64>()];
        prop_oneof![
            30 => (key.clone(), any::<u32>()).prop_map(|(k, v)| Op::Insert(k, v)),
            20 => key.prop_map(Op::Get),
            1 => (0u64..4).prop_map(Op::Retain),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 128,
            rng_seed: prop::test_runner::RngSeed::Fixed(0x736c_6f74_7321),
            ..ProptestConfig::default()
        })]

        /// The table answers as a `HashMap` of the stored keys does, through growth and
        /// rebuilds.
        #[test]
        fn the_table_is_a_map(ops in prop::collection::vec(op(), 1..1500)) {
            let (mut table, mut model) = (Slots::default(), HashMap::new());
            for op in ops {
                match op {
                    Op::Insert(k, v) => {
                        table.insert(k, v);
                        model.insert(stored(k), v);
                    }
                    Op::Get(k) => {
                        prop_assert_eq!(table.get(k), model.get(&stored(k)));
                        prop_assert_eq!(table.get_after(k, table.home_key(k)), model.get(&stored(k)));
                        if model.contains_key(&stored(k)) {
                            prop_assert_ne!(table.home_key(k), 0);
                        }
                    }
                    Op::Retain(part) => {
                        table.retain(|k| k % 4 != part);
                        model.retain(|k, _| k % 4 != part);
                    }
                }
                prop_assert_eq!(table.len(), model.len());
                prop_assert!(table.len() * 2 <= table.slots.len());
            }
        }
    }
}
