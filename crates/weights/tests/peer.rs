//! In-region fan-out: three workers fetch a version from one peer; the peer pulls it from the
//! object store once. Ranged resumes and corrupted transfers over HTTP.

use kvrouter_weights::gen::{write_checkpoint, GenSpec, Update};
use kvrouter_weights::serve::{app, Peer};
use kvrouter_weights::store::{publish, Store};
use kvrouter_weights::transfer::{
    fetch_version, pull_from_peer, PeerClient, Source, PEER_READ_TIMEOUT,
};
use kvrouter_weights::{CodecOptions, WeightsError};
use std::path::Path;

mod common;
use common::{add_nested_file, NESTED};

fn spec() -> GenSpec {
    GenSpec {
        total_bytes: 2 << 20,
        tensor_bytes: 512 << 10,
        cols: 512,
        files: 2,
        seed: 9,
    }
}

async fn published_store(root: &Path) -> Store {
    published_store_of(root, &spec()).await
}

async fn published_store_of(root: &Path, spec: &GenSpec) -> Store {
    std::fs::create_dir_all(root.join("store")).unwrap();
    let store = Store::open(&format!("file://{}", root.join("store").display()), &[]).unwrap();
    let opts = CodecOptions {
        zstd_level: 1,
        chunk_bytes: 256 << 10,
        threads: 2,
    };
    for k in 0..=2u32 {
        let d = root.join(format!("ckpt/v{k}"));
        write_checkpoint(&d, spec, Update::Rl { lr: 1e-5, steps: k }, 2).unwrap();
        add_nested_file(&d, k);
        let prev = (k > 0).then(|| root.join(format!("ckpt/v{}", k - 1)));
        publish(&store, &d, k as u64, prev.as_deref(), 100, &opts)
            .await
            .unwrap();
    }
    // A store of its own for the peer, whose read count starts at 0 (publishing reads
    // `latest` first).
    Store::open(&format!("file://{}", root.join("store").display()), &[]).unwrap()
}

async fn start_peer(root: &Path, store: Store) -> String {
    let peer = Peer::new(root.join("peer-cache"), Some(store), 2, 3);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app(peer)).await.unwrap() });
    format!("http://{addr}")
}

