//! The pick API end to end: `kvrouter serve` over embedded mock engines hands out placements
//! (`POST /v1/pick`); the test sends each request to the chosen engine itself and reports the
//! first token and the finish, as an RL rollout worker holding its own connections does.

mod common;

use serde_json::{json, Value};
use std::time::Duration;

struct Server {
    _proc: common::Proc,
    base: String,
    client: reqwest::Client,
}

async fn serve(workers: &str, extra: &[&str]) -> Server {
    let mut args = vec!["serve", "--port", "0", "--mock-workers", workers];
    args.extend(extra);
    let proc = common::spawn(&args).await;
    Server {
        base: proc.http(),
        _proc: proc,
        client: reqwest::Client::new(),
    }
}

impl Server {
    async fn post(&self, path: &str, headers: &[(&str, &str)], body: Value) -> (u16, Value) {
        let mut req = self.client.post(format!("{}{path}", self.base)).json(&body);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let r = tokio::time::timeout(Duration::from_secs(30), req.send())
            .await
            .expect("answered in time")
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// `POST /v1/pick` with the JSON part `json` and the token ids `ids` after it in binary
    /// (`x-kvrouter-json-length`, or `length` in its place when given).
    async fn post_binary(&self, json: &Value, ids: &[u8], length: Option<&str>) -> (u16, Value) {
        let mut raw = serde_json::to_vec(json).unwrap();
        let n = raw.len().to_string();
        raw.extend_from_slice(ids);
        let r = self
            .client
            .post(format!("{}/v1/pick", self.base))
            .header("x-kvrouter-json-length", length.unwrap_or(&n))
            .body(raw)
            .send();
        let r = tokio::time::timeout(Duration::from_secs(30), r)
            .await
            .expect("answered in time")
            .unwrap();
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    async fn pick(&self, headers: &[(&str, &str)], body: Value) -> Value {
        let (status, v) = self.post("/v1/pick", headers, body).await;
        assert_eq!(status, 200, "{v}");
        v
    }

    async fn report(&self, id: &Value, event: &str, body: Value) -> u16 {
        let path = format!("/v1/pick/{}/{event}", id.as_str().unwrap());
        self.post(&path, &[], body).await.0
    }

    async fn metrics(&self) -> String {
        common::metrics(&self.base).await
    }

    /// The sum of the samples whose line starts with `prefix` (name and labels); 0 when none.
    async fn metric(&self, prefix: &str) -> f64 {
        common::metric(&self.base, prefix).await.unwrap_or(0.0)
    }

    /// Polls `/metrics` until `prefix` sums to `want` (bounded: 15 s).
    async fn await_metric(&self, prefix: &str, want: f64) {
        common::until_metric(&self.base, prefix, want, Duration::from_secs(15)).await
    }
}

/// The sum of the samples of `metrics` whose line starts with `prefix`; 0 when none.
fn sum(metrics: &str, prefix: &str) -> f64 {
    common::metric_in(metrics, prefix).unwrap_or(0.0)
}

fn worker(pick: &Value) -> u64 {
    pick["worker"]["id"].as_u64().unwrap()
}

fn active(worker: u64) -> String {
    format!("kvrouter_worker_active_requests{{worker=\"{worker}\"")
}

/// A prompt of `n` token ids sharing the prefix `prefix` (512 tokens), then `tail`.
fn ids(prefix: u64, tail: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..512).map(|i| 10_000 * (prefix + 1) + i).collect();
    v.extend((0..40).map(|i| 900_000 + tail * 100 + i));
    v
}

/// Sends the request to the picked engine ourselves and reports its lifecycle.
async fn run_on_worker(s: &Server, pick: &Value, prompt: &[u64]) {
    let url = pick["worker"]["url"].as_str().unwrap();
    let body = json!({"model": "mock-model", "prompt": prompt, "max_tokens": 2});
    let r = s
        .client
        .post(format!("{url}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let answer: Value = r.json().await.unwrap();
    assert_eq!(s.report(&pick["id"], "first-token", json!({})).await, 200);
    let usage = &answer["usage"];
    let done = json!({"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"]});
    assert_eq!(s.report(&pick["id"], "finish", done).await, 200);
}

#[tokio::test]
async fn picks_of_the_same_prefix_choose_the_worker_that_cached_it() {
    let s = serve("3", &[]).await;
    for prefix in 0..3 {
        let first = s.pick(&[], json!({"token_ids": ids(prefix, 0)})).await;
        let w = worker(&first);
        run_on_worker(&s, &first, &ids(prefix, 0)).await;
        // The engine's KV events reach the router's index.
        let blocks = format!("kvrouter_worker_cached_blocks{{worker=\"{w}\"");
        let what = format!("worker {w}'s KV events");
        common::until(&what, Duration::from_secs(15), || async {
            s.metric(&blocks).await >= 8.0
        })
        .await;
        for tail in 1..4 {
            let again = s.pick(&[], json!({"token_ids": ids(prefix, tail)})).await;
            assert_eq!(worker(&again), w, "prefix {prefix}, tail {tail}: {again}");
            assert!(again["cached_tokens"].as_u64().unwrap() >= 512, "{again}");
            assert!(!again["decision"]["candidates"]
                .as_array()
                .unwrap()
                .is_empty());
            assert_eq!(s.report(&again["id"], "finish", json!({})).await, 200);
        }
    }
    s.await_metric("kvrouter_picks_outstanding", 0.0).await;
}

/// Little-endian 4-byte words of `ids`.
fn le_bytes(ids: &[u64]) -> Vec<u8> {
    ids.iter().flat_map(|&t| (t as u32).to_le_bytes()).collect()
}

/// Token ids after the JSON part in binary (`x-kvrouter-json-length`) place a pick as the same
/// ids in JSON do; a bad length, a cut id and ids given twice are refused naming the header or
/// the field.
#[tokio::test]
async fn binary_token_ids_pick_as_json_ids_do() {
    let s = serve("3", &[]).await;
    let first = s.pick(&[], json!({"token_ids": ids(7, 0)})).await;
    let w = worker(&first);
    run_on_worker(&s, &first, &ids(7, 0)).await;
    let blocks = format!("kvrouter_worker_cached_blocks{{worker=\"{w}\"");
    common::until(
        "the engine's KV events",
        Duration::from_secs(15),
        || async { s.metric(&blocks).await >= 8.0 },
    )
    .await;
    let (status, binary) = s
        .post_binary(&json!({"max_tokens": 4}), &le_bytes(&ids(7, 1)), None)
        .await;
    assert_eq!(status, 200, "{binary}");
    let json_pick = s
        .pick(&[], json!({"token_ids": ids(7, 2), "max_tokens": 4}))
        .await;
    for p in [&binary, &json_pick] {
        assert_eq!(worker(p), w, "{p}");
        assert_eq!(p["prompt_tokens"], 552, "{p}");
        assert!(p["cached_tokens"].as_u64().unwrap() >= 512, "{p}");
    }
    // Reports ride in the JSON part as in a JSON body.
    let reports = json!({"reports": [{"id": binary["id"], "event": "finish"}]});
    let (status, third) = s.post_binary(&reports, &le_bytes(&ids(7, 3)), None).await;
    assert_eq!(status, 200, "{third}");
    assert_eq!(third["reports"][0]["id"], binary["id"], "{third}");
    assert!(third["reports"][0]["error"].is_null(), "{third}");
    for id in [&json_pick["id"], &third["id"]] {
        assert_eq!(s.report(id, "finish", json!({})).await, 200);
    }
    let good = le_bytes(&ids(7, 4));
    for (json, ids, length, param) in [
        (json!({}), &good[..], Some("x"), "x-kvrouter-json-length"),
        (json!({}), &good[..], Some("+2"), "x-kvrouter-json-length"),
        (
            json!({}),
            &good[..],
            Some("999999"),
            "x-kvrouter-json-length",
        ),
        (
            json!({}),
            &good[..good.len() - 1],
            None,
            "x-kvrouter-json-length",
        ),
        (json!({"token_ids": [1]}), &good[..], None, "token_ids"),
        (json!({"prompt": "hi"}), &good[..], None, "token_ids"),
        (json!({}), &[][..], None, "token_ids"),
        // A length that cuts the JSON short names the header.
        (
            json!({"max_tokens": 4}),
            &good[..],
            Some("3"),
            "x-kvrouter-json-length",
        ),
    ] {
        let (status, v) = s.post_binary(&json, ids, length).await;
        assert_eq!(status, 400, "{json} {length:?}: {v}");
        assert_eq!(v["error"]["param"], param, "{json} {length:?}: {v}");
    }
    // Reports ride also on a pick refused for its binary ids, and are applied.
    let pending = s.pick(&[], json!({"token_ids": ids(7, 5)})).await;
    let both = json!({"token_ids": [1], "reports": [{"id": pending["id"], "event": "finish"}]});
    let (status, v) = s.post_binary(&both, &good, None).await;
    assert_eq!(
        (status, &v["error"]["param"]),
        (400, &json!("token_ids")),
        "{v}"
    );
    assert_eq!(v["reports"][0]["status"], "released", "{v}");
    // The header given twice is refused, naming it.
    let raw = [b"{}".as_slice(), &good].concat();
    let r = s
        .client
        .post(format!("{}/v1/pick", s.base))
        .header("x-kvrouter-json-length", "2")
        .header("x-kvrouter-json-length", "2")
        .body(raw)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["param"], "x-kvrouter-json-length", "{v}");
    s.await_metric("kvrouter_picks_outstanding", 0.0).await;
}

#[tokio::test]
async fn a_finish_releases_the_picks_load() {
    let s = serve("2", &[]).await;
    let body = json!({"model": "mock-model", "messages": [{"role": "user", "content": "hello"}]});
    let p = s.pick(&[], body).await;
    let w = worker(&p);
    assert!(p["worker"]["url"].as_str().unwrap().starts_with("http://"));
    assert_eq!(p["worker"]["dp_rank"], 0);
    assert_eq!(s.metric(&active(w)).await, 1.0);
    assert_eq!(s.metric("kvrouter_picks_outstanding").await, 1.0);
    assert_eq!(s.report(&p["id"], "first-token", json!({})).await, 200);
    let usage = json!({"completion_tokens": 7, "prompt_tokens": 9});
    assert_eq!(s.report(&p["id"], "finish", usage).await, 200);
    assert_eq!(s.metric(&active(w)).await, 0.0);
    assert_eq!(s.metric("kvrouter_picks_outstanding").await, 0.0);
    let m = s.metrics().await;
    assert_eq!(
        sum(&m, "kvrouter_picks_total{source=\"api\",end=\"finished\"}"),
        1.0
    );
    assert_eq!(sum(&m, "kvrouter_output_sequence_tokens_sum"), 7.0);
    // Finished: its id is gone.
    assert_eq!(s.report(&p["id"], "finish", json!({})).await, 404);
    assert_eq!(s.report(&p["id"], "first-token", json!({})).await, 404);
}

#[tokio::test]
async fn an_unconfirmed_pick_expires_and_releases_its_load() {
    let s = serve("1", &["--pick-lease-secs", "0.3"]).await;
    let p = s.pick(&[], json!({"token_ids": ids(0, 0)})).await;
    assert_eq!(p["lease_ms"], 300);
    assert_eq!(s.metric(&active(worker(&p))).await, 1.0);
    s.await_metric(&active(worker(&p)), 0.0).await;
    s.await_metric("kvrouter_picks_outstanding", 0.0).await;
    let m = s.metrics().await;
    assert_eq!(
        sum(&m, "kvrouter_picks_total{source=\"api\",end=\"expired\"}"),
        1.0
    );
    assert_eq!(s.report(&p["id"], "finish", json!({})).await, 404);
    // A confirmed pick outlives the lease (up to --pick-max-duration-secs).
    let q = s.pick(&[], json!({"token_ids": ids(1, 0)})).await;
    assert_eq!(s.report(&q["id"], "first-token", json!({})).await, 200);
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(s.metric("kvrouter_picks_outstanding").await, 1.0);
    assert_eq!(s.report(&q["id"], "finish", json!({})).await, 200);
}

#[tokio::test]
async fn repeated_first_token_reports_do_not_extend_a_pick_past_its_cap() {
    let s = serve(
        "1",
        &[
            "--pick-lease-secs",
            "0.3",
            "--pick-max-duration-secs",
            "0.6",
        ],
    )
    .await;
    let p = s.pick(&[], json!({"token_ids": ids(0, 0)})).await;
    let started = std::time::Instant::now();
    assert_eq!(s.report(&p["id"], "first-token", json!({})).await, 200);
    // A caller that keeps reporting first tokens (for up to 3 s) and never finishes.
    let mut reports = 0;
    while started.elapsed() < Duration::from_secs(3) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if s.report(&p["id"], "first-token", json!({})).await != 200 {
            break;
        }
        reports += 1;
    }
    let ended = started.elapsed();
    assert!(reports >= 2, "{reports} reports");
    // The cap counts from the first report: the pick expired about 0.6 s after it.
    assert!(
        ended < Duration::from_millis(1500),
        "outstanding for {ended:?}"
    );
    s.await_metric("kvrouter_picks_outstanding", 0.0).await;
    let m = s.metrics().await;
    assert_eq!(
        sum(&m, "kvrouter_picks_total{source=\"api\",end=\"expired\"}"),
        1.0
    );
}

