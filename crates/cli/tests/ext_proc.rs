//! `kvrouter serve --ext-proc-port` as a Gateway API endpoint picker, driven the way Envoy
//! drives it: a gRPC client replays Envoy's message sequence (request headers, body chunks,
//! response headers, response body, trailers) in buffered, streamed (`streamed.rs`) and
//! full-duplex body modes, with cancellation mid-stream; with `--ext-proc-observe headers`
//! (`observe.rs`); the gRPC health service
//! (`health.rs`); and a small HTTP proxy in the test asks the picker over ext_proc and
//! forwards to `kvrouter mock-engine` processes.

mod common;

use ep::external_processor_client::ExternalProcessorClient;
use ep::processing_request::Request as In;
use ep::processing_response::Response as Out;
use kvrouter_ext_proc::pb::envoy::config::core::v3 as core;
use kvrouter_ext_proc::pb::envoy::service::ext_proc::v3 as ep;
use prost_types::value::Kind as V;
use serde_json::{json, Value};
use std::time::Duration;
use tokio::sync::mpsc;

const BUFFERED: i32 = 2;
const FULL_DUPLEX: i32 = 4;

/// One ext_proc stream, as Envoy holds it for one HTTP request.
struct Envoy {
    tx: mpsc::Sender<ep::ProcessingRequest>,
    rx: tonic::Streaming<ep::ProcessingResponse>,
}

impl Envoy {
    async fn open(client: &mut ExternalProcessorClient<tonic::transport::Channel>) -> Self {
        let (tx, rx) = mpsc::channel(16);
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        let rx = client.process(stream).await.expect("stream").into_inner();
        Self { tx, rx }
    }

    async fn send(&mut self, m: ep::ProcessingRequest) {
        self.tx.send(m).await.expect("stream open");
    }

    async fn recv(&mut self) -> ep::ProcessingResponse {
        tokio::time::timeout(Duration::from_secs(20), self.rx.message())
            .await
            .expect("a response in time")
            .expect("no stream error")
            .expect("a response")
    }
}

/// A gateway's client: one connection, its streams multiplexed.
type Client = ExternalProcessorClient<tonic::transport::Channel>;

async fn connect(addr: &str) -> Client {
    ExternalProcessorClient::connect(format!("http://{addr}"))
        .await
        .expect("connect")
}

fn header_map(pairs: &[(&str, &str)]) -> Option<core::HeaderMap> {
    Some(core::HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| core::HeaderValue {
                key: (*k).into(),
                raw_value: v.as_bytes().to_vec(),
                ..Default::default()
            })
            .collect(),
    })
}

fn msg(r: In) -> ep::ProcessingRequest {
    ep::ProcessingRequest {
        request: Some(r),
        ..Default::default()
    }
}

/// The first message: request headers, the body modes, and the subset hint, if any.
fn request_headers(
    mode: i32,
    extra: &[(&str, &str)],
    subset: Option<&[String]>,
) -> ep::ProcessingRequest {
    let mut pairs = vec![
        (":method", "POST"),
        (":path", "/v1/completions"),
        (":authority", "gateway"),
        ("content-type", "application/json"),
    ];
    pairs.extend_from_slice(extra);
    let mut m = msg(In::RequestHeaders(ep::HttpHeaders {
        headers: header_map(&pairs),
        ..Default::default()
    }));
    m.protocol_config = Some(ep::ProtocolConfiguration {
        request_body_mode: mode,
        response_body_mode: mode,
        ..Default::default()
    });
    m.metadata_context = subset.map(|s| {
        let list = prost_types::ListValue {
            values: s
                .iter()
                .map(|e| prost_types::Value {
                    kind: Some(V::StringValue(e.clone())),
                })
                .collect(),
        };
        let hint = prost_types::Struct {
            fields: [(
                kvrouter_ext_proc::SUBSET_KEY.to_owned(),
                prost_types::Value {
                    kind: Some(V::ListValue(list)),
                },
            )]
            .into(),
        };
        core::Metadata {
            filter_metadata: [(kvrouter_ext_proc::SUBSET_NAMESPACE.to_owned(), hint)].into(),
            ..Default::default()
        }
    });
    m
}

fn request_body(b: &[u8], eos: bool) -> ep::ProcessingRequest {
    msg(In::RequestBody(ep::HttpBody {
        body: b.to_vec(),
        end_of_stream: eos,
        ..Default::default()
    }))
}

