//! Idle connections to workers, by address: at most [`MAX_IDLE_PER_HOST`] each, closed after
//! [`IDLE_TIMEOUT`] unused (shorter than the 5 s after which uvicorn, which serves vLLM, SGLang
//! and TensorRT-LLM, closes an idle connection, so the router closes first) or as soon as a
//! sweep ([`SWEEP_EVERY`]) finds the worker closed them. A connection is peeked at before reuse.
//! Sockets are probed and closed outside the lock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use tokio::net::TcpStream;

/// Idle connections kept per worker address, at most.
pub(crate) const MAX_IDLE_PER_HOST: usize = 4096;
/// An idle connection unused this long is closed.
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(4);
/// How often idle connections are swept for expired ones and ones the worker closed.
pub(crate) const SWEEP_EVERY: Duration = Duration::from_secs(4);

/// Idle connections by address, each with when it was checked in; oldest first.
type ByAddr = HashMap<Arc<str>, Vec<(TcpStream, Instant)>>;

/// See the module.
#[derive(Debug, Default)]
pub(crate) struct Pool {
    /// Oldest first: connections are checked in at the end and out from the end.
    by_addr: Mutex<ByAddr>,
    sweeping: AtomicBool,
}

/// Whether an idle connection can carry a request: open, and nothing to read. A real
/// non-blocking peek at the socket (not the runtime's cached readiness, which can miss a close
/// that arrived after its last report).
fn open_and_quiet(stream: &TcpStream) -> bool {
    let mut byte = [std::mem::MaybeUninit::<u8>::uninit(); 1];
    matches!(socket2::SockRef::from(stream).peek(&mut byte), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
}

impl Pool {
    fn lock(&self) -> std::sync::MutexGuard<'_, ByAddr> {
        self.by_addr.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The most recently used idle connection to `addr` that is still open, if any.
    pub(crate) fn checkout(&self, addr: &str) -> Option<TcpStream> {
        loop {
            let (stream, expired) = {
                let mut by_addr = self.lock();
                let conns = by_addr.get_mut(addr)?;
                let (stream, since) = conns.pop()?;
                // Older than an expired one: expired too, all closed outside the lock.
                let expired = (since.elapsed() >= IDLE_TIMEOUT).then(|| std::mem::take(conns));
                (stream, expired)
            };
            if expired.is_some() {
                return None;
            }
            if open_and_quiet(&stream) {
                return Some(stream);
            }
        }
    }

    /// Keeps `stream` (its answer read whole) for the next request to `addr`.
    pub(crate) fn checkin(self: &Arc<Self>, addr: &Arc<str>, stream: TcpStream) {
        self.start_sweeper();
        let refused = {
            let mut by_addr = self.lock();
            let conns = by_addr.entry(addr.clone()).or_default();
            match conns.len() < MAX_IDLE_PER_HOST {
                true => {
                    conns.push((stream, Instant::now()));
                    None
                }
                false => Some(stream),
            }
        };
        drop(refused);
    }

    /// Closes the connections unused since before `now - IDLE_TIMEOUT` and those whose worker
    /// closed them (or sent something); forgets addresses left with none. One address at a
    /// time is taken out, probed outside the lock and put back before what was checked in
    /// meanwhile.
    pub(crate) fn sweep(&self, now: Instant) {
        let addrs: Vec<Arc<str>> = self.lock().keys().cloned().collect();
        for addr in addrs {
            let Some(taken) = self.lock().get_mut(&addr).map(std::mem::take) else {
                continue;
            };
            let (alive, dead): (Vec<_>, Vec<_>) = taken.into_iter().partition(|(stream, since)| {
                now.saturating_duration_since(*since) < IDLE_TIMEOUT && open_and_quiet(stream)
            });
            let over = {
                let mut by_addr = self.lock();
                let conns = by_addr.entry(addr.clone()).or_default();
                let newer = std::mem::replace(conns, alive);
                conns.extend(newer);
                // The oldest go first past the bound.
                let over: Vec<_> = conns
                    .drain(..conns.len().saturating_sub(MAX_IDLE_PER_HOST))
                    .collect();
                if conns.is_empty() {
                    by_addr.remove(&addr);
                }
                over
            };
            drop((dead, over));
        }
    }

    /// Starts the sweeper once (on the runtime of the first check-in); it ends with the pool.
    fn start_sweeper(self: &Arc<Self>) {
        if self.sweeping.load(Ordering::Relaxed) || self.sweeping.swap(true, Ordering::Relaxed) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.sweeping.store(false, Ordering::Relaxed);
            return;
        };
        let pool: Weak<Self> = Arc::downgrade(self);
        runtime.spawn(async move {
            let mut tick = tokio::time::interval(SWEEP_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(pool) = pool.upgrade() else { return };
                pool.sweep(Instant::now());
            }
        });
    }

    /// Idle connections kept for `addr`.
    #[cfg(test)]
    pub(crate) fn idle(&self, addr: &str) -> usize {
        self.lock().get(addr).map_or(0, Vec::len)
    }
}
