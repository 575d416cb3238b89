//! Hardening of the HTTP surface, driven in process with `oneshot`: worker-entry limits on the
//! admin API, the admin token checked before anything is parsed, session-release protection,
//! strict routing headers, and OpenAI-shaped JSON for every error the router itself produces.

use axum::body::Body;
use axum::http::{HeaderValue, Request, StatusCode};
use http_body_util::BodyExt;
use kvrouter_core::router::RouterConfig;
use kvrouter_server::{app, AppState, ServeConfig, SessionReleaseAuth};
use serde_json::{json, Value};
use tower::ServiceExt;

mod common;

fn config(admin: Option<&str>) -> ServeConfig {
    ServeConfig {
        admin_token: admin.map(str::to_owned),
        model_names: vec!["mock-model".into()],
        ..ServeConfig::default()
    }
}

async fn call(state: &AppState, req: Request<Body>) -> (StatusCode, Value) {
    let resp = app(state.clone()).oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&bytes).unwrap_or_else(|_| {
        panic!(
            "{status}: the body is not JSON: {:?}",
            String::from_utf8_lossy(&bytes)
        )
    });
    (status, body)
}

fn req(method: &str, path: &str, token: Option<&str>, body: &str) -> Request<Body> {
    let mut b = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json");
    if let Some(t) = token {
        b = b.header("authorization", format!("Bearer {t}"));
    }
    b.body(Body::from(body.to_owned())).unwrap()
}

/// `{"error": {"message", "type", "param", "code"}}` with `code` = the status.
fn assert_openai_error(status: StatusCode, body: &Value) {
    let e = &body["error"];
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert!(e["type"].is_string(), "{body}");
    assert!(e.get("param").is_some(), "{body}");
    assert_eq!(e["code"], status.as_u16(), "{body}");
}