async fn stats(url: &str) -> serde_json::Value {
    reqwest::get(format!("{url}/v1/stats"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_workers_one_store_pull() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let store = published_store(root).await;
    let url = start_peer(root, store).await;
    let source = Source {
        peer: Some(url.clone()),
        store: None,
        keep: None,
        protect: Vec::new(),
    };
    let fetches = (0..3).map(|w| {
        let source = source.clone();
        let cache = root.join(format!("worker-{w}"));
        async move { fetch_version(&source, 2, &cache, 2).await }
    });
    for r in futures::future::join_all(fetches).await {
        let dir = r.unwrap();
        for f in [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            NESTED,
        ] {
            assert!(
                std::fs::read(dir.join(f)).unwrap()
                    == std::fs::read(root.join("ckpt/v2").join(f)).unwrap()
            );
        }
    }
    let s = stats(&url).await;
    assert_eq!(s["store_pulls"], 1, "{s}");
    // One pull from v0: whether v2 is there (the HEAD of its delta), then `latest` (the pull's
    // own check), LIST of base/ and of delta/, the marker and 3 files of base/v0 (2 shards,
    // `original/…`), 2 deltas.
    assert_eq!(s["store_reads"], 10, "{s}");
    assert_eq!(s["files_served"], 9, "{s}");
    // Asking again costs the store nothing.
    fetch_version(&source, 2, &root.join("worker-3"), 2)
        .await
        .unwrap();
    assert_eq!(stats(&url).await["store_reads"], 10);
    // A version the store lacks is a 404 at once from a peer with nothing cached: two HEADs
    // (its delta, its full checkpoint), no pull of the chain below it.
    let fresh = Peer::new(
        root.join("fresh-cache"),
        Some(Store::open(&format!("file://{}", root.join("store").display()), &[]).unwrap()),
        2,
        3,
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let fresh_url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app(fresh)).await.unwrap() });
    let r = reqwest::get(format!("{fresh_url}/v1/versions/50/marker"))
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let s = stats(&fresh_url).await;
    assert_eq!(
        (s["store_pulls"].as_u64(), s["store_reads"].as_u64()),
        (Some(0), Some(2)),
        "{s}"
    );
    assert!(!root.join("fresh-cache/.work").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranged_resume_and_a_corrupted_transfer() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let store = published_store(root).await;
    let url = start_peer(root, store).await;
    let client = PeerClient::new(PEER_READ_TIMEOUT).unwrap();
    let shard = "model-00001-of-00002.safetensors";
    let full = std::fs::read(root.join("ckpt/v1").join(shard)).unwrap();

    // Half a shard already here (an earlier pull's work directory): the rest comes as 206.
    let work = root.join("work");
    std::fs::create_dir_all(work.join("peer-v1")).unwrap();
    std::fs::write(work.join(kvrouter_weights::workdir::WORK_MARK), b"").unwrap();
    std::fs::write(
        work.join("peer-v1").join(format!("{shard}.partial")),
        &full[..full.len() / 2],
    )
    .unwrap();
    let n = pull_from_peer(&client, &url, 1, &root.join("out"), &work, 2)
        .await
        .unwrap();
    let len = |f: &str| {
        std::fs::metadata(root.join("ckpt/v1").join(f))
            .unwrap()
            .len()
    };
    let others = len("model-00002-of-00002.safetensors") + len(NESTED);
    assert_eq!(n, (full.len() - full.len() / 2) as u64 + others);
    assert!(std::fs::read(root.join("out").join(shard)).unwrap() == full);

    // A wrong byte in what was transferred before the resume: caught, named, nothing left.
    let work = root.join("work2");
    std::fs::create_dir_all(work.join("peer-v1")).unwrap();
    std::fs::write(work.join(kvrouter_weights::workdir::WORK_MARK), b"").unwrap();
    let mut bad = full[..full.len() / 2].to_vec();
    let at = bad.len() - 1;
    bad[at] ^= 0x10;
    std::fs::write(work.join("peer-v1").join(format!("{shard}.partial")), &bad).unwrap();
    let err = pull_from_peer(&client, &url, 1, &root.join("out2"), &work, 2)
        .await
        .unwrap_err();
    match err {
        WeightsError::Corrupted {
            tensor, version, ..
        } => {
            assert!(tensor.starts_with("model.layers."), "{tensor}");
            assert_eq!(version, "v1");
        }
        e => panic!("unexpected {e}"),
    }
    assert!(!root.join("out2").exists());

    // Unknown version: an OpenAI-shaped 404 naming the field, from a peer without a store.
    let bare = Peer::new(root.join("empty"), None, 1, 3);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app(bare)).await.unwrap() });
    let r = reqwest::get(format!("http://{addr}/v1/versions/7/marker"))
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["param"], "version");

    // Every refusal is OpenAI-shaped JSON: an unknown route, a wrong method, a range outside
    // the file (they were empty bodies).
    let http = reqwest::Client::new();
    let cases = [
        (http.get(format!("{url}/nonexistent")), 404, "url"),
        (http.post(format!("{url}/v1/versions/1")), 405, "method"),
        (
            http.get(format!("{url}/v1/versions/1/files/{shard}"))
                .header("range", format!("bytes={}-", full.len() + 10)),
            416,
            "range",
        ),
    ];
    for (req, status, param) in cases {
        let r = req.send().await.unwrap();
        assert_eq!(r.status().as_u16(), status);
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(body["error"]["param"], param, "{body}");
        assert!(body["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    }
}

/// A peer that answers the marker, then sends the start of a file and nothing more: the pull
/// fails after the stall bound, naming the file, with nothing left in `out`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_transfer_that_stalls_fails_after_the_stall_bound() {
    use axum::routing::get;
    use futures::StreamExt;
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let _store = published_store(root).await;
    let marker = std::fs::read(root.join("ckpt/v1/weights.json")).unwrap();
    let stalling = axum::Router::new()
        .route(
            "/v1/versions/1/marker",
            get(move || async move { marker.clone() }),
        )
        .route(
            "/v1/versions/1/files/{name}",
            get(|| async {
                let start = futures::stream::once(async {
                    Ok::<_, std::io::Error>(axum::body::Bytes::from_static(b"safetens"))
                });
                axum::body::Body::from_stream(start.chain(futures::stream::pending()))
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, stalling).await.unwrap() });
    let client = PeerClient::new(std::time::Duration::from_millis(300)).unwrap();
    let err = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        pull_from_peer(&client, &url, 1, &root.join("out"), &root.join("work"), 2),
    )
    .await
    .expect("the stall bound ends the pull")
    .unwrap_err()
    .to_string();
    assert!(err.contains("stalled") && err.contains("/files/"), "{err}");
    assert!(!root.join("out").exists());
}

