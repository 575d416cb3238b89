//! A loopback TCP proxy a test controls: stopped, black-holed (a link that fails without
//! closing), or slow to carry the service's answers.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// A loopback TCP proxy to a service on a port of its own. Stopped, nothing listens; black-holed,
/// its connections stay open and every byte is dropped (a link that fails without closing).
pub struct Proxy {
    port: u16,
    target: u16,
    controls: Arc<Controls>,
    task: Option<JoinHandle<()>>,
}

/// What the test sets while the proxy runs.
#[derive(Default)]
struct Controls {
    blackhole: AtomicBool,
    /// How long each read from the service waits before it is passed on, in milliseconds.
    answer_delay_ms: AtomicU64,
}

impl Proxy {
    pub fn new(target: u16) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        Self {
            port,
            target,
            controls: Arc::default(),
            task: None,
        }
    }

    /// `127.0.0.1:port`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub async fn start(&mut self) {
        self.controls.blackhole.store(false, Ordering::SeqCst);
        let listener = TcpListener::bind(("127.0.0.1", self.port)).await.unwrap();
        let (target, controls) = (self.target, self.controls.clone());
        self.task = Some(tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(("127.0.0.1", target)).await else {
                    continue;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                conns.spawn(pump(cr, sw, controls.clone(), false));
                conns.spawn(pump(sr, cw, controls.clone(), true));
            }
        }));
    }

    /// Stops listening and drops every connection (once its task is gone, the port is free).
    pub async fn stop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
            let _ = t.await;
        }
    }

    /// Keeps the connections open and drops what they carry.
    pub fn black_hole(&self) {
        self.controls.blackhole.store(true, Ordering::SeqCst);
    }

    /// Holds each read from the service this long before passing it on (0: at once).
    pub fn delay_answers(&self, delay: std::time::Duration) {
        let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.controls.answer_delay_ms.store(ms, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    controls: Arc<Controls>,
    answers: bool,
) {
    let mut buf = vec![0u8; 16 * 1024];
    // Once black-holed, a connection stays so (the client must notice and reconnect).
    let mut dead = false;
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let delay = controls.answer_delay_ms.load(Ordering::SeqCst);
        if answers && delay > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
        }
        dead |= controls.blackhole.load(Ordering::SeqCst);
        if !dead && to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
