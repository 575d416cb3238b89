//! The gRPC health service (`grpc.health.v1.Health`: `Check` and `Watch`) beside the ext_proc
//! service, as the endpoint picker protocol asks and Kubernetes `grpc:` probes use. The server
//! as a whole (`""`) and [`EXT_PROC_SERVICE`] report `SERVING` while the router is ready (the
//! verdict of `GET /ready`: not draining, at least one worker) and the picker is not draining
//! for shutdown, `NOT_SERVING` otherwise; `Check` answers other names `NOT_FOUND`, `Watch`
//! `SERVICE_UNKNOWN`. One task per server keeps the status current, woken by the changes
//! themselves (a worker coming or leaving, a drain); watchers hear of changes only.

use crate::grpc::{status, Messages};
use kvrouter_server::readiness::Readiness;
use prost::Message;
use tokio::sync::watch;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

/// The ext_proc service's name, as health checks ask for it.
pub const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// The names reported: the whole server and the ext_proc service.
const NAMES: [&str; 2] = ["", EXT_PROC_SERVICE];

const CHECK_PATH: &str = "/grpc.health.v1.Health/Check";
const WATCH_PATH: &str = "/grpc.health.v1.Health/Watch";

/// The picker's health, as every connection sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Health {
    pub(crate) serving: bool,
}

/// Whether a router that is `ready`, on a picker that is `draining` or not, is serving.
fn serving(ready: bool, draining: bool) -> bool {
    ready && !draining
}

fn status_of(service: &str, serving: bool) -> ServingStatus {
    if !NAMES.contains(&service) {
        ServingStatus::ServiceUnknown
    } else if serving {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    }
}

/// A `Check` answer for a known service.
pub(crate) fn response(serving: bool) -> HealthCheckResponse {
    HealthCheckResponse {
        status: status_of("", serving) as i32,
    }
}

/// One health stream.
pub(crate) enum Call {
    Check {
        messages: Messages,
        service: Option<String>,
    },
    Watch {
        messages: Messages,
        service: Option<String>,
        /// The last status sent.
        sent: Option<ServingStatus>,
    },
}

impl Call {
    /// The call a stream's path names, if it is a health method.
    pub(crate) fn of(path: &str, max: usize) -> Option<Self> {
        let messages = Messages::new(max);
        match path {
            CHECK_PATH => Some(Self::Check {
                messages,
                service: None,
            }),
            WATCH_PATH => Some(Self::Watch {
                messages,
                service: None,
                sent: None,
            }),
            _ => None,
        }
    }

    pub(crate) fn messages(&mut self) -> &mut Messages {
        match self {
            Self::Check { messages, .. } | Self::Watch { messages, .. } => messages,
        }
    }

    /// Reads the request message.
    pub(crate) fn request(&mut self, bytes: &[u8]) -> Result<(), String> {
        let (Self::Check { service, .. } | Self::Watch { service, .. }) = self;
        if service.is_some() {
            return Err("a health call takes one request message".into());
        }
        let r = HealthCheckRequest::decode(bytes)
            .map_err(|e| format!("not a grpc.health.v1 request: {e}"))?;
        *service = Some(r.service);
        Ok(())
    }

    /// What a call answers once the request ended: `Check` its status code (`OK`: send
    /// [`response`]) and message; `Watch` nothing (it stays open).
    pub(crate) fn answer(&self, serving: bool) -> Option<(u32, String)> {
        match self {
            Self::Check { service: None, .. } => Some((
                status::INVALID_ARGUMENT,
                "a health check without its request message".into(),
            )),
            Self::Check {
                service: Some(name),
                ..
            } => Some(match status_of(name, serving) {
                ServingStatus::ServiceUnknown => {
                    (status::NOT_FOUND, format!("no service {name:?} here"))
                }
                _ => (status::OK, String::new()),
            }),
            Self::Watch { .. } => None,
        }
    }

    /// A watcher's next message: its service's status, when it changed since the last one
    /// sent (none before its request).
    pub(crate) fn watch_update(&mut self, serving: bool) -> Option<HealthCheckResponse> {
        let Self::Watch {
            service: Some(name),
            sent,
            ..
        } = self
        else {
            return None;
        };
        let now = status_of(name, serving);
        if *sent == Some(now) {
            return None;
        }
        *sent = Some(now);
        Some(HealthCheckResponse { status: now as i32 })
    }
}

/// Keeps the status current on a task (aborted with the server): the current status, and the
/// task. `draining`: the picker's own drain (true once shutdown began).
pub(crate) fn report(
    mut readiness: Readiness,
    mut draining: watch::Receiver<bool>,
) -> (watch::Receiver<Health>, tokio::task::AbortHandle) {
    let first = serving(readiness.ready(), *draining.borrow_and_update());
    let (tx, rx) = watch::channel(Health { serving: first });
    let task = tokio::spawn(async move {
        loop {
            tokio::select! {
                () = readiness.changed() => {}
                changed = draining.changed() => if changed.is_err() { return },
            }
            let now = serving(readiness.ready(), *draining.borrow_and_update());
            tx.send_if_modified(|h| std::mem::replace(&mut h.serving, now) != now);
        }
    });
    (rx, task.abort_handle())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serving_needs_a_ready_router_and_no_drain() {
        assert!(serving(true, false));
        assert!(!serving(false, false));
        assert!(!serving(true, true));
    }

    #[test]
    fn check_answers_known_names_and_refuses_others() {
        let mut call = Call::of(CHECK_PATH, 1024).unwrap();
        assert!(call.answer(true).unwrap().0 == status::INVALID_ARGUMENT);
        let req = HealthCheckRequest {
            service: EXT_PROC_SERVICE.into(),
        };
        call.request(&req.encode_to_vec()).unwrap();
        assert_eq!(call.answer(false), Some((status::OK, String::new())));
        assert!(
            call.request(&req.encode_to_vec()).is_err(),
            "one request only"
        );
        let mut other = Call::of(CHECK_PATH, 1024).unwrap();
        other
            .request(
                &HealthCheckRequest {
                    service: "x".into(),
                }
                .encode_to_vec(),
            )
            .unwrap();
        assert_eq!(other.answer(true).unwrap().0, status::NOT_FOUND);
        assert!(Call::of("/grpc.health.v1.Health/List", 1024).is_none());
    }

    #[test]
    fn a_watcher_hears_its_status_then_changes_only() {
        let mut call = Call::of(WATCH_PATH, 1024).unwrap();
        assert_eq!(call.watch_update(true), None, "nothing before the request");
        call.request(&HealthCheckRequest::default().encode_to_vec())
            .unwrap();
        assert_eq!(call.answer(true), None);
        let status = |r: Option<HealthCheckResponse>| r.map(|r| r.status());
        assert_eq!(
            status(call.watch_update(true)),
            Some(ServingStatus::Serving)
        );
        assert_eq!(status(call.watch_update(true)), None);
        assert_eq!(
            status(call.watch_update(false)),
            Some(ServingStatus::NotServing)
        );
        let mut unknown = Call::of(WATCH_PATH, 1024).unwrap();
        unknown
            .request(
                &HealthCheckRequest {
                    service: "x".into(),
                }
                .encode_to_vec(),
            )
            .unwrap();
        assert_eq!(
            status(unknown.watch_update(true)),
            Some(ServingStatus::ServiceUnknown)
        );
    }
}
