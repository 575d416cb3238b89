//! The pure part of discovery: the set of discovered workers, what a source's event changes in
//! it, and when a drained worker is purged. No I/O and no clock: `now` is passed in (time since
//! the driver started); the driver carries out the returned [`Action`]s.

use super::{Registration, SourceEvent};
use crate::validate::same_worker_url;
use kvrouter_core::ids::WorkerId;
use std::collections::BTreeMap;
use std::time::Duration;

/// What the driver does to the registry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// Register a new worker for `key`; report its id with [`Membership::added`].
    Add {
        /// The source's key (etcd key, endpoint name).
        key: String,
        /// What it registered.
        registration: Registration,
    },
    /// Take a worker out of rotation; requests in flight on it go on.
    Drain(WorkerId),
    /// A draining worker registered again, unchanged: back into rotation (its KV event
    /// subscribers are still running and re-sync when its publisher comes back).
    Revive(WorkerId),
    /// Forget a worker: its index entries and subscribers go.
    Purge(WorkerId),
}

#[derive(Clone, Debug)]
enum Phase {
    Active,
    /// Until the grace period is over (`since + grace`).
    Draining {
        until: Duration,
    },
}

#[derive(Clone, Debug)]
struct Member {
    registration: Registration,
    /// `None` while its registration is under way, or after it failed.
    id: Option<WorkerId>,
    /// The registry refused it (for example, another key registered its URL first): tried
    /// again when a worker at its URL is purged.
    refused: bool,
    phase: Phase,
}

/// The discovered workers, by the key their source gave them.
#[derive(Debug)]
pub(crate) struct Membership {
    grace: Duration,
    members: BTreeMap<String, Member>,
}

impl Membership {
    /// An empty set; removed workers are purged `grace` after their removal.
    pub(crate) fn new(grace: Duration) -> Self {
        Self {
            grace,
            members: BTreeMap::new(),
        }
    }

    /// Applies one event of a source at `now`; returns what to do, in order.
    pub(crate) fn apply(&mut self, event: SourceEvent, now: Duration) -> Vec<Action> {
        let mut actions = Vec::new();
        match event {
            SourceEvent::Put { key, registration } => self.put(key, registration, &mut actions),
            SourceEvent::Delete { key } => self.delete(&key, now, &mut actions),
            SourceEvent::Snapshot(all) => {
                let gone: Vec<String> = self
                    .members
                    .keys()
                    .filter(|k| !all.iter().any(|(key, _)| key == *k))
                    .cloned()
                    .collect();
                for key in gone {
                    self.delete(&key, now, &mut actions);
                }
                for (key, registration) in all {
                    self.put(key, registration, &mut actions);
                }
            }
        }
        actions
    }

    fn put(&mut self, key: String, registration: Registration, actions: &mut Vec<Action>) {
        if let Some(m) = self.members.get_mut(&key) {
            let same = m.registration == registration;
            match (&m.phase, m.id) {
                (Phase::Active, _) if same => return,
                (Phase::Draining { .. }, Some(id)) if same => {
                    m.phase = Phase::Active;
                    actions.push(Action::Revive(id));
                    return;
                }
                _ => {}
            }
            // Changed (or a failed registration given again): the old worker goes at once.
            if let Some(old) = self.members.remove(&key) {
                if let Some(id) = old.id {
                    actions.push(Action::Purge(id));
                    if !same_worker_url(&old.registration.url, &registration.url) {
                        self.retry_refused(&old.registration.url, actions);
                    }
                }
            }
        }
        // Another key's draining worker at the same URL: the engine came back under a new
        // key; the URL can be registered only once.
        let stale: Vec<String> = self
            .members
            .iter()
            .filter(|(_, m)| {
                matches!(m.phase, Phase::Draining { .. })
                    && same_worker_url(&m.registration.url, &registration.url)
            })
            .map(|(k, _)| k.clone())
            .collect();
        for k in stale {
            if let Some(id) = self.members.remove(&k).and_then(|m| m.id) {
                actions.push(Action::Purge(id));
            }
        }
        self.members.insert(
            key.clone(),
            Member {
                registration: registration.clone(),
                id: None,
                refused: false,
                phase: Phase::Active,
            },
        );
        actions.push(Action::Add { key, registration });
    }

    fn delete(&mut self, key: &str, now: Duration, actions: &mut Vec<Action>) {
        let Some(m) = self.members.get_mut(key) else {
            return;
        };
        match (&m.phase, m.id) {
            (Phase::Draining { .. }, _) => {}
            (Phase::Active, Some(id)) => {
                let url = m.registration.url.clone();
                if self.refused_at(&url) {
                    // Another key still names the engine: it takes the URL now (a drain would
                    // hold the URL, and the engine out of rotation, for the grace period).
                    self.members.remove(key);
                    actions.push(Action::Purge(id));
                    self.retry_refused(&url, actions);
                    return;
                }
                let m = self.members.get_mut(key).expect("member");
                m.phase = Phase::Draining {
                    until: now + self.grace,
                };
                actions.push(Action::Drain(id));
            }
            (Phase::Active, None) => {
                self.members.remove(key);
            }
        }
    }

