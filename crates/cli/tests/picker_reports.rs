//! Pick reports in bulk, end to end over real sockets: a finish or first-token report riding on
//! the caller's next pick (`reports` in `POST /v1/pick`, applied before that pick is placed),
//! and a batch of reports (`POST /v1/pick/reports`). Each report answers its own outcome; an
//! unknown, finished or malformed one never fails the pick or the batch.

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
    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let req = self.client.post(format!("{}{path}", self.base)).json(&body);
        let r = tokio::time::timeout(Duration::from_secs(30), req.send())
            .await
            .expect("answered in time")
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    async fn pick(&self, body: Value) -> Value {
        let (status, v) = self.post("/v1/pick", body).await;
        assert_eq!(status, 200, "{v}");
        v
    }

    async fn metric(&self, prefix: &str) -> f64 {
        common::metric(&self.base, prefix).await.unwrap_or(0.0)
    }
}

/// A 552-token prompt: a 512-token prefix of family `prefix`, then its own tail.
fn ids(prefix: u64, tail: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..512).map(|i| 10_000 * (prefix + 1) + i).collect();
    v.extend((0..40).map(|i| 900_000 + tail * 100 + i));
    v
}

const FINISHED: &str = "kvrouter_picks_total{source=\"api\",end=\"finished\"}";

#[tokio::test]
async fn a_report_piggy_backed_on_the_next_pick_is_applied_and_answered() {
    let s = serve("2", &[]).await;
    let a = s.pick(json!({"token_ids": ids(0, 0)})).await;
    assert!(
        a.get("reports").is_none(),
        "no reports sent, none answered: {a}"
    );
    // The first token of `a` rides on `b`, then its finish (with its usage) on `c`.
    let first = json!([{"id": a["id"], "event": "first_token"}]);
    let b = s
        .pick(json!({"token_ids": ids(1, 0), "reports": first}))
        .await;
    assert_eq!(
        b["reports"],
        json!([{"id": a["id"], "status": "generating"}])
    );
    assert_eq!(s.metric("kvrouter_picks_outstanding").await, 2.0);
    let done =
        json!([{"id": a["id"], "event": "finish", "completion_tokens": 5, "prompt_tokens": 552}]);
    let c = s
        .pick(json!({"token_ids": ids(2, 0), "reports": done}))
        .await;
    assert_eq!(c["reports"], json!([{"id": a["id"], "status": "released"}]));
    assert_eq!(
        c["prompt_tokens"], 552,
        "the reports are no part of the prompt: {c}"
    );
    // `a` is released (as finished, with its output), `b` and `c` are outstanding.
    assert_eq!(s.metric("kvrouter_picks_outstanding").await, 2.0);
    assert_eq!(s.metric("kvrouter_worker_active_requests{").await, 2.0);
    assert_eq!(s.metric(FINISHED).await, 1.0);
    assert_eq!(s.metric("kvrouter_output_sequence_tokens_sum").await, 5.0);
    // An id is the answer's string: its number alone names no pick (ids are tagged by the
    // router that made them); `cancelled` releases without a finish.
    let text = b["id"].as_str().unwrap();
    let n: u64 = text.split_once('-').unwrap().1.parse().unwrap();
    let cancel = json!([
        {"id": n, "event": "finish", "status": "cancelled"},
        {"id": text, "event": "finish", "status": "cancelled"},
    ]);
    let d = s
        .pick(json!({"token_ids": ids(3, 0), "reports": cancel}))
        .await;
    assert_eq!(d["reports"][0]["error"]["code"], 404, "{d}");
    assert_eq!(d["reports"][1]["status"], "released", "{d}");
    assert_eq!(s.metric("kvrouter_picks_outstanding").await, 2.0);
    assert_eq!(s.metric(FINISHED).await, 1.0);
}

