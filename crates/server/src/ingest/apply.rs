//! Applying a decoded batch to the index in bounded slices: the core lock is taken once per
//! slice of at most `slice_blocks` blocks and released in between, so a huge batch never holds
//! routing up for long. A `Stored` event longer than a slice is split into parent-chained parts.

use super::Source;
use crate::state::Inner;
use kvrouter_core::event::KvEvent;
use kvrouter_core::index::IndexError;
use kvrouter_kv_wire::{decode_payload, to_kv_events, ConvertOptions};

/// Splits `event` into events of at most `slice_blocks` blocks each (at least 1), in order.
/// A `Stored` part's parent is the last block of the part before it.
pub(crate) fn slices(event: KvEvent, slice_blocks: usize) -> Vec<KvEvent> {
    let n = slice_blocks.max(1);
    match event {
        KvEvent::Stored {
            worker,
            dp_rank,
            mut parent,
            blocks,
            block_size,
            medium,
            namespace,
        } if blocks.len() > n => {
            let mut out = Vec::with_capacity(blocks.len().div_ceil(n));
            for part in blocks.chunks(n) {
                let next_parent = part.last().map(|b| b.engine_hash);
                out.push(KvEvent::Stored {
                    worker,
                    dp_rank,
                    parent,
                    blocks: part.to_vec(),
                    block_size,
                    medium,
                    namespace: namespace.clone(),
                });
                parent = next_parent;
            }
            out
        }
        KvEvent::Removed {
            worker,
            dp_rank,
            engine_hashes,
            medium,
        } if engine_hashes.len() > n => engine_hashes
            .chunks(n)
            .map(|part| KvEvent::Removed {
                worker,
                dp_rank,
                engine_hashes: part.to_vec(),
                medium,
            })
            .collect(),
        other => vec![other],
    }
}

/// Decodes `payload` (outside the core lock) and applies its events slice by slice. Returns
/// the first block-size error among them, if any (the caller logs it; every error is counted
/// in `kv_events_applied_total{status}`). An undecodable payload is counted as `malformed`.
pub(crate) fn apply_payload(state: &Inner, source: &Source, payload: &[u8]) -> Option<IndexError> {
    let batch = match decode_payload(payload) {
        Ok(b) => b,
        Err(_) => {
            super::drop_message(state, "malformed");
            return None;
        }
    };
    let mut block_size = None;
    let opts = ConvertOptions {
        worker: source.worker,
        default_dp_rank: source.dp_rank,
    };
    let slice_blocks = state.config.kv_ingest.apply_slice_blocks;
    for event in to_kv_events(&batch, opts) {
        let mut event = match event {
            Ok(Some(e)) => e,
            Ok(None) => continue,
            Err(_) => {
                state
                    .metrics
                    .kv_events
                    .inc(&[("status", "undecodable"), ("event_type", "unknown")]);
                continue;
            }
        };
        let kind = event.kind();
        // Token ids are hashed here, outside the core lock, so the lock is held for the tree
        // work only and the ingest threads of several engines hash in parallel.
        event.hash_contents(state.config.router.kv_cache_block_size);
        let mut status = "ok";
        let mut parts = slices(event, slice_blocks).into_iter().peekable();
        while let Some(part) = parts.next() {
            // One short critical section per slice; others get the lock in between (an event
            // of one slice, the usual case, needs no turn given away).
            let result = state.lock_core().apply_event(&part);
            if let Err(err) = result {
                if status == "ok" {
                    status = err.status();
                }
                if matches!(err, IndexError::BlockSizeMismatch { .. }) {
                    block_size.get_or_insert(err);
                }
            }
            if parts.peek().is_some() {
                std::thread::yield_now();
            }
        }
        state
            .metrics
            .kv_events
            .inc(&[("status", status), ("event_type", kind)]);
    }
    block_size
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_core::event::{BlockContent, Medium, StoredBlock};
    use kvrouter_core::hashing::HashNamespace;
    use kvrouter_core::ids::{EngineHash, WorkerId};

    fn stored(parent: Option<u64>, hashes: std::ops::Range<u64>) -> KvEvent {
        KvEvent::Stored {
            worker: WorkerId(1),
            dp_rank: 0,
            parent: parent.map(EngineHash),
            blocks: hashes
                .map(|h| StoredBlock {
                    engine_hash: EngineHash(h),
                    content: BlockContent::Tokens(vec![h as u32; 4]),
                })
                .collect(),
            block_size: 4,
            medium: Medium::Gpu,
            namespace: HashNamespace::none(),
        }
    }

    #[test]
    fn a_long_stored_event_becomes_a_parent_chain_of_slices() {
        let parts = slices(stored(Some(7), 10..20), 4);
        assert_eq!(
            parts,
            vec![
                stored(Some(7), 10..14),
                stored(Some(13), 14..18),
                stored(Some(17), 18..20)
            ]
        );
        assert_eq!(slices(stored(None, 0..3), 4), vec![stored(None, 0..3)]);
        assert_eq!(slices(stored(None, 0..3), 0).len(), 3);
    }

    #[test]
    fn sliced_and_whole_events_build_the_same_index() {
        let config = kvrouter_core::router::RouterConfig {
            kv_cache_block_size: 4,
            ..Default::default()
        };
        let mut whole = kvrouter_core::router::Router::new(config.clone()).unwrap();
        let mut sliced = kvrouter_core::router::Router::new(config).unwrap();
        for r in [&mut whole, &mut sliced] {
            r.add_worker(kvrouter_core::router::WorkerSpec::new(WorkerId(1)))
                .unwrap();
        }
        whole.apply_event(&stored(None, 1..50)).unwrap();
        for part in slices(stored(None, 1..50), 7) {
            sliced.apply_event(&part).unwrap();
        }
        assert_eq!(whole.index().stats().blocks, 49);
        assert_eq!(whole.index().snapshot(), sliced.index().snapshot());
    }
}