    /// Records the outcome of an [`Action::Add`]: the worker's id, or `None` when the registry
    /// refused it (it stays known, unregistered, until its source changes or removes it, or a
    /// worker this source registered at its URL goes: see [`Membership::retry_refused`]).
    /// Returns a purge when the key was removed meanwhile.
    pub(crate) fn added(&mut self, key: &str, id: Option<WorkerId>) -> Option<Action> {
        match self.members.get_mut(key) {
            Some(m) if m.id.is_none() => {
                m.id = id;
                m.refused = id.is_none();
                None
            }
            _ => id.map(Action::Purge),
        }
    }

    /// Purges the workers whose grace period is over at `now`.
    pub(crate) fn expire(&mut self, now: Duration) -> Vec<Action> {
        let due: Vec<String> = self
            .members
            .iter()
            .filter(|(_, m)| matches!(m.phase, Phase::Draining { until } if until <= now))
            .map(|(k, _)| k.clone())
            .collect();
        let mut actions = Vec::new();
        for key in due {
            let Some(Member {
                id: Some(id),
                registration,
                ..
            }) = self.members.remove(&key)
            else {
                continue;
            };
            actions.push(Action::Purge(id));
            self.retry_refused(&registration.url, &mut actions);
        }
        actions
    }

    /// A worker at `url` was purged: every key the registry refused at that URL (the same
    /// engine registered under several keys, another one first) is registered again, in key
    /// order; the registry takes the first it can, the others are refused again. So the
    /// engine stays in rotation under a key that still names it. (Only this source's workers
    /// count: a key refused for a URL held by a static `--worker` or another source is tried
    /// again when its own source changes it.)
    fn retry_refused(&mut self, url: &str, actions: &mut Vec<Action>) {
        for (key, m) in self
            .members
            .iter_mut()
            .filter(|(_, m)| m.refused && same_worker_url(&m.registration.url, url))
        {
            m.refused = false;
            actions.push(Action::Add {
                key: key.clone(),
                registration: m.registration.clone(),
            });
        }
    }

    /// Whether a key refused at `url` waits for it.
    fn refused_at(&self, url: &str) -> bool {
        self.members
            .values()
            .any(|m| m.refused && same_worker_url(&m.registration.url, url))
    }

