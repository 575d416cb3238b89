//! Releasing a request's load, and what that sets in motion. A finish or a cancel frees capacity
//! that others wait on: queued requests may be placed now, and a weight-update cycle's draining
//! worker may have gone idle and be ready to load. The release returns those as [`Effects`], and
//! the host (the server's request path, the simulator) carries them out, the same way in both;
//! no caller has to remember a follow-up call.

use crate::ids::RequestId;
use crate::router::{Decision, RouteError, Router, UpdateAction};
use crate::time::Time;

/// What a release set in motion, for the host to carry out.
#[must_use = "a release frees capacity others wait on: carry out its effects"]
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Effects {
    /// Queued requests that left the router queue: placed (`Ok`, their load is recorded; a
    /// host that can no longer deliver one cancels it), or ended (`Err`, e.g. past their
    /// deadline).
    pub placed: Vec<(RequestId, Result<Decision, RouteError>)>,
    /// Engine calls the running weight-update cycle asks for now (loads of draining workers
    /// that went idle).
    pub update: Vec<UpdateAction>,
}

impl Effects {
    /// Nothing to carry out.
    pub fn is_empty(&self) -> bool {
        self.placed.is_empty() && self.update.is_empty()
    }

    /// Appends `other`'s effects after these.
    pub fn extend(&mut self, other: Effects) {
        self.placed.extend(other.placed);
        self.update.extend(other.update);
    }
}

impl Router {
    /// The request completed: its load is released. Returns what that set in motion.
    pub fn finish(&mut self, id: RequestId, now: Time) -> Result<Effects, RouteError> {
        self.ledger
            .release(id)
            .map_err(|_| RouteError::UnknownRequest(id))?;
        self.cost_released(id, now);
        self.group_released(id);
        if id.0 < super::REMOTE_ID_BASE {
            self.announce(|replica| super::RemoteEvent::Finish {
                replica,
                request: id,
            });
        }
        Ok(self.released(now))
    }

    /// The request was cancelled or failed, in any state: its load is released. Returns what
    /// that set in motion.
    pub fn cancel(&mut self, id: RequestId, now: Time) -> Result<Effects, RouteError> {
        self.finish(id, now)
    }

    /// Load was released: draining workers now idle load, and queued requests are placed while
    /// capacity allows.
    pub(super) fn released(&mut self, now: Time) -> Effects {
        let update = self.update_tick(now);
        let placed = self.poll(now);
        Effects { placed, update }
    }
}
