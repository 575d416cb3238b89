use super::*;
use serde_json::json;

/// An EndpointSlice as the API server sends it (discovery.k8s.io/v1).
fn slice(name: &str, port: u16, endpoints: &[(&str, &str, Option<bool>)]) -> EndpointSlice {
    let endpoints: Vec<_> = endpoints
        .iter()
        .map(|(pod, ip, ready)| {
            json!({
                "addresses": [ip],
                "conditions": {"ready": ready, "serving": ready, "terminating": false},
                "targetRef": {"kind": "Pod", "namespace": "ns", "name": pod, "uid": format!("uid-{pod}")},
            })
        })
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "ns", "labels": {"app": "vllm", "kubernetes.io/service-name": "vllm"}},
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "metrics", "port": 9090, "protocol": "TCP"}, {"name": "http", "port": port, "protocol": "TCP"}],
    }))
    .unwrap()
}

fn regs(slice: &EndpointSlice) -> BTreeMap<String, Registration> {
    ready_endpoints("ns", slice, Some("http"))
        .iter()
        .map(|r| (r.key.clone(), registration(r, &BTreeMap::new()).0))
        .collect()
}

#[test]
fn ready_endpoints_take_the_named_port_and_skip_unready_ones() {
    let s = slice(
        "vllm-a",
        8000,
        &[
            ("p1", "10.0.0.1", Some(true)),
            ("p2", "10.0.0.2", Some(false)),
            ("p3", "10.0.0.3", None),
        ],
    );
    let ready = ready_endpoints("ns", &s, Some("http"));
    let keys: Vec<&str> = ready.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(keys, ["ns/p1", "ns/p3"], "ready unset counts as ready");
    assert_eq!(ready[0].port, 8000);
    assert_eq!(ready[0].pod, Some(("p1".into(), Some("uid-p1".into()))));
    assert_eq!(
        ready_endpoints("ns", &s, None)[0].port,
        9090,
        "the first port by default"
    );
    assert!(
        ready_endpoints("ns", &s, Some("grpc")).is_empty(),
        "no such port"
    );
}

#[test]
fn terminating_or_not_serving_endpoints_are_not_ready_even_when_marked_ready() {
    let mut s = slice(
        "vllm-a",
        8000,
        &[("p1", "10.0.0.1", Some(true)), ("p2", "10.0.0.2", None)],
    );
    // `publishNotReadyAddresses`: terminating, yet ready and serving; and one with only
    // `terminating` set.
    for e in &mut s.endpoints {
        let c = e.conditions.get_or_insert_with(Default::default);
        c.terminating = Some(true);
    }
    s.endpoints[1].conditions.as_mut().unwrap().ready = None;
    assert!(ready_endpoints("ns", &s, Some("http")).is_empty());
    // `publishNotReadyAddresses` on a pod not (yet) ready: ready, not serving, not terminating.
    for e in &mut s.endpoints {
        let c = e.conditions.as_mut().unwrap();
        (c.ready, c.serving, c.terminating) = (Some(true), Some(false), Some(false));
    }
    s.endpoints[1].conditions.as_mut().unwrap().serving = Some(true);
    let keys: Vec<String> = ready_endpoints("ns", &s, Some("http"))
        .into_iter()
        .map(|r| r.key)
        .collect();
    assert_eq!(keys, ["ns/p2"], "only the serving one");
}

#[test]
fn annotations_give_the_event_endpoints_dp_size_and_model() {
    let s = slice("vllm-a", 8000, &[("p1", "10.0.0.1", Some(true))]);
    let ready = &ready_endpoints("ns", &s, Some("http"))[0];
    let annotations = BTreeMap::from([
        (KV_EVENTS_PORT.to_owned(), "5557".to_owned()),
        (REPLAY_PORT.to_owned(), "5600".to_owned()),
        (DP_SIZE.to_owned(), "4".to_owned()),
        (MODEL.to_owned(), "Qwen/Qwen3-8B".to_owned()),
    ]);
    let (r, warnings) = registration(ready, &annotations);
    assert!(warnings.is_empty());
    assert_eq!(r.url, "http://10.0.0.1:8000");
    assert_eq!(r.kv_events_endpoint.as_deref(), Some("tcp://10.0.0.1:5557"));
    assert_eq!(r.replay_endpoint.as_deref(), Some("tcp://10.0.0.1:5600"));
    assert_eq!(
        (r.dp_size, r.model.as_deref()),
        (Some(4), Some("Qwen/Qwen3-8B"))
    );
    let bad = BTreeMap::from([
        (DP_SIZE.to_owned(), "0".to_owned()),
        (KV_EVENTS_PORT.to_owned(), "x".to_owned()),
    ]);
    let (r, warnings) = registration(ready, &bad);
    assert_eq!((r.dp_size, r.kv_events_endpoint), (None, None));
    assert_eq!(warnings.len(), 2, "{warnings:?}");
}

#[test]
fn a_pod_is_gone_only_when_no_slice_has_it_ready() {
    let mut s = Slices::default();
    s.list_begin();
    s.list_item(
        "a",
        regs(&slice("a", 8000, &[("p1", "10.0.0.1", Some(true))])),
    );
    let SourceEvent::Snapshot(all) = s.list_done() else {
        panic!("a snapshot")
    };
    assert_eq!(all.len(), 1);
    // p1 moves to slice b: added there first, then dropped from a: no change at all.
    assert_eq!(
        s.apply(
            "b",
            regs(&slice("b", 8000, &[("p1", "10.0.0.1", Some(true))]))
        ),
        vec![]
    );
    assert_eq!(s.apply("a", regs(&slice("a", 8000, &[]))), vec![]);
    // Not ready any more: gone.
    let events = s.apply(
        "b",
        regs(&slice("b", 8000, &[("p1", "10.0.0.1", Some(false))])),
    );
    assert_eq!(
        events,
        vec![SourceEvent::Delete {
            key: "ns/p1".into()
        }]
    );
    let back = s.apply(
        "b",
        regs(&slice("b", 8000, &[("p1", "10.0.0.1", Some(true))])),
    );
    assert!(matches!(&back[..], [SourceEvent::Put { key, .. }] if key == "ns/p1"));
    assert_eq!(
        s.delete("b"),
        vec![SourceEvent::Delete {
            key: "ns/p1".into()
        }]
    );
    // A re-list replaces everything.
    s.list_begin();
    assert_eq!(s.list_done(), SourceEvent::Snapshot(vec![]));
}
