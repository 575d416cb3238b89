//! OTLP traces from a real `kvrouter serve`, received by a small OTLP/HTTP (protobuf) receiver
//! on 127.0.0.1 inside the test, which decodes each export request.

mod common;

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use serde_json::json;
use std::collections::HashMap;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;
use tokio::process::Command;
use tokio::sync::mpsc;
use tokio::time::{timeout, Instant};

/// Accepts OTLP/HTTP posts and hands each decoded request's (path, spans) to the channel.
async fn receiver() -> (String, mpsc::UnboundedReceiver<(String, Vec<Span>)>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut r = BufReader::new(sock);
                loop {
                    let mut line = String::new();
                    if r.read_line(&mut line).await.unwrap_or(0) == 0 {
                        return;
                    }
                    let path = line.split_whitespace().nth(1).unwrap_or("").to_owned();
                    let mut len = 0usize;
                    let mut ctype = String::new();
                    for _ in 0..100 {
                        let mut h = String::new();
                        r.read_line(&mut h).await.unwrap();
                        let h = h.trim_end();
                        if h.is_empty() {
                            break;
                        }
                        let (k, v) = h.split_once(':').unwrap();
                        match k.to_ascii_lowercase().as_str() {
                            "content-length" => len = v.trim().parse().unwrap(),
                            "content-type" => ctype = v.trim().to_owned(),
                            _ => {}
                        }
                    }
                    assert!(len <= 16 << 20, "bounded body");
                    let mut body = vec![0; len];
                    r.read_exact(&mut body).await.unwrap();
                    assert_eq!(ctype, "application/x-protobuf");
                    let req = ExportTraceServiceRequest::decode(body.as_slice()).expect("OTLP");
                    let spans = req
                        .resource_spans
                        .into_iter()
                        .flat_map(|r| r.scope_spans)
                        .flat_map(|s| s.spans)
                        .collect();
                    let _ = tx.send((path, spans));
                    let ok = "HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
                    r.get_mut().write_all(ok.as_bytes()).await.unwrap();
                }
            });
        }
    });
    (format!("http://{addr}"), rx)
}

/// `serve --mock-workers 2` exporting its traces to a fresh [`receiver`].
async fn traced_router() -> (common::Proc, mpsc::UnboundedReceiver<(String, Vec<Span>)>) {
    let (endpoint, spans_rx) = receiver().await;
    let router = common::spawn(&[
        "serve",
        "--port",
        "0",
        "--mock-workers",
        "2",
        "--otlp-endpoint",
        &endpoint,
    ])
    .await;
    (router, spans_rx)
}

fn attr(span: &Span, key: &str) -> Option<Any> {
    span.attributes
        .iter()
        .find(|a| a.key == key)
        .and_then(|a| a.value.clone()?.value)
}

#[tokio::test]
async fn each_request_is_one_trace_with_tokenize_route_first_byte_and_stream_spans() {
    let (router, mut spans_rx) = traced_router().await;
    let base = router.http();
    let client = reqwest::Client::new();
    for (id, stream) in [("otel-1", false), ("otel-2", true)] {
        let body = json!({"model": "mock-model", "prompt": "trace me please", "max_tokens": 3, "stream": stream});
        let resp = timeout(
            Duration::from_secs(30),
            client
                .post(format!("{base}/v1/completions"))
                .header("x-request-id", id)
                .json(&body)
                .send(),
        )
        .await
        .unwrap()
        .unwrap();
        assert_eq!(resp.status(), 200);
        let _ = resp.bytes().await;
    }
    // Collect (bounded) until both traces are complete: a root and its five or four children.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut all: Vec<Span> = Vec::new();
    while all.iter().filter(|s| s.name == "request").count() < 2 {
        let left = deadline.saturating_duration_since(Instant::now());
        let (path, spans) = timeout(left, spans_rx.recv())
            .await
            .expect("spans exported in time")
            .expect("receiver alive");
        assert_eq!(path, "/v1/traces");
        all.extend(spans);
    }
    let roots: HashMap<Vec<u8>, &Span> = all
        .iter()
        .filter(|s| s.name == "request")
        .map(|s| (s.trace_id.clone(), s))
        .collect();
    assert_eq!(roots.len(), 2, "two traces");
    for root in roots.values() {
        let id = match attr(root, "kvrouter.request_id") {
            Some(Any::StringValue(s)) => s,
            other => panic!("request id attribute: {other:?}"),
        };
        assert!(id == "otel-1" || id == "otel-2", "{id}");
        assert_eq!(
            attr(root, "gen_ai.request.model"),
            Some(Any::StringValue("mock-model".into()))
        );
        assert_eq!(
            attr(root, "http.response.status_code"),
            Some(Any::IntValue(200))
        );
        let children: Vec<&Span> = all
            .iter()
            .filter(|s| s.trace_id == root.trace_id && s.parent_span_id == root.span_id)
            .collect();
        let names: Vec<&str> = children.iter().map(|s| s.name.as_str()).collect();
        for want in ["tokenize", "route", "upstream_first_byte", "stream"] {
            assert!(names.contains(&want), "{want} missing from {names:?}");
        }
        // Placed at once: no queue_wait span.
        assert!(!names.contains(&"queue_wait"), "{names:?}");
        let route = children.iter().find(|s| s.name == "route").unwrap();
        let worker = attr(route, "kvrouter.worker");
        assert!(matches!(worker, Some(Any::IntValue(0 | 1))), "{worker:?}");
        assert!(matches!(
            attr(route, "kvrouter.score"),
            Some(Any::DoubleValue(_))
        ));
        for s in &children {
            assert!(
                s.start_time_unix_nano >= root.start_time_unix_nano,
                "{}",
                s.name
            );
            assert!(
                s.end_time_unix_nano <= root.end_time_unix_nano,
                "{}",
                s.name
            );
            assert!(s.start_time_unix_nano <= s.end_time_unix_nano, "{}", s.name);
        }
    }
}

