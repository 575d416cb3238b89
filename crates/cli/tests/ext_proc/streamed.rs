//! The classic `STREAMED` request body mode, replayed as Envoy sends it. Without
//! `send_body_without_waiting_for_header_response`, Envoy sends no body before the headers are
//! answered and lets the headers go on to its router (which picks the host) on that answer: the
//! destination must be on the headers response, placed from the headers alone. With it, the
//! body comes first and the headers wait: the destination is placed from the whole body.

use super::{
    await_metric, common_of, completion, destination, metrics, msg, request_body, request_headers,
    response_body, response_headers, sum, Envoy, ACTIVE, SSE,
};
use ep::processing_request::Request as In;
use ep::processing_response::Response as Out;
use kvrouter_ext_proc::pb::envoy::service::ext_proc::v3 as ep;

const STREAMED: i32 = 1;

/// The first message of a `STREAMED` stream whose body comes before the headers' answer.
fn early_headers(extra: &[(&str, &str)]) -> ep::ProcessingRequest {
    let mut m = request_headers(STREAMED, extra, None);
    let c = m.protocol_config.as_mut().expect("protocol config");
    c.send_body_without_waiting_for_header_response = true;
    m
}

fn is_body(r: &ep::ProcessingResponse) -> bool {
    matches!(r.response, Some(Out::RequestBody(_)))
}

#[tokio::test]
async fn streamed_mode_names_the_destination_on_the_headers_response() {
    let (_p, base, grpc) = super::picker("2", &[]).await;
    let mut client = super::connect(&grpc).await;
    let mut envoy = Envoy::open(&mut client).await;
    envoy.send(request_headers(STREAMED, &[], None)).await;
    let r = envoy.recv().await;
    assert!(matches!(r.response, Some(Out::RequestHeaders(_))), "{r:?}");
    let (header, meta) = destination(&r);
    let header = header.expect("the destination on the headers response");
    assert_eq!(Some(&header), meta.as_ref(), "header and metadata agree");
    assert_eq!(sum(&metrics(&base).await, ACTIVE), 1.0);
    // The body follows the headers; each chunk is let through.
    let body = completion(3, 0);
    let (a, b) = body.split_at(body.len() / 2);
    for (chunk, eos) in [(a, false), (b, true)] {
        envoy.send(request_body(chunk, eos)).await;
        let r = envoy.recv().await;
        assert!(is_body(&r), "{r:?}");
        assert_eq!(destination(&r), (None, None), "the destination is set once");
    }
    envoy.send(response_headers(200)).await;
    envoy.recv().await;
    for (i, chunk) in SSE.iter().enumerate() {
        envoy.send(response_body(chunk, i == SSE.len() - 1)).await;
        envoy.recv().await;
    }
    let m = metrics(&base).await;
    assert_eq!(sum(&m, ACTIVE), 0.0, "released at the end of the answer");
    assert_eq!(
        sum(
            &m,
            "kvrouter_picks_total{source=\"ext_proc\",end=\"finished\"}"
        ),
        1.0
    );
    assert_eq!(
        sum(&m, "kvrouter_output_sequence_tokens_sum"),
        2.0,
        "the usage read from the event stream"
    );
}