fn response_headers(status: u16) -> ep::ProcessingRequest {
    let status = status.to_string();
    msg(In::ResponseHeaders(ep::HttpHeaders {
        headers: header_map(&[(":status", &status), ("content-type", "text/event-stream")]),
        ..Default::default()
    }))
}

fn response_body(b: &[u8], eos: bool) -> ep::ProcessingRequest {
    msg(In::ResponseBody(ep::HttpBody {
        body: b.to_vec(),
        end_of_stream: eos,
        ..Default::default()
    }))
}

fn common_of(r: &ep::ProcessingResponse) -> Option<&ep::CommonResponse> {
    match r.response.as_ref()? {
        Out::RequestHeaders(h) | Out::ResponseHeaders(h) => h.response.as_ref(),
        Out::RequestBody(b) | Out::ResponseBody(b) => b.response.as_ref(),
        _ => None,
    }
}

/// The destination a response names: (header, dynamic metadata).
fn destination(r: &ep::ProcessingResponse) -> (Option<String>, Option<String>) {
    let header = common_of(r)
        .and_then(|c| c.header_mutation.as_ref())
        .and_then(|m| {
            m.set_headers
                .iter()
                .filter_map(|o| o.header.as_ref())
                .find(|h| h.key == kvrouter_ext_proc::DESTINATION)
        })
        .map(|h| String::from_utf8(h.raw_value.clone()).unwrap());
    let meta = r
        .dynamic_metadata
        .as_ref()
        .and_then(|m| m.fields.get(kvrouter_ext_proc::LB_NAMESPACE))
        .and_then(|v| match &v.kind {
            Some(V::StructValue(s)) => s.fields.get(kvrouter_ext_proc::DESTINATION),
            _ => None,
        })
        .and_then(|v| match &v.kind {
            Some(V::StringValue(s)) => Some(s.clone()),
            _ => None,
        });
    (header, meta)
}

fn streamed_body(r: &ep::ProcessingResponse) -> Option<(Vec<u8>, bool)> {
    match common_of(r)?.body_mutation.as_ref()?.mutation.as_ref()? {
        ep::body_mutation::Mutation::StreamedResponse(s) => Some((s.body.clone(), s.end_of_stream)),
        _ => None,
    }
}

fn completion(prefix: u64, tail: u64) -> Vec<u8> {
    let mut ids: Vec<u64> = (0..512).map(|i| 10_000 * (prefix + 1) + i).collect();
    ids.extend((0..40).map(|i| 900_000 + tail * 100 + i));
    json!({"model": "mock-model", "prompt": ids, "max_tokens": 3, "stream": true})
        .to_string()
        .into_bytes()
}

async fn metrics(base: &str) -> String {
    common::metrics(base).await
}

/// The sum of the samples whose line starts with `prefix`; 0 when none.
fn sum(m: &str, prefix: &str) -> f64 {
    common::metric_in(m, prefix).unwrap_or(0.0)
}

async fn await_metric(base: &str, prefix: &str, want: f64) {
    common::until_metric(base, prefix, want, Duration::from_secs(15)).await
}

const ACTIVE: &str = "kvrouter_worker_active_requests{";

async fn picker(workers: &str, extra: &[&str]) -> (common::Proc, String, String) {
    let mut args = vec![
        "serve",
        "--port",
        "0",
        "--mock-workers",
        workers,
        "--ext-proc-port",
        "0",
    ];
    args.extend(extra);
    let p = common::spawn(&args).await;
    let (base, grpc) = (p.http(), p.field("ext_proc"));
    (p, base, grpc)
}

const SSE: [&[u8]; 3] = [
    b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n",
    b"data: {\"choices\":[{\"text\":\"b\"}]}\n\n",
    b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":552,\"completion_tokens\":2}}\n\ndata: [DONE]\n\n",
];

