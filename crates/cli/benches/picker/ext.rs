//! The ext_proc line's client: the message sequence Envoy sends for one exchange, replayed over
//! keep-alive gRPC streams.

use super::{cpu_seconds, fresh_prompts, prompt};
use ep::external_processor_client::ExternalProcessorClient;
use ep::processing_request::Request as In;
use kvrouter_ext_proc::pb::envoy::config::core::v3 as core;
use kvrouter_ext_proc::pb::envoy::service::ext_proc::v3 as ep;
use serde_json::json;

fn msg(r: In) -> ep::ProcessingRequest {
    ep::ProcessingRequest {
        request: Some(r),
        ..Default::default()
    }
}

/// One exchange's messages as Envoy sends them with the bench's processing mode (request body
/// `BUFFERED`; response body `BUFFERED` for the full line, whose three chunks stand for a
/// streamed answer, `STREAMED` for the headers line): request headers, request body, response
/// headers, then the three response body chunks (the last ending the stream), which a gateway
/// told to send no body (`--ext-proc-observe headers`) does not send.
fn exchange_messages(i: u64, response_body_mode: i32) -> Vec<ep::ProcessingRequest> {
    let h = |pairs: &[(&str, &str)]| core::HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| core::HeaderValue {
                key: (*k).into(),
                raw_value: v.as_bytes().to_vec(),
                ..Default::default()
            })
            .collect(),
    };
    let body =
        json!({"model": "mock-model", "prompt": prompt(i), "max_tokens": 16, "stream": true});
    let mut first = msg(In::RequestHeaders(ep::HttpHeaders {
        headers: Some(h(&[
            (":method", "POST"),
            (":path", "/v1/completions"),
            ("content-type", "application/json"),
        ])),
        ..Default::default()
    }));
    first.protocol_config = Some(ep::ProtocolConfiguration {
        request_body_mode: 2,
        response_body_mode,
        ..Default::default()
    });
    let chunk = |b: &[u8], eos| {
        msg(In::ResponseBody(ep::HttpBody {
            body: b.to_vec(),
            end_of_stream: eos,
            ..Default::default()
        }))
    };
    vec![
        first,
        msg(In::RequestBody(ep::HttpBody {
            body: serde_json::to_vec(&body).unwrap(),
            end_of_stream: true,
            ..Default::default()
        })),
        msg(In::ResponseHeaders(ep::HttpHeaders {
            headers: Some(h(&[(":status", "200")])),
            ..Default::default()
        })),
        chunk(b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n", false),
        chunk(b"data: {\"choices\":[{\"text\":\"b\"}]}\n\n", false),
        chunk(
            b"data: {\"choices\":[],\"usage\":{\"completion_tokens\":2}}\n\ndata: [DONE]\n\n",
            true,
        ),
    ]
}

/// Whether a response headers' answer asks Envoy to send no response body (a `mode_override`
/// with `response_body_mode: NONE`), which Envoy with `allow_mode_override` applies at once
/// (`Filter::onReceiveMessage` in `source/extensions/filters/http/ext_proc/ext_proc.cc`).
fn no_more_body(r: &ep::ProcessingResponse) -> bool {
    r.mode_override
        .as_ref()
        .is_some_and(|m| m.response_body_mode == 0)
}

/// The full exchange line: `response_body_mode` as the gateway's processing mode says it.
pub(super) async fn ext_proc_exchanges(
    addr: &str,
    pid: u32,
    n: u64,
    concurrency: u64,
    response_body_mode: i32,
    connections: u64,
) -> f64 {
    // Keep-alive HTTP/2 connections, the tasks' streams spread over them. Envoy's HTTP/2 pool
    // holds one connection per worker thread to a host and multiplexes that thread's streams
    // over it, so a gateway with W worker threads is `connections = W`; at most one
    // connection per task.
    let mut channels = Vec::new();
    for _ in 0..connections.min(concurrency).max(1) {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        channels.push(channel);
    }
    let clients: Vec<_> = (0..concurrency as usize)
        .map(|c| ExternalProcessorClient::new(channels[c % channels.len()].clone()))
        .collect();
    let first = fresh_prompts(n);
    let before = cpu_seconds(pid);
    let tasks: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(c, mut client)| {
            tokio::spawn(async move {
                for i in (c as u64..n).step_by(concurrency as usize) {
                    let (tx, rx) = tokio::sync::mpsc::channel(8);
                    let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
                    let mut inbound = client.process(stream).await.unwrap().into_inner();
                    for m in exchange_messages(first + i, response_body_mode) {
                        let body = matches!(m.request, Some(In::ResponseBody(_)));
                        tx.send(m).await.unwrap();
                        let r = inbound.message().await.unwrap().expect("a response");
                        if !body && no_more_body(&r) {
                            // The answer's body goes by unseen; at the HTTP stream's end Envoy
                            // half-closes the stream and resets it (`Filter::onDestroy` ->
                            // `closeStreamMaybeGraceful` -> `ProcessorStreamImpl::close`:
                            // `closeStream()` then `resetStream()`), below.
                            break;
                        }
                    }
                    // Half-close, then reset (dropping the response stream).
                    drop(tx);
                    drop(inbound);
                }
                client
            })
        })
        .collect();
    let mut clients = Vec::new();
    for t in tasks {
        clients.push(t.await.unwrap());
    }
    // Measured before the connections close (closing them is not an exchange's cost).
    let cpu = cpu_seconds(pid) - before;
    drop(clients);
    cpu
}
