//! Structured logs, the access log and the request id, on a real `kvrouter serve` process.

mod common;

use serde_json::{json, Value};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStderr, Command};
use tokio::time::{timeout, Instant};

/// A router started with ARGS, its address, and its stderr read line by line.
struct Router {
    _child: Child,
    http: String,
    stderr: Lines<BufReader<ChildStderr>>,
}

async fn start(args: &[&str]) -> Router {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args(["serve", "--port", "0", "--mock-workers", "1"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start kvrouter");
    let mut out = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let line = timeout(Duration::from_secs(60), out.next_line())
        .await
        .expect("startup line in time")
        .expect("readable stdout")
        .expect("a startup line");
    let http = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .expect("an http address")
        .to_owned();
    // Keep stdout drained so the router never blocks on it.
    tokio::spawn(async move { while let Ok(Some(_)) = out.next_line().await {} });
    let stderr = BufReader::new(child.stderr.take().expect("stderr")).lines();
    Router {
        _child: child,
        http,
        stderr,
    }
}

impl Router {
    /// Reads stderr (bounded: 10 s, 10,000 lines) until a line matches `want`; every line
    /// read must be a JSON object when `json` is set.
    async fn await_line(&mut self, json: bool, want: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut seen = Vec::new();
        for _ in 0..10_000 {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = match timeout(left, self.stderr.next_line()).await {
                Ok(Ok(Some(line))) => line,
                _ => break,
            };
            let v = match serde_json::from_str::<Value>(&line) {
                Ok(v) if v.is_object() => v,
                _ if json => panic!("a log line is not a JSON object: {line}"),
                _ => Value::String(line.clone()),
            };
            if want(&v) {
                return v;
            }
            seen.push(line);
        }
        panic!("no matching log line; saw {seen:#?}");
    }
}

async fn post(url: &str, request_id: Option<&str>, body: Value) -> reqwest::Response {
    let mut req = reqwest::Client::new().post(url).json(&body);
    if let Some(id) = request_id {
        req = req.header("x-request-id", id);
    }
    timeout(Duration::from_secs(30), req.send())
        .await
        .expect("answer in time")
        .expect("an answer")
}

fn completion() -> Value {
    json!({"model": "mock-model", "prompt": "hello there, router", "max_tokens": 4})
}

fn is_access(v: &Value, id: &str) -> bool {
    v["target"] == "kvrouter::access" && v["request_id"] == id
}

#[tokio::test]
async fn json_logs_carry_one_access_line_per_request_and_the_request_id_reaches_the_engine() {
    let mut r = start(&[
        "--log-format",
        "json",
        "--access-log",
        "--log-level",
        "info,kvrouter_mock_engine=debug",
    ])
    .await;
    let url = format!("{}/v1/completions", r.http);
    let resp = post(&url, Some("trace-abc.123"), completion()).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-request-id"], "trace-abc.123");
    let _ = resp.bytes().await;
    // The engine saw the same id (the mock engine logs it at debug).
    let engine = r
        .await_line(true, |v| {
            v["target"] == "kvrouter_mock_engine::request" && v["request_id"] == "trace-abc.123"
        })
        .await;
    assert_eq!(engine["status"], 200);
    let line = r.await_line(true, |v| is_access(v, "trace-abc.123")).await;
    assert_eq!(line["level"], "INFO");
    assert_eq!(line["model"], "mock-model");
    assert_eq!(line["worker"], 0);
    assert_eq!(line["status"], "ok");
    assert_eq!(line["http_status"], 200);
    assert_eq!(line["completion_tokens"], 4);
    assert!(line["prompt_tokens"].as_u64().unwrap() > 0, "{line}");
    for ms in ["ttft_ms", "duration_ms", "queue_ms"] {
        assert!(line[ms].as_f64().is_some_and(|t| t >= 0.0), "{ms}: {line}");
    }
    assert!(line["ts_ms"].as_u64().is_some(), "{line}");

    // A stream that asks for no usage block has its tokens counted on the line (it said 0):
    // its events but `[DONE]`, so an engine that ends with a finish event apart (this mock,
    // OpenAI) counts one more.
    let mut streamed = completion();
    streamed["stream"] = json!(true);
    let resp = post(&url, Some("streamed-1"), streamed).await;
    let _ = resp.bytes().await;
    let line = r.await_line(true, |v| is_access(v, "streamed-1")).await;
    let counted = line["completion_tokens"].as_u64().unwrap();
    assert!((4..=5).contains(&counted), "{line}");

    // Without an id the router makes one, returns it, and logs it.
    let resp = post(&url, None, completion()).await;
    let made = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
    assert!(made.starts_with("kvr-"), "{made}");
    let _ = resp.bytes().await;
    r.await_line(true, |v| is_access(v, &made)).await;

    // A router-made error has its line too (once), with the client's id.
    let resp = post(
        &url,
        Some("bad-model-1"),
        json!({"model": "nope", "prompt": "x"}),
    )
    .await;
    assert_eq!(resp.status(), 404);
    assert_eq!(resp.headers()["x-request-id"], "bad-model-1");
    let line = r.await_line(true, |v| is_access(v, "bad-model-1")).await;
    assert_eq!(line["http_status"], 404);
    assert_eq!(line["status"], "client_error");
}

#[tokio::test]
async fn an_invalid_request_id_is_a_400_naming_the_header() {
    let r = start(&[]).await;
    let url = format!("{}/v1/completions", r.http);
    let long = "x".repeat(129);
    for bad in [long.as_str(), "has space"] {
        let resp = post(&url, Some(bad), completion()).await;
        assert_eq!(resp.status(), 400, "{bad}");
        let made = resp.headers()["x-request-id"].to_str().unwrap().to_owned();
        assert!(made.starts_with("kvr-"), "{made}");
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["error"]["param"], "x-request-id", "{body}");
    }
    let ok = "y".repeat(128);
    let resp = post(&url, Some(&ok), completion()).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-request-id"], ok.as_str());
}

#[tokio::test]
async fn the_access_log_is_off_by_default_and_sampled_when_asked() {
    // Off: no access line, but the requests are answered and the later warning still shows.
    let mut r = start(&["--log-format", "json"]).await;
    let url = format!("{}/v1/completions", r.http);
    for i in 0..3 {
        let resp = post(&url, Some(&format!("off-{i}")), completion()).await;
        assert_eq!(resp.status(), 200);
        let _ = resp.bytes().await;
    }
    // A line that comes after the requests' ends: a refused request logs nothing either.
    let resp = post(&url, Some("probe"), json!({"model": "nope", "prompt": "x"})).await;
    assert_eq!(resp.status(), 404);
    drop(r._child);
    let deadline = Instant::now() + Duration::from_secs(10);
    while let Ok(Ok(Some(line))) = timeout(
        deadline.saturating_duration_since(Instant::now()),
        r.stderr.next_line(),
    )
    .await
    {
        let v: Value = serde_json::from_str(&line).expect("a JSON line");
        assert_ne!(v["target"], "kvrouter::access", "{line}");
    }

    // A sample of 0.5 logs every second request.
    let mut r = start(&[
        "--log-format",
        "json",
        "--access-log",
        "--access-log-sample",
        "0.5",
    ])
    .await;
    let url = format!("{}/v1/completions", r.http);
    for i in 0..4 {
        let resp = post(&url, Some(&format!("s-{i}")), completion()).await;
        let _ = resp.bytes().await;
    }
    let first = r
        .await_line(true, |v| v["target"] == "kvrouter::access")
        .await;
    assert_eq!(first["request_id"], "s-1", "{first}");
    let second = r
        .await_line(true, |v| v["target"] == "kvrouter::access")
        .await;
    assert_eq!(second["request_id"], "s-3", "{second}");
}

#[tokio::test]
async fn bad_log_flags_are_refused_naming_the_flag() {
    for (args, flag) in [
        (vec!["--log-level", "info,=bogus[["], "--log-level"),
        // A mistyped level (a bare word is a target, all else off) silenced every line.
        (vec!["--log-level", "warnn"], "--log-level"),
        (vec!["--log-level", "info,kvrouter"], "--log-level"),
        (vec!["--access-log-sample", "1.5"], "--access-log-sample"),
        (vec!["--log-format", "xml"], "--log-format"),
    ] {
        let out = timeout(
            Duration::from_secs(60),
            Command::new(env!("CARGO_BIN_EXE_kvrouter"))
                .args(["serve", "--port", "0", "--mock-workers", "1"])
                .args(&args)
                .output(),
        )
        .await
        .expect("exits in time")
        .expect("runs");
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag), "{args:?}: {err}");
    }
}

