//! Lookups in a slice sorted by key, for keys asked in ascending order: the router asks every
//! candidate's overlap and held prefix in rank order, so one forward walk answers them all where a
//! binary search per candidate would cost a branchy search each.

/// A cursor over `items` (sorted by `key`, keys distinct). [`SortedWalk::find`] walks forward
/// while keys ascend; a key below the last one asked restarts the walk with a binary search, so
/// the answers are always right and ascending keys cost O(items + keys) in all.
#[derive(Debug)]
pub(crate) struct SortedWalk<'a, T, K> {
    items: &'a [T],
    at: usize,
    key: fn(&T) -> K,
}

impl<'a, T, K: Ord> SortedWalk<'a, T, K> {
    /// A walk from the start of `items`.
    pub(crate) fn new(items: &'a [T], key: fn(&T) -> K) -> Self {
        Self { items, at: 0, key }
    }

    /// The item with key `k`, if any.
    pub(crate) fn find(&mut self, k: K) -> Option<&'a T> {
        let key = self.key;
        if self.at > 0 && key(&self.items[self.at - 1]) >= k {
            self.at = self.items.partition_point(|x| key(x) < k);
        }
        while let Some(x) = self.items.get(self.at) {
            match key(x).cmp(&k) {
                std::cmp::Ordering::Less => self.at += 1,
                std::cmp::Ordering::Equal => {
                    self.at += 1;
                    return Some(x);
                }
                std::cmp::Ordering::Greater => return None,
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Against a binary search per key, for keys in any order (ascending or not).
        #[test]
        fn finds_what_a_search_finds(
            items in proptest::collection::btree_set(0u32..200, 0..40),
            queries in proptest::collection::vec(0u32..220, 0..80),
            sort_queries: bool,
        ) {
            let items: Vec<(u32, u32)> = items.into_iter().map(|k| (k, k * 3)).collect();
            let mut queries = queries;
            if sort_queries {
                queries.sort_unstable();
                queries.dedup();
            }
            let mut walk = SortedWalk::new(&items, |x| x.0);
            for q in queries {
                let want = items.binary_search_by_key(&q, |x| x.0).ok().map(|i| &items[i]);
                prop_assert_eq!(walk.find(q), want, "key {}", q);
            }
        }
    }
}
