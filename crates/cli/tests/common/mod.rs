//! Starting the `kvrouter` binary in tests: it prints one line with its addresses on start.
#![allow(dead_code, unreachable_pub)]

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

/// Polls every 20 ms, bounded by `within`, until `check` gives a value; panics naming `what`
/// when the time is up.
pub async fn until<T, F, Fut>(what: &str, within: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = std::time::Instant::now();
    while start.elapsed() < within {
        if let Some(v) = check().await {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out after {within:?} waiting for {what}");
}