#[tokio::test]
async fn text_logs_stay_the_default() {
    let mut r = start(&["--access-log"]).await;
    let url = format!("{}/v1/completions", r.http);
    let resp = post(&url, Some("text-1"), completion()).await;
    let _ = resp.bytes().await;
    let line = r
        .await_line(false, |v| {
            v.as_str()
                .is_some_and(|l| l.contains("kvrouter::access") && l.contains("text-1"))
        })
        .await;
    assert!(line.as_str().unwrap().contains("INFO"), "{line}");
}

async fn scrape(base: &str) -> String {
    timeout(Duration::from_secs(30), common::metrics(base))
        .await
        .expect("metrics in time")
}

#[tokio::test]
async fn metrics_carry_the_model_label_and_the_prefix_renames_every_name() {
    let r = start(&[]).await;
    let url = format!("{}/v1/completions", r.http);
    let resp = post(&url, None, completion()).await;
    let _ = resp.bytes().await;
    let text = scrape(&r.http).await;
    for want in [
        "kvrouter_requests_total{status=\"ok\",mode=\"cost\",model=\"mock-model\"} 1\n",
        "kvrouter_time_to_first_token_seconds_count{model=\"mock-model\"} 1\n",
        "kvrouter_request_duration_seconds_count{model=\"mock-model\"} 1\n",
        "# TYPE kvrouter_inter_token_latency_seconds histogram\n",
        // The served hit rate's two sums come from the same answers.
        "kvrouter_cached_tokens_count 1\n",
        "kvrouter_usage_prompt_tokens_count 1\n",
        "kvrouter_weight_update_running 0\n",
        "kvrouter_weight_update_workers{phase=\"done\"} 0\n",
    ] {
        assert!(text.contains(want), "{want} missing from\n{text}");
    }

    let r = start(&["--metrics-prefix", "llm_router_"]).await;
    let resp = post(&format!("{}/v1/completions", r.http), None, completion()).await;
    let _ = resp.bytes().await;
    let renamed = scrape(&r.http).await;
    assert!(!renamed.contains("kvrouter_"), "{renamed}");
    // The same lines, names renamed (values aside).
    let names = |t: &str, p: &str| -> Vec<String> {
        t.lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .map(|l| l.strip_prefix(p).expect("prefixed").to_owned())
            .collect()
    };
    assert_eq!(names(&text, "kvrouter_"), names(&renamed, "llm_router_"));
    assert!(renamed.contains(
        "llm_router_requests_total{status=\"ok\",mode=\"cost\",model=\"mock-model\"} 1\n"
    ));

    let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args([
            "serve",
            "--port",
            "0",
            "--mock-workers",
            "1",
            "--metrics-prefix",
            "9bad-",
        ])
        .output()
        .await
        .expect("runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--metrics-prefix"));
}