#[tokio::test]
async fn a_pick_is_one_trace_with_its_route_span() {
    let (router, mut spans_rx) = traced_router().await;
    let base = router.http();
    let client = reqwest::Client::new();
    let post = |path: String, body: serde_json::Value| {
        let req = client
            .post(format!("{base}{path}"))
            .header("x-request-id", "otel-pick")
            .json(&body);
        async move {
            let resp = timeout(Duration::from_secs(30), req.send())
                .await
                .unwrap()
                .unwrap();
            assert_eq!(resp.status(), 200);
            resp.json::<serde_json::Value>().await.unwrap()
        }
    };
    let pick = post(
        "/v1/pick".into(),
        json!({"model": "mock-model", "prompt": "trace my pick"}),
    )
    .await;
    let id = pick["id"].as_str().unwrap();
    post(format!("/v1/pick/{id}/first-token"), json!({})).await;
    post(
        format!("/v1/pick/{id}/finish"),
        json!({"completion_tokens": 2}),
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut all: Vec<Span> = Vec::new();
    while !all.iter().any(|s| s.name == "request") {
        let left = deadline.saturating_duration_since(Instant::now());
        let (_, spans) = timeout(left, spans_rx.recv())
            .await
            .expect("spans exported in time")
            .expect("receiver alive");
        all.extend(spans);
    }
    let root = all.iter().find(|s| s.name == "request").unwrap();
    assert_eq!(
        attr(root, "kvrouter.request_id"),
        Some(Any::StringValue("otel-pick".into()))
    );
    assert_eq!(
        attr(root, "kvrouter.pick"),
        Some(Any::StringValue("api".into()))
    );
    let (trace, parent) = (root.trace_id.clone(), root.span_id.clone());
    // The children may come in a later batch than the root.
    let deadline = Instant::now() + Duration::from_secs(20);
    let children = |all: &[Span]| {
        all.iter()
            .filter(|s| s.trace_id == trace && s.parent_span_id == parent)
            .map(|s| s.name.clone())
            .collect::<Vec<_>>()
    };
    let mut names = children(&all);
    while !names.iter().any(|n| n == "route") {
        let left = deadline.saturating_duration_since(Instant::now());
        let (_, spans) = timeout(left, spans_rx.recv())
            .await
            .expect("the route span in time")
            .expect("receiver alive");
        all.extend(spans);
        names = children(&all);
    }
    let route = all
        .iter()
        .find(|s| s.name == "route" && s.trace_id == trace)
        .unwrap();
    let worker = attr(route, "kvrouter.worker");
    assert!(matches!(worker, Some(Any::IntValue(0 | 1))), "{worker:?}");
    assert!(
        names.iter().any(|n| n == "upstream_first_byte"),
        "{names:?}"
    );
}

#[tokio::test]
async fn a_bad_otlp_flag_is_refused_naming_it() {
    for (args, flag) in [
        (vec!["--otlp-endpoint", "127.0.0.1:4318"], "--otlp-endpoint"),
        (
            vec![
                "--otlp-endpoint",
                "http://127.0.0.1:4318",
                "--otlp-sample-ratio",
                "2",
            ],
            "--otlp-sample-ratio",
        ),
    ] {
        let out = timeout(
            Duration::from_secs(60),
            Command::new(env!("CARGO_BIN_EXE_kvrouter"))
                .args(["serve", "--port", "0", "--mock-workers", "1"])
                .args(&args)
                .output(),
        )
        .await
        .unwrap()
        .unwrap();
        assert!(!out.status.success());
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(flag),
            "{args:?}"
        );
    }
}
