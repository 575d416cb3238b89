//! What the server holds of replica sync (`--replica-sync`, see the `replica` module): the
//! publisher's wake-up (the core lock's guard rings it), the NATS link once up, and the counters.
//! Kept apart from `replica` so shared state does not depend on the sync loops.

use crate::config::ReplicaSyncConfig;
use crate::health::Reason;
use kvrouter_core::ids::WorkerId;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, OnceLock};
use tokio::sync::Notify;

/// Replica sync as the rest of the server sees it: the publisher's wake-up, the link once
/// connected, and the metrics.
#[derive(Debug, Default)]
pub(crate) struct ReplicaState {
    id: u64,
    /// This process among all that send as `id` (0 without sync): see
    /// [`ReplicaState::instance`].
    instance: u64,
    /// Wakes the publisher: the core queued events.
    pub(crate) notify: Notify,
    link: OnceLock<Arc<Link>>,
    /// This replica's own health verdicts not yet published: ejected (with why) or recovered,
    /// the latest per worker (at most one entry a worker, however long the link is down).
    verdicts: Mutex<Vec<(WorkerId, Option<Reason>)>>,
    /// Off in tests that show what unshared verdicts cost.
    share_verdicts: bool,
    pub(crate) metrics: SyncMetrics,
}

impl ReplicaState {
    pub(crate) fn new(config: Option<&ReplicaSyncConfig>) -> Self {
        Self {
            id: config.map_or(0, |c| c.replica_id),
            instance: config.map_or(0, |c| c.instance),
            share_verdicts: config.is_some_and(|c| c.share_health),
            ..Default::default()
        }
    }

    /// This replica's own verdict on `worker` changed: queue it for the others (with sync on).
    /// It replaces one still waiting for the same worker: a verdict says the worker's state
    /// now, so only the latest matters, and the queue stays one entry a worker while the
    /// publisher is not connected (nothing takes them then).
    pub(crate) fn verdict(&self, worker: WorkerId, verdict: Option<Reason>) {
        if !self.share_verdicts {
            return;
        }
        let mut waiting = self.verdicts.lock().expect("verdicts lock");
        waiting.retain(|(w, _)| *w != worker);
        waiting.push((worker, verdict));
        drop(waiting);
        self.notify.notify_one();
    }

    /// Takes the verdicts waiting to be published, oldest first.
    pub(crate) fn take_verdicts(&self) -> Vec<(WorkerId, Option<Reason>)> {
        std::mem::take(&mut *self.verdicts.lock().expect("verdicts lock"))
    }

    /// This replica's id (0 without sync).
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// This process's instance number, sent with every message: a message under this
    /// replica's id from another instance means two processes were given one `--replica-id`.
    pub(crate) fn instance(&self) -> u64 {
        self.instance
    }

    /// The NATS link, once connected and joined.
    pub(crate) fn link(&self) -> Option<&Arc<Link>> {
        self.link.get()
    }

    /// The link is up (once).
    pub(crate) fn set_link(&self, link: Arc<Link>) {
        let _ = self.link.set(link);
    }
}

/// An open NATS connection and the lease bucket.
pub(crate) struct Link {
    pub(crate) client: async_nats::Client,
    pub(crate) lease: async_nats::jetstream::kv::Store,
    pub(crate) config: ReplicaSyncConfig,
    /// Held from taking the update lease until its cycle has begun: one start at a time in
    /// this replica (see `replica::lease::acquire`).
    pub(crate) starting: tokio::sync::Mutex<()>,
}

impl Link {
    /// Publishes `body` to `subject` (with `headers`), waiting at most a heartbeat for the
    /// client to take it: a client whose connection is stuck stops taking messages once its
    /// queue is full, and would hold the caller up for good. Whether it was taken.
    pub(crate) async fn send(
        &self,
        subject: String,
        headers: Option<async_nats::HeaderMap>,
        body: bytes::Bytes,
    ) -> bool {
        let publish = async {
            match headers {
                Some(h) => self.client.publish_with_headers(subject, h, body).await,
                None => self.client.publish(subject, body).await,
            }
        };
        matches!(
            tokio::time::timeout(self.config.heartbeat, publish).await,
            Ok(Ok(()))
        )
    }
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("config", &self.config)
            .finish()
    }
}

/// Counters of replica sync.
#[derive(Debug, Default)]
pub(crate) struct SyncMetrics {
    pub(crate) connected: AtomicBool,
    pub(crate) published: AtomicU64,
    pub(crate) publish_errors: AtomicU64,
    pub(crate) dropped: AtomicU64,
    pub(crate) received: AtomicU64,
    pub(crate) rejected: AtomicU64,
    pub(crate) untranslated: AtomicU64,
    pub(crate) lost_messages: AtomicU64,
    pub(crate) peers_alive: AtomicU64,
    pub(crate) expired: AtomicU64,
    pub(crate) lag_ms: AtomicU64,
    pub(crate) lease_lost: AtomicU64,
    pub(crate) rollbacks: AtomicU64,
    /// Reads of the buckets after a reconnect's repair or another replica's.
    pub(crate) repairs: AtomicU64,
    /// Messages under this replica's id from another process.
    pub(crate) id_conflicts: AtomicU64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_waiting_to_be_published_keep_the_latest_per_worker() {
        // Nothing takes verdicts while the link is down: a flapping worker's each change had
        // been queued for good.
        let state = ReplicaState::new(Some(&ReplicaSyncConfig::new("nats://127.0.0.1:4222", 1)));
        for _ in 0..1000 {
            state.verdict(WorkerId(1), Some(Reason::FailedChecks));
            state.verdict(WorkerId(2), Some(Reason::FailedRequests));
            state.verdict(WorkerId(1), None);
        }
        assert_eq!(
            state.take_verdicts(),
            vec![
                (WorkerId(2), Some(Reason::FailedRequests)),
                (WorkerId(1), None)
            ]
        );
        assert!(state.take_verdicts().is_empty());
    }
}
