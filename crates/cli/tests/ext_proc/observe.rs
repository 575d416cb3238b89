//! `--ext-proc-observe headers`: the response headers' answer asks Envoy for no response body
//! (`mode_override`), and the answer's end is the stream's end. Replayed as Envoy (1.37,
//! `source/extensions/filters/http/ext_proc/ext_proc.cc`) behaves with `allow_mode_override`:
//! `Filter::onReceiveMessage` applies the override to the rest of the request, so no body
//! chunk follows; `Filter::closeGrpcStreamIfLastRespReceived` leaves the stream open after the
//! response headers' answer because response trailers are still wanted (`sendTrailers()`);
//! an HTTP/1.1 answer has none, so at the HTTP stream's end `Filter::onDestroy` ->
//! `closeStreamMaybeGraceful` -> `ProcessorStreamImpl::close` half-closes the stream
//! (`closeStream()`) and resets it (`resetStream()`): [`Envoy::close`]. Envoy does the same
//! when the downstream client goes away mid-answer. Without `allow_mode_override` Envoy
//! ignores the override and sends the body as configured.

use super::{
    await_metric, metrics, msg, request_body, request_headers, response_body, response_headers,
    sum, Envoy, ACTIVE, BUFFERED, FULL_DUPLEX, SSE,
};
use ep::processing_request::Request as In;
use ep::processing_response::Response as Out;
use kvrouter_ext_proc::pb::envoy::service::ext_proc::v3 as ep;

const NONE: i32 = 0;
const STREAMED: i32 = 1;
const SEND: i32 = 1;
const FINISHED: &str = "kvrouter_picks_total{source=\"ext_proc\",end=\"finished\"}";
const CANCELLED: &str = "kvrouter_picks_total{source=\"ext_proc\",end=\"cancelled\"}";
const FAILED: &str = "kvrouter_picks_total{source=\"ext_proc\",end=\"failed\"}";
const TTFT: &str = "kvrouter_time_to_first_token_seconds_count";
const OUTPUT: &str = "kvrouter_output_sequence_tokens_count";

impl Envoy {
    /// The end of the HTTP stream as Envoy ends the ext_proc stream then: a half-close
    /// (`closeStream()`), then a reset (`resetStream()`, dropping the response stream).
    fn close(self) {
        let Envoy { tx, rx } = self;
        drop(tx);
        drop(rx);
    }
}

async fn headers_picker(workers: &str) -> (super::common::Proc, String, String) {
    super::picker(workers, &["--ext-proc-observe", "headers"]).await
}

/// Places one buffered request and answers its response headers with `status`: the stream and
/// the answer to the response headers.
async fn placed_and_answered(
    grpc: &str,
    prefix: u64,
    status: u16,
) -> (Envoy, ep::ProcessingResponse) {
    let mut client = super::connect(grpc).await;
    let mut envoy = Envoy::open(&mut client).await;
    let mut first = request_headers(BUFFERED, &[], None);
    first.protocol_config.as_mut().unwrap().response_body_mode = STREAMED;
    envoy.send(first).await;
    envoy.recv().await;
    envoy
        .send(request_body(&super::completion(prefix, 0), true))
        .await;
    assert!(super::destination(&envoy.recv().await).0.is_some());
    envoy.send(response_headers(status)).await;
    let r = envoy.recv().await;
    assert!(matches!(r.response, Some(Out::ResponseHeaders(_))), "{r:?}");
    (envoy, r)
}

#[tokio::test]
async fn headers_mode_asks_for_no_body_and_the_streams_end_releases_the_load() {
    let (_p, base, grpc) = headers_picker("2").await;
    let (envoy, r) = placed_and_answered(&grpc, 30, 200).await;
    let mode = r
        .mode_override
        .expect("a mode override on the headers' answer");
    assert_eq!(mode.response_body_mode, NONE, "no response body");
    assert_eq!(mode.response_trailer_mode, SEND, "keeps the stream open");
    assert_eq!(
        mode.request_body_mode, BUFFERED,
        "the request body mode echoed (body modes are taken as given)"
    );
    let m = metrics(&base).await;
    assert_eq!(sum(&m, ACTIVE), 1.0, "held while the answer goes on");
    assert_eq!(sum(&m, TTFT), 1.0, "the first token taken at the headers");
    // The answer ends: Envoy closes the stream.
    envoy.close();
    await_metric(&base, ACTIVE, 0.0).await;
    await_metric(&base, FINISHED, 1.0).await;
    let m = metrics(&base).await;
    assert_eq!(sum(&m, CANCELLED), 0.0);
    assert_eq!(sum(&m, OUTPUT), 0.0, "no output length is made up");
}