/// Two routers (replicas behind one balancer, or one router restarted) number their picks
/// alike: a report that reaches the router that did not make the pick is a 404 saying so, and
/// releases nothing there (it had released that router's own pick of the same number).
#[tokio::test]
async fn a_report_to_another_router_releases_nothing_there() {
    let (one, two) = (serve("1", &[]).await, serve("1", &[]).await);
    let a = one.pick(json!({"token_ids": ids(0, 0)})).await;
    let b = two.pick(json!({"token_ids": ids(0, 0)})).await;
    let (ida, idb) = (a["id"].as_str().unwrap(), b["id"].as_str().unwrap());
    assert_eq!(
        ida.split_once('-').unwrap().1,
        idb.split_once('-').unwrap().1,
        "both routers numbered their first pick alike: {ida} {idb}"
    );
    let (status, v) = two.post(&format!("/v1/pick/{ida}/finish"), json!({})).await;
    assert_eq!(status, 404, "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("not made by this router"), "{message}");
    assert_eq!(two.metric("kvrouter_picks_outstanding").await, 1.0);
    let (status, v) = two.post(&format!("/v1/pick/{idb}/finish"), json!({})).await;
    assert_eq!(
        (status, v["status"].as_str()),
        (200, Some("released")),
        "{v}"
    );
    assert_eq!(one.metric("kvrouter_picks_outstanding").await, 1.0);
}

#[tokio::test]
async fn piggy_backed_reports_are_applied_before_the_pick_is_placed() {
    // One pick may be outstanding: the next fits only once the report released the first.
    let s = serve("1", &["--pick-max-outstanding", "1"]).await;
    let a = s.pick(json!({"token_ids": ids(0, 0)})).await;
    let (status, v) = s.post("/v1/pick", json!({"token_ids": ids(1, 0)})).await;
    assert_eq!(status, 529, "{v}");
    let done = json!([{"id": a["id"], "event": "finish"}]);
    let b = s
        .pick(json!({"token_ids": ids(1, 0), "reports": done}))
        .await;
    assert_eq!(b["reports"][0]["status"], "released", "{b}");
    assert_eq!(s.metric("kvrouter_picks_outstanding").await, 1.0);
}

#[tokio::test]
async fn bad_reports_answer_their_own_errors_and_the_pick_goes_on() {
    let s = serve("1", &[]).await;
    let a = s.pick(json!({"token_ids": ids(0, 0)})).await;
    let reports = json!([
        {"id": "999999", "event": "finish"},
        {"id": "not-a-pick", "event": "finish"},
        {"event": "finish"},
        {"id": a["id"], "event": "done"},
        {"id": a["id"], "event": "finish", "status": "ok", "tokens": 3},
        {"id": a["id"], "event": "finish"},
        {"id": a["id"], "event": "finish"},
        7,
        {"id": [1], "event": "finish"},
        {"id": "9".repeat(5_000), "event": "finish"},
        {"id": a["id"], "event": "x".repeat(5_000)},
        {"id": a["id"], "event": "finish", "k".repeat(5_000): 1},
        // A list is not a report, even one whose items line up with a report's fields.
        [a["id"], "finish", "failed", null, null, null],
    ]);
    let b = s
        .pick(json!({"token_ids": ids(1, 0), "reports": reports}))
        .await;
    let out = b["reports"].as_array().unwrap();
    assert_eq!(out.len(), 13, "{b}");
    assert_eq!(out[12]["error"]["code"].as_u64(), Some(400), "{}", out[12]);
    assert_eq!(out[12]["error"]["param"], "reports[12]", "{}", out[12]);
    assert!(out[12]["error"]["message"]
        .as_str()
        .unwrap()
        .contains("object"));
    let code = |i: usize| out[i]["error"]["code"].as_u64();
    let param = |i: usize| out[i]["error"]["param"].as_str().unwrap_or("").to_owned();
    assert_eq!(
        (code(0), out[0]["id"].clone()),
        (Some(404), json!("999999"))
    );
    assert_eq!(code(1), Some(404), "{}", out[1]);
    // A 404 names the report's id as the field at fault.
    assert_eq!(
        (param(0), param(1)),
        ("reports[0].id".into(), "reports[1].id".into())
    );
    assert_eq!(param(6), "reports[6].id", "{}", out[6]);
    assert_eq!((code(2), param(2)), (Some(400), "reports[2]".into()));
    assert_eq!(out[2]["id"], Value::Null);
    assert_eq!((code(3), param(3)), (Some(400), "reports[3].event".into()));
    assert_eq!(code(4), Some(400), "an unknown field: {}", out[4]);
    assert!(param(4).starts_with("reports[4]"), "{}", out[4]);
    assert_eq!(out[5], json!({"id": a["id"], "status": "released"}));
    let message = out[6]["error"]["message"].as_str().unwrap();
    assert!(message.contains("finished, expired"), "{message}");
    assert_eq!((code(7), param(7)), (Some(400), "reports[7]".into()));
    // An id of the wrong type says what an id is, not serde's words.
    assert_eq!((code(8), param(8)), (Some(400), "reports[8].id".into()));
    let message = out[8]["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("as the pick's answer gives it"),
        "{message}"
    );
    assert!(!message.contains("variant"), "{message}");
    // A huge id comes back cut to its start and its length, in the outcome and the message.
    assert_eq!(code(9), Some(404), "{}", out[9]);
    let echoed = out[9]["id"].as_str().unwrap();
    let message = out[9]["error"]["message"].as_str().unwrap();
    for text in [echoed, message] {
        assert!(text.len() < 200 && text.contains("(5000 bytes)"), "{text}");
    }
    // So do serde's messages quoting a huge event or key.
    for i in [10, 11] {
        assert_eq!(code(i), Some(400), "{}", out[i]);
        let message = out[i]["error"]["message"].as_str().unwrap();
        assert!(
            message.len() < 400 && message.contains(" bytes)"),
            "{message}"
        );
        assert!(
            out[i]["error"]["param"].as_str().unwrap().len() < 100,
            "{}",
            out[i]
        );
    }
    // Only `a` was released: the new pick is the one outstanding.
    assert_eq!(s.metric("kvrouter_picks_outstanding").await, 1.0);
    assert_eq!(s.metric(FINISHED).await, 1.0);
    // `reports` that is no list refuses the pick, naming it.
    let (status, v) = s
        .post(
            "/v1/pick",
            json!({"token_ids": ids(2, 0), "reports": {"id": "1"}}),
        )
        .await;
    assert_eq!(
        (status, v["error"]["param"].clone()),
        (400, json!("reports"))
    );
    assert_eq!(s.metric("kvrouter_picks_outstanding").await, 1.0);
}

#[tokio::test]
async fn a_batch_of_reports_is_applied_in_order() {
    let s = serve("2", &[]).await;
    let a = s.pick(json!({"token_ids": ids(0, 0)})).await;
    let b = s.pick(json!({"token_ids": ids(1, 0)})).await;
    assert_eq!(s.metric("kvrouter_worker_active_requests{").await, 2.0);
    let reports = json!({"reports": [
        {"id": a["id"], "event": "first_token"},
        {"id": a["id"], "event": "finish", "completion_tokens": 4},
        {"id": b["id"], "event": "finish", "status": "failed"},
        {"id": b["id"], "event": "first_token"},
    ]});
    let (status, v) = s.post("/v1/pick/reports", reports).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "kvrouter.pick.reports");
    let out = &v["reports"];
    assert_eq!(out[0], json!({"id": a["id"], "status": "generating"}));
    assert_eq!(out[1], json!({"id": a["id"], "status": "released"}));
    assert_eq!(out[2], json!({"id": b["id"], "status": "released"}));
    assert_eq!(out[3]["error"]["code"], 404, "{v}");
    assert_eq!(s.metric("kvrouter_worker_active_requests{").await, 0.0);
    assert_eq!(s.metric("kvrouter_picks_outstanding").await, 0.0);
    let failed = "kvrouter_picks_total{source=\"api\",end=\"failed\"}";
    assert_eq!(s.metric(failed).await, 1.0);
    // The request behind a pick reported failed is counted as failed, not as cancelled.
    for (status, n) in [("ok", 1.0), ("failed", 1.0), ("cancelled", 0.0)] {
        let key = format!("kvrouter_requests_total{{status=\"{status}\"");
        assert_eq!(s.metric(&key).await, n, "{status}");
    }
    // Only a body that is no `{"reports": [...]}` is the batch's error, naming the field.
    for (body, param) in [
        (json!({}), json!("reports")),
        (json!({"reports": "a"}), json!("reports")),
        (json!({"reports": [], "extra": 1}), json!("extra")),
        (json!([1]), Value::Null),
    ] {
        let (status, v) = s.post("/v1/pick/reports", body.clone()).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
    let (status, v) = s.post("/v1/pick/reports", json!({"reports": []})).await;
    assert_eq!((status, v["reports"].clone()), (200, json!([])));
}

/// Found by probing: reports are bounded in number, state possible token counts and name
/// picks by the exact id handed out; a pick refused after its reports were applied says so;
/// a full pick table answers 529 with `Retry-After`.
#[tokio::test]
async fn reports_are_bounded_checked_and_answered_when_the_pick_is_refused() {
    let s = serve("1", &["--pick-max-outstanding", "2"]).await;
    let a = s.pick(json!({"token_ids": ids(0, 0)})).await;
    let id = a["id"].as_str().unwrap().to_owned();
    let too_many: Vec<Value> = (0..1025)
        .map(|_| json!({"id": "999999", "event": "finish"}))
        .collect();
    let (status, v) = s
        .post("/v1/pick/reports", json!({"reports": too_many}))
        .await;
    assert_eq!(
        (status, v["error"]["param"].clone()),
        (400, json!("reports")),
        "{v}"
    );

    let reports = json!([
        {"id": format!("+{id}"), "event": "first_token"},
        {"id": format!("0{id}"), "event": "first_token"},
        {"id": &id, "event": "finish", "prompt_tokens": 5, "cached_tokens": 9},
        {"id": &id, "event": "finish", "completion_tokens": 18446744073709551615u64},
        // It teaches the cost policy output lengths: no answer is a million tokens long.
        {"id": &id, "event": "finish", "completion_tokens": 4294967295u64},
    ]);
    let (status, v) = s
        .post("/v1/pick/reports", json!({"reports": reports}))
        .await;
    assert_eq!(status, 200, "{v}");
    let out = v["reports"].as_array().unwrap();
    let code = |i: usize| out[i]["error"]["code"].as_u64();
    let param = |i: usize| out[i]["error"]["param"].as_str().unwrap_or("").to_owned();
    assert_eq!((code(0), code(1)), (Some(404), Some(404)), "{v}");
    assert_eq!(
        (code(2), param(2)),
        (Some(400), "reports[2].cached_tokens".into())
    );
    for i in [3, 4] {
        assert_eq!(
            (code(i), param(i)),
            (Some(400), format!("reports[{i}].completion_tokens"))
        );
    }
    assert_eq!(
        s.metric("kvrouter_picks_outstanding").await,
        1.0,
        "nothing released"
    );

    // A pick refused for its own body still applies its reports, and says how they went.
    let done = json!([{"id": &id, "event": "finish", "completion_tokens": 3}]);
    let (status, v) = s
        .post("/v1/pick", json!({"token_ids": [-1], "reports": done}))
        .await;
    assert_eq!(
        (status, v["error"]["param"].clone()),
        (400, json!("token_ids")),
        "{v}"
    );
    assert_eq!(
        v["reports"],
        json!([{"id": &id, "status": "released"}]),
        "{v}"
    );
    assert_eq!(s.metric("kvrouter_picks_outstanding").await, 0.0);

    // `reports: null` is no reports; a full table answers 529 with Retry-After.
    s.pick(json!({"token_ids": ids(1, 0), "reports": null}))
        .await;
    s.pick(json!({"token_ids": ids(2, 0)})).await;
    let r = s
        .client
        .post(format!("{}/v1/pick", s.base))
        .json(&json!({"token_ids": ids(3, 0)}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 529);
    assert!(
        r.headers().get("retry-after").is_some(),
        "{:?}",
        r.headers()
    );
}

/// Found by probing: a finish that gives no `completion_tokens` (the counts are optional, and
/// the Python client leaves them out by default) was learnt as a 0-token answer, pulling the
/// cost policy's learnt output lengths towards 0. Its length is now unknown: not learnt, not
/// in the histogram.
#[tokio::test]
async fn a_finish_without_token_counts_teaches_no_output_length() {
    let s = serve("2", &[]).await;
    let count = "kvrouter_output_sequence_tokens_count";
    let sum = "kvrouter_output_sequence_tokens_sum";
    let unmeasured = s.pick(json!({"token_ids": ids(0, 0)})).await;
    let measured = s.pick(json!({"token_ids": ids(1, 0)})).await;
    let reports = json!({"reports": [
        {"id": unmeasured["id"], "event": "finish"},
        {"id": measured["id"], "event": "finish", "completion_tokens": 7},
    ]});
    let (status, v) = s.post("/v1/pick/reports", reports).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["reports"][0]["status"], "released", "{v}");
    assert_eq!((s.metric(count).await, s.metric(sum).await), (1.0, 7.0));
    assert_eq!(s.metric(FINISHED).await, 2.0);
}