/// `/metrics` as text.
async fn metrics_text(state: &AppState) -> String {
    let resp = app(state.clone())
        .oneshot(req("GET", "/metrics", None, ""))
        .await
        .unwrap();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[tokio::test]
async fn a_registration_given_up_while_it_waits_for_the_models_leaves_nothing_behind() {
    // Found by the soak (bench/soak): the router registered the worker in the routing core and
    // started its KV subscriber and health checks, then waited for its `/v1/models`; a client
    // that gave up meanwhile dropped the registration before the registry listed it, leaving
    // a worker requests were placed on, that no `DELETE` could remove, and a subscriber thread
    // for good.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", silent.local_addr().unwrap());
    let state = AppState::new(config(Some("t"))).unwrap();
    let body = json!({"url": url, "block_size": 64, "max_num_batched_tokens": 8192,
        "kv_capacity_blocks": 1000, "kv_events_endpoint": "tcp://127.0.0.1:1"});
    let post = call(
        &state,
        req("POST", "/admin/workers", Some("t"), &body.to_string()),
    );
    let given_up = tokio::time::timeout(std::time::Duration::from_millis(300), post).await;
    assert!(given_up.is_err(), "still waiting for the worker's models");
    assert_eq!(state.worker_count(), 0);
    let text = metrics_text(&state).await;
    assert!(
        !text.contains("kvrouter_worker_active_requests{"),
        "a worker the registry does not list is routable:\n{text}"
    );
    // The same registration made again, with its models given, is accepted and removable.
    let mut body = body;
    body["models"] = json!(["mock-model"]);
    let (s, b) = call(
        &state,
        req("POST", "/admin/workers", Some("t"), &body.to_string()),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{b}");
    let id = b["id"].as_u64().expect("an id");
    let (s, b) = call(
        &state,
        req("DELETE", &format!("/admin/workers/{id}"), Some("t"), ""),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{b}");
    assert!(!metrics_text(&state)
        .await
        .contains("kvrouter_worker_active_requests{"));
}

/// A router with one mock engine (real sockets on 127.0.0.1:0).
async fn with_worker(admin: Option<&str>) -> common::WithEngines {
    let c = ServeConfig {
        router: RouterConfig {
            router_kv_events: false,
            ..RouterConfig::default()
        },
        ..config(admin)
    };
    common::start(c, 1, 50.0).await
}

#[tokio::test]
async fn an_absurd_dp_size_is_a_400_not_an_abort() {
    let state = AppState::new(config(Some("t"))).unwrap();
    let body = json!({"url": "http://127.0.0.1:1", "dp_size": 4294967295u64, "block_size": 64,
        "max_num_batched_tokens": 8192, "kv_events_endpoint": "tcp://127.0.0.1:1"});
    let (s, b) = call(
        &state,
        req("POST", "/admin/workers", Some("t"), &body.to_string()),
    )
    .await;
    assert_eq!(
        (s, b["error"]["param"].as_str()),
        (StatusCode::BAD_REQUEST, Some("dp_size"))
    );
    assert_eq!(state.worker_count(), 0);
}

#[tokio::test]
async fn every_worker_field_is_checked_and_named() {
    let state = AppState::new(config(Some("t"))).unwrap();
    let base = json!({"url": "http://127.0.0.1:1", "block_size": 64,
        "max_num_batched_tokens": 8192, "kv_events_endpoint": "tcp://127.0.0.1:1"});
    let cases = [
        ("url", json!("garbage://x")),
        ("kv_events_endpoint", json!("garbage://x")),
        ("kv_events_endpoint", json!("http://127.0.0.1:5557")),
        ("replay_endpoint", json!("tcp://127.0.0.1:70000")),
        ("replay_endpoint", json!("tcp://127.0.0.1:5558\0")),
        ("kv_events_endpoint", json!("ipc:///tmp/k\0v")),
        ("profile", json!("")),
        ("block_size", json!(0)),
        ("max_num_batched_tokens", json!(0)),
        ("kv_capacity_blocks", json!(0)),
        ("dp_size", json!(0)),
    ];
    for (field, value) in cases {
        let mut body = base.clone();
        body[field] = value.clone();
        let (s, b) = call(
            &state,
            req("POST", "/admin/workers", Some("t"), &body.to_string()),
        )
        .await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{field} = {value}: {b}");
        assert_eq!(b["error"]["param"], field, "{field} = {value}: {b}");
        assert_openai_error(s, &b);
    }
    assert_eq!(state.worker_count(), 0);
    let (s, _) = call(
        &state,
        req("POST", "/admin/workers", Some("t"), &base.to_string()),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "the valid entry is accepted");
    // Found by probing: a taken id was a 400 with no field, where a taken URL is a 409 naming
    // `url`; both are conflicts now, each naming its field.
    for (body, param) in [
        (json!({"url": "http://127.0.0.1:2", "id": 0}), "id"),
        (json!({"url": "http://127.0.0.1:1/"}), "url"),
    ] {
        let (s, b) = call(
            &state,
            req("POST", "/admin/workers", Some("t"), &body.to_string()),
        )
        .await;
        assert_eq!(s, StatusCode::CONFLICT, "{body}: {b}");
        assert_eq!(b["error"]["param"], param, "{body}: {b}");
    }
    assert_eq!(state.worker_count(), 1);
}

#[tokio::test]
async fn the_admin_token_is_checked_before_the_path_and_body() {
    let state = AppState::new(config(Some("t"))).unwrap();
    for (method, path, body) in [
        ("POST", "/admin/workers/not-a-number/pause", ""),
        ("DELETE", "/admin/workers/18446744073709551616", ""),
        ("POST", "/admin/workers", "{"),
        ("POST", "/admin/workers/1/policy-version", "[]"),
        ("GET", "/admin/no-such-thing", ""),
        ("PATCH", "/admin/workers", ""),
    ] {
        for token in [None, Some("wrong"), Some("t2"), Some("")] {
            let (s, b) = call(&state, req(method, path, token, body)).await;
            assert_eq!(
                s,
                StatusCode::UNAUTHORIZED,
                "{method} {path} {token:?}: {b}"
            );
            assert_openai_error(s, &b);
        }
    }
    // With the token the malformed path is a JSON 400.
    let (s, b) = call(
        &state,
        req("POST", "/admin/workers/abc/pause", Some("t"), ""),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
    assert_openai_error(s, &b);
}

#[tokio::test]
async fn session_release_can_require_the_admin_token() {
    let open = AppState::new(config(Some("t"))).unwrap();
    let (s, b) = call(&open, req("DELETE", "/v1/sessions/abc", None, "")).await;
    assert_eq!((s, b["released"].as_bool()), (StatusCode::OK, Some(false)));
    let guarded = AppState::new(ServeConfig {
        session_release_auth: SessionReleaseAuth::Admin,
        ..config(Some("t"))
    })
    .unwrap();
    for (method, path, body) in [
        ("DELETE", "/v1/sessions/abc", ""),
        ("POST", "/finish_session", r#"{"session_id":"abc"}"#),
        ("POST", "/finish_session", "{"),
    ] {
        let (s, b) = call(&guarded, req(method, path, Some("nope"), body)).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{method} {path}: {b}");
        assert_openai_error(s, &b);
    }
    let (s, _) = call(&guarded, req("DELETE", "/v1/sessions/abc", Some("t"), "")).await;
    assert_eq!(s, StatusCode::OK);
    let (s, _) = call(
        &guarded,
        req(
            "POST",
            "/finish_session",
            Some("t"),
            r#"{"session_id":"abc"}"#,
        ),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
}

fn completion(headers: &[(&'static str, HeaderValue)]) -> Request<Body> {
    let mut r = req(
        "POST",
        "/v1/completions",
        None,
        r#"{"model":"mock-model","prompt":"hello","max_tokens":2}"#,
    );
    for (k, v) in headers {
        r.headers_mut().insert(*k, v.clone());
    }
    r
}

#[tokio::test]
async fn routing_headers_are_strict_and_deadlines_saturate() {
    let server = with_worker(None).await;
    let state = server.state.clone();
    let text = |s: &str| HeaderValue::from_str(s).unwrap();
    let (s, b) = call(&state, completion(&[])).await;
    assert_eq!(s, StatusCode::OK, "{b}");
    for (name, value) in [
        ("x-kvrouter-worker-id", text("abc")),
        ("x-kvrouter-worker-id", text("-1")),
        ("x-worker-instance-id", text("18446744073709551616")),
        ("x-kvrouter-dp-rank", text("4294967296")),
        ("x-kvrouter-deadline-ms", text("18446744073709551616")),
        ("x-kvrouter-deadline-ms", text("soon")),
        ("x-kvrouter-priority", text("10")),
        ("x-kvrouter-group-size", text("0")),
        (
            "x-session-id",
            HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap(),
        ),
    ] {
        let mut headers = vec![(name, value.clone())];
        if name == "x-kvrouter-dp-rank" {
            headers.push(("x-kvrouter-worker-id", text("0")));
        }
        if name == "x-kvrouter-group-size" {
            headers.push(("x-kvrouter-group-id", text("g")));
        }
        let (s, b) = call(&state, completion(&headers)).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{name}: {value:?}: {b}");
        assert_eq!(b["error"]["param"], name, "{name}: {b}");
    }
    // A count past its bound is told the bound (it was "at least 1", which it is).
    for value in ["0", "99999999999"] {
        let headers = [
            ("x-kvrouter-group-id", text("g")),
            ("x-kvrouter-group-size", text(value)),
        ];
        let (s, b) = call(&state, completion(&headers)).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
        let message = b["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("from 1 to 4294967295"), "{value}: {b}");
    }
    server.stop().await;
}

#[tokio::test]
async fn router_errors_are_openai_json() {
    let state = AppState::new(config(Some("t"))).unwrap();
    let (s, b) = call(&state, req("GET", "/no/such/route", None, "")).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_openai_error(s, &b);
    let resp = app(state.clone())
        .oneshot(req("GET", "/v1/completions", None, ""))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert!(resp.headers().contains_key("allow"), "Allow is kept");
    let (s, b) = call(&state, req("GET", "/v1/completions", None, "")).await;
    assert_openai_error(s, &b);
    let big = "x".repeat((64 << 20) + 1);
    let (s, b) = call(&state, req("POST", "/v1/completions", None, &big)).await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
    assert_openai_error(s, &b);
}

#[tokio::test]
async fn a_chat_message_without_content_names_the_field() {
    let server = with_worker(None).await;
    let state = server.state.clone();
    let body = json!({"model": "mock-model", "max_tokens": 2,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user"}]});
    let (s, b) = call(
        &state,
        req("POST", "/v1/chat/completions", None, &body.to_string()),
    )
    .await;
    assert_eq!(
        (s, b["error"]["param"].as_str()),
        (StatusCode::BAD_REQUEST, Some("messages[1].content")),
        "{b}"
    );
    // An assistant turn with tool calls and null content stays valid.
    let body = json!({"model": "mock-model", "max_tokens": 2, "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]});
    let (s, b) = call(
        &state,
        req("POST", "/v1/chat/completions", None, &body.to_string()),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{b}");
    server.stop().await;
}

/// Bodies over 256 KiB are parsed, templated and tokenized on the blocking pool: the same
/// answers and the same errors, in the same order, as a small body's.
#[tokio::test]
async fn a_big_body_is_answered_and_refused_as_a_small_one() {
    let server = with_worker(None).await;
    let state = server.state.clone();
    let text = "lorem ipsum ".repeat(30_000); // 360 KB
    let chat = |model: &str, last: Value| {
        json!({"model": model, "max_tokens": 2,
            "messages": [{"role": "system", "content": text}, last]})
        .to_string()
    };
    let post = |body: String| req("POST", "/v1/chat/completions", None, &body);
    let ok = chat("mock-model", json!({"role": "user", "content": "hi"}));
    assert!(ok.len() > 256 << 10);
    let (s, b) = call(&state, post(ok)).await;
    assert_eq!(s, StatusCode::OK, "{b}");
    assert!(
        b["usage"]["prompt_tokens"].as_u64().unwrap() > 30_000,
        "{b}"
    );
    // The message's own error, then the model's before it.
    let (s, b) = call(&state, post(chat("mock-model", json!({"role": "user"})))).await;
    assert_eq!(
        (s, b["error"]["param"].as_str()),
        (StatusCode::BAD_REQUEST, Some("messages[1].content")),
        "{b}"
    );
    let (s, b) = call(&state, post(chat("no-such-model", json!({"role": "user"})))).await;
    assert_eq!(b["error"]["param"], "model", "{s} {b}");
    // Not JSON, and JSON that is not an object.
    let (s, b) = call(&state, post(format!("{{\"x\": \"{text}"))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
    assert!(b["error"]["message"]
        .as_str()
        .unwrap()
        .contains("not valid JSON"));
    let (s, b) = call(&state, post(json!([text]).to_string())).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
    assert!(b["error"]["message"]
        .as_str()
        .unwrap()
        .contains("JSON object"));
    server.stop().await;
}

#[tokio::test]
async fn the_mock_engine_answers_unknown_routes_and_methods_in_json() {
    let server = with_worker(None).await;
    let engine = format!("http://{}", server.engines[0].endpoints.http);
    let client = reqwest::Client::new();
    for (method, path, status) in [
        (reqwest::Method::GET, "/no/such/route", 404),
        (reqwest::Method::GET, "/v1/completions", 405),
    ] {
        let r = client
            .request(method, format!("{engine}{path}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), status);
        let body: Value = r.json().await.expect("a JSON body");
        assert_eq!(body["error"]["code"], status, "{body}");
    }
    server.stop().await;
}

/// `kvrouter_router_queue_pending_requests` from `/metrics`.
async fn pending(state: &AppState) -> u64 {
    let resp = app(state.clone())
        .oneshot(req("GET", "/metrics", None, ""))
        .await
        .unwrap();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8_lossy(&bytes)
        .lines()
        .find_map(|l| l.strip_prefix("kvrouter_router_queue_pending_requests "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn a_client_that_leaves_while_its_request_is_queued_is_counted_cancelled() {
    // Found by a cancellation audit: until a placement makes the request's load guard, nothing
    // counted it, so clients giving up in the queue showed nowhere.
    let server = with_worker(Some("t")).await;
    let state = server.state.clone();
    let waiting = tokio::spawn({
        let state = state.clone();
        async move {
            let r = completion(&[("x-kvrouter-policy-version", HeaderValue::from_static("5"))]);
            call(&state, r).await
        }
    });
    let until = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while pending(&state).await != 1 {
        assert!(tokio::time::Instant::now() < until, "never queued");
        tokio::task::yield_now().await;
    }
    waiting.abort();
    let _ = waiting.await;
    assert_eq!(pending(&state).await, 0, "taken out of the queue");
    let text = metrics_text(&state).await;
    let cancelled: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("kvrouter_requests_total{status=\"cancelled\""))
        .collect();
    assert_eq!(cancelled.len(), 1, "{text}");
    assert!(cancelled[0].ends_with(" 1"), "{}", cancelled[0]);
    server.stop().await;
}

#[tokio::test]
async fn a_huge_deadline_waits_instead_of_wrapping_into_the_past() {
    // The request waits in the queue for policy version 5, which no worker serves yet; its
    // deadline of u64::MAX ms used to wrap to a moment already past (504 at once).
    let server = with_worker(Some("t")).await;
    let state = server.state.clone();
    let waiting = tokio::spawn({
        let state = state.clone();
        async move {
            let r = completion(&[
                (
                    "x-kvrouter-deadline-ms",
                    HeaderValue::from_static("18446744073709551615"),
                ),
                ("x-kvrouter-policy-version", HeaderValue::from_static("5")),
            ]);
            call(&state, r).await
        }
    });
    let until = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while pending(&state).await != 1 {
        assert!(
            !waiting.is_finished(),
            "it was answered instead of waiting: {:?}",
            waiting.await.unwrap()
        );
        assert!(tokio::time::Instant::now() < until, "never queued");
        tokio::task::yield_now().await;
    }
    let (s, b) = call(
        &state,
        req(
            "POST",
            "/admin/workers/0/policy-version",
            Some("t"),
            r#"{"version":5}"#,
        ),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{b}");
    let (s, b) = tokio::time::timeout(std::time::Duration::from_secs(30), waiting)
        .await
        .expect("placed once version 5 is served")
        .unwrap();
    assert_eq!(s, StatusCode::OK, "{b}");
    server.stop().await;
}

#[tokio::test]
async fn a_zero_deadline_unknown_pins_and_repeated_routing_headers_are_400s_naming_the_header() {
    let server = with_worker(None).await;
    let state = server.state.clone();
    let text = |s: &'static str| HeaderValue::from_static(s);
    let single: [(&str, &[(&'static str, HeaderValue)]); 7] = [
        (
            "x-kvrouter-deadline-ms",
            &[("x-kvrouter-deadline-ms", text("0"))],
        ),
        // Found by probing: a rank with no worker was ignored, and a version requirement no
        // version meets waited out the queue.
        ("x-kvrouter-dp-rank", &[("x-kvrouter-dp-rank", text("0"))]),
        ("x-dynamo-dp-rank", &[("x-dynamo-dp-rank", text("0"))]),
        (
            "x-kvrouter-min-policy-version",
            &[
                ("x-kvrouter-policy-version", text("5")),
                ("x-kvrouter-min-policy-version", text("6")),
            ],
        ),
        (
            "x-kvrouter-worker-id",
            &[("x-kvrouter-worker-id", text("77"))],
        ),
        (
            "x-worker-instance-id",
            &[("x-worker-instance-id", text("77"))],
        ),
        (
            "x-kvrouter-dp-rank",
            &[
                ("x-kvrouter-worker-id", text("0")),
                ("x-kvrouter-dp-rank", text("3")),
            ],
        ),
    ];
    for (param, headers) in single {
        let (s, b) = call(&state, completion(headers)).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{param}: {b}");
        assert_eq!(b["error"]["param"], param, "{b}");
        assert_openai_error(s, &b);
    }
    // A lone rank is told the worker header of its own family.
    let (_, b) = call(&state, completion(&[("x-dynamo-dp-rank", text("0"))])).await;
    let message = b["error"]["message"].as_str().unwrap();
    assert!(message.contains("x-dynamo-worker-instance-id"), "{message}");
    for (name, a, b) in [
        ("x-kvrouter-worker-id", "0", "0"),
        ("x-kvrouter-deadline-ms", "100", "5000"),
        ("x-kvrouter-priority", "1", "2"),
        ("x-session-id", "a", "b"),
        ("x-kvrouter-policy-version", "0", "1"),
    ] {
        let mut r = completion(&[]);
        r.headers_mut().append(name, text(a));
        r.headers_mut().append(name, text(b));
        let (s, body) = call(&state, r).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{name}: {body}");
        assert_eq!(body["error"]["param"], name, "{body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("more than once"),
            "{body}"
        );
    }
    let (s, b) = call(
        &state,
        completion(&[
            ("x-kvrouter-worker-id", text("0")),
            ("x-kvrouter-dp-rank", text("0")),
        ]),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "a known pin is served: {b}");
    server.stop().await;
}

#[tokio::test]
async fn the_bearer_scheme_is_case_insensitive() {
    let state = AppState::new(config(Some("t"))).unwrap();
    for scheme in ["Bearer", "bearer", "BEARER"] {
        let mut r = req("GET", "/admin/workers", None, "");
        r.headers_mut().insert(
            "authorization",
            HeaderValue::from_str(&format!("{scheme} t")).unwrap(),
        );
        let (s, b) = call(&state, r).await;
        assert_eq!(s, StatusCode::OK, "{scheme}: {b}");
    }
    let mut r = req("GET", "/admin/workers", None, "");
    r.headers_mut()
        .insert("authorization", HeaderValue::from_static("Basic t"));
    assert_eq!(call(&state, r).await.0, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn a_long_uri_is_an_openai_414_on_a_real_socket() {
    let server = with_worker(None).await;
    let long = format!("/v1/models?{}", "q".repeat(9 * 1024));
    let (s, b) = call(&server.state, req("GET", &long, None, "")).await;
    assert_eq!(s, StatusCode::URI_TOO_LONG, "{b}");
    assert_openai_error(s, &b);
    // Over the socket: the router's 414 comes before hyper's own, wordless one.
    for n in [9 * 1024, 60 * 1024] {
        let url = format!("http://{}/v1/models?{}", server.addr, "q".repeat(n));
        let r = reqwest::get(url).await.unwrap();
        assert_eq!(r.status().as_u16(), 414, "{n}");
        let body: Value = r.json().await.expect("a JSON body");
        assert_eq!(body["error"]["code"], 414, "{body}");
    }
    // Under the limit it is served.
    let ok = format!("/v1/models?{}", "q".repeat(4 * 1024));
    assert_eq!(
        call(&server.state, req("GET", &ok, None, "")).await.0,
        StatusCode::OK
    );
    server.stop().await;
}

/// Found by probing: `content-encoding` was ignored (a gzip body was "not valid JSON", a plain
/// one marked `br` was served). A coded body is a 415 naming the coding; `identity` is plain.
#[tokio::test]
async fn a_compressed_body_is_a_415_naming_its_coding() {
    let server = with_worker(None).await;
    let body = r#"{"model":"mock-model","prompt":"hi","max_tokens":1}"#;
    for (codings, want) in [
        (&["gzip"][..], StatusCode::UNSUPPORTED_MEDIA_TYPE),
        (&["br"], StatusCode::UNSUPPORTED_MEDIA_TYPE),
        (&["Identity"], StatusCode::OK),
        (&["identity, identity"], StatusCode::OK),
        // Every header counts, not only the first.
        (&["identity", "gzip"], StatusCode::UNSUPPORTED_MEDIA_TYPE),
    ] {
        let mut r = req("POST", "/v1/completions", None, body);
        for c in codings {
            r.headers_mut()
                .append("content-encoding", HeaderValue::from_static(c));
        }
        let (s, b) = call(&server.state, r).await;
        assert_eq!(s, want, "{codings:?}: {b}");
        if s != StatusCode::OK {
            assert_openai_error(s, &b);
            assert_eq!(b["error"]["param"], "content-encoding", "{b}");
            let last = codings[codings.len() - 1];
            assert!(
                b["error"]["message"].as_str().unwrap().contains(last),
                "{b}"
            );
        }
    }
    // Only where a body is read.
    let mut r = req("GET", "/v1/models", None, "");
    r.headers_mut()
        .insert("content-encoding", HeaderValue::from_static("gzip"));
    assert_eq!(call(&server.state, r).await.0, StatusCode::OK);
    server.stop().await;
}

#[tokio::test]
async fn admin_body_type_errors_name_the_field_and_paths_are_whole() {
    let state = AppState::new(config(Some("t"))).unwrap();
    for (path, body, param) in [
        (
            "/admin/workers",
            r#"{"url":"http://127.0.0.1:1","dp_size":4294967296}"#,
            "dp_size",
        ),
        (
            "/admin/workers",
            r#"{"url":"http://127.0.0.1:1","policy_version":-1}"#,
            "policy_version",
        ),
        (
            "/admin/workers",
            r#"{"url":"http://127.0.0.1:1","labels":{"a":1}}"#,
            "labels.a",
        ),
        ("/admin/policy/update", r#"{"version":-1}"#, "version"),
    ] {
        let (s, b) = call(&state, req("POST", path, Some("t"), body)).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body}: {b}");
        assert_eq!(b["error"]["param"], param, "{body}: {b}");
    }
    let (s, b) = call(
        &state,
        req("POST", "/finish_session", None, r#"{"session_id":5}"#),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(b["error"]["param"], "session_id");
    assert!(
        b["error"]["message"]
            .as_str()
            .unwrap()
            .contains("must be a string"),
        "{b}"
    );
    let (s, b) = call(&state, req("GET", "/admin/nonexistent", Some("t"), "")).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(
        b["error"]["message"]
            .as_str()
            .unwrap()
            .contains("/admin/nonexistent"),
        "{b}"
    );
    let (s, b) = call(&state, req("PATCH", "/admin/workers", Some("t"), "")).await;
    assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED);
    assert!(
        b["error"]["message"]
            .as_str()
            .unwrap()
            .contains("/admin/workers"),
        "{b}"
    );
}

#[tokio::test]
async fn a_url_registered_twice_is_a_409_and_huge_ids_are_404s() {
    let server = with_worker(Some("t")).await;
    let state = server.state.clone();
    let url = format!("http://{}", server.engines[0].endpoints.http);
    for dup in [url.clone(), format!("{url}/")] {
        let body = json!({"url": dup}).to_string();
        let (s, b) = call(&state, req("POST", "/admin/workers", Some("t"), &body)).await;
        assert_eq!(s, StatusCode::CONFLICT, "{b}");
        assert_eq!(b["error"]["param"], "url", "{b}");
        assert_openai_error(s, &b);
    }
    assert_eq!(state.worker_count(), 1);
    let max = u64::MAX;
    for (method, path) in [
        ("DELETE", format!("/admin/workers/{max}")),
        ("POST", format!("/admin/workers/{max}/pause")),
        ("POST", format!("/admin/workers/{max}/resume")),
    ] {
        let (s, b) = call(&state, req(method, &path, Some("t"), "")).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{method} {path}: {b}");
        assert!(
            b["error"]["message"]
                .as_str()
                .unwrap()
                .contains(&max.to_string()),
            "{b}"
        );
    }
    server.stop().await;
}

#[tokio::test]
async fn explicit_kv_events_endpoints_are_not_completed_from_server_info() {
    // The engine advertises both endpoints; a registration that names only the events endpoint
    // gets no replay endpoint from /server_info (explicit endpoints win as a set).
    let c = ServeConfig {
        router: RouterConfig {
            router_kv_events: true,
            ..RouterConfig::default()
        },
        ..config(Some("t"))
    };
    let server = common::start(c, 1, 50.0).await;
    let state = server.state.clone();
    let e = &server.engines[0].endpoints;
    let (url, events) = (format!("http://{}", e.http), e.kv_events.clone().unwrap());
    assert!(e.replay.is_some(), "the engine has a replay endpoint");
    let (s, b) = call(&state, req("DELETE", "/admin/workers/0", Some("t"), "")).await;
    assert_eq!(s, StatusCode::OK, "{b}");
    let body = json!({"url": url, "kv_events_endpoint": events}).to_string();
    let (s, b) = call(&state, req("POST", "/admin/workers", Some("t"), &body)).await;
    assert_eq!(s, StatusCode::CREATED, "{b}");
    let (_, list) = call(&state, req("GET", "/admin/workers", Some("t"), "")).await;
    let w = &list["workers"][0];
    assert_eq!(w["kv_events_endpoint"], json!(events), "{list}");
    assert_eq!(w["replay_endpoint"], Value::Null, "{list}");
    assert!(w["block_size"].is_u64(), "the rest is discovered: {list}");
    server.stop().await;
}

/// An engine without KV events whose `/server_info` says absurd things (a zero step budget, a
/// KV capacity past any bound) is registered as if it had not said them, as it was before the
/// router read those values from event-less engines; sane ones are taken, in the router's blocks.
#[tokio::test]
async fn an_event_less_engines_absurd_server_info_is_left_out_not_refused() {
    async fn engine(info: Value) -> String {
        let app = axum::Router::new().route(
            "/server_info",
            axum::routing::get(move || {
                let info = info.clone();
                async move { axum::Json(info) }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        format!("http://{addr}")
    }
    let server = common::start(config(Some("t")), 1, 50.0).await;
    let state = server.state.clone();
    let no_events = |batch: u64, blocks: u64, block_size: u64| {
        json!({"max_num_batched_tokens": batch, "num_gpu_blocks": blocks,
               "kv_events": {"publisher": "null", "block_size": block_size}})
    };
    let absurd = engine(no_events(0, u64::MAX, 16)).await;
    let sane = engine(no_events(4096, 1000, 16)).await;
    for url in [&absurd, &sane] {
        let body = json!({"url": url}).to_string();
        let (s, b) = call(&state, req("POST", "/admin/workers", Some("t"), &body)).await;
        assert_eq!(s, StatusCode::CREATED, "{url}: {b}");
    }
    let (_, list) = call(&state, req("GET", "/admin/workers", Some("t"), "")).await;
    let of = |url: &str| {
        list["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["url"] == url)
            .unwrap()
            .clone()
    };
    let (a, s) = (of(&absurd), of(&sane));
    assert_eq!(
        (&a["max_num_batched_tokens"], &a["kv_capacity_blocks"]),
        (&Value::Null, &Value::Null),
        "{list}"
    );
    let router_bs = RouterConfig::default().kv_cache_block_size as u64;
    assert_eq!(s["max_num_batched_tokens"], 4096, "{list}");
    assert_eq!(s["kv_capacity_blocks"], 1000 * 16 / router_bs, "{list}");
    assert_eq!(
        s["block_size"],
        Value::Null,
        "its block size is not the router's to check"
    );
    server.stop().await;
}

/// Found by probing: only the `--api-key` layer's 401 named its scheme; the admin API's did not.
#[tokio::test]
async fn every_401_names_the_bearer_scheme() {
    let state = AppState::new(config(Some("t"))).unwrap();
    let resp = app(state)
        .oneshot(req("GET", "/admin/workers", None, ""))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(resp.headers()["www-authenticate"], "Bearer");
}