    /// When the next drained worker is due for its purge.
    pub(crate) fn next_deadline(&self) -> Option<Duration> {
        self.members
            .values()
            .filter_map(|m| match m.phase {
                Phase::Draining { until } => Some(until),
                Phase::Active => None,
            })
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(url: &str) -> Registration {
        Registration {
            url: url.into(),
            ..Registration::default()
        }
    }

    fn put(key: &str, url: &str) -> SourceEvent {
        SourceEvent::Put {
            key: key.into(),
            registration: reg(url),
        }
    }

    fn del(key: &str) -> SourceEvent {
        SourceEvent::Delete { key: key.into() }
    }

    const GRACE: Duration = Duration::from_secs(30);
    const T0: Duration = Duration::ZERO;

    fn add(key: &str, url: &str) -> Action {
        Action::Add {
            key: key.into(),
            registration: reg(url),
        }
    }

    #[test]
    fn a_removed_worker_drains_and_is_purged_after_the_grace_period() {
        let mut m = Membership::new(GRACE);
        assert_eq!(
            m.apply(put("a", "http://a"), T0),
            vec![add("a", "http://a")]
        );
        assert_eq!(m.added("a", Some(WorkerId(7))), None);
        assert_eq!(m.apply(put("a", "http://a"), T0), vec![], "unchanged");
        let t1 = Duration::from_secs(5);
        assert_eq!(m.apply(del("a"), t1), vec![Action::Drain(WorkerId(7))]);
        assert_eq!(m.apply(del("a"), t1), vec![], "draining already");
        assert_eq!(m.next_deadline(), Some(t1 + GRACE));
        assert_eq!(m.expire(t1 + GRACE - Duration::from_millis(1)), vec![]);
        assert_eq!(m.expire(t1 + GRACE), vec![Action::Purge(WorkerId(7))]);
        assert_eq!(m.next_deadline(), None);
        assert_eq!(m.apply(del("a"), t1 + GRACE), vec![], "gone");
    }

    #[test]
    fn a_worker_back_unchanged_while_draining_is_revived_and_a_changed_one_replaced() {
        let mut m = Membership::new(GRACE);
        m.apply(put("a", "http://a"), T0);
        m.added("a", Some(WorkerId(1)));
        m.apply(del("a"), T0);
        assert_eq!(
            m.apply(put("a", "http://a"), T0),
            vec![Action::Revive(WorkerId(1))]
        );
        assert_eq!(m.next_deadline(), None, "no purge pending");
        assert_eq!(
            m.apply(put("a", "http://a2"), T0),
            vec![Action::Purge(WorkerId(1)), add("a", "http://a2")],
            "a changed registration replaces the worker"
        );
    }

    #[test]
    fn the_same_url_under_a_new_key_purges_the_draining_one_first() {
        let mut m = Membership::new(GRACE);
        m.apply(put("old", "http://a/"), T0);
        m.added("old", Some(WorkerId(1)));
        m.apply(del("old"), T0);
        assert_eq!(
            m.apply(put("new", "http://a"), T0),
            vec![Action::Purge(WorkerId(1)), add("new", "http://a")]
        );
        assert_eq!(m.expire(GRACE), vec![], "purged already");
    }

    #[test]
    fn a_url_refused_under_a_second_key_is_registered_when_the_first_key_goes() {
        let mut m = Membership::new(GRACE);
        m.apply(put("first", "http://a"), T0);
        m.added("first", Some(WorkerId(1)));
        // The same engine under a second key: the registry refuses its URL.
        assert_eq!(
            m.apply(put("second", "http://a/"), T0),
            vec![add("second", "http://a/")]
        );
        assert_eq!(m.added("second", None), None);
        m.apply(put("third", "http://a"), T0);
        assert_eq!(m.added("third", None), None);
        // A registration under way at that URL is not doubled.
        m.apply(put("pending", "http://a"), T0);
        // The first key goes: the worker is replaced at once (no grace period out of
        // rotation), every refused key is tried again in order.
        assert_eq!(
            m.apply(del("first"), T0),
            vec![
                Action::Purge(WorkerId(1)),
                add("second", "http://a/"),
                add("third", "http://a")
            ]
        );
        assert_eq!(m.next_deadline(), None, "nothing drains");
        assert_eq!(m.added("second", Some(WorkerId(2))), None);
        assert_eq!(m.added("third", None), None, "refused again");
        // With no refused key left at the URL, a delete drains as before.
        m.apply(del("third"), T0);
        assert_eq!(m.apply(del("second"), T0), vec![Action::Drain(WorkerId(2))]);
    }

    #[test]
    fn a_refused_key_is_tried_again_when_the_owner_moves_to_another_url() {
        let mut m = Membership::new(GRACE);
        m.apply(put("first", "http://a"), T0);
        m.added("first", Some(WorkerId(1)));
        m.apply(put("second", "http://a"), T0);
        m.added("second", None);
        assert_eq!(
            m.apply(put("first", "http://b"), T0),
            vec![
                Action::Purge(WorkerId(1)),
                add("second", "http://a"),
                add("first", "http://b")
            ]
        );
        assert_eq!(m.added("second", Some(WorkerId(2))), None);
    }

    #[test]
    fn a_snapshot_drains_what_it_lacks_and_adds_what_is_new() {
        let mut m = Membership::new(GRACE);
        m.apply(put("a", "http://a"), T0);
        m.added("a", Some(WorkerId(1)));
        m.apply(put("b", "http://b"), T0);
        m.added("b", Some(WorkerId(2)));
        let snapshot = SourceEvent::Snapshot(vec![
            ("b".into(), reg("http://b")),
            ("c".into(), reg("http://c")),
        ]);
        assert_eq!(
            m.apply(snapshot, T0),
            vec![Action::Drain(WorkerId(1)), add("c", "http://c")]
        );
    }

    #[test]
    fn a_failed_or_overtaken_registration_leaves_nothing_behind() {
        let mut m = Membership::new(GRACE);
        m.apply(put("a", "http://a"), T0);
        assert_eq!(m.added("a", None), None, "refused by the registry");
        assert_eq!(m.apply(del("a"), T0), vec![], "nothing registered to drain");
        assert_eq!(m.next_deadline(), None);
        // Removed while its registration was under way: the new worker is purged at once.
        m.apply(put("b", "http://b"), T0);
        m.apply(del("b"), T0);
        assert_eq!(
            m.added("b", Some(WorkerId(3))),
            Some(Action::Purge(WorkerId(3)))
        );
        // Given again unchanged after a refusal: not tried again (the refusal was about what
        // it registered); changed: tried again.
        m.apply(put("c", "http://c"), T0);
        m.added("c", None);
        assert_eq!(m.apply(put("c", "http://c"), T0), vec![]);
        assert_eq!(
            m.apply(put("c", "http://c2"), T0),
            vec![add("c", "http://c2")]
        );
    }
}
