//! A connection's shutdown phases and its health watchers: what each phase does to the
//! streams (watchers told `NOT_SERVING`, `Process` streams cut, the connection stopped), and
//! the status updates `Watch` calls get.

use super::{Call, Conn, Entry};
use crate::grpc::{self, status};
use crate::h2::frame::code;
use crate::health;
use crate::service::Phase;

impl Conn {
    pub(in crate::connection) fn on_phase(&mut self, now: Phase) {
        self.phase = now;
        match now {
            Phase::Serving => {}
            // Watchers hear NOT_SERVING at once.
            Phase::Draining => self.on_health(),
            Phase::Cutting => {
                let ids: Vec<u32> = self
                    .calls
                    .iter()
                    .filter(|(_, e)| matches!(e.call, Call::Process(_)))
                    .map(|(id, _)| *id)
                    .collect();
                for id in ids {
                    let message = "kvrouter shut down (--shutdown-grace-secs passed)";
                    self.end(id, status::UNAVAILABLE, message);
                }
            }
            Phase::Stopped => {
                // Watchers hear NOT_SERVING if they have not yet (a drain with nothing in
                // flight is over at once), then their call ends.
                self.on_health();
                for id in self.watchers() {
                    self.end(id, status::UNAVAILABLE, "kvrouter shut down");
                }
                self.stop(code::NO_ERROR);
            }
        }
    }

    /// Ends every stream and the connection (GOAWAY with `error`).
    pub(in crate::connection) fn stop(&mut self, error: u32) {
        let ids: Vec<u32> = self.calls.keys().copied().collect();
        for id in ids {
            self.remove(id);
            self.h2.reset(id, code::CANCEL);
        }
        self.h2.goaway(error);
        self.phase = Phase::Stopped;
    }

    pub(in crate::connection) fn on_health(&mut self) {
        for id in self.watchers() {
            self.send_health(id);
        }
    }

    /// The streams of `Watch` calls.
    fn watchers(&self) -> Vec<u32> {
        self.calls
            .iter()
            .filter(|(_, e)| matches!(e.call, Call::Health(health::Call::Watch { .. })))
            .map(|(id, _)| *id)
            .collect()
    }

    /// Sends a watcher its status if it changed since the last one it got.
    pub(super) fn send_health(&mut self, id: u32) {
        let serving = self.serving();
        let Some(Entry {
            call: Call::Health(h),
            ..
        }) = self.calls.get_mut(&id)
        else {
            return;
        };
        if let Some(msg) = h.watch_update(serving) {
            self.scratch.clear();
            grpc::encode(&msg, &mut self.scratch);
            self.send(id);
        }
    }
}