/// A peer keeping two versions is asked for a third while a client still downloads the oldest:
/// the pull keeps the version being sent (it recycled its files in place under the download,
/// which then got bytes of no version), and a read of a version the pull may recycle waits for
/// it. Found by a hostile probe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_being_downloaded_is_not_recycled_under_the_download() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let big = GenSpec {
        total_bytes: 24 << 20,
        tensor_bytes: 4 << 20,
        cols: 1024,
        files: 1,
        seed: 5,
    };
    let store = published_store_of(root, &big).await;
    let peer = Peer::new(root.join("peer-cache"), Some(store), 2, 2);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app(peer)).await.unwrap() });
    let get = |path: String| {
        let url = url.clone();
        async move {
            let r = reqwest::get(format!("{url}{path}")).await.unwrap();
            assert!(r.status().is_success(), "{path}: {}", r.status());
            r
        }
    };
    get("/v1/versions/0/marker".into()).await;
    get("/v1/versions/1/marker".into()).await;
    let shard = "model-00001-of-00001.safetensors";
    let want = std::fs::read(root.join("ckpt/v0").join(shard)).unwrap();
    // Start the download of v0 and take only its first chunk: the rest waits in the peer.
    let mut download = get(format!("/v1/versions/0/files/{shard}")).await;
    let mut got = download
        .chunk()
        .await
        .unwrap()
        .expect("a first chunk")
        .to_vec();
    assert!(
        got.len() < want.len() / 2,
        "the file should not fit in one read"
    );
    // v2 is pulled; keeping two versions, it would recycle v0.
    get("/v1/versions/2/marker".into()).await;
    while let Some(c) = download.chunk().await.unwrap() {
        got.extend_from_slice(&c);
    }
    assert!(got == want, "the download of v0 is v0's bytes");
    // v2 came whole, and v1 is still served.
    let v2 = get(format!("/v1/versions/2/files/{shard}"))
        .await
        .bytes()
        .await
        .unwrap();
    assert!(v2 == std::fs::read(root.join("ckpt/v2").join(shard)).unwrap());
    get("/v1/versions/1/marker".into()).await;
}

/// A peer that answers every marker request with `marker` (or, without one, an endless body)
/// and every file request with an endless body; each answer stops after `cap` bytes at most
/// (the test's bound). Answers `Connection: close`, one request a connection.
async fn flooding_peer(marker: Option<Vec<u8>>, cap: usize) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let marker = marker.clone();
            tokio::spawn(async move {
                let mut head = vec![0u8; 4096];
                let n = sock.read(&mut head).await.unwrap_or(0);
                let line = String::from_utf8_lossy(&head[..n]).to_string();
                let is_marker = line.lines().next().unwrap_or("").contains("/marker ");
                if let (true, Some(m)) = (is_marker, &marker) {
                    let reply = format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                        m.len()
                    );
                    let _ = sock.write_all(reply.as_bytes()).await;
                    let _ = sock.write_all(m).await;
                    return;
                }
                let _ = sock
                    .write_all(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n")
                    .await;
                let chunk = vec![b' '; 1 << 20];
                let mut sent = 0;
                while sent < cap {
                    if sock.write_all(&chunk).await.is_err() {
                        return;
                    }
                    sent += chunk.len();
                }
            });
        }
    });
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_sends_too_much_is_cut_off_at_the_markers_sizes() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let _ = published_store(root).await;
    let client = PeerClient::new(PEER_READ_TIMEOUT).unwrap();
    let marker = std::fs::read(root.join("ckpt/v1/weights.json")).unwrap();
    let largest = std::fs::read_dir(root.join("ckpt/v1"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .max()
        .unwrap();

    // Files without end: the pull fails at the first file, whose partial stays within its size.
    let url = flooding_peer(Some(marker), 64 << 20).await;
    let work = root.join("w1");
    let err = pull_from_peer(&client, &url, 1, &root.join("o1"), &work, 2)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("more than the marker's"), "{err}");
    let on_disk: u64 = walk(&work)
        .iter()
        .map(|p| p.metadata().unwrap().len())
        .sum();
    assert!(on_disk <= largest, "{on_disk} bytes in the work directory");
    assert!(!root.join("o1").exists());

    // A marker without end: refused at the bound, not read into memory whole.
    let url = flooding_peer(None, 200 << 20).await;
    let err = pull_from_peer(&client, &url, 1, &root.join("o2"), &root.join("w2"), 2)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("marker is larger than"), "{err}");
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}
