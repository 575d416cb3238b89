//! Delta weight sync end to end on loopback, real processes: `kvrouter weights publish` of v0
//! (full) and v1 (delta) into a filesystem object store, one in-region `kvrouter weights serve`
//! peer, three mock engines behind `kvrouter serve`. One `/admin/policy/update` with a `source`
//! pulls v1 once from the store (at the peer), fans it out to the three workers' directories,
//! aborts and continues the in-flight step, and loads the pulled path on every engine.

mod common;

use serde_json::{json, Value};
use std::path::Path;
use std::time::Duration;

const TOKEN: &str = "w-t0k";
const MAX_TOKENS: u64 = 60;

/// Runs `kvrouter ARGS` to completion (bounded) and returns its JSON report line.
async fn kvrouter(args: &[&str]) -> Value {
    let out = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_kvrouter"))
            .args(args)
            .output(),
    )
    .await
    .expect("in time")
    .expect("runs");
    assert!(
        out.status.success(),
        "kvrouter {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    serde_json::from_str(text.lines().last().expect("a report line")).unwrap()
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

async fn get_json(client: &reqwest::Client, url: String) -> Value {
    client.get(url).send().await.unwrap().json().await.unwrap()
}

/// One streamed completion: (status, completion tokens, pieces, last fingerprint).
async fn stream(client: &reqwest::Client, base: &str, i: u64) -> (u16, u64, u64, Option<String>) {
    let body = json!({"model": "mock-model", "prompt": (0..100).map(|t| 1000 + i * 1000 + t).collect::<Vec<_>>(),
        "max_tokens": MAX_TOKENS, "stream": true, "stream_options": {"include_usage": true}});
    let r = client
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    let (mut tokens, mut pieces, mut fp) = (0, 0, None);
    for event in text.split("\n\n").filter(|e| !e.trim().is_empty()) {
        let data = event.trim().strip_prefix("data:").unwrap().trim();
        if data == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        assert!(v.get("error").is_none(), "in-band error: {v}");
        if let Some(f) = v["system_fingerprint"].as_str() {
            fp = Some(f.to_owned());
        }
        if v["choices"][0]["text"]
            .as_str()
            .is_some_and(|t| !t.is_empty())
        {
            pieces += 1;
        }
        if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
            tokens = n;
        }
    }
    (status, tokens, pieces, fp)
}

/// How long a poll waits (3000 polls of 10 ms before the common poll).
const WAIT: Duration = Duration::from_secs(30);

