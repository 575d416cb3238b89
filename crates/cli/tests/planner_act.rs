//! `kvrouter serve --planner-act kubernetes` against a fake Kubernetes API server on loopback
//! (no cluster here): it keeps each workload's replicas, answers GET on the `scale`
//! subresource and applies merge-patches to it, and can be scripted to fail (403, 500). A burst
//! raises the Deployment's replicas within a deadline; a GPU budget caps them with a second
//! pool's StatefulSet holding its share; failed calls are counted and retried; bad flags are
//! named. Polls with bounded deadlines; no fixed sleeps.

mod common;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Json;
use serde_json::{json, Value};
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const NS: &str = "test";
const TOKEN: &str = "act-t0k";

#[derive(Default)]
struct Fake {
    /// Replicas by (kind, name).
    replicas: Mutex<BTreeMap<(String, String), u32>>,
    /// Every PATCH: (kind, name, replicas).
    patches: Mutex<Vec<(String, String, u32)>>,
    gets: Mutex<u64>,
    /// Statuses the next GETs / PATCHes answer instead of succeeding.
    fail_gets: Mutex<VecDeque<u16>>,
    fail_patches: Mutex<VecDeque<u16>>,
    /// PATCH calls received, answered or not.
    patch_calls: Mutex<u64>,
    /// How long each PATCH takes before it is applied and answered.
    patch_delay: Mutex<Option<Duration>>,
}

fn scale(name: &str, n: u32) -> Value {
    json!({
        "apiVersion": "autoscaling/v1", "kind": "Scale",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"replicas": n}, "status": {"replicas": n},
    })
}

fn failure(code: u16) -> Response {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": "scripted failure", "reason": if code == 403 { "Forbidden" } else { "InternalError" },
        "code": code,
    });
    (StatusCode::from_u16(code).unwrap(), Json(body)).into_response()
}

async fn get_scale(
    State(f): State<Arc<Fake>>,
    Path((kind, name)): Path<(String, String)>,
) -> Response {
    *f.gets.lock().unwrap() += 1;
    if let Some(code) = f.fail_gets.lock().unwrap().pop_front() {
        return failure(code);
    }
    match f.replicas.lock().unwrap().get(&(kind, name.clone())) {
        Some(n) => Json(scale(&name, *n)).into_response(),
        None => failure(404),
    }
}

async fn patch_scale(
    State(f): State<Arc<Fake>>,
    Path((kind, name)): Path<(String, String)>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    assert_eq!(
        headers.get("content-type").unwrap(),
        "application/merge-patch+json"
    );
    *f.patch_calls.lock().unwrap() += 1;
    let delay = *f.patch_delay.lock().unwrap();
    if let Some(d) = delay {
        tokio::time::sleep(d).await;
    }
    if let Some(code) = f.fail_patches.lock().unwrap().pop_front() {
        return failure(code);
    }
    let n = u32::try_from(body["spec"]["replicas"].as_u64().expect("spec.replicas")).unwrap();
    assert_eq!(body, json!({"spec": {"replicas": n}}), "only the replicas");
    f.patches
        .lock()
        .unwrap()
        .push((kind.clone(), name.clone(), n));
    f.replicas.lock().unwrap().insert((kind, name.clone()), n);
    Json(scale(&name, n)).into_response()
}

/// A kubeconfig file, removed when dropped (the test's end).
struct Kubeconfig(std::path::PathBuf);

