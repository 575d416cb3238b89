//! Router CPU per placement without forwarding, measured as `overhead` measures the proxy: the
//! router as its own process (pinned to one core with `taskset` when it exists), the load
//! generator in this process, router CPU time from /proc divided by the requests: the median
//! of 11 windows of 1,000 (see `windows`).
//!
//! - pick API: `POST /v1/pick` (a 2,048-token prompt as token ids) + `POST /v1/pick/{id}/finish`,
//!   at concurrency 16 over keep-alive HTTP/1.1, with the ids as a JSON list (`pair`) or in
//!   binary after the JSON part (`pair-bin`, `x-kvrouter-json-length`, as the Python client's
//!   `pick(token_ids=...)` sends them); and a steady client's picks that each carry the
//!   previous pick's finish (`reports`), one exchange per pick, with the ids as a JSON list
//!   (`piggy`) or in binary (`piggy-bin`).
//! - ext_proc: one full Envoy exchange per request (request headers, the same prompt's body,
//!   response headers, three response body chunks, the last ending the stream), at
//!   concurrency 64, each task on its own keep-alive gRPC connection (`ext`) or the 64 streams
//!   over 2 connections, as a gateway with two worker threads multiplexes them (`ext-mux`); and
//!   (`ext-headers`, on a second router started with `--ext-proc-observe headers`) the exchange
//!   Envoy then makes: request headers, body and response headers, then the stream's end, on a
//!   connection per stream and over 2 connections (`ext-headers-mux`).
//!
//! `cargo bench -p kvrouter --bench picker`    (bounded: some 70,000 loopback requests);
//! `KVROUTER_PICKER_BIN=<kvrouter>` measures another build of the router with the same client.

#![allow(missing_docs)]

mod ext;

use ext::ext_proc_exchanges;
use serde_json::json;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_kvrouter");
const PROMPT_TOKENS: u64 = 2048;
const FAMILIES: u64 = 32;
/// Operations per window of a line, and windows per line.
const WINDOW: u64 = 1_000;
const WINDOWS: u64 = 11;

/// Runs `f` (the router CPU seconds it measured): those and its wall time.
async fn timed(f: impl std::future::Future<Output = f64>) -> (f64, Duration) {
    let started = Instant::now();
    let cpu = f.await;
    (cpu, started.elapsed())
}

/// The router's CPU time so far (user + system, all its threads): the run time the scheduler
/// keeps per thread in nanoseconds (`/proc/<pid>/task/*/schedstat`), where `/proc/<pid>/stat`
/// counts 10 ms ticks.
fn cpu_seconds(pid: u32) -> f64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0.0;
    };
    let ns: u64 = tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    ns as f64 / 1e9
}

/// One keep-alive client for every line, so its connections outlive a window.
fn client() -> reqwest::Client {
    static CLIENT: std::sync::OnceLock<reqwest::Client> = std::sync::OnceLock::new();
    CLIENT.get_or_init(reqwest::Client::new).clone()
}

/// The first of `n` prompt numbers no window has sent yet (each window sends new tails, as
/// one run of 4,000 did).
fn fresh_prompts(n: u64) -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(n, std::sync::atomic::Ordering::Relaxed)
}

/// A 2,048-token prompt: a 1,536-token prefix shared by its family, then its own tail.
fn prompt(i: u64) -> Vec<u64> {
    prompt_of(i, PROMPT_TOKENS)
}

/// A `tokens`-token prompt: three quarters shared by its family, then its own tail.
fn prompt_of(i: u64, tokens: u64) -> Vec<u64> {
    let family = i % FAMILIES;
    let shared = tokens * 3 / 4;
    let mut ids: Vec<u64> = (0..shared).map(|t| 1000 + family * 2000 + t).collect();
    ids.extend((0..tokens - shared).map(|t| 100_000 + (i * 7919 + t) % 20_000));
    ids
}

