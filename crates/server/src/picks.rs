//! Outstanding picks of the pick API: placements handed to a caller that sends the request
//! itself. Each holds the load guard of its placement under a lease: a pick whose caller
//! reports neither a first token nor a finish before the lease ends expires, and its guard
//! releases its load (as cancelled). A reported first token extends the lease to
//! `--pick-max-duration-secs`. The table is bounded (`--pick-max-outstanding`).

use crate::guard::LoadGuard;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

struct Lease {
    guard: LoadGuard,
    expires: Instant,
}

#[derive(Default)]
struct Table {
    leases: HashMap<u64, Lease>,
    /// The leases by expiry, earliest first.
    by_expiry: BTreeSet<(Instant, u64)>,
}

/// The outstanding picks and their leases.
#[derive(Default)]
pub(crate) struct PickTable {
    table: Mutex<Table>,
    /// Wakes the reaper when a lease ends earlier than every one before it.
    earlier: Notify,
}

/// Why a pick could not be kept.
pub(crate) struct Full(pub(crate) Box<LoadGuard>);

impl PickTable {
    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().expect("picks lock")
    }

    /// Outstanding picks.
    pub(crate) fn len(&self) -> usize {
        self.lock().leases.len()
    }

    /// Keeps pick `id` until `expires`, unless `max` picks are outstanding already.
    pub(crate) fn insert(
        &self,
        id: u64,
        guard: LoadGuard,
        expires: Instant,
        max: usize,
    ) -> Result<(), Full> {
        let mut t = self.lock();
        if t.leases.len() >= max {
            return Err(Full(Box::new(guard)));
        }
        let earliest = t.by_expiry.first().is_none_or(|(at, _)| expires < *at);
        t.by_expiry.insert((expires, id));
        t.leases.insert(id, Lease { guard, expires });
        drop(t);
        if earliest {
            self.earlier.notify_one();
        }
        Ok(())
    }

    /// The caller saw pick `id`'s first token: its lease now ends at `expires`. Returns
    /// whether the pick is outstanding.
    pub(crate) fn first_token(&self, id: u64, expires: Instant) -> bool {
        let mut t = self.lock();
        let t = &mut *t;
        let Some(lease) = t.leases.get_mut(&id) else {
            return false;
        };
        lease.guard.first_token();
        t.by_expiry.remove(&(lease.expires, id));
        lease.expires = expires;
        t.by_expiry.insert((expires, id));
        true
    }

    /// Takes pick `id` out of the table (its caller finished or cancelled it).
    pub(crate) fn take(&self, id: u64) -> Option<LoadGuard> {
        let mut t = self.lock();
        let lease = t.leases.remove(&id)?;
        t.by_expiry.remove(&(lease.expires, id));
        Some(lease.guard)
    }

    /// Takes out every pick whose lease ended by `now` (the caller drops them, outside the
    /// table's lock, which releases their load).
    fn expired(&self, now: Instant) -> Vec<LoadGuard> {
        let mut t = self.lock();
        let mut out = Vec::new();
        while let Some(&(at, id)) = t.by_expiry.first() {
            if at > now {
                break;
            }
            t.by_expiry.pop_first();
            if let Some(lease) = t.leases.remove(&id) {
                out.push(lease.guard);
            }
        }
        out
    }

    /// When the earliest lease ends.
    fn next_expiry(&self) -> Option<Instant> {
        self.lock().by_expiry.first().map(|(at, _)| *at)
    }

    /// Ends every outstanding pick (the server stops): their load is released.
    pub(crate) fn clear(&self) {
        let leases: Vec<Lease> = {
            let mut t = self.lock();
            t.by_expiry.clear();
            t.leases.drain().map(|(_, l)| l).collect()
        };
        drop(leases);
    }
}

/// The reaper: ends picks whose lease ran out, counting them as expired.
pub(crate) fn spawn_reaper(inner: Arc<crate::state::Inner>) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let picks = &inner.picks;
            match picks.next_expiry() {
                Some(at) => tokio::select! {
                    _ = picks.earlier.notified() => {}
                    _ = tokio::time::sleep_until(tokio::time::Instant::from_std(at)) => {}
                },
                None => picks.earlier.notified().await,
            }
            let expired = picks.expired(Instant::now());
            for guard in expired {
                inner
                    .metrics
                    .picks
                    .inc(&[("source", "api"), ("end", "expired")]);
                drop(guard);
            }
        }
    })
}
