//! The gRPC health service (`grpc.health.v1.Health`: `Check` and `Watch`) beside the ext_proc
//! service, as the endpoint picker protocol asks and Kubernetes `grpc:` probes use. The server
//! as a whole (`""`) and [`EXT_PROC_SERVICE`] report `SERVING` while the router is ready (the
//! verdict of `GET /ready`: not draining, at least one worker) and the picker is not draining
//! for shutdown, `NOT_SERVING` otherwise; other names are `NOT_FOUND`. One task per server keeps
//! the statuses current, woken by the changes themselves (a worker coming or leaving, a drain).

use kvrouter_server::readiness::Readiness;
use tokio::sync::watch;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

/// The ext_proc service's name, as health checks ask for it.
pub const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// The names reported: the whole server and the ext_proc service.
const NAMES: [&str; 2] = ["", EXT_PROC_SERVICE];

/// The status for a router that is `ready`, on a picker that is `draining` or not.
fn status(ready: bool, draining: bool) -> ServingStatus {
    if ready && !draining {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    }
}

async fn set(reporter: &HealthReporter, status: ServingStatus) {
    for name in NAMES {
        reporter.set_service_status(name, status).await;
    }
}

/// Reports the current statuses, then keeps them current on a task (aborted with the server).
/// `draining`: the picker's own drain (true once shutdown began).
pub(crate) async fn report(
    reporter: HealthReporter,
    mut readiness: Readiness,
    mut draining: watch::Receiver<bool>,
) -> tokio::task::AbortHandle {
    let mut last = status(readiness.ready(), *draining.borrow_and_update());
    set(&reporter, last).await;
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = readiness.changed() => {}
                changed = draining.changed() => if changed.is_err() { return },
            }
            let now = status(readiness.ready(), *draining.borrow_and_update());
            // Watchers hear of changes only (a second worker changes nothing).
            if now != last {
                set(&reporter, now).await;
                last = now;
            }
        }
    })
    .abort_handle()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serving_needs_a_ready_router_and_no_drain() {
        assert_eq!(status(true, false), ServingStatus::Serving);
        assert_eq!(status(false, false), ServingStatus::NotServing);
        assert_eq!(status(true, true), ServingStatus::NotServing);
    }
}