#[tokio::test]
async fn picks_wait_in_the_router_queue_and_are_refused_when_it_is_full() {
    let s = serve(
        "1",
        &[
            "--router-queue-threshold",
            "0",
            "--router-queue-max-requests",
            "1",
        ],
    )
    .await;
    let first = s.pick(&[], json!({"token_ids": ids(0, 0)})).await;
    // The worker is busy (prefill tokens above 0): the next pick waits in the queue.
    let queued = {
        let (client, base) = (s.client.clone(), s.base.clone());
        tokio::spawn(async move {
            let r = client
                .post(format!("{base}/v1/pick"))
                .json(&json!({"token_ids": ids(1, 0)}))
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        })
    };
    s.await_metric("kvrouter_router_queue_pending_requests", 1.0)
        .await;
    let (status, body) = s
        .post("/v1/pick", &[], json!({"token_ids": ids(2, 0)}))
        .await;
    assert_eq!(status, 529, "{body}");
    assert_eq!(body["error"]["type"], "overloaded");
    // The first pick's prefill ends: the queued one is placed.
    assert_eq!(s.report(&first["id"], "first-token", json!({})).await, 200);
    let (status, placed) = tokio::time::timeout(Duration::from_secs(15), queued)
        .await
        .expect("placed in time")
        .unwrap();
    assert_eq!(status, 200, "{placed}");
    assert_eq!(s.report(&placed["id"], "finish", json!({})).await, 200);
    assert_eq!(s.report(&first["id"], "finish", json!({})).await, 200);
}

