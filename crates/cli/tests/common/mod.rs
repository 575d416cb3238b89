//! Starting the `kvrouter` binary in tests: it prints one line with its addresses on start.
#![allow(dead_code, unreachable_pub)]

pub mod proxy;

use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::time::timeout;

/// A running `kvrouter` process, killed on drop.
pub struct Proc {
    pub child: Child,
    /// Its startup line.
    pub line: String,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

impl Proc {
    /// The `http://host:port` it listens on.
    pub fn http(&self) -> String {
        self.line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .expect("an http address")
            .to_owned()
    }

    /// Sends `signal` (`-TERM`, `-STOP`, `-CONT`) to the process with `kill`.
    pub fn signal(&self, signal: &str) {
        let pid = self.child.id().expect("running").to_string();
        let ok = std::process::Command::new("kill")
            .args([signal, &pid])
            .status()
            .expect("kill runs")
            .success();
        assert!(ok, "kill {signal} {pid}");
    }

    /// The value of `key=value` on the startup line.
    pub fn field(&self, key: &str) -> String {
        let prefix = format!("{key}=");
        self.line
            .split_whitespace()
            .find_map(|w| w.strip_prefix(prefix.as_str()))
            .expect("the field")
            .to_owned()
    }
}

/// A loopback port free at the time of asking (for a process told to listen on it).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts `kvrouter ARGS` and waits (bounded) for its startup line.
pub async fn spawn(args: &[&str]) -> Proc {
    spawn_with_env(args, &[]).await
}

/// Starts `kvrouter ARGS` with extra environment variables and waits (bounded) for its
/// startup line.
pub async fn spawn_with_env(args: &[&str], env: &[(&str, &str)]) -> Proc {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start kvrouter");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let line = timeout(Duration::from_secs(60), lines.next_line())
        .await
        .expect("startup line in time")
        .expect("readable stdout")
        .expect("a startup line");
    Proc { child, line }
}

/// What a poll's check gives: `true` or `Some(value)` when done, `false` or `None` when not yet.
pub trait Ready {
    type Value;
    fn ready(self) -> Option<Self::Value>;
}

impl Ready for bool {
    type Value = ();
    fn ready(self) -> Option<()> {
        self.then_some(())
    }
}

impl<T> Ready for Option<T> {
    type Value = T;
    fn ready(self) -> Option<T> {
        self
    }
}

/// Polls every 20 ms, bounded by `within`, until `check` is ready (see [`Ready`]); `None` when
/// the time is up.
pub async fn poll<F, Fut>(within: Duration, mut check: F) -> Option<<Fut::Output as Ready>::Value>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future,
    Fut::Output: Ready,
{
    let start = std::time::Instant::now();
    while start.elapsed() < within {
        if let Some(v) = check().await.ready() {
            return Some(v);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

/// Polls every 20 ms, bounded by `within`, until `check` is ready (`true` or a value; see
/// [`Ready`]); panics naming `what` when the time is up.
pub async fn until<F, Fut>(what: &str, within: Duration, check: F) -> <Fut::Output as Ready>::Value
where
    F: FnMut() -> Fut,
    Fut: std::future::Future,
    Fut::Output: Ready,
{
    match poll(within, check).await {
        Some(v) => v,
        None => panic!("timed out after {within:?} waiting for {what}"),
    }
}

/// The text of `base`'s `/metrics`; panics when it cannot be read (the process is up).
pub async fn metrics(base: &str) -> String {
    reqwest::get(format!("{base}/metrics"))
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("the /metrics body")
}

/// The sum of the samples on the lines of a `/metrics` text that start with `series` (a metric
/// name, or a name with its labels or their beginning: `name{worker="0"`); `None` when there is
/// no such sample.
pub fn metric_in(text: &str, series: &str) -> Option<f64> {
    let mut values = text
        .lines()
        .filter(|l| l.starts_with(series))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .peekable();
    values.peek()?;
    Some(values.sum())
}

/// [`metric_in`] of `base`'s `/metrics`.
pub async fn metric(base: &str, series: &str) -> Option<f64> {
    metric_in(&metrics(base).await, series)
}

/// Polls `base`'s `/metrics` (bounded by `within`) until `series` sums to `want` (an absent
/// series counts 0); panics with the last value seen when the time is up.
pub async fn until_metric(base: &str, series: &str, want: f64, within: Duration) {
    let last = std::cell::Cell::new(None);
    let seen = &last;
    let reached = poll(within, || async move {
        let v = metric(base, series).await;
        seen.set(v);
        v.unwrap_or(0.0) == want
    })
    .await;
    assert!(
        reached.is_some(),
        "{series} stayed {:?} for {within:?}, want {want}",
        last.get()
    );
}

/// `kvrouter serve` over the one worker at `url` (no health checks), with `extra` flags.
pub async fn serve_one_worker(url: &str, name: &str, extra: &[&str]) -> (Proc, std::path::PathBuf) {
    serve_workers(&[url], name, extra).await
}

/// `kvrouter serve` over the workers at `urls` (a workers file, in that order: ids 0, 1, ...;
/// no health checks), with `extra` flags; the folder of the file, for the caller to remove.
pub async fn serve_workers(
    urls: &[&str],
    name: &str,
    extra: &[&str],
) -> (Proc, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("kvr-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let workers = dir.join("workers.toml");
    let entries: String = urls
        .iter()
        .map(|url| format!("[[workers]]\nurl = \"{url}\"\n"))
        .collect();
    std::fs::write(&workers, entries).unwrap();
    let mut args = vec![
        "serve",
        "--port",
        "0",
        "--workers-file",
        workers.to_str().unwrap(),
        "--health-check-interval-secs",
        "0",
    ];
    args.extend(extra);
    (spawn(&args).await, dir)
}
