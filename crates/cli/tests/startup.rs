//! What `kvrouter serve` prints when it starts (a real process): models, block size, tokenizer,
//! chat template (and the ChatML fallback when it was taken), each worker's URL and KV events.

use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use tokio::time::timeout;

/// Starts `kvrouter serve --port 0 ARGS` and reads its startup lines up to the one starting
/// with `last` (at most 100 lines, 60 s).
async fn startup(args: &[&str], last: &str) -> Vec<String> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args(["serve", "--port", "0"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start kvrouter");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut seen = Vec::new();
    for _ in 0..100 {
        let line = timeout(Duration::from_secs(60), lines.next_line())
            .await
            .expect("startup lines in time")
            .expect("readable stdout")
            .unwrap_or_else(|| panic!("stdout ended before {last:?}: {seen:#?}"));
        let done = line.trim_start().starts_with(last);
        seen.push(line);
        if done {
            return seen;
        }
    }
    panic!("no line starting with {last:?} in {seen:#?}");
}

fn has(lines: &[String], text: &str) -> bool {
    lines.iter().any(|l| l.contains(text))
}

#[tokio::test]
async fn startup_names_models_block_size_tokenizer_template_and_workers() {
    let lines = startup(&["--mock-workers", "2"], "worker 1:").await;
    assert!(
        lines[0].starts_with("kvrouter serve listening on http://"),
        "{lines:#?}"
    );
    assert!(has(&lines, "  models: mock-model"), "{lines:#?}");
    assert!(has(&lines, "  kv block size: 64 tokens"), "{lines:#?}");
    assert!(has(&lines, "  tokenizer: builtin"), "{lines:#?}");
    assert!(
        has(&lines, "  chat template: ChatML (built-in default)"),
        "{lines:#?}"
    );
    for w in ["worker 0: http://127.0.0.1:", "worker 1: http://127.0.0.1:"] {
        let line = lines.iter().find(|l| l.contains(w)).expect(w);
        assert!(line.contains(" kv-events=tcp://127.0.0.1:"), "{line}");
    }
    let lines = startup(
        &[
            "--mock-workers",
            "1",
            "--no-router-kv-events",
            "--kv-cache-block-size",
            "16",
        ],
        "worker 0:",
    )
    .await;
    assert!(has(&lines, "  kv block size: 16 tokens"), "{lines:#?}");
    assert!(has(&lines, "kv-events=off"), "{lines:#?}");
}

/// A word-level tokenizer.json small enough to write in a test.
const TOKENIZER: &str = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
"normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
"model":{"type":"WordLevel","vocab":{"[UNK]":0,"the":1,"of":2,"hello":3},"unk_token":"[UNK]"}}"#;

#[tokio::test]
async fn startup_says_when_the_chatml_fallback_was_taken() {
    let dir = std::env::temp_dir().join(format!("kvrouter-startup-{}", std::process::id()));
    let (bare, with_template) = (dir.join("bare"), dir.join("templated"));
    for d in [&bare, &with_template] {
        std::fs::create_dir_all(d).unwrap();
        std::fs::write(d.join("tokenizer.json"), TOKENIZER).unwrap();
    }
    std::fs::write(
        with_template.join("tokenizer_config.json"),
        r#"{"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}"#,
    )
    .unwrap();
    let tok = bare.join("tokenizer.json");
    let lines = startup(
        &["--mock-workers", "1", "--tokenizer", tok.to_str().unwrap()],
        "worker 0:",
    )
    .await;
    assert!(has(&lines, "  tokenizer: bare ("), "{lines:#?}");
    let line = lines.iter().find(|l| l.contains("chat template:")).unwrap();
    assert!(
        line.contains("ChatML FALLBACK") && line.contains("bare"),
        "{line}"
    );
    let tok = with_template.join("tokenizer.json");
    let lines = startup(
        &["--mock-workers", "1", "--tokenizer", tok.to_str().unwrap()],
        "worker 0:",
    )
    .await;
    let line = lines.iter().find(|l| l.contains("chat template:")).unwrap();
    assert!(
        line.contains("jinja")
            && line.contains("tokenizer_config.json")
            && !line.contains("ChatML"),
        "{line}"
    );
}

#[tokio::test]
async fn a_closed_stdout_does_not_stop_the_router() {
    // Its stdout is a socket whose other end is closed before it starts: every write fails
    // with EPIPE, as when a reader took the first line and went away. So it cannot print the
    // port it took: it is given a free one, which a process of a test running beside this one
    // may take in between; then it is started again on another (at most 5 tries), and any
    // other early exit fails the test.
    let mut tries = 0;
    let (mut child, url) = loop {
        tries += 1;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let (theirs, ours) = std::os::unix::net::UnixStream::pair().unwrap();
        drop(ours);
        // Its log goes to a file (a pipe nobody reads could fill and block it).
        let log = std::env::temp_dir().join(format!(
            "kvrouter-closed-stdout-{}-{tries}.log",
            std::process::id()
        ));
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
            .args(["serve", "--mock-workers", "2", "--port", &port.to_string()])
            .env_remove("RUST_BACKTRACE")
            .stdout(Stdio::from(std::os::fd::OwnedFd::from(theirs)))
            .stderr(std::fs::File::create(&log).unwrap())
            .kill_on_drop(true)
            .spawn()
            .expect("start kvrouter");
        let url = format!("http://127.0.0.1:{port}");
        if wait_ready(&mut child, &url).await {
            break (child, url);
        }
        let err = std::fs::read_to_string(&log).unwrap_or_default();
        assert!(
            err.contains("Address already in use") && tries < 5,
            "the router exited (its stdout was closed): {err}"
        );
    };
    let client = reqwest::Client::new();
    for i in 0..5 {
        let r = client
            .post(format!("{url}/v1/chat/completions"))
            .timeout(Duration::from_secs(30))
            .json(&serde_json::json!({
                "model": "mock-model", "max_tokens": 2,
                "messages": [{"role": "user", "content": format!("hello {i}")}]
            }))
            .send()
            .await
            .unwrap_or_else(|e| panic!("request {i}: {e}"));
        assert_eq!(r.status(), 200, "request {i}");
    }
    // A router whose write failed used to panic and exit (code 101) a moment later, while its
    // runtime wound down: it must still be running 5 s on.
    let exited = timeout(Duration::from_secs(5), child.wait()).await;
    assert!(
        exited.is_err(),
        "the router exited after writing to a closed stdout: {exited:?}"
    );
}

/// Waits until `child` answers `/ready` at `url` (true), or exits (false); at most 60 s.
async fn wait_ready(child: &mut tokio::process::Child, url: &str) -> bool {
    let client = reqwest::Client::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let ready = client
            .get(format!("{url}/ready"))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200);
        if ready {
            return true;
        }
        if child.try_wait().unwrap().is_some() {
            return false;
        }
        assert!(tokio::time::Instant::now() < deadline, "not ready in 60 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