#[tokio::test]
async fn publish_pull_fan_out_and_load_on_three_engines_losing_no_rollout() {
    let tmp = tempfile_dir();
    let root = tmp.as_path();
    let store = format!("file://{}", root.join("store").display());
    std::fs::create_dir_all(root.join("store")).unwrap();
    let (v0, v1) = (root.join("trainer/v0"), root.join("trainer/v1"));
    kvrouter(&[
        "weights",
        "gen",
        "--out",
        p(&v0),
        "--size-mib",
        "8",
        "--threads",
        "1",
    ])
    .await;
    kvrouter(&[
        "weights",
        "gen",
        "--out",
        p(&v1),
        "--size-mib",
        "8",
        "--steps",
        "1",
        "--lr",
        "1e-5",
        "--threads",
        "1",
    ])
    .await;
    let r = kvrouter(&[
        "weights",
        "publish",
        "--dir",
        p(&v0),
        "--version",
        "0",
        "--store",
        &store,
        "--threads",
        "1",
    ])
    .await;
    assert_eq!(r["full"], true, "{r}");
    let r = kvrouter(&[
        "weights",
        "publish",
        "--dir",
        p(&v1),
        "--version",
        "1",
        "--prev",
        p(&v0),
        "--store",
        &store,
        "--threads",
        "1",
    ])
    .await;
    assert_eq!(r["full"], false, "{r}");
    assert!(
        r["delta_bytes"].as_u64().unwrap() * 10 < r["checkpoint_bytes"].as_u64().unwrap(),
        "{r}"
    );

    let peer = common::spawn(&[
        "weights",
        "serve",
        "--dir",
        p(&root.join("region-cache")),
        "--listen",
        "127.0.0.1:0",
        "--store",
        &store,
        "--threads",
        "1",
    ])
    .await;
    let peer_url = peer.http();
    let mut engines = Vec::new();
    for _ in 0..3 {
        engines.push(
            common::spawn(&[
                "mock-engine",
                "--port",
                "0",
                // Slow enough that the step is still decoding when the update's abort
                // arrives, even on a loaded machine (the pull comes first).
                "--speedup-ratio",
                "0.5",
                "--weight-load-ms",
                "100",
            ])
            .await,
        );
    }
    let urls: Vec<String> = engines.iter().map(common::Proc::http).collect();
    let mut args = vec!["serve", "--port", "0", "--admin-token", TOKEN];
    for u in &urls {
        args.extend(["--worker", u.as_str()]);
    }
    let router = common::spawn(&args).await;
    let base = router.http();
    let client = reqwest::Client::new();

    let mut step = Vec::new();
    for i in 0..6 {
        let (client, base) = (client.clone(), base.clone());
        step.push(tokio::spawn(async move { stream(&client, &base, i).await }));
    }
    common::until("the step in flight", WAIT, || async {
        common::metric(&base, "kvrouter_worker_active_requests{")
            .await
            .unwrap_or(0.0)
            >= 6.0
    })
    .await;
    let dir = format!("{}/worker-{{worker}}", root.display());
    let source = json!({"peer": peer_url, "dir": dir, "threads": 1});
    let policy = updated(&client, &base, 1, &source).await;
    assert_eq!(policy["update"]["done"], 3, "{policy}");
    for w in policy["workers"].as_array().unwrap() {
        assert_eq!(
            (w["policy_version"].as_u64(), w["state"].as_str()),
            (Some(1), Some("serving")),
            "{policy}"
        );
    }
    // No rollout lost: every request of the step answered once with its whole budget.
    for t in step {
        let (status, tokens, pieces, fp) = tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .unwrap()
            .unwrap();
        assert_eq!((status, tokens, pieces), (200, MAX_TOKENS, MAX_TOKENS));
        assert_eq!(fp.as_deref(), Some("policy-1"));
    }
    // Each engine loaded its own pulled copy of v1, byte-identical to the trainer's.
    let mut paths = std::collections::BTreeSet::new();
    for u in &urls {
        let info = get_json(&client, format!("{u}/server_info")).await;
        assert_eq!(info["policy_version"], 1, "{info}");
        let path = info["model_path"].as_str().expect("model_path").to_owned();
        assert!(path.ends_with("/v1"), "{path}");
        for shard in [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
        ] {
            assert!(
                std::fs::read(Path::new(&path).join(shard)).unwrap()
                    == std::fs::read(v1.join(shard)).unwrap()
            );
        }
        paths.insert(path);
    }
    assert_eq!(paths.len(), 3);
    // The WAN was crossed once for the region: the update's check that v1 exists (HEAD of the
    // delta), the peer's own check before pulling (the same HEAD), then one pull (`latest`,
    // LIST of base/ and of delta/, marker, 2 shards of base v0, one delta); the three workers
    // read from the peer.
    let stats = get_json(&client, format!("{peer_url}/v1/stats")).await;
    assert_eq!(stats["store_pulls"], 1, "{stats}");
    assert_eq!(stats["store_reads"], 9, "{stats}");
    assert_eq!(stats["files_served"], 6, "{stats}");

    // Bad sources are refused before anything starts, naming the field.
    for (source, field) in [
        (json!({"dir": "/tmp/x"}), "source.peer"),
        (json!({"peer": "ftp://x", "dir": "/tmp/x"}), "source.peer"),
        (json!({"peer": peer_url, "dir": ""}), "source.dir"),
        (
            json!({"peer": peer_url, "dir": "/tmp/x", "keep": 0}),
            "source.keep",
        ),
        (
            json!({"store": "nope://x", "dir": "/tmp/x"}),
            "source.store",
        ),
    ] {
        let r = client
            .post(format!("{base}/admin/policy/update"))
            .bearer_auth(TOKEN)
            .json(&json!({"version": 2, "source": source}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"]["param"], field, "{body}");
    }
}

#[tokio::test]
async fn the_mock_engine_refuses_a_wrong_or_corrupted_model_path() {
    let tmp = tempfile_dir();
    let root = tmp.as_path();
    let v0 = root.join("v0");
    kvrouter(&[
        "weights",
        "gen",
        "--out",
        p(&v0),
        "--size-mib",
        "2",
        "--threads",
        "1",
    ])
    .await;
    kvrouter(&[
        "weights",
        "stamp",
        "--dir",
        p(&v0),
        "--version",
        "0",
        "--threads",
        "1",
    ])
    .await;
    let engine = common::spawn(&["mock-engine", "--port", "0", "--weight-load-ms", "1"]).await;
    let client = reqwest::Client::new();
    let load = |body: Value| {
        let client = client.clone();
        let url = format!("{}/update_weights", engine.http());
        async move {
            let r = client.post(url).json(&body).send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let (s, _) = load(json!({"version": 0, "model_path": p(&v0)})).await;
    assert_eq!(s, 200);
    let (s, b) = load(json!({"version": 1, "model_path": p(&v0)})).await;
    assert_eq!(
        (s, b["error"]["param"].as_str()),
        (400, Some("model_path")),
        "{b}"
    );
    assert!(
        b["error"]["message"]
            .as_str()
            .unwrap()
            .contains("holds version 0"),
        "{b}"
    );
    let (s, b) = load(json!({"version": 0, "model_path": p(&root.join("missing"))})).await;
    assert_eq!(
        (s, b["error"]["param"].as_str()),
        (400, Some("model_path")),
        "{b}"
    );
    let shard = v0.join("model-00001-of-00002.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&shard, bytes).unwrap();
    let (s, b) = load(json!({"version": 0, "model_path": p(&v0)})).await;
    assert_eq!(s, 400, "{b}");
    let msg = b["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("corrupted") && msg.contains("model.layers.") && msg.contains("version v0"),
        "{msg}"
    );
}

/// A fresh directory under the target dir, removed on drop.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn as_path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tempfile_dir() -> TempDir {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let d = std::env::temp_dir().join(format!(
        "kvrouter-weights-test-{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&d).unwrap();
    TempDir(d)
}

/// Starts an abort update to `version` with `source`, waits for it to end and returns
/// `/admin/policy`.
async fn updated(client: &reqwest::Client, base: &str, version: u64, source: &Value) -> Value {
    let r = client
        .post(format!("{base}/admin/policy/update"))
        .bearer_auth(TOKEN)
        .json(&json!({"version": version, "mode": "abort", "source": source}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202, "{}", r.text().await.unwrap());
    let policy = || async {
        client
            .get(format!("{base}/admin/policy"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap()
            .json::<Value>()
            .await
            .unwrap()
    };
    common::until("the update to finish", WAIT, || async {
        policy().await["update"]["running"] == false
    })
    .await;
    policy().await
}

/// A worker cache keeping 2 versions never recycles the version its engine runs: after a
/// rollback to v1 (not the newest in the cache), the update to v4 writes into v2's files and
/// leaves v1 whole (before, v1 was deleted while the engine still ran it).
#[tokio::test]
async fn a_rolled_back_version_survives_the_next_fetch_while_its_engine_runs_it() {
    let tmp = tempfile_dir();
    let root = tmp.as_path();
    let store = format!("file://{}", root.join("store").display());
    std::fs::create_dir_all(root.join("store")).unwrap();
    for v in 0..=4u32 {
        let dir = root.join(format!("trainer/v{v}"));
        let steps = v.to_string();
        kvrouter(&[
            "weights",
            "gen",
            "--out",
            p(&dir),
            "--size-mib",
            "2",
            "--steps",
            &steps,
            "--lr",
            "1e-5",
            "--threads",
            "1",
        ])
        .await;
        let version = v.to_string();
        let prev = root.join(format!("trainer/v{}", v.saturating_sub(1)));
        let mut args = vec![
            "weights",
            "publish",
            "--dir",
            p(&dir),
            "--version",
            &version,
            "--store",
            &store,
            "--threads",
            "1",
        ];
        if v > 0 {
            args.extend(["--prev", p(&prev)]);
        }
        kvrouter(&args).await;
    }
    let router = common::spawn(&[
        "serve",
        "--port",
        "0",
        "--mock-workers",
        "1",
        "--admin-token",
        TOKEN,
    ])
    .await;
    let base = router.http();
    let client = reqwest::Client::new();
    let cache = root.join("cache");
    let source = json!({"store": store, "dir": p(&cache), "keep": 2, "threads": 1});
    let listing = || {
        let mut v: Vec<String> = std::fs::read_dir(&cache)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with('v'))
            .collect();
        v.sort();
        v
    };
    for version in [2, 3, 1, 4] {
        let policy = updated(&client, &base, version, &source).await;
        let w = &policy["workers"][0];
        assert_eq!(
            (w["policy_version"].as_u64(), w["state"].as_str()),
            (Some(version), Some("serving")),
            "{policy}"
        );
        if version == 1 {
            // Rolled back: v3 (run until now) and v2 stay beside v1.
            assert_eq!(listing(), ["v1", "v2", "v3"]);
        }
    }
    // v1 was run while v4 was fetched: v2 was recycled, v1 is whole.
    assert_eq!(listing(), ["v1", "v3", "v4"]);
    let r = kvrouter(&["weights", "verify", "--dir", p(&cache.join("v1"))]).await;
    assert_eq!(
        (r["ok"].as_bool(), r["version"].as_u64()),
        (Some(true), Some(1)),
        "{r}"
    );
}

/// A peer that accepts, reads the request and never answers fails the pull after
/// `--peer-marker-timeout-secs` (the marker is the first thing asked), instead of holding it
/// for good.
#[tokio::test]
async fn a_stalled_peer_fails_the_pull_after_the_read_timeout() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stalled = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = listener.accept().await {
            held.push(conn); // Kept open, never written to.
        }
    });
    let dir = tempfile_dir();
    let out = dir.as_path().join("out");
    let peer = format!("http://{addr}");
    let pull = |extra: &[&str]| {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_kvrouter"))
            .args(["weights", "pull", "--version", "1", "--out", p(&out)])
            .args(["--peer", &peer])
            .args(extra)
            .output()
    };
    let started = std::time::Instant::now();
    let run = tokio::time::timeout(
        Duration::from_secs(60),
        pull(&["--peer-marker-timeout-secs", "1"]),
    )
    .await
    .expect("the pull ends on its own")
    .unwrap();
    assert!(!run.status.success());
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
    assert!(!out.exists());
    // A zero timeout is refused; --have and --store do not apply to a peer pull: refused
    // rather than ignored.
    for (extra, flag) in [
        (
            ["--peer-read-timeout-secs", "0"],
            "--peer-read-timeout-secs",
        ),
        (
            ["--peer-marker-timeout-secs", "-1"],
            "--peer-marker-timeout-secs",
        ),
        (["--have", p(dir.as_path())], "--have"),
    ] {
        let bad = pull(&extra).await.unwrap();
        let err = String::from_utf8_lossy(&bad.stderr);
        assert!(!bad.status.success() && err.contains(flag), "{err}");
    }
    stalled.abort();
}

/// Sizes past 1 TiB, a learning rate that is not a number, and a `serve --dir` that is a file
/// are refused naming the flag (2^44 MiB wrapped to a 2 KB checkpoint; the file was served as
/// a cache that answered "cached: false" and then 500s). Found by a hostile probe.
#[tokio::test]
async fn absurd_sizes_and_a_file_as_the_cache_are_refused_naming_the_flag() {
    let dir = tempfile_dir();
    let out = dir.as_path().join("g");
    let file = dir.as_path().join("file");
    std::fs::write(&file, "x").unwrap();
    let size = (1u64 << 44).to_string();
    // A scratch directory with the user's files: the bench removes its scratch after it.
    let mine = dir.as_path().join("mine");
    std::fs::create_dir_all(&mine).unwrap();
    std::fs::write(mine.join("notes.txt"), "data").unwrap();
    // A link to an empty directory: removing it would take the link and leave the target full.
    let empty = dir.as_path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let link = dir.as_path().join("link");
    std::os::unix::fs::symlink(&empty, &link).unwrap();
    for (args, needle) in [
        (
            vec![
                "bench",
                "--scratch",
                p(&link),
                "--size-mib",
                "1",
                "--sweep-mib",
                "1",
            ],
            "give the directory itself",
        ),
        (
            vec![
                "bench",
                "--scratch",
                p(&mine),
                "--size-mib",
                "1",
                "--sweep-mib",
                "1",
            ],
            "--scratch",
        ),
        (
            vec!["gen", "--out", p(&out), "--size-mib", &size],
            "--size-mib must be at most",
        ),
        (
            vec!["gen", "--out", p(&out), "--lr", "NaN"],
            "--lr must be a finite number",
        ),
        (
            vec!["serve", "--dir", p(&file), "--listen", "127.0.0.1:0"],
            "is not a directory",
        ),
        // Checked without --peer too (a store pull ignored it).
        (
            vec![
                "pull",
                "--store",
                "file:///nonexistent",
                "--version",
                "1",
                "--out",
                p(&out),
                "--peer-read-timeout-secs",
                "-5",
            ],
            "--peer-read-timeout-secs",
        ),
    ] {
        let run = tokio::time::timeout(
            Duration::from_secs(60),
            tokio::process::Command::new(env!("CARGO_BIN_EXE_kvrouter"))
                .arg("weights")
                .args(&args)
                .output(),
        )
        .await
        .expect("exits in time")
        .unwrap();
        assert!(!run.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&run.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    assert!(!out.exists());
    assert!(mine.join("notes.txt").exists());
}
