//! The load ledger: what each rank is working on right now.
//!
//! Per rank: active requests, active prefill tokens (the uncached part of prompts not yet past
//! their first token) and active decode blocks (blocks held by active requests, a prefix shared
//! by several counted once). A request goes begin → first token → finish, and may be cancelled
//! from any state; every unit begun is released exactly once.

mod chains;

use crate::fast_map::FastMap;
use crate::ids::{RequestId, SequenceHash, WorkerRank};
use crate::sorted::SortedWalk;
use chains::{ChainEnd, ChainTrie};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Why a ledger operation was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    /// `begin` with an id that is already active.
    #[error("request {0} is already active")]
    DuplicateRequest(RequestId),
    /// An operation on an id that is not active.
    #[error("request {0} is not active")]
    UnknownRequest(RequestId),
}

/// A rank's current load.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankLoad {
    /// Requests begun and not yet finished or cancelled.
    pub active_requests: u32,
    /// Uncached prompt tokens of requests that have not produced their first token.
    pub active_prefill_tokens: u64,
    /// Distinct KV blocks held by active requests.
    pub active_decode_blocks: u64,
}

/// What a request puts on its rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestLoad {
    /// The rank serving it.
    pub rank: WorkerRank,
    /// Uncached prompt tokens it will prefill.
    pub prefill_tokens: u64,
    /// Sequence hashes of its full prompt blocks (shared prefixes are counted once per rank).
    pub blocks: Vec<SequenceHash>,
    /// Blocks it holds that no other request can share (a trailing partial block).
    pub private_blocks: u64,
}

/// The phase of an active request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Begun, no token yet: its prefill tokens count.
    Prefill,
    /// Past its first token.
    Decode,
}

/// What an active request puts on its rank, as the ledger keeps it (its chain lives in the
/// trie alone).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActiveLoad {
    /// The rank serving it.
    pub rank: WorkerRank,
    /// Uncached prompt tokens it will prefill.
    pub prefill_tokens: u64,
    /// Its full prompt blocks (the length of its chain).
    pub chain_blocks: u64,
    /// Blocks it holds that no other request can share.
    pub private_blocks: u64,
}

#[derive(Debug)]
struct Active {
    load: ActiveLoad,
    end: ChainEnd,
    phase: Phase,
}

/// The ledger of every rank's load.
#[derive(Debug, Default)]
pub struct LoadLedger {
    ranks: FastMap<WorkerRank, RankLoad>,
    /// The block chains of the active requests, shared prefixes stored once.
    chains: ChainTrie,
    requests: FastMap<RequestId, Active>,
}

/// How many leading blocks of one prompt each rank's active requests hold
/// ([`LoadLedger::held_prefixes`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HeldPrefixes {
    /// The ranks holding at least one block, sorted, with the length held.
    ranks: Vec<(WorkerRank, usize)>,
}

impl HeldPrefixes {
    /// The held length on `rank` (0 when it holds none of the prompt).
    pub fn get(&self, rank: WorkerRank) -> usize {
        self.ranks
            .binary_search_by_key(&rank, |r| r.0)
            .map_or(0, |i| self.ranks[i].1)
    }

    /// [`HeldPrefixes::get`] for ranks asked in ascending order (as the router asks its
    /// candidates), by one forward walk.
    pub fn walk(&self) -> impl FnMut(WorkerRank) -> usize + '_ {
        let mut walk = SortedWalk::new(&self.ranks, |r| r.0);
        move |rank| walk.find(rank).map_or(0, |r| r.1)
    }
}

