//! The keys a cluster summary's prefix sketch holds (see `global::sketch`).

use super::PrefixIndex;
use crate::ids::SequenceHash;

impl PrefixIndex {
    /// The sequence hashes a prefix sketch needs: every held block at a checkpoint depth
    /// (depth + 1 a multiple of `interval`) and the last block of every held run (a node end),
    /// each once. Blocks kept only as a path to held ones are skipped. `interval` 0 is taken
    /// as 1.
    pub fn checkpoint_keys(&self, interval: u32) -> Vec<SequenceHash> {
        let k = interval.max(1);
        let mut keys = Vec::new();
        for id in self.tree.node_ids() {
            let node = self.tree.node(id);
            if node.holders.is_empty() || node.hashes.is_empty() {
                continue;
            }
            // First depth d ≥ start with (d + 1) % k == 0.
            let first = node.start + (k - 1 - node.start % k) % k;
            let mut d = first;
            while d < node.end() {
                keys.push(node.hashes[(d - node.start) as usize]);
                d += k;
            }
            if (node.end()) % k != 0 {
                keys.push(node.hashes[node.hashes.len() - 1]);
            }
        }
        keys
    }
}

#[cfg(test)]
mod tests {
    use crate::event::{BlockContent, KvEvent, Medium, StoredBlock};
    use crate::hashing::{BlockHasher, HashNamespace};
    use crate::ids::{EngineHash, WorkerId};
    use crate::index::PrefixIndex;

    fn tokens(b: u32) -> Vec<u32> {
        (0..4).map(|i| b * 100 + i).collect()
    }

    #[test]
    fn keys_are_checkpoints_and_run_ends() {
        let mut index = PrefixIndex::new(4);
        let chain: Vec<u32> = (1..=10).collect();
        let event = KvEvent::Stored {
            worker: WorkerId(1),
            dp_rank: 0,
            parent: None,
            blocks: chain
                .iter()
                .map(|&b| StoredBlock {
                    engine_hash: EngineHash(u64::from(b)),
                    content: BlockContent::Tokens(tokens(b)),
                })
                .collect(),
            block_size: 4,
            medium: Medium::Gpu,
            namespace: HashNamespace::none(),
        };
        index.apply(&event).unwrap();
        let all: Vec<u32> = chain.iter().flat_map(|&b| tokens(b)).collect();
        let seq = BlockHasher::new(4, &HashNamespace::none()).sequence_hashes(&all);
        let mut keys = index.checkpoint_keys(4);
        keys.sort();
        let mut want = vec![seq[3], seq[7], seq[9]];
        want.sort();
        assert_eq!(keys, want);
        let mut every = index.checkpoint_keys(1);
        every.sort();
        let mut all_seq = seq.clone();
        all_seq.sort();
        assert_eq!(every, all_seq, "interval 1 holds every block once");
    }
}