#[tokio::test]
async fn a_session_stays_on_its_worker_through_picks() {
    let s = serve("3", &["--router-session-affinity-ttl-secs", "60"]).await;
    for session in ["alice", "bob", "carol"] {
        let h = [("x-session-id", session)];
        let first = s.pick(&h, json!({"token_ids": ids(0, 0)})).await;
        for turn in 1..4 {
            // Different prompts, and the others' load: the session keeps its worker.
            let next = s.pick(&h, json!({"token_ids": ids(turn + 10, turn)})).await;
            assert_eq!(worker(&next), worker(&first), "{session} turn {turn}");
            assert_eq!(s.report(&next["id"], "finish", json!({})).await, 200);
        }
    }
}

#[tokio::test]
async fn bad_picks_get_errors_naming_the_field() {
    let s = serve("1", &[]).await;
    for (body, param) in [
        (json!({"token_ids": "abc"}), "token_ids"),
        (json!({"token_ids": [1, -2]}), "token_ids"),
        (json!({"token_ids": []}), "token_ids"),
        (json!({"token_ids": [1], "prompt": "x"}), "token_ids"),
        // Found by probing: the prompt was dropped silently.
        (
            json!({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}),
            "messages",
        ),
        (json!({"messages": 3}), "messages"),
        (json!({"prompt": [1], "model": 5}), "model"),
    ] {
        let (status, v) = s.post("/v1/pick", &[], body.clone()).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
    let (status, v) = s
        .post(
            "/v1/pick",
            &[("x-kvrouter-priority", "x")],
            json!({"prompt": [1]}),
        )
        .await;
    assert_eq!(
        (status, &v["error"]["param"]),
        (400, &json!("x-kvrouter-priority"))
    );
    // A field set to null is one left out: not "both prompt and messages".
    let (status, v) = s
        .post("/v1/pick", &[], json!({"prompt": [1], "messages": null}))
        .await;
    assert_eq!(status, 200, "{v}");
    let (status, v) = s.post("/v1/pick/nope/finish", &[], json!({})).await;
    assert_eq!(status, 404, "{v}");
    assert_eq!(
        s.report(&json!("12345"), "first-token", json!({})).await,
        404
    );
    let p = s.pick(&[], json!({"prompt": [1, 2, 3]})).await;
    let path = format!("/v1/pick/{}/finish", p["id"].as_str().unwrap());
    let (status, v) = s
        .post(&path, &[], json!({"completion_tokens": "many"}))
        .await;
    assert_eq!(
        (status, &v["error"]["param"]),
        (400, &json!("completion_tokens")),
        "{v}"
    );
    let (status, v) = s.post(&path, &[], json!({"status": "weird"})).await;
    assert_eq!(
        (status, &v["error"]["param"]),
        (400, &json!("status")),
        "{v}"
    );
    // A list is not a report (serde would read one as the fields in order), and a syntax error
    // names no field.
    let (status, v) = s
        .post(&path, &[], json!(["failed", null, null, null]))
        .await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("object"),
        "{v}"
    );
    let r = s
        .client
        .post(format!("{}{path}", s.base))
        .header("content-type", "application/json")
        .body("{")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["param"].is_null(), "{v}");
    assert_eq!(
        s.report(&p["id"], "finish", json!({"status": "cancelled"}))
            .await,
        200
    );
    let m = s.metrics().await;
    assert_eq!(
        sum(&m, "kvrouter_picks_total{source=\"api\",end=\"cancelled\"}"),
        1.0
    );
}

