//! Admission through the router queue: a request is placed now, or waits in the queue until the
//! driver places it (or its deadline passes); a handler that goes away while waiting takes its
//! request out of the queue.

use crate::error::ServeError;
use crate::state::{AppState, Inner, Release};
use kvrouter_core::ids::RequestId;
use kvrouter_core::router::{Admission, Decision, RouteError, RouteRequest};
use std::time::Instant;

/// Takes a request out of the queue if its handler goes away while it waits.
struct QueuedGuard<'a> {
    inner: &'a Inner,
    id: RequestId,
    armed: bool,
}

impl Drop for QueuedGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.inner.forget_placement(self.id);
            if !self.inner.lock_core().cancel_queued(self.id) {
                // Placed between our last look and now: release it.
                self.inner.release(self.id, Release::Cancelled);
            }
        }
    }
}

/// Admission: placed now, or queued until the driver places it (or its deadline passes); with
/// the decision, when it entered the queue (`None`: placed at once).
pub(crate) async fn admit(
    state: &AppState,
    request: RouteRequest,
) -> Result<(Decision, Option<Instant>), ServeError> {
    let inner = &state.inner;
    let id = request.id;
    let queued_at = Instant::now();
    // Register the waiter first, so a placement by the driver always finds it.
    let rx = inner.await_placement(id);
    let submitted = inner.lock_core().submit(request, inner.now());
    let reject = |reason: &'static str, e| {
        inner.metrics.rejections.inc(&[("reason", reason)]);
        ServeError::Rejected(e)
    };
    match submitted {
        Ok(Admission::Dispatched(d)) => {
            inner.forget_placement(id);
            Ok((d, None))
        }
        Ok(Admission::Queued) => {
            inner.wake_queue();
            let mut guard = QueuedGuard {
                inner,
                id,
                armed: true,
            };
            let placed = rx.await;
            guard.armed = false;
            inner
                .metrics
                .queue_wait
                .observe(queued_at.elapsed().as_secs_f64());
            match placed {
                Ok(Ok(d)) => Ok((d, Some(queued_at))),
                Ok(Err(RouteError::DeadlineExceeded)) => {
                    inner.metrics.rejections.inc(&[("reason", "deadline")]);
                    Err(ServeError::Route(RouteError::DeadlineExceeded))
                }
                Ok(Err(e @ RouteError::QueueWaitExceeded { .. })) => {
                    inner.metrics.rejections.inc(&[("reason", "max_wait")]);
                    Err(ServeError::Route(e))
                }
                Ok(Err(e)) => Err(ServeError::Route(e)),
                Err(_) => Err(ServeError::Upstream("the router queue stopped".into())),
            }
        }
        Err(e) => {
            inner.forget_placement(id);
            match e {
                RouteError::QueueFull { .. } | RouteError::OverQueueBound { .. } => {
                    Err(reject("queue_full", e))
                }
                RouteError::AllEligibleWorkersOverloaded
                    if inner.config.router.reject_when_overloaded =>
                {
                    Err(reject("overloaded", e))
                }
                e => Err(ServeError::Route(e)),
            }
        }
    }
}
