//! Router replicas in the simulation (`--router-replicas N`): request i is placed by replica
//! i mod N (a round-robin load balancer), every replica reads the engines' KV events, and each
//! sees the others' events ([`RemoteEvent`]: load, placements, sessions, groups, versions,
//! update holds) `--replica-sync-delay-ms` after they happen, as the live server's replicas do
//! over NATS. Without sync each replica sees only its own requests.

use super::{ms, Event, Simulation};
use kvrouter_core::router::{RemoteEvent, Router};

/// Rounds of immediate delivery after one event, at most.
const MAX_ROUNDS: usize = 64;

impl Simulation<'_> {
    /// The replica that owns request `i`.
    pub(super) fn router_of(&mut self, i: usize) -> &mut Router {
        let r = i % (1 + self.replicas.len());
        if r == 0 {
            &mut self.router
        } else {
            &mut self.replicas[r - 1]
        }
    }

    /// Every replica.
    pub(super) fn all_routers(&mut self) -> impl Iterator<Item = &mut Router> {
        std::iter::once(&mut self.router).chain(self.replicas.iter_mut())
    }

    /// Sends what each replica queued to the others, arriving after the sync delay; with no
    /// delay they see it at once (before the next event, even one at the same instant).
    pub(super) fn send_sync(&mut self) {
        if self.replicas.is_empty() {
            return;
        }
        let delay = self.config.replica_sync_delay_ms;
        // Bounded: applying events queues new ones only through placements they release.
        for _ in 0..MAX_ROUNDS {
            let outgoing: Vec<(usize, Vec<RemoteEvent>)> = self
                .all_routers()
                .map(|r| r.take_outgoing())
                .enumerate()
                .filter(|(_, events)| !events.is_empty())
                .collect();
            if outgoing.is_empty() {
                return;
            }
            for (from, events) in outgoing {
                if delay > 0.0 {
                    self.queue
                        .push(self.now + ms(delay), Event::Sync(from, events));
                } else {
                    self.synced(from, events);
                }
            }
        }
    }

    /// Replica `from`'s events reach the others: what they set in motion is carried out.
    pub(super) fn synced(&mut self, from: usize, events: Vec<RemoteEvent>) {
        let now = self.now;
        let mut effects = Vec::new();
        for (to, r) in self.all_routers().enumerate() {
            if to == from {
                continue;
            }
            for e in &events {
                if let Ok(more) = r.apply_remote(e.clone(), now) {
                    effects.push(more);
                }
            }
        }
        for e in effects {
            self.apply(e);
        }
    }
}