/// `--pick-auth admin`: picks and every report need the admin token, so a client of the data
/// plane can neither add load nor report a worker failed.
#[tokio::test]
async fn with_pick_auth_admin_picks_and_reports_need_the_admin_token() {
    let s = serve("2", &["--pick-auth", "admin", "--admin-token", "p1ck"]).await;
    let body = json!({"model": "mock-model", "prompt": "hello"});
    let (status, e) = s.post("/v1/pick", &[], body.clone()).await;
    assert_eq!(status, 401, "{e}");
    assert_eq!(s.metric("kvrouter_picks_outstanding").await, 0.0);
    let auth = [("authorization", "Bearer p1ck")];
    let p = s.pick(&auth, body).await;
    let finish = format!("/v1/pick/{}/finish", p["id"].as_str().unwrap());
    let failed = json!({"status": "failed"});
    for path in [finish.as_str(), "/v1/pick/reports"] {
        let (status, e) = s.post(path, &[], failed.clone()).await;
        assert_eq!(status, 401, "{path}: {e}");
    }
    assert_eq!(s.metric("kvrouter_picks_outstanding").await, 1.0);
    assert_eq!(s.post(&finish, &auth, json!({})).await.0, 200);
    assert_eq!(s.metric("kvrouter_picks_outstanding").await, 0.0);
}

