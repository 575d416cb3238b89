//! The libzmq contexts of the KV event subscribers. A libzmq context opens at most 1,023
//! sockets (`ZMQ_MAX_SOCKETS`, which the `zmq` crate cannot raise), and a rank's subscriber holds
//! three (its SUB, the PAIR libzmq opens in the same context for `zmq_socket_monitor`, and our
//! PAIR reading it) plus a DEALER while it replays; one shared context made every subscriber fail
//! with "Too many open files" (EMFILE) once the router followed ~340 ranks (a worker of
//! `dp_size` 1024, or 16 workers of 64). So ranks share a context up to [`RANKS_PER_CONTEXT`],
//! and another is made for more (each context adds libzmq's I/O and reaper threads).

use std::sync::Mutex;

/// Ranks that share one context: 4 sockets each at most (all of them replaying at once, as
/// after an engine restart) stays under libzmq's 1,023.
pub(crate) const RANKS_PER_CONTEXT: usize = 250;

/// The contexts and how many ranks each serves.
#[derive(Default)]
pub(crate) struct Contexts {
    slots: Mutex<Vec<(zmq::Context, usize)>>,
}

/// One rank's place in a context, given back when its subscriber ends.
pub(crate) struct Lease<'a> {
    pool: &'a Contexts,
    index: usize,
    /// The context its sockets are opened in.
    pub(crate) ctx: zmq::Context,
}

impl Contexts {
    fn slots(&self) -> std::sync::MutexGuard<'_, Vec<(zmq::Context, usize)>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A place for one more rank: in the first context with room, else in a new one.
    pub(crate) fn lease(&self) -> Lease<'_> {
        let mut slots = self.slots();
        let index = match slots.iter().position(|(_, n)| *n < RANKS_PER_CONTEXT) {
            Some(i) => i,
            None => {
                slots.push((zmq::Context::new(), 0));
                slots.len() - 1
            }
        };
        slots[index].1 += 1;
        Lease {
            pool: self,
            index,
            ctx: slots[index].0.clone(),
        }
    }

    /// The contexts made so far and the ranks each serves now.
    #[cfg(test)]
    fn load(&self) -> Vec<usize> {
        self.slots().iter().map(|(_, n)| *n).collect()
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        self.pool.slots()[self.index].1 -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_past_one_contexts_share_go_to_another_and_free_places_are_reused() {
        let pool = Contexts::default();
        let mut leases: Vec<Lease<'_>> = (0..RANKS_PER_CONTEXT + 1).map(|_| pool.lease()).collect();
        assert_eq!(pool.load(), [RANKS_PER_CONTEXT, 1]);
        leases.swap_remove(0);
        let again = pool.lease();
        assert_eq!(again.index, 0, "the freed place is taken first");
        assert_eq!(pool.load(), [RANKS_PER_CONTEXT, 1]);
        drop(leases);
        drop(again);
        assert_eq!(pool.load(), [0, 0]);
        // Each context opens its own sockets: a SUB and its monitor per rank fit.
        let lease = pool.lease();
        let sub = lease.ctx.socket(zmq::SUB).expect("a socket");
        drop(sub);
    }
}
