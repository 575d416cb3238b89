//! A small gateway for the end-to-end test: for each request it asks the endpoint picker over
//! ext_proc (as Envoy does, buffered body mode), forwards to the endpoint named, and replays
//! the answer's headers, body chunks and end to the picker.

use super::{
    destination, request_body, request_headers, response_body, response_headers, Envoy, BUFFERED,
};
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use ep::processing_response::Response as Out;
use kvrouter_ext_proc::pb::envoy::service::ext_proc::v3 as ep;
use kvrouter_ext_proc::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;

#[derive(Clone)]
struct Gateway {
    picker: ExternalProcessorClient<tonic::transport::Channel>,
    http: reqwest::Client,
}

/// Starts the gateway on 127.0.0.1:0; returns its base URL.
pub(crate) async fn start(ext_proc: &str) -> String {
    let picker = super::connect(ext_proc).await;
    let gw = Gateway {
        picker,
        http: reqwest::Client::new(),
    };
    let app = axum::Router::new()
        .route("/v1/completions", axum::routing::post(forward))
        .with_state(gw);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

async fn forward(State(mut gw): State<Gateway>, body: Bytes) -> Response {
    let mut envoy = Envoy::open(&mut gw.picker).await;
    envoy.send(request_headers(BUFFERED, &[], None)).await;
    envoy.recv().await;
    envoy.send(request_body(&body, true)).await;
    let r = envoy.recv().await;
    if let Some(Out::ImmediateResponse(i)) = r.response {
        let status = axum::http::StatusCode::from_u16(i.status.unwrap().code as u16).unwrap();
        return (status, i.body).into_response();
    }
    let endpoints = destination(&r).0.expect("a destination");
    let upstream = endpoints.split(',').next().unwrap().to_owned();
    let mut answer = gw
        .http
        .post(format!("http://{upstream}/v1/completions"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("the engine answers");
    envoy.send(response_headers(answer.status().as_u16())).await;
    // With `allow_mode_override`, Envoy takes the picker's override: no body goes to it when
    // the override says so, and the stream's end (below) is the answer's end.
    let body_wanted = envoy
        .recv()
        .await
        .mode_override
        .is_none_or(|m| m.response_body_mode != 0);
    let mut text = Vec::new();
    while let Some(chunk) = answer.chunk().await.expect("the body") {
        if body_wanted {
            envoy.send(response_body(&chunk, false)).await;
            envoy.recv().await;
        }
        text.extend_from_slice(&chunk);
    }
    if body_wanted {
        envoy.send(response_body(b"", true)).await;
        envoy.recv().await;
    }
    // The HTTP stream's end: Envoy half-closes the ext_proc stream, then resets it.
    drop(envoy);
    ([("x-upstream", upstream)], text).into_response()
}

/// Sends a completion through the gateway: the engine that served it and the answer.
pub(crate) async fn complete(
    http: &reqwest::Client,
    gateway: &str,
    body: &[u8],
) -> (String, String) {
    let r = http
        .post(format!("{gateway}/v1/completions"))
        .header("content-type", "application/json")
        .body(body.to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let upstream = r.headers()["x-upstream"].to_str().unwrap().to_owned();
    (upstream, r.text().await.unwrap())
}