impl LoadLedger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// The current load of `rank` (zero when it has none).
    pub fn load(&self, rank: WorkerRank) -> RankLoad {
        self.ranks.get(&rank).copied().unwrap_or_default()
    }

    /// Number of active requests over all ranks.
    pub fn active_requests(&self) -> usize {
        self.requests.len()
    }

    /// Whether `id` is active.
    pub fn is_active(&self, id: RequestId) -> bool {
        self.requests.contains_key(&id)
    }

    /// The phase and rank of an active request.
    pub fn get(&self, id: RequestId) -> Option<(WorkerRank, Phase)> {
        self.requests.get(&id).map(|a| (a.load.rank, a.phase))
    }

    /// What an active request puts on its rank.
    pub fn request_load(&self, id: RequestId) -> Option<ActiveLoad> {
        self.requests.get(&id).map(|a| a.load)
    }

    /// Ids of every active request, sorted.
    pub fn active_ids(&self) -> Vec<RequestId> {
        let mut ids: Vec<RequestId> = self.requests.keys().copied().collect();
        ids.sort();
        ids
    }

    /// How many leading blocks of `blocks` are already held by active requests on `rank`: one
    /// lookup per segment of the held chains it runs through, and a binary search in the last
    /// (a sequence hash stands for its whole prefix).
    pub fn held_prefix_blocks(&self, rank: WorkerRank, blocks: &[SequenceHash]) -> usize {
        self.chains.held_prefix(rank, blocks)
    }

    /// [`LoadLedger::held_prefix_blocks`] on every rank at once: one walk down the prompt's path,
    /// whatever the number of ranks.
    pub fn held_prefixes(&self, blocks: &[SequenceHash]) -> HeldPrefixes {
        let mut held = HeldPrefixes::default();
        self.chains.held_prefixes(blocks, &mut held.ranks);
        held
    }

    /// Each block that active requests on `rank` hold, with how many of them hold it. Walks
    /// every held block: for tests and diagnostics, not for the routing path.
    pub fn held_block_counts(&self, rank: WorkerRank) -> BTreeMap<SequenceHash, u32> {
        self.chains
            .block_counts()
            .remove(&rank)
            .map(|(blocks, _)| blocks.into_iter().collect())
            .unwrap_or_default()
    }

    /// Starts accounting for a request.
    pub fn begin(&mut self, id: RequestId, load: RequestLoad) -> Result<(), LedgerError> {
        let RequestLoad {
            rank,
            prefill_tokens,
            blocks,
            private_blocks,
        } = load;
        self.begin_chain(id, rank, prefill_tokens, &blocks, private_blocks)
    }

    /// [`LoadLedger::begin`] with the request's chain borrowed: the ledger stores it once, in
    /// its trie of active chains, and keeps no copy of it.
    pub fn begin_chain(
        &mut self,
        id: RequestId,
        rank: WorkerRank,
        prefill_tokens: u64,
        blocks: &[SequenceHash],
        private_blocks: u64,
    ) -> Result<(), LedgerError> {
        if self.requests.contains_key(&id) {
            return Err(LedgerError::DuplicateRequest(id));
        }
        let (added, end) = self.chains.insert(rank, blocks);
        let state = self.ranks.entry(rank).or_default();
        state.active_requests += 1;
        state.active_prefill_tokens += prefill_tokens;
        state.active_decode_blocks += private_blocks + added;
        let load = ActiveLoad {
            rank,
            prefill_tokens,
            chain_blocks: blocks.len() as u64,
            private_blocks,
        };
        self.requests.insert(
            id,
            Active {
                load,
                end,
                phase: Phase::Prefill,
            },
        );
        Ok(())
    }

    /// The request produced its first token: its prefill tokens no longer count. Idempotent.
    pub fn first_token(&mut self, id: RequestId) -> Result<(), LedgerError> {
        let active = self
            .requests
            .get_mut(&id)
            .ok_or(LedgerError::UnknownRequest(id))?;
        if active.phase == Phase::Prefill {
            active.phase = Phase::Decode;
            let state = self
                .ranks
                .get_mut(&active.load.rank)
                .expect("rank of active request");
            state.active_prefill_tokens -= active.load.prefill_tokens;
        }
        Ok(())
    }

    /// The request ended (finished, cancelled or failed): release everything it held.
    pub fn release(&mut self, id: RequestId) -> Result<ActiveLoad, LedgerError> {
        let active = self
            .requests
            .remove(&id)
            .ok_or(LedgerError::UnknownRequest(id))?;
        let state = self
            .ranks
            .get_mut(&active.load.rank)
            .expect("rank of active request");
        state.active_requests -= 1;
        if active.phase == Phase::Prefill {
            state.active_prefill_tokens -= active.load.prefill_tokens;
        }
        state.active_decode_blocks -=
            active.load.private_blocks + self.chains.remove(active.load.rank, active.end);
        if *state == RankLoad::default() {
            // An idle rank has no entry: the map is bounded by the ranks with requests, not by
            // every rank ever loaded (a removed worker's last request ends here too).
            self.ranks.remove(&active.load.rank);
        }
        Ok(active.load)
    }

    /// Ranks with an entry (tests: only those with active requests have one).
    #[cfg(test)]
    pub(crate) fn rank_entries(&self) -> usize {
        self.ranks.len()
    }

    /// Active requests on `rank`, sorted by id.
    pub fn requests_on(&self, rank: WorkerRank) -> Vec<RequestId> {
        let mut ids: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, a)| a.load.rank == rank)
            .map(|(id, _)| *id)
            .collect();
        ids.sort();
        ids
    }

    /// Recomputes every rank's load and held blocks from the active requests and compares.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.chains.check()?;
        let mut expect: FastMap<WorkerRank, (RankLoad, FastMap<SequenceHash, u32>)> =
            FastMap::default();
        for active in self.requests.values() {
            let (load, blocks) = expect.entry(active.load.rank).or_default();
            load.active_requests += 1;
            if active.phase == Phase::Prefill {
                load.active_prefill_tokens += active.load.prefill_tokens;
            }
            load.active_decode_blocks += active.load.private_blocks;
            let chain = self.chains.chain(active.end);
            if chain.len() as u64 != active.load.chain_blocks {
                return Err(format!(
                    "a chain of {} blocks on {} reads {} in the trie",
                    active.load.chain_blocks,
                    active.load.rank,
                    chain.len()
                ));
            }
            for seq in chain {
                *blocks.entry(seq).or_default() += 1;
            }
        }
        let mut held = self.chains.block_counts();
        for (rank, state) in &self.ranks {
            let (mut load, blocks) = expect.remove(rank).unwrap_or_default();
            let (counts, distinct) = held.remove(rank).unwrap_or_default();
            if blocks != counts {
                return Err(format!(
                    "{rank}: block counts differ from the active requests'"
                ));
            }
            load.active_decode_blocks += distinct;
            if load != *state {
                return Err(format!("{rank}: ledger {state:?}, recomputed {load:?}"));
            }
        }
        if let Some((rank, _)) = expect.into_iter().next() {
            return Err(format!("{rank} has active requests but no ledger entry"));
        }
        if let Some((rank, _)) = held.into_iter().next() {
            return Err(format!("{rank} holds blocks but has no ledger entry"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::WorkerId;

    fn rank(w: u64) -> WorkerRank {
        WorkerRank::new(WorkerId(w), 0)
    }

    fn load(w: u64, prefill: u64, blocks: &[u64]) -> RequestLoad {
        RequestLoad {
            rank: rank(w),
            prefill_tokens: prefill,
            blocks: blocks.iter().map(|b| SequenceHash(*b)).collect(),
            private_blocks: 1,
        }
    }

    #[test]
    fn lifecycle_moves_prefill_then_releases_everything() {
        let mut ledger = LoadLedger::new();
        ledger
            .begin(RequestId(1), load(1, 100, &[1, 2, 3]))
            .unwrap();
        ledger.begin(RequestId(2), load(1, 50, &[1, 2, 4])).unwrap();
        let l = ledger.load(rank(1));
        assert_eq!(
            l,
            RankLoad {
                active_requests: 2,
                active_prefill_tokens: 150,
                active_decode_blocks: 6
            }
        );
        ledger.first_token(RequestId(1)).unwrap();
        ledger.first_token(RequestId(1)).unwrap();
        assert_eq!(ledger.load(rank(1)).active_prefill_tokens, 50);
        ledger.release(RequestId(2)).unwrap();
        assert_eq!(ledger.load(rank(1)).active_decode_blocks, 4);
        ledger.release(RequestId(1)).unwrap();
        assert_eq!(ledger.load(rank(1)), RankLoad::default());
        assert_eq!(ledger.rank_entries(), 0, "an idle rank keeps no entry");
        ledger.check_invariants().unwrap();
    }

    #[test]
    fn unknown_and_duplicate_requests_are_refused() {
        let mut ledger = LoadLedger::new();
        ledger.begin(RequestId(1), load(1, 1, &[])).unwrap();
        assert_eq!(
            ledger.begin(RequestId(1), load(2, 1, &[])),
            Err(LedgerError::DuplicateRequest(RequestId(1)))
        );
        assert_eq!(
            ledger.first_token(RequestId(9)),
            Err(LedgerError::UnknownRequest(RequestId(9)))
        );
        ledger.release(RequestId(1)).unwrap();
        assert!(ledger.release(RequestId(1)).is_err());
    }

    #[test]
    fn held_prefix_counts_leading_blocks_of_active_requests() {
        let mut ledger = LoadLedger::new();
        ledger.begin(RequestId(1), load(1, 0, &[1, 2, 3])).unwrap();
        let q = |b: &[u64]| b.iter().map(|x| SequenceHash(*x)).collect::<Vec<_>>();
        assert_eq!(ledger.held_prefix_blocks(rank(1), &q(&[1, 2, 3, 4])), 3);
        assert_eq!(ledger.held_prefix_blocks(rank(1), &q(&[1, 2, 9])), 2);
        assert_eq!(ledger.held_prefix_blocks(rank(1), &q(&[9])), 0);
        assert_eq!(ledger.held_prefix_blocks(rank(2), &q(&[1])), 0);
    }
}