impl std::ops::Deref for Kubeconfig {
    type Target = std::path::Path;

    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for Kubeconfig {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Serves the fake API on a free loopback port; returns a kubeconfig pointing at it.
async fn serve_api(fake: Arc<Fake>) -> Kubeconfig {
    let app = axum::Router::new()
        .route(
            &format!("/apis/apps/v1/namespaces/{NS}/{{kind}}/{{name}}/scale"),
            get(get_scale).patch(patch_scale),
        )
        .with_state(fake);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let path = std::env::temp_dir().join(format!(
        "kvrouter-act-kubeconfig-{}-{}",
        std::process::id(),
        addr.port()
    ));
    let config = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{addr}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\n    namespace: {NS}\ncurrent-context: fake\nusers:\n- name: fake\n  user: {{}}\n"
    );
    std::fs::write(&path, config).unwrap();
    Kubeconfig(path)
}

async fn router(kubeconfig: &std::path::Path, extra: &[&str]) -> common::Proc {
    let mut args = vec![
        "serve",
        "--port",
        "0",
        "--mock-workers",
        "2",
        "--admin-token",
        TOKEN,
        "--planner-act",
        "kubernetes",
        "--planner-tick-s",
        "0.2",
        "--planner-requests-per-worker",
        "4",
        "--planner-up-window-s",
        "1",
        "--planner-down-window-s",
        "60",
    ];
    // No cool-down unless the test sets one.
    if !extra.contains(&"--planner-act-cooldown-s") {
        args.extend(["--planner-act-cooldown-s", "0"]);
    }
    args.extend(extra);
    common::spawn_with_env(&args, &[("KUBECONFIG", kubeconfig.to_str().unwrap())]).await
}

/// Long requests from many clients at once (the planner's demand: requests / 4 per worker).
fn burst(base: &str, n: usize) -> Vec<tokio::task::JoinHandle<()>> {
    (0..n)
        .map(|i| {
            let url = format!("{base}/v1/completions");
            tokio::spawn(async move {
                let body = json!({"model": "mock-model", "prompt": format!("burst {i} {}", "x ".repeat(200)), "max_tokens": 300, "ignore_eos": true});
                let _ = reqwest::Client::new().post(url).json(&body).send().await;
            })
        })
        .collect()
}

fn replicas(f: &Fake, kind: &str, name: &str) -> u32 {
    f.replicas.lock().unwrap()[&(kind.to_owned(), name.to_owned())]
}

/// `GET /admin/planner` (behind the admin token), if it answers JSON.
async fn planner_status(base: &str) -> Option<Value> {
    reqwest::Client::new()
        .get(format!("{base}/admin/planner"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .ok()?
        .json()
        .await
        .ok()
}

fn deployment(name: &str) -> (String, String) {
    ("deployments".to_owned(), name.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_raises_the_deployments_replicas_through_its_scale_subresource() {
    let fake = Arc::new(Fake::default());
    fake.replicas.lock().unwrap().insert(deployment("vllm"), 2);
    let kubeconfig = serve_api(fake.clone()).await;
    let r = router(
        &kubeconfig,
        &["--planner-target", "mock-model=test/deployment/vllm"],
    )
    .await;
    let base = r.http();
    common::until(
        "the planner reading the scale",
        Duration::from_secs(20),
        || async { (*fake.gets.lock().unwrap() >= 3).then_some(()) },
    )
    .await;
    let before = replicas(&fake, "deployments", "vllm");
    let burst_at = Instant::now();
    let tasks = burst(&base, 24);
    let up = common::until(
        "replicas raised by a PATCH",
        Duration::from_secs(10),
        || async {
            let n = replicas(&fake, "deployments", "vllm");
            (n >= 4 && n > before).then_some(n)
        },
    )
    .await;
    eprintln!("replicas {before} -> {up} in {:?}", burst_at.elapsed());
    let actions = common::until("the actions counter", Duration::from_secs(5), || async {
        common::metric(
            &base,
            "kvrouter_planner_actions_total{pool=\"mock-model\",direction=\"up\"}",
        )
        .await
        .filter(|n| *n >= 1.0)
    })
    .await;
    assert!(actions >= 1.0);
    let status = planner_status(&base).await.expect("GET /admin/planner");
    assert_eq!(
        status["actuation"]["targets"][0]["target"], "test/deployment/vllm",
        "{status}"
    );
    // Only changes are patched: never the replicas the workload already had.
    let patches = fake.patches.lock().unwrap().clone();
    let mut last = before;
    for (_, _, n) in &patches {
        assert_ne!(*n, last, "a patch that changes nothing: {patches:?}");
        last = *n;
    }
    for t in tasks {
        t.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_gpu_budget_caps_the_pools_together() {
    let fake = Arc::new(Fake::default());
    fake.replicas.lock().unwrap().insert(deployment("vllm"), 2);
    fake.replicas
        .lock()
        .unwrap()
        .insert(("statefulsets".to_owned(), "other".to_owned()), 1);
    let kubeconfig = serve_api(fake.clone()).await;
    // 8 GPUs at 2 a worker: 4 workers; the other pool holds 1, so mock-model gets at most 3
    // (its burst wants 6).
    let r = router(
        &kubeconfig,
        &[
            "--planner-target",
            "mock-model=test/deployment/vllm",
            "--planner-target",
            "other=test/statefulset/other",
            "--planner-gpu-budget",
            "8",
            "--planner-gpus-per-worker",
            "2",
        ],
    )
    .await;
    let base = r.http();
    let tasks = burst(&base, 24);
    common::until(
        "the deployment at its share",
        Duration::from_secs(15),
        || async { (replicas(&fake, "deployments", "vllm") == 3).then_some(()) },
    )
    .await;
    // The recommendation is over the share (the budget, not the law, held it).
    let rec = common::until(
        "a recommendation over 3",
        Duration::from_secs(10),
        || async {
            common::metric(
                &base,
                "kvrouter_planner_recommended_workers{pool=\"mock-model\"}",
            )
            .await
            .filter(|n| *n > 3.0)
        },
    )
    .await;
    let gets = *fake.gets.lock().unwrap();
    common::until("more ticks", Duration::from_secs(10), || async {
        (*fake.gets.lock().unwrap() >= gets + 6).then_some(())
    })
    .await;
    let patches = fake.patches.lock().unwrap().clone();
    assert!(
        patches
            .iter()
            .all(|(k, _, n)| k == "deployments" && *n <= 3),
        "recommended {rec}: {patches:?}"
    );
    assert_eq!(replicas(&fake, "statefulsets", "other"), 1);
    for t in tasks {
        t.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forbidden_and_failing_api_calls_are_counted_and_retried() {
    let fake = Arc::new(Fake::default());
    fake.replicas.lock().unwrap().insert(deployment("vllm"), 1);
    fake.fail_gets.lock().unwrap().extend([403, 500]);
    fake.fail_patches.lock().unwrap().extend([500, 403]);
    let kubeconfig = serve_api(fake.clone()).await;
    // The min is 3: the planner wants 3 at once.
    let r = router(
        &kubeconfig,
        &[
            "--planner-target",
            "mock-model=test/deployment/vllm",
            "--planner-min-workers",
            "3",
        ],
    )
    .await;
    let base = r.http();
    common::until(
        "the patch after the failures",
        Duration::from_secs(20),
        || async { (replicas(&fake, "deployments", "vllm") == 3).then_some(()) },
    )
    .await;
    for op in ["get", "patch"] {
        let n = common::metric(
            &base,
            &format!("kvrouter_planner_action_failures_total{{pool=\"mock-model\",op=\"{op}\"}}"),
        )
        .await;
        assert_eq!(n, Some(2.0), "{op} failures");
    }
    assert_eq!(
        fake.patches.lock().unwrap().len(),
        1,
        "one successful patch"
    );
    assert_eq!(
        common::metric(
            &base,
            "kvrouter_planner_actions_total{pool=\"mock-model\",direction=\"up\"}"
        )
        .await,
        Some(1.0)
    );
}

/// A patch the API applies after the planner stopped waiting (`--planner-act-timeout-s`):
/// it counts as failed, and it starts the cool-down, so the planner, which still reads the old
/// replicas, does not send it again at every tick.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_patch_answered_too_late_starts_the_cool_down() {
    let fake = Arc::new(Fake::default());
    fake.replicas.lock().unwrap().insert(deployment("vllm"), 1);
    *fake.patch_delay.lock().unwrap() = Some(Duration::from_secs(3));
    let kubeconfig = serve_api(fake.clone()).await;
    let r = router(
        &kubeconfig,
        &[
            "--planner-target",
            "mock-model=test/deployment/vllm",
            "--planner-min-workers",
            "3",
            "--planner-act-timeout-s",
            "0.3",
            "--planner-act-cooldown-s",
            "600",
        ],
    )
    .await;
    let base = r.http();
    // The tick after the timeout reports the cool-down (a tick is 0.2 s, the PATCH's answer
    // 3 s away: before the fix, each tick sent another PATCH).
    common::until(
        "the cool-down after the unanswered patch",
        Duration::from_secs(20),
        || async {
            let status = planner_status(&base).await?;
            let last = status["actuation"]["targets"][0]["last"]
                .as_str()?
                .to_owned();
            last.starts_with("cooling down").then_some(())
        },
    )
    .await;
    assert_eq!(*fake.patch_calls.lock().unwrap(), 1, "one PATCH sent");
    let failures = common::metric(
        &base,
        "kvrouter_planner_action_failures_total{pool=\"mock-model\",op=\"patch\"}",
    )
    .await;
    assert_eq!(failures, Some(1.0), "the unanswered patch counts as failed");
}

async fn serve_fails(args: &[&str]) -> String {
    let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_kvrouter"));
    c.args(["serve", "--port", "0", "--mock-workers", "1"])
        .args(args);
    c.env("RUST_BACKTRACE", "0");
    let out = tokio::time::timeout(Duration::from_secs(60), c.output())
        .await
        .expect("serve exits")
        .unwrap();
    assert!(!out.status.success(), "{args:?} must fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[tokio::test]
async fn bad_actuation_flags_are_named() {
    for (args, flag) in [
        (
            &[
                "--planner-act",
                "kubernetes",
                "--planner-target",
                "pool-without-target",
            ][..],
            "--planner-target",
        ),
        (
            &[
                "--planner-act",
                "kubernetes",
                "--planner-target",
                "p=ns/job/x",
            ][..],
            "--planner-target",
        ),
        (&["--planner-act", "kubernetes"][..], "--planner-target"),
        (
            &[
                "--planner-act",
                "kubernetes",
                "--planner-target",
                "p=ns/deployment/x",
                "--planner-gpu-budget",
                "1",
                "--planner-gpus-per-worker",
                "2",
            ][..],
            "--planner-gpu-budget",
        ),
        (
            &[
                "--planner-act",
                "kubernetes",
                "--planner-target",
                "p=ns/deployment/x",
                "--planner-act-cooldown-s=-1",
            ][..],
            "--planner-act-cooldown-s",
        ),
        // Two pools scaling one Deployment (found by a probe: both were accepted).
        (
            &[
                "--planner-act",
                "kubernetes",
                "--planner-target",
                "p=ns/deployment/x",
                "--planner-target",
                "q=ns/deployment/x",
            ][..],
            "scales that workload already",
        ),
        // A down window shorter than the up window flapped.
        (
            &["--planner-advise", "--planner-down-window-s", "3"][..],
            "--planner-down-window-s",
        ),
        (&["--planner-act", "ssh"][..], "--planner-act"),
        (
            &["--planner-target", "p=ns/deployment/x"][..],
            "--planner-act",
        ),
    ] {
        let err = serve_fails(args).await;
        assert!(err.contains(flag), "{args:?}: {err}");
    }
}