#[tokio::test]
async fn headers_mode_releases_a_stream_cancelled_before_or_during_the_answer() {
    let (_p, base, grpc) = headers_picker("1").await;
    // Cancelled before the answer began: cancelled, as in full mode.
    let mut client = super::connect(&grpc).await;
    let mut envoy = Envoy::open(&mut client).await;
    envoy.send(request_headers(BUFFERED, &[], None)).await;
    envoy.recv().await;
    envoy
        .send(request_body(&super::completion(31, 0), true))
        .await;
    envoy.recv().await;
    assert_eq!(sum(&metrics(&base).await, ACTIVE), 1.0);
    envoy.close();
    await_metric(&base, ACTIVE, 0.0).await;
    await_metric(&base, CANCELLED, 1.0).await;
    // Cancelled mid-answer: Envoy ends the stream exactly as at the answer's end, so the load
    // goes at once, counted as finished. Here as with `ext_proc_graceful_grpc_close`: only the
    // half-close, and Envoy waits for the picker to end its side.
    let (envoy, _) = placed_and_answered(&grpc, 32, 200).await;
    assert_eq!(sum(&metrics(&base).await, ACTIVE), 1.0);
    let Envoy { tx, mut rx } = envoy;
    drop(tx);
    let end = tokio::time::timeout(std::time::Duration::from_secs(20), rx.message()).await;
    assert!(
        matches!(end, Ok(Ok(None))),
        "the picker ends its side: {end:?}"
    );
    let m = metrics(&base).await;
    assert_eq!(sum(&m, ACTIVE), 0.0);
    assert_eq!(sum(&m, FINISHED), 1.0);
    // A failed answer (non-2xx) counts toward the worker's health at the end.
    let (envoy, _) = placed_and_answered(&grpc, 33, 500).await;
    envoy.close();
    await_metric(&base, FAILED, 1.0).await;
    await_metric(&base, ACTIVE, 0.0).await;
}

#[tokio::test]
async fn headers_mode_ends_at_response_trailers_and_falls_back_when_the_override_is_ignored() {
    let (_p, base, grpc) = headers_picker("2").await;
    // An answer with trailers (HTTP/2 upstream): Envoy sends them, as the override asks.
    let (mut envoy, _) = placed_and_answered(&grpc, 34, 200).await;
    envoy
        .send(msg(In::ResponseTrailers(ep::HttpTrailers::default())))
        .await;
    assert!(matches!(
        envoy.recv().await.response,
        Some(Out::ResponseTrailers(_))
    ));
    let m = metrics(&base).await;
    assert_eq!(sum(&m, ACTIVE), 0.0, "released at the trailers");
    assert_eq!(sum(&m, FINISHED), 1.0);
    assert_eq!(sum(&m, OUTPUT), 0.0);
    envoy.close();
    // A gateway without allow_mode_override sends the body anyway: observed in full.
    let (mut envoy, _) = placed_and_answered(&grpc, 35, 200).await;
    for (i, chunk) in SSE.iter().enumerate() {
        envoy.send(response_body(chunk, i == SSE.len() - 1)).await;
        let r = envoy.recv().await;
        assert!(matches!(r.response, Some(Out::ResponseBody(_))), "{r:?}");
    }
    let m = metrics(&base).await;
    assert_eq!(sum(&m, ACTIVE), 0.0);
    assert_eq!(sum(&m, FINISHED), 2.0);
    assert_eq!(
        sum(&m, "kvrouter_output_sequence_tokens_sum"),
        2.0,
        "the usage read from the answer"
    );
    envoy.close();
    // ... and a stream it then ends before the answer's end was cancelled, as in full mode.
    let (mut envoy, _) = placed_and_answered(&grpc, 36, 200).await;
    envoy.send(response_body(SSE[0], false)).await;
    envoy.recv().await;
    envoy.close();
    await_metric(&base, CANCELLED, 1.0).await;
    await_metric(&base, ACTIVE, 0.0).await;
}

#[tokio::test]
async fn headers_mode_sends_no_override_where_envoy_would_ignore_it() {
    let (_p, base, grpc) = headers_picker("1").await;
    let mut client = super::connect(&grpc).await;
    let mut envoy = Envoy::open(&mut client).await;
    envoy.send(request_headers(FULL_DUPLEX, &[], None)).await;
    envoy
        .send(request_body(&super::completion(37, 0), true))
        .await;
    envoy.recv().await;
    envoy.recv().await;
    envoy.send(response_headers(200)).await;
    let r = envoy.recv().await;
    assert_eq!(r.mode_override, None, "{r:?}");
    envoy.send(response_body(SSE[2], true)).await;
    envoy.recv().await;
    await_metric(&base, ACTIVE, 0.0).await;
    assert_eq!(sum(&metrics(&base).await, FINISHED), 1.0);
}
