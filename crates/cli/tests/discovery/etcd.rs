//! A real etcd for the discovery tests (Debian's `etcd-server`): started on free loopback
//! ports with a temporary data dir; the tests fail, not skip, without the binary.

use super::{free_port, poll};
use serde_json::Value;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;
use tokio::process::{Child, Command};

/// A real etcd on free loopback ports with a temporary data dir; killed and removed on drop.
pub(crate) struct Etcd {
    child: Child,
    dir: PathBuf,
    pub(crate) client: String,
    peer: String,
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn etcd_binary() -> PathBuf {
    let candidates = ["/usr/bin/etcd", "/usr/local/bin/etcd"];
    candidates
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .unwrap_or_else(|| {
            panic!(
                "etcd is not installed (apt-get install etcd-server): this test needs a real etcd"
            )
        })
}

pub(crate) async fn start_etcd() -> Etcd {
    let (client_port, peer_port) = (free_port(), free_port());
    let dir = std::env::temp_dir().join(format!(
        "kvrouter-etcd-{}-{client_port}",
        std::process::id()
    ));
    let client = format!("http://127.0.0.1:{client_port}");
    let peer = format!("http://127.0.0.1:{peer_port}");
    let child = etcd_process(&dir, &client, &peer);
    let etcd = Etcd {
        child,
        dir,
        client,
        peer,
    };
    etcd.answers().await;
    etcd
}

fn etcd_process(dir: &std::path::Path, client: &str, peer: &str) -> Child {
    Command::new(etcd_binary())
        .args(["--name", "test", "--data-dir"])
        .arg(dir)
        .args([
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
        ])
        .args([
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
        ])
        .args(["--initial-cluster", &format!("test={peer}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start etcd")
}

impl Etcd {
    async fn answers(&self) {
        let http = reqwest::Client::new();
        poll("etcd answers", Duration::from_secs(30), || async {
            http.post(format!("{}/v3/kv/range", self.client))
                .body(r#"{"key":"AA=="}"#)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
        })
        .await;
    }

    /// Stops etcd and starts it again on the same ports with an empty data dir: its
    /// revisions start over.
    pub(crate) async fn restart_empty(&mut self) {
        self.child.start_kill().unwrap();
        let _ = self.child.wait().await;
        let _ = std::fs::remove_dir_all(&self.dir);
        self.child = etcd_process(&self.dir, &self.client, &self.peer);
        self.answers().await;
    }

    /// Puts `value` under the raw bytes of `key`.
    pub(crate) async fn put(&self, key: &[u8], value: &str) {
        let body = format!(
            r#"{{"key":"{}","value":"{}"}}"#,
            b64(key),
            b64(value.as_bytes())
        );
        let r = reqwest::Client::new()
            .post(format!("{}/v3/kv/put", self.client))
            .body(body)
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "put: {}", r.status());
    }
}

/// base64 by hand: the test needs no extra crate for one encoding.
fn b64(bytes: &[u8]) -> String {
    use std::fmt::Write;
    const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in bytes.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            let _ = if i <= c.len() {
                out.write_char(A[(n >> (18 - 6 * i) & 63) as usize] as char)
            } else {
                out.write_char('=')
            };
        }
    }
    out
}

/// Whether `key` exists in etcd.
pub(crate) async fn key_exists(http: &reqwest::Client, etcd: &str, key: &str) -> bool {
    let answer: Value = http
        .post(format!("{etcd}/v3/kv/range"))
        .body(format!(r#"{{"key":"{}"}}"#, b64(key.as_bytes())))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    answer["kvs"].as_array().is_some_and(|k| !k.is_empty())
}
