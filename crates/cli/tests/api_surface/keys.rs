//! API keys, end to end: `serve --api-key[-file]` guards the data plane, `--worker-api-key`
//! reaches engines started with `--api-key` (`kvrouter mock-engine --api-key`, as vLLM takes
//! it), and a worker refusing the router's key is the router's 502, not the client's 401.

use super::common;
use serde_json::{json, Value};

/// POSTs a completion to `base` with `authorization` (if any): status, `www-authenticate`,
/// body.
async fn complete(base: &str, authorization: Option<&str>) -> (u16, Option<String>, Value) {
    let mut req = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": "mock-model", "prompt": "hello there", "max_tokens": 3}));
    if let Some(a) = authorization {
        req = req.header("authorization", a);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    let challenge = r
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().unwrap().to_owned());
    (status, challenge, r.json().await.unwrap_or(Value::Null))
}

async fn get_status(url: &str, authorization: Option<&str>) -> u16 {
    let mut req = reqwest::Client::new().get(url);
    if let Some(a) = authorization {
        req = req.header("authorization", a);
    }
    req.send().await.unwrap().status().as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn api_keys_guard_the_data_plane_and_the_workers_key_reaches_them() {
    let engine = common::spawn(&[
        "mock-engine",
        "--port",
        "0",
        "--speedup-ratio",
        "50",
        "--api-key",
        "wk",
    ])
    .await;
    let e = engine.http();
    // The engine guards /v1 as vLLM does; its probes stay open.
    assert_eq!(get_status(&format!("{e}/v1/models"), None).await, 401);
    assert_eq!(
        get_status(&format!("{e}/v1/models"), Some("Bearer wk")).await,
        200
    );
    assert_eq!(get_status(&format!("{e}/health"), None).await, 200);
    // Two keys while rotating, one per line.
    let dir = std::env::temp_dir().join(format!("kvrouter-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let keys = dir.join("keys");
    std::fs::write(&keys, "old-key\n\n  new-key  \n").unwrap();
    let keys = keys.to_str().unwrap();
    let router = common::spawn(&[
        "serve",
        "--port",
        "0",
        "--worker",
        &e,
        "--no-router-kv-events",
        "--api-key-file",
        keys,
        "--worker-api-key",
        "wk",
        "--admin-token",
        "adm",
    ])
    .await;
    let r = router.http();
    for given in [
        None,
        Some("Bearer wrong"),
        Some("Basic old-key"),
        Some("Bearer"),
    ] {
        let (status, challenge, body) = complete(&r, given).await;
        assert_eq!(status, 401, "{given:?}: {body}");
        assert_eq!(challenge.as_deref(), Some("Bearer"), "{given:?}");
        assert_eq!(body["error"]["type"], "authentication_error", "{given:?}");
    }
    // Either key (any scheme case), or the admin token: served, through the engine's key.
    for given in ["Bearer old-key", "bearer new-key", "BEARER adm"] {
        let (status, _, body) = complete(&r, Some(given)).await;
        assert_eq!(status, 200, "{given}: {body}");
        assert_eq!(body["usage"]["completion_tokens"], 3, "{given}");
    }
    assert_eq!(get_status(&format!("{r}/v1/models"), None).await, 401);
    assert_eq!(
        get_status(&format!("{r}/v1/models"), Some("Bearer new-key")).await,
        200
    );
    // The pick API is data plane too.
    let pick = reqwest::Client::new()
        .post(format!("{r}/v1/pick"))
        .json(&json!({"model": "mock-model", "prompt": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(pick.status().as_u16(), 401);
    // Probes and metrics stay open.
    for path in ["/health", "/live", "/ready", "/metrics"] {
        assert_eq!(get_status(&format!("{r}{path}"), None).await, 200, "{path}");
    }
    // Without the workers' key the engine refuses the router: the client hears a 502 naming
    // the flag, not a 401 that would blame its own key.
    let keyless = common::spawn(&[
        "serve",
        "--port",
        "0",
        "--worker",
        &e,
        "--no-router-kv-events",
    ])
    .await;
    let (status, _, body) = complete(&keyless.http(), None).await;
    assert_eq!(status, 502, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("--worker-api-key"), "{message}");
    // The refusal says nothing of the worker's health: it stays in rotation, and the refusals
    // are counted per worker.
    let (status, _, _) = complete(&keyless.http(), None).await;
    assert_eq!(status, 502);
    let refusals = common::metric(&keyless.http(), "kvrouter_upstream_key_refusals_total{")
        .await
        .unwrap_or(0.0);
    assert_eq!(refusals, 2.0);
    std::fs::remove_dir_all(&dir).ok();
}

/// Embedded engines want the key the router sends, as real ones would.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn embedded_engines_take_the_workers_key() {
    let router = common::spawn(&[
        "serve",
        "--port",
        "0",
        "--mock-workers",
        "1",
        "--mock-speedup-ratio",
        "50",
        "--worker-api-key",
        "wk",
        "--admin-token",
        "adm",
    ])
    .await;
    let r = router.http();
    let (status, _, body) = complete(&r, None).await;
    assert_eq!(status, 200, "{body}");
    let workers: Value = reqwest::Client::new()
        .get(format!("{r}/admin/workers"))
        .bearer_auth("adm")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let engine = workers["workers"][0]["url"].as_str().unwrap();
    assert_eq!(get_status(&format!("{engine}/v1/models"), None).await, 401);
}

#[tokio::test]
async fn bad_key_flags_are_clear_errors_naming_the_flag() {
    let dir = std::env::temp_dir().join(format!("kvrouter-badkeys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_owned()
    };
    let (blank, spaced, two) = (
        file("blank", "\n  \n"),
        file("spaced", "good\nbad key\n"),
        file("two", "a\nb\n"),
    );
    for (flags, named) in [
        (
            vec!["--api-key", "k", "--api-key-file", blank.as_str()],
            "--api-key-file",
        ),
        (vec!["--api-key-file", blank.as_str()], "is empty"),
        (vec!["--api-key-file", spaced.as_str()], "key 2 of 2"),
        (vec!["--api-key", "a\tb"], "--api-key"),
        (vec!["--worker-api-key", ""], "--worker-api-key"),
        (vec!["--worker-api-key-file", two.as_str()], "takes one"),
        (vec!["--api-key-file", "/dev/zero"], "not a regular file"),
    ] {
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_kvrouter"))
            .args(["serve", "--port", "0", "--mock-workers", "1"])
            .args(&flags)
            .output()
            .await
            .unwrap();
        assert!(!out.status.success(), "{flags:?} is refused");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(named), "{flags:?}: {stderr}");
    }
    // A worker URL's credentials stay out of the message.
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args([
            "serve",
            "--port",
            "0",
            "--worker",
            "http://u:SECRETPW@127.0.0.1:1",
        ])
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("credentials"),
        "{stderr}"
    );
    assert!(!stderr.contains("SECRETPW"), "{stderr}");
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args(["mock-engine", "--port", "0", "--api-key", ""])
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--api-key"));
    std::fs::remove_dir_all(&dir).ok();
}
