//! Outstanding picks of the pick API: placements handed to a caller that sends the request
//! itself. Each holds the load guard of its placement under a lease: a pick whose caller
//! reports neither a first token nor a finish before the lease ends expires, and its guard
//! releases its load (as cancelled). A reported first token extends the lease to
//! `--pick-max-duration-secs`. The table is bounded (`--pick-max-outstanding`). It lives with
//! the pick routes (`app`): dropping the router ends the outstanding picks, releasing their load.
//! Its reaper task is started with the first pick and ends with the table.

use crate::guard::LoadGuard;
use crate::state::AppState;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Instant;
use tokio::sync::Notify;

struct Lease {
    guard: LoadGuard,
    expires: Instant,
    /// Whether a first token was reported: the lease was extended once, and is not again.
    started: bool,
}

#[derive(Default)]
struct Table {
    leases: HashMap<u64, Lease>,
    /// The leases by expiry, earliest first.
    by_expiry: BTreeSet<(Instant, u64)>,
}

/// A pick's id as answers write it: the tag of the router that made it (random per process, 8
/// hex digits), a dash, and its request number (`3f9a0c12-17`). Clients keep it as an opaque
/// string. The tag keeps a report sent to another replica, or to this router after a restart,
/// from releasing a pick that happens to have the same number there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PickId {
    tag: u32,
    number: u64,
}

impl std::fmt::Display for PickId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:08x}-{}", self.tag, self.number)
    }
}

impl serde::Serialize for PickId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Why a text is not one of this router's pick ids.
pub(crate) enum NotOurs {
    /// Not shaped as a pick id.
    Malformed,
    /// A pick id of another router: a replica, or this one before a restart.
    Foreign,
}

/// The outstanding picks and their leases.
pub(crate) struct PickTable {
    state: AppState,
    /// This router's pick id tag.
    tag: u32,
    table: Mutex<Table>,
    /// Wakes the reaper when a lease ends earlier than every one before it.
    earlier: Arc<Notify>,
    reaper: OnceLock<tokio::task::AbortHandle>,
}

/// Why a pick could not be kept.
pub(crate) struct Full(pub(crate) Box<LoadGuard>);

impl PickTable {
    /// An empty table (no I/O; the reaper starts with the first pick).
    pub(crate) fn new(state: AppState) -> Self {
        Self {
            state,
            tag: crate::access::process_random() as u32,
            table: Mutex::default(),
            earlier: Arc::default(),
            reaper: OnceLock::new(),
        }
    }

    /// The server's state.
    pub(crate) fn state(&self) -> &AppState {
        &self.state
    }

    /// The tag every pick id of this router begins with.
    pub(crate) fn tag(&self) -> String {
        format!("{:08x}", self.tag)
    }

    /// The id of pick number `number`.
    pub(crate) fn id(&self, number: u64) -> PickId {
        PickId {
            tag: self.tag,
            number,
        }
    }

    /// The pick number of `text` if it is an id this router wrote (exactly as written: the
    /// tag in lower-case hex, the number in decimal without sign or leading zero).
    pub(crate) fn parse_id(&self, text: &str) -> Result<u64, NotOurs> {
        let (tag, number) = text.split_once('-').ok_or(NotOurs::Malformed)?;
        let canonical = |s: &str, hex: bool| {
            !s.is_empty()
                && s.bytes()
                    .all(|b| b.is_ascii_digit() || (hex && matches!(b, b'a'..=b'f')))
        };
        let decimal = canonical(number, false) && (number == "0" || !number.starts_with('0'));
        if tag.len() != 8 || !canonical(tag, true) || !decimal {
            return Err(NotOurs::Malformed);
        }
        if u32::from_str_radix(tag, 16) != Ok(self.tag) {
            return Err(NotOurs::Foreign);
        }
        number.parse().map_err(|_| NotOurs::Malformed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().expect("picks lock")
    }

    fn count(&self, t: &Table) {
        let n = t.leases.len() as u64;
        let gauge = &self.state.inner.metrics.picks_outstanding;
        gauge.store(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// Outstanding picks.
    pub(crate) fn len(&self) -> usize {
        self.lock().leases.len()
    }

    /// Keeps pick `id` until `expires`, unless `max` picks are outstanding already.
    pub(crate) fn insert(
        self: &Arc<Self>,
        id: u64,
        guard: LoadGuard,
        expires: Instant,
        max: usize,
    ) -> Result<(), Full> {
        self.reaper.get_or_init(|| {
            spawn_reaper(Arc::downgrade(self), self.earlier.clone()).abort_handle()
        });
        let mut t = self.lock();
        if t.leases.len() >= max {
            return Err(Full(Box::new(guard)));
        }
        let earliest = t.by_expiry.first().is_none_or(|(at, _)| expires < *at);
        t.by_expiry.insert((expires, id));
        t.leases.insert(
            id,
            Lease {
                guard,
                expires,
                started: false,
            },
        );
        self.count(&t);
        drop(t);
        if earliest {
            self.earlier.notify_one();
        }
        Ok(())
    }

    /// The caller saw pick `id`'s first token: its lease now ends at `expires`. A repeated
    /// report changes nothing (the cap counts from the first, or a caller that never finishes
    /// could hold its load for ever). Returns whether the pick is outstanding.
    pub(crate) fn first_token(&self, id: u64, expires: Instant) -> bool {
        let mut t = self.lock();
        let t = &mut *t;
        let Some(lease) = t.leases.get_mut(&id) else {
            return false;
        };
        if lease.started {
            return true;
        }
        lease.started = true;
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
        self.count(&t);
        Some(lease.guard)
    }

    /// Ends every pick whose lease ended by `now`, counting it as expired; the guards are
    /// dropped outside the table's lock, which releases their load.
    fn expire(&self, now: Instant) {
        let mut expired = Vec::new();
        {
            let mut t = self.lock();
            while let Some(&(at, id)) = t.by_expiry.first() {
                if at > now {
                    break;
                }
                t.by_expiry.pop_first();
                if let Some(lease) = t.leases.remove(&id) {
                    expired.push(lease.guard);
                }
            }
            self.count(&t);
        }
        let metrics = &self.state.inner.metrics;
        for guard in expired {
            metrics.picks.inc(&[("source", "api"), ("end", "expired")]);
            drop(guard);
        }
    }

    /// When the earliest lease ends.
    fn next_expiry(&self) -> Option<Instant> {
        self.lock().by_expiry.first().map(|(at, _)| *at)
    }
}

impl Drop for PickTable {
    fn drop(&mut self) {
        if let Some(reaper) = self.reaper.get() {
            reaper.abort();
        }
        let t = self.table.get_mut().expect("picks lock");
        t.by_expiry.clear();
        t.leases.clear();
        self.count(&Table::default());
    }
}

/// The reaper: sleeps until the earliest lease ends (or an earlier one is added), then ends
/// the picks whose lease ran out. It holds the table only while it looks, and ends with it.
fn spawn_reaper(table: Weak<PickTable>, earlier: Arc<Notify>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let Some(next) = table.upgrade().map(|t| t.next_expiry()) else {
                return;
            };
            match next {
                Some(at) => tokio::select! {
                    _ = earlier.notified() => {}
                    _ = tokio::time::sleep_until(tokio::time::Instant::from_std(at)) => {}
                },
                None => earlier.notified().await,
            }
            let Some(t) = table.upgrade() else {
                return;
            };
            t.expire(Instant::now());
        }
    })
}
