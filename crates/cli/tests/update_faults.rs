//! Weight updates that go wrong, on loopback with real processes: a failed load leaves its
//! workers paused until a later update succeeds on them (a worker an operator paused stays
//! paused), and an update to a version the weight source lacks is refused before any worker
//! leaves rotation.

mod common;

use serde_json::{json, Value};
use std::time::Duration;

const TOKEN: &str = "u-t0k";
/// How long a poll waits.
const WAIT: Duration = Duration::from_secs(30);

async fn policy(client: &reqwest::Client, base: &str) -> Value {
    client
        .get(format!("{base}/admin/policy"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// `POST /admin/policy/update` with `body`: (status, answer).
async fn update(client: &reqwest::Client, base: &str, body: &Value) -> (u16, Value) {
    let r = client
        .post(format!("{base}/admin/policy/update"))
        .bearer_auth(TOKEN)
        .json(body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

/// Starts an update with `body`, waits for it to end and returns `/admin/policy`.
async fn updated(client: &reqwest::Client, base: &str, body: &Value) -> Value {
    let (status, answer) = update(client, base, body).await;
    assert_eq!(status, 202, "{answer}");
    common::until("the update to finish", WAIT, || async {
        policy(client, base).await["update"]["running"] == false
    })
    .await;
    policy(client, base).await
}

/// Each worker's (policy version, state), by id.
fn workers(policy: &Value) -> Vec<(u64, u64, String)> {
    policy["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["id"].as_u64().unwrap(),
                w["policy_version"].as_u64().unwrap(),
                w["state"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

async fn completion(client: &reqwest::Client, base: &str) -> u16 {
    client
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": "mock-model", "prompt": "after the update", "max_tokens": 2}))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// Workers a failed update paused come back once a later update loads on them; the one an
/// operator paused by hand stays paused (before, all three needed `/resume`).
#[tokio::test]
async fn a_successful_update_resumes_the_workers_a_failed_one_paused() {
    let router = common::spawn(&[
        "serve",
        "--port",
        "0",
        "--mock-workers",
        "3",
        "--admin-token",
        TOKEN,
    ])
    .await;
    let base = router.http();
    let client = reqwest::Client::new();
    let ids: Vec<u64> = workers(&policy(&client, &base).await)
        .iter()
        .map(|w| w.0)
        .collect();
    assert_eq!(ids.len(), 3);
    let by_hand = ids[2];
    let r = client
        .post(format!("{base}/admin/workers/{by_hand}/pause"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // Every engine refuses the load (a directory that does not exist).
    let bad = json!({"version": 1, "load": {"body": {"model_path": "/nonexistent/kvrouter-v1"}}});
    let p = updated(&client, &base, &bad).await;
    for (id, version, state) in workers(&p) {
        assert_eq!((version, state.as_str()), (0, "paused"), "worker {id}: {p}");
        assert_eq!(p["update"]["phases"][id.to_string()], "failed", "{p}");
    }

    let p = updated(&client, &base, &json!({"version": 1})).await;
    assert_eq!(p["update"]["done"], 3, "{p}");
    for (id, version, state) in workers(&p) {
        let want = if id == by_hand { "paused" } else { "serving" };
        assert_eq!((version, state.as_str()), (1, want), "worker {id}: {p}");
    }
    assert_eq!(completion(&client, &base).await, 200);

    // The operator's resume still brings the hand-paused one back.
    let r = client
        .post(format!("{base}/admin/workers/{by_hand}/resume"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let p = policy(&client, &base).await;
    assert!(workers(&p).iter().all(|w| w.2 == "serving"), "{p}");
}

/// An update to a version neither the peer nor the store has is answered 404 naming the
/// version, before any worker leaves rotation; the peer answers 404 (not 502) for it too.
#[tokio::test]
async fn an_update_to_a_version_the_source_lacks_drains_nothing() {
    let tmp = std::env::temp_dir().join(format!("kvrouter-update-faults-{}", std::process::id()));
    let store_dir = tmp.join("store");
    std::fs::create_dir_all(&store_dir).unwrap();
    let store = format!("file://{}", store_dir.display());
    let peer = common::spawn(&[
        "weights",
        "serve",
        "--dir",
        tmp.join("peer-cache").to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--store",
        &store,
        "--threads",
        "1",
    ])
    .await;
    let peer_url = peer.http();
    let client = reqwest::Client::new();
    // The peer: a version beyond its store is not found (not a gateway failure).
    let r = client
        .get(format!("{peer_url}/v1/versions/7/marker"))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let body: Value = r.json().await.unwrap();
    assert_eq!(
        (status, body["error"]["param"].as_str()),
        (404, Some("version")),
        "{body}"
    );
    assert!(
        body["error"]["message"].as_str().unwrap().contains("7"),
        "{body}"
    );

    let router = common::spawn(&[
        "serve",
        "--port",
        "0",
        "--mock-workers",
        "2",
        "--admin-token",
        TOKEN,
    ])
    .await;
    let base = router.http();
    let dir = tmp.join("worker-{worker}").display().to_string();
    for source in [
        json!({"store": store, "dir": dir}),
        json!({"peer": peer_url, "dir": dir}),
        json!({"peer": peer_url, "store": store, "dir": dir}),
    ] {
        let (status, body) = update(&client, &base, &json!({"version": 7, "source": source})).await;
        assert_eq!(
            (status, body["error"]["param"].as_str()),
            (404, Some("version")),
            "{source}: {body}"
        );
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains("version 7"), "{message}");
        // Nothing started: no cycle, every worker serving at its old version.
        let p = policy(&client, &base).await;
        assert!(p["update"].is_null(), "{source}: {p}");
        for (id, version, state) in workers(&p) {
            assert_eq!(
                (version, state.as_str()),
                (0, "serving"),
                "worker {id}: {p}"
            );
        }
    }
    assert_eq!(completion(&client, &base).await, 200);
    let _ = std::fs::remove_dir_all(&tmp);
}