#[tokio::test]
async fn buffered_mode_names_the_worker_and_the_answer_releases_it() {
    let (_p, base, grpc) = picker("2", &[]).await;
    let mut client = connect(&grpc).await;
    let mut envoy = Envoy::open(&mut client).await;
    envoy.send(request_headers(BUFFERED, &[], None)).await;
    let r = envoy.recv().await;
    assert!(matches!(r.response, Some(Out::RequestHeaders(_))), "{r:?}");
    assert_eq!(
        destination(&r),
        (None, None),
        "nothing is chosen before the body"
    );
    envoy.send(request_body(&completion(0, 0), true)).await;
    let r = envoy.recv().await;
    assert!(matches!(r.response, Some(Out::RequestBody(_))), "{r:?}");
    let (header, meta) = destination(&r);
    let header = header.expect("x-gateway-destination-endpoint");
    assert_eq!(Some(&header), meta.as_ref(), "header and metadata agree");
    let endpoints: Vec<&str> = header.split(',').collect();
    assert_eq!(
        endpoints.len(),
        2,
        "the chosen worker and one fallback: {header}"
    );
    assert!(endpoints.iter().all(|e| e.starts_with("127.0.0.1:")));
    assert_ne!(endpoints[0], endpoints[1]);
    let set: Vec<String> = common_of(&r)
        .unwrap()
        .header_mutation
        .as_ref()
        .unwrap()
        .set_headers
        .iter()
        .map(|o| o.header.as_ref().unwrap().key.clone())
        .collect();
    assert!(
        set.contains(&"x-kvrouter-worker-id".to_owned()),
        "{set:?}: for a frontend in direct mode"
    );
    assert_eq!(sum(&metrics(&base).await, ACTIVE), 1.0);
    envoy.send(response_headers(200)).await;
    assert!(matches!(
        envoy.recv().await.response,
        Some(Out::ResponseHeaders(_))
    ));
    // An answer with trailers: its last chunk does not end the stream (no trailers follow a
    // chunk that does), the trailers do.
    for chunk in SSE {
        envoy.send(response_body(chunk, false)).await;
        assert!(matches!(
            envoy.recv().await.response,
            Some(Out::ResponseBody(_))
        ));
    }
    envoy
        .send(msg(In::ResponseTrailers(ep::HttpTrailers::default())))
        .await;
    assert!(matches!(
        envoy.recv().await.response,
        Some(Out::ResponseTrailers(_))
    ));
    // Nothing follows the answer's end: the picker ends its side with its last answer.
    let end = tokio::time::timeout(Duration::from_secs(20), envoy.rx.message()).await;
    assert!(matches!(end, Ok(Ok(None))), "{end:?}");
    let m = metrics(&base).await;
    assert_eq!(sum(&m, ACTIVE), 0.0);
    assert_eq!(
        sum(
            &m,
            "kvrouter_picks_total{source=\"ext_proc\",end=\"finished\"}"
        ),
        1.0
    );
    assert_eq!(sum(&m, "kvrouter_time_to_first_token_seconds_count"), 1.0);
    assert_eq!(
        sum(&m, "kvrouter_output_sequence_tokens_sum"),
        2.0,
        "usage read from the answer"
    );
}

/// A body message past the codec's first decode buffer (32 KiB, `ExtProcCodec`), and one past
/// tonic's default message limit (4 MiB; tonic ended such a stream without an answer) but within
/// the body limit (64 MiB), are read whole and placed.
#[tokio::test]
async fn body_messages_past_the_decode_buffer_and_four_mib_are_read_whole() {
    let (_p, base, grpc) = picker("2", &[]).await;
    let mut client = connect(&grpc).await;
    // Both streams stay open: each holds its placement.
    let mut open = Vec::new();
    for (placed, (ids, at_least)) in [(12_000, 64 * 1024), (700_000, 4 << 20)]
        .into_iter()
        .enumerate()
    {
        let mut envoy = Envoy::open(&mut client).await;
        envoy.send(request_headers(BUFFERED, &[], None)).await;
        envoy.recv().await;
        let ids: Vec<u64> = (0..ids).map(|i| 100_000 + i % 50_000).collect();
        let body = json!({"model": "mock-model", "prompt": ids, "max_tokens": 3}).to_string();
        assert!(body.len() > at_least, "{}", body.len());
        envoy.send(request_body(body.as_bytes(), true)).await;
        let r = envoy.recv().await;
        assert!(
            matches!(r.response, Some(Out::RequestBody(_))),
            "{}",
            body.len()
        );
        assert!(destination(&r).0.is_some(), "placed: {}", body.len());
        let active = sum(&metrics(&base).await, ACTIVE);
        assert_eq!(active, (placed + 1) as f64);
        open.push(envoy);
    }
}

