//! `kvrouter serve` configured from `--config FILE` and `KVROUTER_<FLAG>` variables as a real
//! process: command line > environment > file > defaults, `--print-config`, and the errors.

mod common;

use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use tokio::time::timeout;

fn kvrouter(env: &[(&str, &str)]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvrouter"));
    // Only the variables this test sets.
    for (k, _) in std::env::vars() {
        if k.starts_with("KVROUTER_") {
            c.env_remove(k);
        }
    }
    c.envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    c
}

fn temp_file(name: &str, text: &str) -> String {
    let dir = std::env::temp_dir().join(format!("kvrouter-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}

/// Runs a `kvrouter` command to its end (bounded): (exit code, stdout, stderr).
async fn finished(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let out = timeout(Duration::from_secs(60), kvrouter(env).args(args).output())
        .await
        .expect("exits in time")
        .expect("runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn serve_takes_its_flags_from_a_config_file_and_the_environment() {
    let file = temp_file(
        "serve.toml",
        "# a deployment's settings\nport = 0\nmock-workers = 1\nmodel-name = [\"from-file\"]\n",
    );
    let mut c = kvrouter(&[
        ("KVROUTER_MODEL_NAME", "mock-model"),
        ("KVROUTER_EXPOSE_DECISIONS", "true"),
    ]);
    c.args(["serve", "--config", &file]).stderr(Stdio::null());
    let mut child = c.spawn().expect("start kvrouter");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let line = timeout(Duration::from_secs(60), lines.next_line())
        .await
        .expect("startup line in time")
        .expect("readable stdout")
        .expect("a startup line");
    let p = common::Proc { child, line };
    // port = 0 from the file: it did not take the default 8000.
    assert!(!p.http().ends_with(":8000"), "{}", p.line);
    assert_eq!(p.field("workers"), "1", "mock-workers from the file");
    let client = reqwest::Client::new();
    let models: serde_json::Value = client
        .get(format!("{}/v1/models", p.http()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        models["data"][0]["id"], "mock-model",
        "the environment beats the file"
    );
    let r = client
        .post(format!("{}/v1/chat/completions", p.http()))
        .json(&serde_json::json!({
            "model": "mock-model", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hello"}]
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        r.headers().contains_key("x-kvrouter-decision"),
        "KVROUTER_EXPOSE_DECISIONS=true took effect"
    );
}

/// `--print-config` still prints a configuration a start would refuse, and says on stderr what
/// the start would say, naming where the value came from.
#[tokio::test]
async fn print_config_says_what_a_start_would_refuse() {
    let (code, out, err) = finished(
        &["serve", "--print-config", "--mock-workers", "1"],
        &[("KVROUTER_ROUTER_COST_SPEEDUP_RATIO", "0")],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("router-cost-speedup-ratio = 0"), "{out}");
    assert!(err.contains("would be refused"), "{err}");
    assert!(err.contains("--router-cost-speedup-ratio"), "{err}");
    assert!(err.contains("KVROUTER_ROUTER_COST_SPEEDUP_RATIO"), "{err}");
    let (code, _, err) = finished(
        &[
            "serve",
            "--print-config",
            "--mock-workers",
            "1",
            "--log-level",
            "a=notalevel",
        ],
        &[],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("would be refused: --log-level"), "{err}");
    // An accepted configuration: no warning, and nothing opened or created on the way.
    let log =
        std::env::temp_dir().join(format!("kvrouter-print-config-{}.log", std::process::id()));
    let _ = std::fs::remove_file(&log);
    let (code, _, err) = finished(
        &[
            "serve",
            "--print-config",
            "--mock-workers",
            "1",
            "--provenance-log",
            log.to_str().unwrap(),
            "--otlp-endpoint",
            "http://127.0.0.1:9",
        ],
        &[],
    )
    .await;
    assert_eq!((code, err.as_str()), (0, ""));
    assert!(!log.exists(), "--print-config created {}", log.display());
}

#[tokio::test]
async fn print_config_shows_the_effective_values_and_hides_the_token() {
    let file = temp_file("print.toml", "mock-workers = 2\nrouter-mode = \"random\"\n");
    let (code, out, err) = finished(
        &[
            "serve",
            "--config",
            &file,
            "--print-config",
            "--router-mode",
            "least-loaded",
        ],
        &[
            ("KVROUTER_ADMIN_TOKEN", "sekrit"),
            ("KVROUTER_PORT", "9123"),
        ],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(!out.contains("sekrit"), "{out}");
    assert!(out.contains("admin-token = \"<redacted>\""), "{out}");
    assert!(
        out.contains("port = 9123  # environment KVROUTER_PORT"),
        "{out}"
    );
    assert!(
        out.contains("mock-workers = 2  # config file line 1"),
        "{out}"
    );
    assert!(
        out.contains("router-mode = \"least-loaded\"  # command line"),
        "{out}"
    );
    assert!(
        out.contains("shutdown-grace-secs = 30.0\n"),
        "defaults too: {out}"
    );
}

#[tokio::test]
async fn config_errors_name_the_key_the_line_or_the_variable() {
    let file = temp_file("bad-key.toml", "mock-workers = 1\nport = 0\nretrys = 3\n");
    let (code, _, err) = finished(&["serve", "--config", &file], &[]).await;
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("line 3") && err.contains("unknown key `retrys`"),
        "{err}"
    );
    let file = temp_file("bad-value.toml", "mock-workers = \"two\"\n");
    let (code, _, err) = finished(&["serve", "--config", &file], &[]).await;
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("line 1: key `mock-workers`") && err.contains("two"),
        "{err}"
    );
    let (code, _, err) = finished(
        &["serve", "--mock-workers", "1"],
        &[("KVROUTER_RETRIES", "-1")],
    )
    .await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("KVROUTER_RETRIES"), "{err}");
    // A value the flag's parser takes but a later range check refuses: the error names the
    // variable that set it.
    let (code, _, err) = finished(
        &["serve", "--mock-workers", "1", "--port", "0"],
        &[("KVROUTER_ROUTER_COST_SPEEDUP_RATIO", "0")],
    )
    .await;
    assert_ne!(code, 0, "{err}");
    assert!(
        err.contains("--router-cost-speedup-ratio was set by KVROUTER_ROUTER_COST_SPEEDUP_RATIO"),
        "{err}"
    );
    let (code, _, err) = finished(&["serve", "--config", "/nonexistent/kvrouter.toml"], &[]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--config /nonexistent/kvrouter.toml"), "{err}");
}

#[tokio::test]
async fn a_weight_the_router_mode_does_not_read_is_warned_about() {
    let out = std::env::temp_dir().join(format!("kvrouter-config-{}-unread", std::process::id()));
    let out = out.to_str().unwrap();
    let args = [
        "sim",
        "--workload",
        "seed001",
        "--workload-args",
        "requests=4",
        "--workers",
        "2",
        "--quiet",
        "--out",
        out,
    ];
    let warned = "--router-kv-overlap-score-credit is set but the router mode in effect (cost) does not read it";
    let (code, _, err) = finished(&args, &[("KVROUTER_ROUTER_KV_OVERLAP_SCORE_CREDIT", "2")]).await;
    assert_eq!(code, 0, "{err}");
    assert!(err.contains(warned), "{err}");
    // Read in kv mode: no warning.
    let (code, _, err) = finished(
        &args,
        &[
            ("KVROUTER_ROUTER_KV_OVERLAP_SCORE_CREDIT", "2"),
            ("KVROUTER_ROUTER_MODE", "kv"),
        ],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("does not read it"), "{err}");
    // The modes a run compares decide, and a compare item's own key is checked too.
    let mut compared = args.to_vec();
    compared.extend(["--compare", "round-robin,kv:router_cost_fit=true"]);
    let (code, _, err) =
        finished(&compared, &[("KVROUTER_ROUTER_COST_DECODE_WEIGHT", "0.9")]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("--router-cost-decode-weight is set but the router mode in effect (round-robin, kv) does not read it"),
        "{err}"
    );
    assert!(
        err.contains("--compare item kv:router_cost_fit=true: router_cost_fit is not read by kv"),
        "{err}"
    );
}

#[tokio::test]
async fn sim_duration_is_checked_and_refused_for_rl_workloads() {
    for (args, says) in [
        (
            vec!["sim", "--workload", "agentic", "--duration-s", "0"],
            "--duration-s must be a number of seconds above 0",
        ),
        (
            vec!["sim", "--workload", "grpo", "--duration-s", "10"],
            "--duration-s cannot cut an RL workload",
        ),
    ] {
        let (code, _, err) = finished(&args, &[]).await;
        assert_ne!(code, 0, "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

#[tokio::test]
async fn serve_help_is_grouped_by_topic() {
    let (code, out, err) = finished(&["serve", "--help"], &[]).await;
    assert_eq!(code, 0, "{err}");
    // In the order docs/serve.md gives: where to listen first, the optional roles last.
    let mut lines = out.lines();
    for heading in [
        "Listening and workers:",
        "Routing:",
        "KV events:",
        "Admission",
        "Sessions:",
        "RL",
        "Observability:",
        "Health:",
        "Pick API",
        "Worker discovery",
        "Global routing",
        "Planner",
        "Configuration:",
    ] {
        assert!(
            lines.any(|l| l.starts_with(heading)),
            "{heading}, in this order: {out}"
        );
    }
}

/// Found by a probe: a file flag naming a device was read without end (memory grew about
/// 1 GB/s until the kernel killed the process). Every file a command reads is refused unless
/// it is a regular file, naming the flag.
#[tokio::test]
async fn a_device_given_as_a_file_is_refused_not_read() {
    let cases: [&[&str]; 6] = [
        &["serve", "--config", "/dev/zero"],
        &["serve", "--workers-file", "/dev/zero"],
        &["serve", "--mock-workers", "1", "--tokenizer", "/dev/zero"],
        &[
            "serve",
            "--mock-workers",
            "1",
            "--chat-template",
            "/dev/zero",
        ],
        &["sim", "--trace", "/dev/zero"],
        &["plan", "--trace", "/dev/zero", "--ttft-p99-ms", "100"],
    ];
    for args in cases {
        let (code, _, err) = finished(args, &[]).await;
        assert_ne!(code, 0, "{args:?}");
        assert!(err.contains("/dev/zero"), "{args:?}: {err}");
        assert!(err.contains("not a regular file"), "{args:?}: {err}");
    }
    // A session file of a trace folder that is a device (found by a re-probe).
    let dir = std::env::temp_dir().join(format!("kvrouter-device-trace-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::os::unix::fs::symlink("/dev/zero", dir.join("s.json")).unwrap();
    let (code, _, err) = finished(&["sim", "--trace", dir.to_str().unwrap()], &[]).await;
    let _ = std::fs::remove_dir_all(&dir);
    assert_ne!(code, 0);
    assert!(err.contains("s.json: not a regular file"), "{err}");
}
