//! The pure part of Kubernetes discovery: ready endpoints of EndpointSlices, their
//! registrations from pod annotations, and the changes of the union of all slices (a pod may
//! move between the slices of a service; it is gone only when no slice has it ready).

use crate::discovery::{Registration, SourceEvent};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use std::collections::BTreeMap;

/// Pod annotation: the port of the engine's KV event publisher (rank 0), on the pod's IP.
pub const KV_EVENTS_PORT: &str = "kvrouter.io/kv-events-port";
/// Pod annotation: the port of the engine's replay socket (rank 0), on the pod's IP.
pub const REPLAY_PORT: &str = "kvrouter.io/replay-port";
/// Pod annotation: the engine's data-parallel size.
pub const DP_SIZE: &str = "kvrouter.io/dp-size";
/// Pod annotation: the model the engine serves.
pub const MODEL: &str = "kvrouter.io/model";
/// Pod annotation: the step-time profile the `cost` policy prices the engine with.
pub const PROFILE: &str = "kvrouter.io/profile";

/// A ready endpoint of a slice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Ready {
    /// `namespace/pod` (or `namespace/ip:port` without a pod reference).
    pub(crate) key: String,
    pub(crate) ip: String,
    pub(crate) port: u16,
    /// The pod behind it: name and uid.
    pub(crate) pod: Option<(String, Option<String>)>,
}

/// Ready endpoints of `slice` on its port named `port_name` (the first port when `None`).
/// `ready` unset counts as ready (the API's rule). A Service with `publishNotReadyAddresses`
/// marks every endpoint ready and says the pod's readiness in `serving`, so `serving` false is
/// not ready either; and a terminating endpoint never is: a pod on its way out takes no new
/// request. A slice without the named port has none (warned).
pub(crate) fn ready_endpoints(
    namespace: &str,
    slice: &EndpointSlice,
    port_name: Option<&str>,
) -> Vec<Ready> {
    let ports = slice.ports.as_deref().unwrap_or(&[]);
    let port = match port_name {
        Some(name) => ports.iter().find(|p| p.name.as_deref() == Some(name)),
        None => ports.first(),
    };
    let Some(port) = port
        .and_then(|p| p.port)
        .and_then(|p| u16::try_from(p).ok())
    else {
        if !slice.endpoints.is_empty() {
            let name = slice.metadata.name.as_deref().unwrap_or("?");
            let wanted = port_name.map_or("no port".into(), |n| format!("no port named {n:?}"));
            tracing::warn!(
                "kubernetes discovery: EndpointSlice {namespace}/{name} has {wanted} \
                 (--port-name): its endpoints are not workers"
            );
        }
        return Vec::new();
    };
    let mut ready = Vec::new();
    for e in &slice.endpoints {
        let c = e.conditions.as_ref();
        if c.and_then(|c| c.ready) == Some(false)
            || c.and_then(|c| c.serving) == Some(false)
            || c.and_then(|c| c.terminating) == Some(true)
        {
            continue;
        }
        let Some(ip) = e.addresses.first() else {
            continue;
        };
        let pod = e
            .target_ref
            .as_ref()
            .filter(|r| r.kind.as_deref() == Some("Pod"))
            .and_then(|r| Some((r.name.clone()?, r.uid.clone())));
        let key = match &pod {
            Some((name, _)) => format!("{namespace}/{name}"),
            None => format!("{namespace}/{}", host_port(ip, port)),
        };
        ready.push(Ready {
            key,
            ip: ip.clone(),
            port,
            pod,
        });
    }
    ready
}

fn host_port(ip: &str, port: u16) -> String {
    if ip.contains(':') {
        format!("[{ip}]:{port}")
    } else {
        format!("{ip}:{port}")
    }
}

/// The registration of a ready endpoint, with what its pod's annotations say. Unreadable
/// annotations are left out (and named in the returned warnings).
pub(crate) fn registration(
    ready: &Ready,
    annotations: &BTreeMap<String, String>,
) -> (Registration, Vec<String>) {
    let mut warnings = Vec::new();
    let mut port = |name: &str| {
        let v = annotations.get(name)?;
        match v.trim().parse::<u16>() {
            Ok(p) if p > 0 => Some(format!("tcp://{}", host_port(&ready.ip, p))),
            _ => {
                warnings.push(format!("{name}: {v:?} is not a port"));
                None
            }
        }
    };
    let kv_events_endpoint = port(KV_EVENTS_PORT);
    let replay_endpoint = port(REPLAY_PORT);
    let dp_size = annotations
        .get(DP_SIZE)
        .and_then(|v| match v.trim().parse::<u32>() {
            Ok(d) if d > 0 => Some(d),
            _ => {
                warnings.push(format!("{DP_SIZE}: {v:?} is not a positive number"));
                None
            }
        });
    let registration = Registration {
        url: format!("http://{}", host_port(&ready.ip, ready.port)),
        kv_events_endpoint,
        replay_endpoint,
        dp_size,
        model: annotations.get(MODEL).cloned(),
        profile: annotations.get(PROFILE).cloned(),
    };
    (registration, warnings)
}

/// The registrations of every slice, and the union last told to the driver.
#[derive(Debug, Default)]
pub(crate) struct Slices {
    slices: BTreeMap<String, BTreeMap<String, Registration>>,
    /// Slices seen since a (re-)list began.
    listing: Option<BTreeMap<String, BTreeMap<String, Registration>>>,
    told: BTreeMap<String, Registration>,
}

impl Slices {
    fn union(&self) -> BTreeMap<String, Registration> {
        let mut all = BTreeMap::new();
        for endpoints in self.slices.values() {
            for (k, r) in endpoints {
                all.entry(k.clone()).or_insert_with(|| r.clone());
            }
        }
        all
    }

    fn changes(&mut self) -> Vec<SourceEvent> {
        let now = self.union();
        let mut events: Vec<SourceEvent> = self
            .told
            .keys()
            .filter(|k| !now.contains_key(*k))
            .map(|k| SourceEvent::Delete { key: k.clone() })
            .collect();
        for (k, r) in &now {
            if self.told.get(k) != Some(r) {
                events.push(SourceEvent::Put {
                    key: k.clone(),
                    registration: r.clone(),
                });
            }
        }
        self.told = now;
        events
    }

    /// A slice was added or changed.
    pub(crate) fn apply(
        &mut self,
        slice: &str,
        endpoints: BTreeMap<String, Registration>,
    ) -> Vec<SourceEvent> {
        self.slices.insert(slice.to_owned(), endpoints);
        self.changes()
    }

    /// A slice was deleted.
    pub(crate) fn delete(&mut self, slice: &str) -> Vec<SourceEvent> {
        self.slices.remove(slice);
        self.changes()
    }

    /// A (re-)list begins: the slices it brings replace all, at [`Slices::list_done`].
    pub(crate) fn list_begin(&mut self) {
        self.listing = Some(BTreeMap::new());
    }

    /// A slice of the list.
    pub(crate) fn list_item(&mut self, slice: &str, endpoints: BTreeMap<String, Registration>) {
        self.listing
            .get_or_insert_with(BTreeMap::new)
            .insert(slice.to_owned(), endpoints);
    }

    /// The list is complete: the whole set, as a snapshot.
    pub(crate) fn list_done(&mut self) -> SourceEvent {
        self.slices = self.listing.take().unwrap_or_default();
        self.told = self.union();
        SourceEvent::Snapshot(self.told.clone().into_iter().collect())
    }
}

#[cfg(test)]
mod tests;