#[tokio::test]
async fn full_duplex_mode_answers_after_the_body_and_echoes_it() {
    let (_p, base, grpc) = picker("2", &[]).await;
    let mut client = connect(&grpc).await;
    let mut envoy = Envoy::open(&mut client).await;
    let body = completion(1, 0);
    envoy.send(request_headers(FULL_DUPLEX, &[], None)).await;
    let (a, b) = body.split_at(body.len() / 3);
    let (b, c) = b.split_at(b.len() / 2);
    envoy.send(request_body(a, false)).await;
    envoy.send(request_body(b, false)).await;
    envoy.send(request_body(c, true)).await;
    let first = envoy.recv().await;
    assert!(
        matches!(first.response, Some(Out::RequestHeaders(_))),
        "{first:?}"
    );
    let (header, meta) = destination(&first);
    assert!(header.is_some() && header == meta, "{first:?}");
    let echoed = envoy.recv().await;
    assert_eq!(
        streamed_body(&echoed),
        Some((body.clone(), true)),
        "the body goes on whole"
    );
    envoy.send(response_headers(200)).await;
    envoy.recv().await;
    envoy.send(response_body(SSE[0], false)).await;
    assert_eq!(
        streamed_body(&envoy.recv().await),
        Some((SSE[0].to_vec(), false))
    );
    envoy.send(response_body(SSE[2], true)).await;
    assert_eq!(
        streamed_body(&envoy.recv().await),
        Some((SSE[2].to_vec(), true))
    );
    await_metric(&base, ACTIVE, 0.0).await;
}

#[tokio::test]
async fn a_stream_cancelled_mid_answer_releases_its_load() {
    let (_p, base, grpc) = picker("1", &[]).await;
    let mut client = connect(&grpc).await;
    let mut envoy = Envoy::open(&mut client).await;
    envoy.send(request_headers(BUFFERED, &[], None)).await;
    envoy.recv().await;
    envoy.send(request_body(&completion(2, 0), true)).await;
    assert!(destination(&envoy.recv().await).0.is_some());
    envoy.send(response_headers(200)).await;
    envoy.recv().await;
    envoy.send(response_body(SSE[0], false)).await;
    envoy.recv().await;
    assert_eq!(sum(&metrics(&base).await, ACTIVE), 1.0);
    // The client went away: Envoy resets the stream.
    drop(envoy);
    await_metric(&base, ACTIVE, 0.0).await;
    await_metric(
        &base,
        "kvrouter_picks_total{source=\"ext_proc\",end=\"cancelled\"}",
        1.0,
    )
    .await;
}