/// The floor under any pick: two bodiless keep-alive HTTP/1.1 exchanges (`GET /live`) per pair,
/// so the pick figures can be read as this plus the pick's own work.
async fn live_pairs(base: &str, pid: u32, n: u64, concurrency: u64) -> f64 {
    let client = client();
    let before = cpu_seconds(pid);
    let tasks: Vec<_> = (0..concurrency)
        .map(|c| {
            let (client, base) = (client.clone(), base.to_owned());
            tokio::spawn(async move {
                for _ in (c..n).step_by(concurrency as usize) {
                    for _ in 0..2 {
                        let r = client.get(format!("{base}/live")).send().await.unwrap();
                        assert_eq!(r.status(), 200);
                        r.bytes().await.unwrap();
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    cpu_seconds(pid) - before
}

/// `POST /v1/pick` with a JSON body, or a JSON part of `json_length` bytes followed by binary
/// token ids; the answer, which must be 200.
async fn post_pick(
    client: &reqwest::Client,
    base: &str,
    body: Vec<u8>,
    json_length: Option<usize>,
) -> serde_json::Value {
    let mut r = client.post(format!("{base}/v1/pick"));
    r = match json_length {
        None => r.header("content-type", "application/json"),
        Some(n) => r
            .header("content-type", "application/octet-stream")
            .header("x-kvrouter-json-length", n),
    };
    let r = r.body(body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

async fn pick_pairs(base: &str, pid: u32, n: u64, concurrency: u64) -> f64 {
    pick_pairs_of(base, pid, n, concurrency, PROMPT_TOKENS, false).await
}

/// Picks of `tokens`-token prompts, each then finished; `binary`: the ids follow an empty
/// JSON part as 4-byte little-endian words (`x-kvrouter-json-length`), as the Python client's
/// `pick(token_ids=...)` sends them, instead of a JSON list.
async fn pick_pairs_of(
    base: &str,
    pid: u32,
    n: u64,
    concurrency: u64,
    tokens: u64,
    binary: bool,
) -> f64 {
    let client = client();
    let first = fresh_prompts(n);
    let bodies: Vec<Vec<u8>> = (first..first + n)
        .map(|i| {
            let ids = prompt_of(i, tokens);
            if binary {
                let ids = ids.into_iter().flat_map(|t| (t as u32).to_le_bytes());
                b"{}".iter().copied().chain(ids).collect()
            } else {
                serde_json::to_vec(&json!({"token_ids": ids})).unwrap()
            }
        })
        .collect();
    let bodies = std::sync::Arc::new(bodies);
    let json_length = binary.then_some(2);
    let before = cpu_seconds(pid);
    let tasks: Vec<_> = (0..concurrency)
        .map(|c| {
            let (client, base, bodies) = (client.clone(), base.to_owned(), bodies.clone());
            tokio::spawn(async move {
                for i in (c..n).step_by(concurrency as usize) {
                    let body = bodies[i as usize].clone();
                    let v = post_pick(&client, &base, body, json_length).await;
                    let id = v["id"].as_str().unwrap();
                    let r = client
                        .post(format!("{base}/v1/pick/{id}/finish"))
                        .json(&json!({"completion_tokens": 16}))
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(r.status(), 200);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    cpu_seconds(pid) - before
}

/// A steady pick client: each pick carries the previous pick's finish (`reports`), so each
/// pick is one HTTP exchange; each task's last pick is finished with `POST /v1/pick/reports`.
/// `binary`: the token ids follow the JSON part as 4-byte little-endian words
/// (`x-kvrouter-json-length`) instead of being a JSON list.
async fn piggy_backed_picks(base: &str, pid: u32, n: u64, concurrency: u64, binary: bool) -> f64 {
    let client = client();
    // `{"token_ids": [...]}` less its opening brace, for the reports to go in front; or `}`
    // and the binary ids.
    let first = fresh_prompts(n);
    let tails: Vec<Vec<u8>> = (first..first + n)
        .map(|i| {
            if binary {
                let ids = prompt(i).into_iter().flat_map(|t| (t as u32).to_le_bytes());
                b"}".iter().copied().chain(ids).collect()
            } else {
                serde_json::to_vec(&json!({"token_ids": prompt(i)})).unwrap()[1..].to_vec()
            }
        })
        .collect();
    let tails = std::sync::Arc::new(tails);
    let before = cpu_seconds(pid);
    let tasks: Vec<_> = (0..concurrency)
        .map(|c| {
            let (client, base, tails) = (client.clone(), base.to_owned(), tails.clone());
            tokio::spawn(async move {
                let mut previous: Option<String> = None;
                for i in (c..n).step_by(concurrency as usize) {
                    let mut body = b"{".to_vec();
                    if let Some(id) = &previous {
                        let r = json!([{"id": id, "event": "finish", "completion_tokens": 16}]);
                        let comma = if binary { "" } else { ", " };
                        body.extend_from_slice(format!("\"reports\": {r}{comma}").as_bytes());
                    }
                    let json_length = binary.then_some(body.len() + 1);
                    body.extend_from_slice(&tails[i as usize]);
                    let v = post_pick(&client, &base, body, json_length).await;
                    if previous.is_some() {
                        assert_eq!(v["reports"][0]["status"], "released", "{v}");
                    }
                    previous = Some(v["id"].as_str().unwrap().to_owned());
                }
                if let Some(id) = previous {
                    let r = client
                        .post(format!("{base}/v1/pick/reports"))
                        .json(&json!({"reports": [{"id": id, "event": "finish"}]}))
                        .send()
                        .await
                        .unwrap();
                    assert_eq!(r.status(), 200);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    cpu_seconds(pid) - before
}

/// A router process under measurement.
struct Router {
    _child: tokio::process::Child,
    base: String,
    grpc: String,
    pid: u32,
    /// Its CPU rate while idle (embedded engines, timers), taken off each line.
    idle_per_s: f64,
}

/// Starts the router (`KVROUTER_PICKER_BIN`, else this build) with `extra` flags, pinned to
/// core 0 when `taskset` exists; `None` when it does not start (an older build without a flag).
async fn start_router(extra: &[&str]) -> Option<Router> {
    let taskset = std::process::Command::new("taskset")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    // Another build of the router (a before/after comparison under the same conditions).
    let bin = std::env::var("KVROUTER_PICKER_BIN").unwrap_or_else(|_| BIN.to_owned());
    let mut cmd = if taskset {
        let mut c = Command::new("taskset");
        c.args(["-c", "0", &bin]);
        c
    } else {
        Command::new(&bin)
    };
    let args = [
        "serve",
        "--port",
        "0",
        "--mock-workers",
        "4",
        "--ext-proc-port",
        "0",
    ];
    let mut child = cmd
        .args(args)
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
        .await
        .unwrap()
        .unwrap()?;
    let field = |p: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(p))
            .unwrap()
            .to_owned()
    };
    let (base, grpc) = (format!("http://{}", field("http://")), field("ext_proc="));
    let pid = child.id().unwrap();
    // The router process counts its embedded engines' CPU too; they are idle here (nothing is
    // forwarded to them), which the idle sample below bounds.
    let idle_start = cpu_seconds(pid);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle_per_s = (cpu_seconds(pid) - idle_start) / 2.0;
    println!(
        "router {extra:?} idle CPU: {:.1} ms/s (embedded engines, timers; taken off each line below)",
        idle_per_s * 1e3
    );
    Some(Router {
        _child: child,
        base,
        grpc,
        pid,
        idle_per_s,
    })
}

#[tokio::main]
async fn main() {
    // Warm up (caches, connections, the index's families), then measure ([`windows`]).
    // `KVROUTER_PICKER_LINES=piggy,pair` runs only those lines (names below), to profile one.
    let lines = std::env::var("KVROUTER_PICKER_LINES").unwrap_or_default();
    let want = |name: &str| lines.is_empty() || lines.split(',').any(|l| l.trim() == name);
    let router = start_router(&[]).await.expect("the router starts");
    let (base, pid, idle_per_s) = (&router.base, router.pid, router.idle_per_s);
    pick_pairs(base, pid, 500, 16).await;
    if want("pair") {
        let (us, rate) = windows(idle_per_s, |n| pick_pairs(base, pid, n, 16)).await;
        println!(
            "pair: pick + finish, {PROMPT_TOKENS}-token prompt as token ids, concurrency 16: {us} µs router CPU per pair ({rate:.0} pairs/s)"
        );
    }
    if want("pair-bin") {
        let (us, _) = windows(idle_per_s, |n| {
            pick_pairs_of(base, pid, n, 16, PROMPT_TOKENS, true)
        })
        .await;
        println!(
            "pair-bin: the same with the token ids in binary after the JSON part (x-kvrouter-json-length), concurrency 16: {us} µs router CPU per pair"
        );
    }
    // The response body mode a gateway sets for buffered answers (`BUFFERED`).
    ext_lines(&router, 2, "ext", "ext_proc full exchange", &want).await;
    if want("floor") {
        let (us, _) = windows(idle_per_s, |n| live_pairs(base, pid, n, 16)).await;
        println!("floor: two GET /live per pair, concurrency 16: {us} µs router CPU per pair");
    }
    if want("short") {
        let (us, _) = windows(idle_per_s, |n| pick_pairs_of(base, pid, n, 16, 64, false)).await;
        println!(
            "short: pick + finish, 64-token prompt as token ids, concurrency 16: {us} µs router CPU per pair"
        );
    }
    if want("piggy") {
        let (us, _) = windows(idle_per_s, |n| piggy_backed_picks(base, pid, n, 16, false)).await;
        println!(
            "piggy: pick with the previous pick's finish piggy-backed, {PROMPT_TOKENS}-token prompt as token ids, concurrency 16: {us} µs router CPU per pick"
        );
    }
    if want("piggy-bin") {
        let (us, _) = windows(idle_per_s, |n| piggy_backed_picks(base, pid, n, 16, true)).await;
        println!(
            "piggy-bin: the same with the token ids in binary after the JSON part (x-kvrouter-json-length), concurrency 16: {us} µs router CPU per pick"
        );
    }
    if want("ext-headers") || want("ext-headers-mux") {
        drop(router);
        // Its own router: `--ext-proc-observe` is a process's setting.
        let Some(router) = start_router(&["--ext-proc-observe", "headers"]).await else {
            println!("ext-headers: skipped (this router build has no --ext-proc-observe)");
            return;
        };
        // The response body mode a gateway sets for streamed answers (`STREAMED`); the picker's
        // override turns it off after the response headers.
        let exchange = "ext_proc exchange with --ext-proc-observe headers (request headers, body, \
                        response headers, then the stream's end)";
        ext_lines(&router, 1, "ext-headers", exchange, &want).await;
    }
}

/// The ext_proc lines `name` and `name-mux` (each when `want` names it) against `router`, with
/// the gateway's `response_body_mode`: each of 64 streams on its own keep-alive gRPC
/// connection, then the 64 over 2 connections, as a gateway of two worker threads sends them.
async fn ext_lines(
    router: &Router,
    response_body_mode: i32,
    name: &str,
    exchange: &str,
    want: &impl Fn(&str) -> bool,
) {
    let (grpc, pid) = (&router.grpc, router.pid);
    for (suffix, connections, over) in [
        ("", 64, "a keep-alive gRPC connection per stream"),
        ("-mux", 2, "over 2 keep-alive gRPC connections"),
    ] {
        let line = format!("{name}{suffix}");
        if !want(&line) {
            continue;
        }
        ext_proc_exchanges(grpc, pid, 500, 64, response_body_mode, connections).await;
        let (us, rate) = windows(router.idle_per_s, |n| {
            ext_proc_exchanges(grpc, pid, n, 64, response_body_mode, connections)
        })
        .await;
        println!(
            "{line}: {exchange}, {PROMPT_TOKENS}-token prompt, concurrency 64, {over}: {us} µs router CPU per exchange ({rate:.0} exchanges/s)"
        );
    }
}

/// Runs a line in WINDOWS windows of WINDOW operations: router CPU per operation (less the
/// idle rate over each window's wall time), as `median (min–max)` in µs, and operations/s.
/// The median of windows resists the bursts of other work on a shared machine.
async fn windows<F, Fut>(idle_per_s: f64, mut line: F) -> (String, f64)
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = f64>,
{
    let mut per_op = Vec::new();
    let mut wall_total = Duration::ZERO;
    for _ in 0..WINDOWS {
        let (cpu, wall) = timed(line(WINDOW)).await;
        wall_total += wall;
        per_op.push((cpu - idle_per_s * wall.as_secs_f64()) / WINDOW as f64 * 1e6);
    }
    per_op.sort_by(f64::total_cmp);
    let text = format!(
        "{:.1} ({:.1}–{:.1})",
        per_op[per_op.len() / 2],
        per_op[0],
        per_op[per_op.len() - 1]
    );
    (text, (WINDOWS * WINDOW) as f64 / wall_total.as_secs_f64())
}