#[tokio::test]
async fn streamed_mode_reads_the_model_header_and_a_cancelled_stream_releases_its_load() {
    let (_p, base, grpc) = super::picker("1", &[]).await;
    let mut client = super::connect(&grpc).await;
    // The model comes from the gateway's body-based routing header when there is no body yet.
    let mut envoy = Envoy::open(&mut client).await;
    let unknown = [("x-gateway-model-name", "no-such-model")];
    envoy.send(request_headers(STREAMED, &unknown, None)).await;
    match envoy.recv().await.response {
        Some(Out::ImmediateResponse(i)) => assert_eq!(i.status.unwrap().code, 404),
        other => panic!("{other:?}"),
    }
    let mut envoy = Envoy::open(&mut client).await;
    let known = [("x-gateway-model-name", "mock-model")];
    envoy.send(request_headers(STREAMED, &known, None)).await;
    assert!(destination(&envoy.recv().await).0.is_some());
    envoy
        .send(request_body(b"{\"model\":\"mock-model\",", false))
        .await;
    assert!(is_body(&envoy.recv().await));
    assert_eq!(sum(&metrics(&base).await, ACTIVE), 1.0);
    // The client went away mid-body: Envoy resets the stream.
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
async fn streamed_mode_with_early_body_answers_the_headers_after_the_whole_body() {
    let (_p, base, grpc) = super::picker("2", &[]).await;
    let mut client = super::connect(&grpc).await;
    let body = completion(4, 0);
    let (a, b) = body.split_at(body.len() / 3);
    let (b, c) = b.split_at(b.len() / 2);
    let mut envoy = Envoy::open(&mut client).await;
    envoy.send(early_headers(&[])).await;
    for (chunk, eos) in [(a, false), (b, false), (c, true)] {
        envoy.send(request_body(chunk, eos)).await;
    }
    // The headers' answer first (with the destination), then one answer per chunk, in order.
    let first = envoy.recv().await;
    assert!(
        matches!(first.response, Some(Out::RequestHeaders(_))),
        "{first:?}"
    );
    let (header, meta) = destination(&first);
    assert!(header.is_some() && header == meta, "{first:?}");
    for _ in 0..3 {
        let r = envoy.recv().await;
        assert!(is_body(&r), "{r:?}");
        let mutated = common_of(&r).and_then(|c| c.body_mutation.as_ref());
        assert!(mutated.is_none(), "chunks go on unchanged: {r:?}");
    }
    envoy.send(response_headers(200)).await;
    envoy.recv().await;
    envoy.send(response_body(SSE[2], true)).await;
    envoy.recv().await;
    await_metric(&base, ACTIVE, 0.0).await;

    // With request trailers, Envoy holds them until the chunks before them are answered: the
    // chunk that completes the JSON body is the end.
    let mut envoy = Envoy::open(&mut client).await;
    envoy.send(early_headers(&[])).await;
    let (a, b) = body.split_at(body.len() / 2);
    envoy.send(request_body(a, false)).await;
    envoy.send(request_body(b, false)).await;
    let first = envoy.recv().await;
    assert!(destination(&first).0.is_some(), "{first:?}");
    assert!(is_body(&envoy.recv().await));
    assert!(is_body(&envoy.recv().await));
    envoy
        .send(msg(In::RequestTrailers(ep::HttpTrailers::default())))
        .await;
    assert!(matches!(
        envoy.recv().await.response,
        Some(Out::RequestTrailers(_))
    ));
    drop(envoy);
    await_metric(&base, ACTIVE, 0.0).await;
}

#[tokio::test]
async fn a_buffered_partial_body_cut_at_the_limit_is_placed_from_the_headers() {
    const BUFFERED_PARTIAL: i32 = 3;
    let (_p, base, grpc) = super::picker("1", &[]).await;
    let mut client = super::connect(&grpc).await;
    let mut envoy = Envoy::open(&mut client).await;
    envoy
        .send(request_headers(BUFFERED_PARTIAL, &[], None))
        .await;
    envoy.recv().await;
    // Envoy's one body message, cut at its buffer limit: no end, and no more to come.
    let body = completion(5, 0);
    envoy
        .send(request_body(&body[..body.len() / 2], false))
        .await;
    let r = envoy.recv().await;
    assert!(is_body(&r), "{r:?}");
    assert!(destination(&r).0.is_some(), "{r:?}");
    assert_eq!(sum(&metrics(&base).await, ACTIVE), 1.0);
    drop(envoy);
    await_metric(&base, ACTIVE, 0.0).await;
}

/// A request without a body (`GET /v1/models` through the gateway: its headers carry
/// `end_of_stream`) is placed from its headers, whatever the body mode; it was refused as a
/// body that is not JSON.
#[tokio::test]
async fn a_request_without_a_body_is_placed_from_its_headers() {
    const BUFFERED: i32 = 2;
    let (_p, base, grpc) = super::picker("2", &[]).await;
    let mut client = super::connect(&grpc).await;
    let mut envoy = Envoy::open(&mut client).await;
    let mut headers = request_headers(BUFFERED, &[(":method", "GET")], None);
    if let Some(In::RequestHeaders(h)) = headers.request.as_mut() {
        h.end_of_stream = true;
    }
    envoy.send(headers).await;
    let r = envoy.recv().await;
    assert!(matches!(r.response, Some(Out::RequestHeaders(_))), "{r:?}");
    let (header, _) = destination(&r);
    assert!(header.is_some(), "a destination: {r:?}");
    assert_eq!(sum(&metrics(&base).await, ACTIVE), 1.0);
}
