//! Who the other replicas are: when each was last heard from, and its worker table (its worker
//! ids by URL). Pure: the caller passes `now`.

use kvrouter_core::router::RemoteEvent;
use std::collections::HashMap;
use std::time::{Duration, Instant};

#[derive(Debug)]
struct Peer {
    last_seen: Instant,
    /// Its worker id → URL.
    workers: HashMap<u64, String>,
    /// The next sequence number expected; `None` until its first message (a table learned
    /// from the members bucket on joining says nothing about where its numbers are).
    next_seq: Option<u64>,
}

/// Events held per replica while its worker table is unknown, at most.
pub(crate) const MAX_HELD: usize = 4096;

/// The other replicas.
#[derive(Debug, Default)]
pub(crate) struct Peers {
    peers: HashMap<u64, Peer>,
    /// Events of replicas whose worker table is not known yet (a replica's first messages
    /// after it started, or after it was expired here), applied once it is.
    held: HashMap<u64, Vec<RemoteEvent>>,
    /// Per replica id, the sending processes of its last two messages from different
    /// processes (most recent first; 0: none yet, or a sender that predates instances).
    instances: HashMap<u64, [u64; 2]>,
}

impl Peers {
    /// Replica `id` was heard from at `now` (with its worker table, if it sent one). Returns the
    /// number of messages lost since the last one from it.
    pub(crate) fn seen(
        &mut self,
        id: u64,
        seq: u64,
        now: Instant,
        workers: Option<Vec<(u64, String)>>,
    ) -> u64 {
        let peer = self.peers.entry(id).or_insert_with(|| Peer {
            last_seen: now,
            workers: HashMap::new(),
            next_seq: None,
        });
        peer.last_seen = now;
        let lost = peer.next_seq.map_or(0, |next| seq.saturating_sub(next));
        peer.next_seq = Some(seq + 1);
        if let Some(ws) = workers {
            peer.workers = ws.into_iter().collect();
        }
        lost
    }

    /// A message from replica `id` came from process `instance`. Returns true when the sender
    /// went back to the process before the last (A, B, A): two processes share the id. A
    /// replica restarted under its id changes process once (A, B, B, ...) and is not counted.
    pub(crate) fn sent_by(&mut self, id: u64, instance: u64) -> bool {
        if instance == 0 {
            return false;
        }
        let [last, before] = self.instances.entry(id).or_default();
        if instance == *last {
            return false;
        }
        let alternates = instance == *before;
        (*last, *before) = (instance, *last);
        alternates
    }

    /// Learns a replica's worker table (from the members bucket) without counting it alive.
    pub(crate) fn learn_workers(&mut self, id: u64, now: Instant, workers: Vec<(u64, String)>) {
        let peer = self.peers.entry(id).or_insert_with(|| Peer {
            last_seen: now,
            workers: HashMap::new(),
            next_seq: None,
        });
        peer.workers = workers.into_iter().collect();
    }

    /// The URL of replica `id`'s worker `worker`.
    pub(crate) fn worker_url(&self, id: u64, worker: u64) -> Option<&str> {
        self.peers
            .get(&id)?
            .workers
            .get(&worker)
            .map(String::as_str)
    }

    /// Whether replica `id`'s worker table is known.
    pub(crate) fn knows_workers(&self, id: u64) -> bool {
        self.peers.get(&id).is_some_and(|p| !p.workers.is_empty())
    }

    /// Holds replica `id`'s `events` until its worker table is known; returns how many did
    /// not fit ([`MAX_HELD`]).
    pub(crate) fn hold(&mut self, id: u64, events: Vec<RemoteEvent>) -> u64 {
        let held = self.held.entry(id).or_default();
        let room = MAX_HELD.saturating_sub(held.len());
        let over = events.len().saturating_sub(room) as u64;
        held.extend(events.into_iter().take(room));
        over
    }

    /// The events held for replica `id` (its worker table is known now).
    pub(crate) fn take_held(&mut self, id: u64) -> Vec<RemoteEvent> {
        self.held.remove(&id).unwrap_or_default()
    }

    /// Forgets and returns the replicas not heard from within `ttl` of `now`.
    pub(crate) fn expire(&mut self, now: Instant, ttl: Duration) -> Vec<u64> {
        let mut gone: Vec<u64> = self
            .peers
            .iter()
            .filter(|(_, p)| now.saturating_duration_since(p.last_seen) > ttl)
            .map(|(id, _)| *id)
            .collect();
        gone.sort_unstable();
        for id in &gone {
            self.peers.remove(id);
            self.instances.remove(id);
            self.held.remove(id);
        }
        gone
    }

    /// Replicas alive (heard from within the TTL, as of the last [`Peers::expire`]).
    pub(crate) fn alive(&self) -> usize {
        self.peers.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silent_peers_expire_and_lost_messages_are_counted() {
        let t0 = Instant::now();
        let ttl = Duration::from_secs(5);
        let mut p = Peers::default();
        assert_eq!(p.seen(1, 0, t0, Some(vec![(0, "http://a".into())])), 0);
        assert_eq!(p.seen(2, 10, t0, None), 0);
        assert_eq!(p.seen(1, 3, t0 + Duration::from_secs(4), None), 2);
        assert_eq!(p.worker_url(1, 0), Some("http://a"));
        assert!(!p.knows_workers(2));
        assert_eq!(p.expire(t0 + Duration::from_secs(6), ttl), vec![2]);
        assert_eq!(p.alive(), 1);
        assert_eq!(p.expire(t0 + Duration::from_secs(10), ttl), vec![1]);
        assert_eq!(p.alive(), 0);
    }

    #[test]
    fn events_are_held_until_the_worker_table_is_known_and_bounded() {
        let mut p = Peers::default();
        let e = |s| RemoteEvent::SessionReleased { session: s };
        assert_eq!(p.hold(3, vec![e(1), e(2)]), 0);
        assert_eq!(p.hold(3, (0..MAX_HELD as u64).map(e).collect()), 2);
        let held = p.take_held(3);
        assert_eq!((held.len(), &held[0]), (MAX_HELD, &e(1)));
        assert!(p.take_held(3).is_empty());
        // An expired replica's held events go with it.
        p.seen(4, 0, Instant::now(), None);
        p.hold(4, vec![e(9)]);
        p.expire(
            Instant::now() + Duration::from_secs(10),
            Duration::from_secs(1),
        );
        assert!(p.take_held(4).is_empty());
    }

    #[test]
    fn a_peer_first_learned_from_the_members_bucket_has_lost_nothing() {
        let t0 = Instant::now();
        let mut p = Peers::default();
        // Joining: the bucket names replica 1, which has sent 52 messages before.
        p.learn_workers(1, t0, vec![(0, "http://a".into())]);
        assert_eq!(p.seen(1, 52, t0, None), 0);
        assert_eq!(p.seen(1, 55, t0, None), 2, "then gaps count");
    }

    #[test]
    fn two_processes_under_one_id_alternate_and_a_restart_does_not() {
        let mut p = Peers::default();
        // Replica 1 restarted (process 10, then 11 for good); replicas of an older build (0).
        let restart = [10, 10, 11, 11, 11, 0, 0];
        assert!(restart.iter().all(|i| !p.sent_by(1, *i)));
        // Replica 2 is two processes: flagged from the first return to an earlier one.
        let twins: Vec<bool> = [20, 21, 20, 20, 21]
            .iter()
            .map(|i| p.sent_by(2, *i))
            .collect();
        assert_eq!(twins, [false, false, true, false, true]);
    }
}
