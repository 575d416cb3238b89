//! The router's readiness, for hosts that report it elsewhere than `GET /ready` (the gRPC
//! health service of the ext_proc port): the same verdict, ready when the router is not
//! draining for shutdown and has at least one worker, and a way to wait for it to change.

use crate::state::AppState;
use kvrouter_http::Phase;
use tokio::sync::watch;

/// Watches the router's readiness (cheap; one per reporter).
pub struct Readiness {
    state: AppState,
    roster: watch::Receiver<usize>,
    phase: watch::Receiver<Phase>,
}

impl AppState {
    /// Whether the router takes requests: not draining, and at least one worker (the verdict
    /// of `GET /ready`).
    pub fn is_ready(&self) -> bool {
        !self.inner.lifecycle.is_draining() && self.worker_count() > 0
    }

    /// A watch on [`AppState::is_ready`].
    pub fn readiness(&self) -> Readiness {
        Readiness {
            state: self.clone(),
            roster: self.inner.roster.subscribe(),
            phase: self.inner.lifecycle.subscribe(),
        }
    }
}

impl Readiness {
    /// The verdict now; [`Readiness::changed`] then waits for the next change after it.
    pub fn ready(&mut self) -> bool {
        self.roster.mark_unchanged();
        self.phase.mark_unchanged();
        self.state.is_ready()
    }

    /// Resolves when a worker came or left or the router began to drain since the last
    /// [`Readiness::ready`] (never, once the router is gone).
    pub async fn changed(&mut self) {
        tokio::select! {
            Ok(()) = self.roster.changed() => {}
            Ok(()) = self.phase.changed() => {}
            else => std::future::pending().await,
        }
    }
}
