//! The engines a weight update calls, one lane per worker: the lane is locked while the update
//! pauses its engine (and, after the pause, checks whether the router is stopping), and holds
//! the engine's URL while the engine is paused and not yet resumed. A stopping router marks the
//! lanes stopped (no pause starts any more), waits for each pause in flight, and resumes every
//! engine still held, by URL: a worker removed meanwhile is resumed too.

use kvrouter_core::ids::WorkerId;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// One worker's lane: the URL of its engine while an update holds it paused.
pub(crate) type Lane = Arc<tokio::sync::Mutex<Option<String>>>;

/// Every worker's lane, and whether the router is stopping.
#[derive(Default)]
pub(crate) struct UpdateLanes {
    stopped: AtomicBool,
    lanes: Mutex<HashMap<WorkerId, Lane>>,
}

impl UpdateLanes {
    /// The lane of `worker`, made on first use. Lanes no update uses and that hold no engine
    /// go meanwhile, so the table is bounded by the workers being updated, not by every
    /// worker ever updated (discovered workers come and go under new ids).
    pub(crate) fn lane(&self, worker: WorkerId) -> Lane {
        let mut lanes = self.lanes.lock().expect("update lanes lock");
        lanes.retain(|w, lane| {
            *w == worker
                || Arc::strong_count(lane) > 1
                || lane.try_lock().map_or(true, |held| held.is_some())
        });
        lanes.entry(worker).or_default().clone()
    }

    /// Whether the router is stopping: no engine is paused any more.
    pub(crate) fn stopped(&self) -> bool {
        self.stopped.load(Ordering::SeqCst)
    }

    /// The router stops: no pause starts from now on. Returns every lane, for their engines to
    /// be resumed.
    pub(crate) fn stop(&self) -> Vec<(WorkerId, Lane)> {
        self.stopped.store(true, Ordering::SeqCst);
        let lanes = self.lanes.lock().expect("update lanes lock");
        lanes.iter().map(|(w, l)| (*w, l.clone())).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_stop_sees_every_held_engine_and_no_pause_starts_after_it() {
        let lanes = UpdateLanes::default();
        *lanes.lane(WorkerId(1)).lock().await = Some("http://a".into());
        let _ = lanes.lane(WorkerId(2));
        assert!(!lanes.stopped());
        let mut held = Vec::new();
        for (w, lane) in lanes.stop() {
            if let Some(url) = lane.lock().await.take() {
                held.push((w, url));
            }
        }
        assert_eq!(held, [(WorkerId(1), "http://a".to_owned())]);
        assert!(lanes.stopped());
        assert!(lanes.lane(WorkerId(1)).lock().await.is_none());
    }

    #[tokio::test]
    async fn lanes_of_workers_no_update_holds_go() {
        let lanes = UpdateLanes::default();
        *lanes.lane(WorkerId(0)).lock().await = Some("http://held".into());
        let in_use = lanes.lane(WorkerId(1));
        for w in 2..1000 {
            let _ = lanes.lane(WorkerId(w));
        }
        let left: Vec<WorkerId> = {
            let mut v: Vec<WorkerId> = lanes.lanes.lock().unwrap().keys().copied().collect();
            v.sort();
            v
        };
        assert_eq!(left, [WorkerId(0), WorkerId(1), WorkerId(999)]);
        drop(in_use);
        let held: Vec<_> = lanes.stop().into_iter().map(|(w, _)| w).collect();
        assert!(
            held.contains(&WorkerId(0)),
            "an engine held paused is never forgotten"
        );
    }
}