#[tokio::test]
async fn the_subset_hint_restricts_the_choice_and_failures_follow_the_failure_mode() {
    let (_p, base, grpc) = picker("3", &[]).await;
    let mut client = connect(&grpc).await;
    // Learn the workers' endpoints from unrestricted picks.
    let mut seen = std::collections::BTreeSet::new();
    for prefix in 0..6 {
        let mut envoy = Envoy::open(&mut client).await;
        envoy.send(request_headers(BUFFERED, &[], None)).await;
        envoy.recv().await;
        envoy.send(request_body(&completion(prefix, 0), true)).await;
        let (h, _) = destination(&envoy.recv().await);
        seen.insert(h.unwrap().split(',').next().unwrap().to_owned());
    }
    await_metric(&base, ACTIVE, 0.0).await;
    let only: Vec<String> = seen.iter().take(1).cloned().collect();
    for prefix in 10..14 {
        let mut envoy = Envoy::open(&mut client).await;
        envoy
            .send(request_headers(BUFFERED, &[], Some(&only)))
            .await;
        envoy.recv().await;
        envoy.send(request_body(&completion(prefix, 0), true)).await;
        let (h, _) = destination(&envoy.recv().await);
        assert_eq!(h.unwrap().split(',').next(), Some(only[0].as_str()));
    }
    // A subset with no known endpoint: 503, as the protocol asks.
    let nowhere = vec!["10.255.255.1:1".to_owned()];
    let mut envoy = Envoy::open(&mut client).await;
    envoy
        .send(request_headers(BUFFERED, &[], Some(&nowhere)))
        .await;
    envoy.recv().await;
    envoy.send(request_body(&completion(20, 0), true)).await;
    match envoy.recv().await.response {
        Some(Out::ImmediateResponse(i)) => assert_eq!(i.status.unwrap().code, 503),
        other => panic!("{other:?}"),
    }
    // Invalid bodies: closed mode refuses them naming the field.
    let mut envoy = Envoy::open(&mut client).await;
    envoy.send(request_headers(BUFFERED, &[], None)).await;
    envoy.recv().await;
    envoy
        .send(request_body(
            br#"{"model":"mock-model","messages":3}"#,
            true,
        ))
        .await;
    match envoy.recv().await.response {
        Some(Out::ImmediateResponse(i)) => {
            assert_eq!(i.status.unwrap().code, 400);
            let body: Value = serde_json::from_slice(&i.body).unwrap();
            assert_eq!(body["error"]["param"], "messages", "{body}");
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn fail_open_lets_an_unplaceable_request_go_on_without_a_destination() {
    let (_p, _base, grpc) = picker("1", &["--ext-proc-failure-mode", "open"]).await;
    let mut client = connect(&grpc).await;
    let mut envoy = Envoy::open(&mut client).await;
    envoy.send(request_headers(BUFFERED, &[], None)).await;
    envoy.recv().await;
    envoy.send(request_body(b"not json", true)).await;
    let r = envoy.recv().await;
    assert!(matches!(r.response, Some(Out::RequestBody(_))), "{r:?}");
    assert_eq!(destination(&r), (None, None));
}

#[path = "ext_proc/proxy.rs"]
mod proxy;

#[path = "ext_proc/health.rs"]
mod health;

#[path = "ext_proc/streamed.rs"]
mod streamed;

#[path = "ext_proc/observe.rs"]
mod observe;

#[path = "ext_proc/malformed.rs"]
mod malformed;

#[path = "ext_proc/connection.rs"]
mod connection;

#[path = "ext_proc/churn.rs"]
mod churn;

#[tokio::test]
async fn a_gateway_in_front_of_engines_sends_a_prefix_to_one_engine_and_releases_load() {
    let mut engines = Vec::new();
    for _ in 0..3 {
        let args = [
            "mock-engine",
            "--port",
            "0",
            "--speedup-ratio",
            "20",
            "--kv-events-endpoint",
            "tcp://127.0.0.1:0",
        ];
        engines.push(common::spawn(&args).await);
    }
    let urls: Vec<String> = engines.iter().map(common::Proc::http).collect();
    // Observing every chunk of the answer, then only its headers and the stream's end (the
    // gateway taking the picker's mode override), each with its own router.
    through_gateway(&urls, &[], 0..3).await;
    through_gateway(&urls, &["--ext-proc-observe", "headers"], 10..13).await;
}

/// A router with `extra` flags over the engines at `urls`, behind the test's gateway: each
/// prefix's requests go to one engine, and every answer's end releases its load.
async fn through_gateway(urls: &[String], extra: &[&str], prefixes: std::ops::Range<u64>) {
    let mut args = vec!["serve", "--port", "0", "--ext-proc-port", "0"];
    for u in urls {
        args.extend(["--worker", u.as_str()]);
    }
    args.extend(extra);
    let router = common::spawn(&args).await;
    let base = router.http();
    let gateway = proxy::start(&router.field("ext_proc")).await;
    let http = reqwest::Client::new();
    let requests = prefixes.clone().count() as f64 * 4.0;
    for prefix in prefixes {
        let blocks_before = sum(&metrics(&base).await, "kvrouter_worker_cached_blocks{");
        let (first, _) = proxy::complete(&http, &gateway, &completion(prefix, 0)).await;
        // The engine's KV events reach the picker's index.
        common::until("the KV events", Duration::from_secs(15), || async {
            sum(&metrics(&base).await, "kvrouter_worker_cached_blocks{") >= blocks_before + 8.0
        })
        .await;
        for tail in 1..4 {
            let (upstream, text) =
                proxy::complete(&http, &gateway, &completion(prefix, tail)).await;
            assert_eq!(upstream, first, "{extra:?}: prefix {prefix}, tail {tail}");
            assert!(text.contains("data: [DONE]"), "{text}");
        }
    }
    await_metric(&base, ACTIVE, 0.0).await;
    await_metric(
        &base,
        "kvrouter_picks_total{source=\"ext_proc\",end=\"finished\"}",
        requests,
    )
    .await;
}