#[tokio::test]
async fn bad_pick_flags_are_refused_naming_the_flag() {
    for (flag, value) in [
        ("--pick-lease-secs", "0"),
        // Told the bound it misses (it said "must be ≥ 0").
        ("--pick-lease-secs", "-3"),
        // Past a year: accepted, it made every pick panic adding it to the clock.
        ("--pick-lease-secs", "1e19"),
        ("--pick-max-duration-secs", "1.5e19"),
        ("--ext-proc-pick-timeout-secs", "1e19"),
        ("--pick-max-duration-secs", "-1"),
        ("--pick-max-outstanding", "0"),
        ("--pick-auth", "admin"),
    ] {
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_kvrouter"))
            .args(["serve", "--port", "0", "--mock-workers", "1"])
            .arg(format!("{flag}={value}"))
            .output()
            .await
            .unwrap();
        assert!(!out.status.success(), "{flag} {value}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag), "{err}");
        if value == "-3" {
            assert!(err.contains("> 0"), "{err}");
        }
    }
}

#[tokio::test]
async fn the_table_of_outstanding_picks_is_bounded() {
    let s = serve("1", &["--pick-max-outstanding", "2"]).await;
    let a = s.pick(&[], json!({"token_ids": ids(0, 0)})).await;
    let _b = s.pick(&[], json!({"token_ids": ids(1, 0)})).await;
    let (status, v) = s
        .post("/v1/pick", &[], json!({"token_ids": ids(2, 0)}))
        .await;
    assert_eq!(status, 529, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--pick-max-outstanding"),
        "{v}"
    );
    // The refused pick left no load behind; a finish makes room again.
    assert_eq!(s.metric("kvrouter_worker_active_requests{").await, 2.0);
    assert_eq!(s.report(&a["id"], "finish", json!({})).await, 200);
    s.pick(&[], json!({"token_ids": ids(3, 0)})).await;
}