#[tokio::test]
async fn picks_have_access_lines_like_proxied_requests() {
    let mut r = start(&["--log-format", "json", "--access-log"]).await;
    let resp = post(&format!("{}/v1/pick", r.http), Some("pick-1"), completion()).await;
    assert_eq!(resp.status(), 200);
    let pick: Value = resp.json().await.unwrap();
    let id = pick["id"].as_str().unwrap().to_owned();
    let finish = format!("{}/v1/pick/{id}/finish", r.http);
    let resp = post(&finish, None, json!({"completion_tokens": 3})).await;
    assert_eq!(resp.status(), 200);
    let line = r.await_line(true, |v| is_access(v, "pick-1")).await;
    assert_eq!(line["pick"], "api", "{line}");
    assert_eq!(line["status"], "ok");
    assert_eq!(line["worker"], 0);
    assert_eq!(line["model"], "mock-model");
    assert_eq!(line["completion_tokens"], 3);
    assert!(line["prompt_tokens"].as_u64().unwrap() > 0, "{line}");
    // A pick the router refuses has its line too.
    let resp = post(
        &format!("{}/v1/pick", r.http),
        Some("pick-bad"),
        json!({"model": "nope", "prompt": "x"}),
    )
    .await;
    assert_eq!(resp.status(), 404);
    let line = r.await_line(true, |v| is_access(v, "pick-bad")).await;
    assert_eq!(line["http_status"], 404);
    assert_eq!(line["status"], "client_error");
    assert_eq!(line["pick"], "api");
    // So does one whose body is refused before it is read as a request.
    let resp = post(
        &format!("{}/v1/pick", r.http),
        Some("pick-bad-ids"),
        json!({"token_ids": "not ids"}),
    )
    .await;
    assert_eq!(resp.status(), 400);
    let line = r.await_line(true, |v| is_access(v, "pick-bad-ids")).await;
    assert_eq!(line["http_status"], 400);
    assert_eq!(line["pick"], "api");
}
