//! Input hardening of `kvrouter serve` as a real process: the admin token from the environment
//! or a file (never only the command line), and workers-file validation that names the file,
//! the worker and the field instead of aborting later.

mod common;

use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use tokio::time::timeout;

fn kvrouter() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvrouter"));
    c.env_remove("KVROUTER_ADMIN_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    c
}

/// Runs `kvrouter serve ARGS`, which must refuse to start: its stderr.
async fn refused(args: &[&str], env: &[(&str, &str)]) -> String {
    let mut c = kvrouter();
    c.arg("serve").args(args).envs(env.iter().copied());
    let out = timeout(Duration::from_secs(60), c.output())
        .await
        .expect("exits in time")
        .expect("runs");
    assert!(!out.status.success(), "it started: {args:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Starts `kvrouter serve --mock-workers 1 --port 0 ARGS` with `env`.
async fn started(args: &[&str], env: &[(&str, &str)]) -> common::Proc {
    let mut c = kvrouter();
    c.args(["serve", "--mock-workers", "1", "--port", "0"])
        .args(args)
        .envs(env.iter().copied())
        .stderr(Stdio::null());
    let mut child = c.spawn().expect("start kvrouter");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let line = timeout(Duration::from_secs(60), lines.next_line())
        .await
        .expect("startup line in time")
        .expect("readable stdout")
        .expect("a startup line");
    common::Proc { child, line }
}

async fn admin_status(p: &common::Proc, token: &str) -> u16 {
    reqwest::Client::new()
        .get(format!("{}/admin/workers", p.http()))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

fn temp_file(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvrouter-faults-input-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[tokio::test]
async fn the_admin_token_comes_from_the_environment_or_a_file() {
    let p = started(&[], &[("KVROUTER_ADMIN_TOKEN", "from-env")]).await;
    assert_eq!(admin_status(&p, "from-env").await, 200);
    assert_eq!(admin_status(&p, "from-en").await, 401);
    drop(p);
    let file = temp_file("token", "  from-file\n");
    let p = started(&["--admin-token-file", file.to_str().unwrap()], &[]).await;
    assert_eq!(admin_status(&p, "from-file").await, 200, "trimmed");
    assert_eq!(admin_status(&p, "from-env").await, 401);
    drop(p);
    let empty = temp_file("empty", "\n \n");
    let err = refused(
        &[
            "--mock-workers",
            "1",
            "--admin-token-file",
            empty.to_str().unwrap(),
        ],
        &[],
    )
    .await;
    assert!(
        err.contains("--admin-token-file") && err.contains("empty"),
        "{err}"
    );
    let err = refused(
        &[
            "--mock-workers",
            "1",
            "--admin-token-file",
            "/nonexistent/kvrouter-token",
        ],
        &[],
    )
    .await;
    assert!(
        err.contains("--admin-token-file /nonexistent/kvrouter-token"),
        "{err}"
    );
    let err = refused(
        &[
            "--mock-workers",
            "1",
            "--admin-token-file",
            file.to_str().unwrap(),
        ],
        &[("KVROUTER_ADMIN_TOKEN", "from-env")],
    )
    .await;
    assert!(err.contains("both given"), "{err}");
    let err = refused(
        &["--mock-workers", "1", "--session-release-auth", "admin"],
        &[],
    )
    .await;
    assert!(err.contains("--session-release-auth"), "{err}");
}

#[tokio::test]
async fn an_admin_token_file_is_bounded_and_must_be_a_regular_file() {
    // A token file longer than 4 KiB is refused (it used to be read whole, however large).
    let long = temp_file("long-token", &"t".repeat(5000));
    let err = refused(
        &[
            "--mock-workers",
            "1",
            "--admin-token-file",
            long.to_str().unwrap(),
        ],
        &[],
    )
    .await;
    assert!(
        err.contains("--admin-token-file") && err.contains("4096 bytes"),
        "{err}"
    );
    // /dev/zero never ends: it is refused before any byte is read.
    let err = refused(
        &["--mock-workers", "1", "--admin-token-file", "/dev/zero"],
        &[],
    )
    .await;
    assert!(
        err.contains("--admin-token-file /dev/zero") && err.contains("regular file"),
        "{err}"
    );
}

#[tokio::test]
async fn a_bad_workers_file_names_the_file_worker_and_field() {
    let cases = [
        ("dp_size = 4294967295", "dp_size"),
        ("kv_events_endpoint = \"garbage://x\"", "kv_events_endpoint"),
        ("max_num_batched_tokens = 0", "max_num_batched_tokens"),
        ("block_size = 0", "block_size"),
    ];
    for (i, (line, field)) in cases.iter().enumerate() {
        let text = format!(
            "[[workers]]\nurl = \"http://127.0.0.1:1\"\n\n[[workers]]\nurl = \"http://127.0.0.1:2\"\n{line}\n"
        );
        let path = temp_file(&format!("workers-{i}.toml"), &text);
        let err = refused(&["--workers-file", path.to_str().unwrap()], &[]).await;
        let want = format!("--workers-file {}: workers[1].{field}", path.display());
        assert!(err.contains(&want), "want {want:?} in {err}");
    }
    let err = refused(&["--worker", "garbage://x"], &[]).await;
    assert!(
        err.contains("--worker garbage://x") && err.contains("url"),
        "{err}"
    );
}

#[tokio::test]
async fn an_absurd_number_of_embedded_engines_is_refused_before_any_starts() {
    // 100,000 embedded engines grew to 6.8 GB and 15,000 sockets in 35 s without a word.
    let err = refused(&["--mock-workers", "100000", "--port", "0"], &[]).await;
    assert!(err.contains("--mock-workers must be at most 256"), "{err}");
    let err = refused(&["--port", "0"], &[("KVROUTER_MOCK_WORKERS", "257")]).await;
    assert!(
        err.contains("--mock-workers must be at most 256") && err.contains("KVROUTER_MOCK_WORKERS"),
        "{err}"
    );
}

#[tokio::test]
async fn an_admin_call_with_an_absurd_dp_size_leaves_the_process_serving() {
    let p = started(&["--admin-token", "t"], &[]).await;
    let client = reqwest::Client::new();
    let r = client
        .post(format!("{}/admin/workers", p.http()))
        .bearer_auth("t")
        .json(
            &serde_json::json!({"url": "http://127.0.0.1:1", "dp_size": 4294967295u64,
            "block_size": 64, "max_num_batched_tokens": 8192,
            "kv_events_endpoint": "tcp://127.0.0.1:1"}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["param"], "dp_size");
    assert_eq!(admin_status(&p, "t").await, 200, "still serving");
}

#[tokio::test]
async fn too_many_or_too_large_headers_get_an_openai_shaped_431() {
    let p = started(&[], &[]).await;
    let client = reqwest::Client::new();
    let body = serde_json::json!({"model": "mock-model", "prompt": "hi", "max_tokens": 1});
    let mut many = client.post(format!("{}/v1/completions", p.http()));
    for i in 0..150 {
        many = many.header(format!("x-filler-{i}"), "v");
    }
    let huge = client
        .post(format!("{}/v1/completions", p.http()))
        .header("x-filler", "v".repeat(100 * 1024));
    for (what, request) in [("150 headers", many), ("100 KiB of header", huge)] {
        let resp = request.json(&body).send().await.unwrap();
        assert_eq!(resp.status().as_u16(), 431, "{what}");
        let e: serde_json::Value = resp.json().await.expect("a JSON body");
        assert_eq!(e["error"]["code"], 431, "{what}: {e}");
        assert!(e["error"]["message"].is_string(), "{what}: {e}");
    }
    // The process still serves.
    let ok = client
        .post(format!("{}/v1/completions", p.http()))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status().as_u16(), 200);
}
