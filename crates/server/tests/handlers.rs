//! Handler tests without sockets: the app is driven with `oneshot` requests.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use kvrouter_server::{app, AppState, ServeConfig};
use serde_json::Value;
use tower::ServiceExt;

fn state(admin: Option<&str>) -> AppState {
    let config = ServeConfig {
        admin_token: admin.map(str::to_owned),
        model_names: vec!["m".into()],
        ..ServeConfig::default()
    };
    AppState::new(config).unwrap()
}

async fn call(state: AppState, req: Request<Body>) -> (StatusCode, Value) {
    let resp = app(state).oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

fn post(path: &str, body: &str) -> Request<Body> {
    Request::post(path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap()
}

#[tokio::test]
async fn no_workers_is_503_with_the_reason() {
    let (s, body) = call(
        state(None),
        post("/v1/completions", r#"{"model":"m","prompt":"hi"}"#),
    )
    .await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("no workers"));
    let (s, _) = call(
        state(None),
        Request::get("/health").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    let (s, _) = call(
        state(None),
        Request::get("/live").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
}

#[tokio::test]
async fn malformed_requests_name_the_field() {
    let (s, body) = call(state(None), post("/v1/chat/completions", "{")).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(body["error"]["type"], "invalid_request_error");
    let (s, body) = call(state(None), post("/v1/completions", r#"{"model":"m"}"#)).await;
    assert_eq!(
        (s, body["error"]["param"].as_str()),
        (StatusCode::BAD_REQUEST, Some("prompt"))
    );
    let (s, body) = call(
        state(None),
        post("/v1/completions", r#"{"model":"x","prompt":"a"}"#),
    )
    .await;
    assert_eq!(
        (s, body["error"]["param"].as_str()),
        (StatusCode::NOT_FOUND, Some("model"))
    );
    let (s, body) = call(
        state(None),
        post("/v1/completions", r#"{"model":"m","prompt":[1,-2]}"#),
    )
    .await;
    assert_eq!(
        (s, body["error"]["param"].as_str()),
        (StatusCode::BAD_REQUEST, Some("prompt"))
    );
    // A `stream` that is not a boolean is refused here, not forwarded for the engine to refuse.
    let (s, body) = call(
        state(None),
        post(
            "/v1/completions",
            r#"{"model":"m","prompt":"a","stream":"yes"}"#,
        ),
    )
    .await;
    assert_eq!(
        (s, body["error"]["param"].as_str()),
        (StatusCode::BAD_REQUEST, Some("stream"))
    );
}

#[tokio::test]
async fn the_admin_api_needs_its_token() {
    let (s, _) = call(
        state(Some("t")),
        Request::get("/admin/workers").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let req = Request::get("/admin/workers")
        .header("authorization", "Bearer t")
        .body(Body::empty())
        .unwrap();
    let (s, body) = call(state(Some("t")), req).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(body["workers"], Value::Array(vec![]));
    let (s, _) = call(
        state(None),
        Request::get("/admin/workers").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "admin API off without a token");
    let req = post("/admin/workers", r#"{"url":"ftp://x"}"#);
    let (req_parts, body) = req.into_parts();
    let mut req = Request::from_parts(req_parts, body);
    req.headers_mut()
        .insert("authorization", "Bearer t".parse().unwrap());
    let (s, body) = call(state(Some("t")), req).await;
    assert_eq!(
        (s, body["error"]["param"].as_str()),
        (StatusCode::BAD_REQUEST, Some("url"))
    );
}

#[tokio::test]
async fn metrics_are_prometheus_text() {
    let resp = app(state(None))
        .oneshot(Request::get("/metrics").body(Body::empty()).unwrap())
        .await
        .unwrap();
    let text = String::from_utf8(
        resp.into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec(),
    )
    .unwrap();
    for name in [
        "kvrouter_time_to_first_token_seconds",
        "kvrouter_routing_overhead_seconds",
        "kvrouter_router_queue_pending_requests",
    ] {
        assert!(text.contains(&format!("# TYPE {name}")), "{name} missing");
    }
}
