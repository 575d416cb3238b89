//! publish/pull through object storage: the local filesystem store, and a real S3-compatible
//! server on loopback (moto in server mode; the test fails when it is not installed: `.ci/run`
//! installs it).

use kvrouter_weights::gen::{write_checkpoint, GenSpec, Update};
use kvrouter_weights::store::{publish, pull, pull_recycling, Store};
use kvrouter_weights::transfer::{fetch_version, Source};
use kvrouter_weights::{CodecOptions, WeightsError};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{add_nested_file, assert_same_files, checkpoint_files, copy_dir};

fn spec() -> GenSpec {
    GenSpec {
        total_bytes: 3 << 20,
        tensor_bytes: 512 << 10,
        cols: 512,
        files: 2,
        seed: 42,
    }
}

fn opts() -> CodecOptions {
    CodecOptions {
        zstd_level: 1,
        chunk_bytes: 256 << 10,
        threads: 2,
    }
}

/// Versions 0..=n of the RL model (lr 1e-5) under `root/ckpt/vK`.
fn versions(root: &Path, n: u32) -> Vec<PathBuf> {
    (0..=n)
        .map(|k| {
            let d = root.join(format!("ckpt/v{k}"));
            write_checkpoint(&d, &spec(), Update::Rl { lr: 1e-5, steps: k }, 2).unwrap();
            add_nested_file(&d, k);
            d
        })
        .collect()
}

/// Publishes v0..=4 with a full checkpoint every 3 versions, then pulls and checks.
async fn publish_and_pull(store: &Store, root: &Path) {
    let dirs = versions(root, 4);
    for (k, d) in dirs.iter().enumerate() {
        let prev = k.checked_sub(1).map(|p| dirs[p].as_path());
        let r = publish(store, d, k as u64, prev, 3, &opts()).await.unwrap();
        assert_eq!(r.full, k == 0 || k == 3, "v{k}");
        if let Some(b) = r.delta_bytes {
            assert!(
                b * 10 < r.checkpoint_bytes,
                "delta {b} of {}",
                r.checkpoint_bytes
            );
        }
    }
    assert_eq!(store.latest().await.unwrap(), Some(4));
    assert_eq!(store.full_versions().await.unwrap(), vec![0, 3]);
    let work = root.join("work");
    // v2: base v0 + two deltas.
    let r = pull(store, Some(2), &root.join("out2"), None, &work, 2)
        .await
        .unwrap();
    assert_eq!((r.started_from, r.deltas, r.downloaded_full), (0, 2, true));
    assert_same_files(&dirs[2], &root.join("out2"));
    // latest (v4): nearest full checkpoint is v3.
    let r = pull(store, None, &root.join("out4"), None, &work, 2)
        .await
        .unwrap();
    assert_eq!((r.version, r.started_from, r.deltas), (4, 3, 1));
    assert_same_files(&dirs[4], &root.join("out4"));
    // From a local v2: two deltas, no full download.
    let r = pull(
        store,
        Some(4),
        &root.join("out4b"),
        Some(&root.join("out2")),
        &work,
        2,
    )
    .await
    .unwrap();
    assert_eq!((r.started_from, r.deltas, r.downloaded_full), (2, 2, false));
    assert_same_files(&dirs[4], &root.join("out4b"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_filesystem_store_publish_pull_and_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    std::fs::create_dir_all(root.join("store")).unwrap();
    let store = Store::open(&format!("file://{}", root.join("store").display()), &[]).unwrap();
    publish_and_pull(&store, root).await;

    // A published version is never replaced: publishing v1 again is refused before anything is
    // written, so the delta v2 builds on and `latest` stay as they were.
    let delta = std::fs::read(root.join("store/delta/v0-v1/delta.kvwd")).unwrap();
    let err = publish(
        &store,
        &root.join("ckpt/v2"),
        1,
        Some(&root.join("ckpt/v0")),
        3,
        &opts(),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(err.contains("--version 1") && err.contains("v4"), "{err}");
    assert_eq!(store.latest().await.unwrap(), Some(4));
    assert_eq!(
        std::fs::read(root.join("store/delta/v0-v1/delta.kvwd")).unwrap(),
        delta
    );

    // A --have of links (a model cache's snapshot) that is the wanted version is copied whole:
    // the files the links point to, not just the marker.
    let linked = root.join("linked-v2");
    std::fs::create_dir_all(&linked).unwrap();
    for e in std::fs::read_dir(root.join("ckpt/v2")).unwrap() {
        let e = e.unwrap();
        std::os::unix::fs::symlink(e.path(), linked.join(e.file_name())).unwrap();
    }
    let r = pull(
        &store,
        Some(2),
        &root.join("out2-linked"),
        Some(&linked),
        &root.join("work-linked"),
        2,
    )
    .await
    .unwrap();
    assert_eq!((r.deltas, r.downloaded_full), (0, false));
    assert_same_files(&root.join("ckpt/v2"), &root.join("out2-linked"));

    // A --have that is not a checkpoint directory is refused, not silently ignored.
    let err = pull(
        &store,
        Some(1),
        &root.join("out-nohave"),
        Some(&root.join("no-such-dir")),
        &root.join("work-nohave"),
        2,
    )
    .await
    .unwrap_err();
    assert!(
        err.is_refusal() && err.to_string().contains("--have"),
        "{err}"
    );
    assert!(!root.join("out-nohave").exists() && !root.join("work-nohave").exists());

    // Resume: half of the v0->v1 delta is already downloaded; the rest comes with a range request.
    let work = root.join("work-resume");
    std::fs::create_dir_all(&work).unwrap();
    // An earlier pull's (marked) work directory.
    std::fs::write(work.join(kvrouter_weights::workdir::WORK_MARK), b"").unwrap();
    let full = std::fs::read(root.join("store/delta/v0-v1/delta.kvwd")).unwrap();
    std::fs::write(
        work.join("delta-v0-v1.kvwd.partial"),
        &full[..full.len() / 2],
    )
    .unwrap();
    let r = pull(
        &store,
        Some(1),
        &root.join("out1"),
        Some(&root.join("ckpt/v0")),
        &work,
        2,
    )
    .await
    .unwrap();
    assert_eq!(r.deltas, 1);
    // `latest`; HEAD + ranged GET for the resumed delta; a LIST of base/ and one of delta/.
    assert_eq!(r.store_reads, 5);
    assert_same_files(&root.join("ckpt/v1"), &root.join("out1"));

    // A transfer that delivered a wrong byte is caught and named (tensor and version).
    let work = root.join("work-bad");
    std::fs::create_dir_all(&work).unwrap();
    // An earlier pull's (marked) work directory.
    std::fs::write(work.join(kvrouter_weights::workdir::WORK_MARK), b"").unwrap();
    let mut bad = full[..full.len() / 2].to_vec();
    bad[20] ^= 0xFF;
    std::fs::write(work.join("delta-v0-v1.kvwd.partial"), &bad).unwrap();
    let err = pull(
        &store,
        Some(1),
        &root.join("out1-bad"),
        Some(&root.join("ckpt/v0")),
        &work,
        2,
    )
    .await
    .unwrap_err();
    match err {
        WeightsError::Corrupted { version, .. } => assert_eq!(version, "v0->v1"),
        e => panic!("unexpected {e}"),
    }
    assert!(!root.join("out1-bad").exists());

    // A corrupted byte of a stored full checkpoint is named with its tensor and version.
    let shard = root.join("store/base/v3/model-00002-of-00002.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&shard, &bytes).unwrap();
    let err = pull(
        &store,
        Some(3),
        &root.join("out3-bad"),
        None,
        &root.join("work-bad3"),
        2,
    )
    .await
    .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("model.layers.1.k_proj.weight") && text.contains("version v3"),
        "{text}"
    );
    // Once the store is mended, the same work directory pulls it: the bad copy, complete in
    // size, was dropped rather than kept as downloaded.
    bytes[last] ^= 1;
    std::fs::write(&shard, &bytes).unwrap();
    let r = pull(
        &store,
        Some(3),
        &root.join("out3-mended"),
        None,
        &root.join("work-bad3"),
        2,
    )
    .await
    .unwrap();
    assert_eq!((r.version, r.deltas), (3, 0));
    assert_same_files(&root.join("ckpt/v3"), &root.join("out3-mended"));
}

/// The inode numbers of a directory's shard files (not its marker).
fn inodes(dir: &Path) -> Vec<u64> {
    use std::os::unix::fs::MetadataExt;
    let mut v: Vec<u64> = checkpoint_files(dir)
        .into_iter()
        .map(|f| std::fs::metadata(dir.join(f)).unwrap().ino())
        .collect();
    v.sort_unstable();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_recycles_the_given_directory_and_every_superseded_intermediate() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    std::fs::create_dir_all(root.join("store")).unwrap();
    let store = Store::open(&format!("file://{}", root.join("store").display()), &[]).unwrap();
    let dirs = versions(root, 3);
    for (k, d) in dirs.iter().enumerate() {
        let prev = k.checked_sub(1).map(|p| dirs[p].as_path());
        publish(&store, d, k as u64, prev, 10, &opts())
            .await
            .unwrap();
    }
    // v0 -> v3 by three deltas: the first overwrites `old`, the second has nothing to reuse
    // (its base is the local v0), the third overwrites the first's intermediate, i.e. `old`'s
    // files again.
    let old = root.join("old");
    copy_dir(&dirs[1], &old);
    let old_inodes = inodes(&old);
    let work = root.join("work");
    let r = pull_recycling(
        &store,
        Some(3),
        &root.join("out3"),
        Some(&dirs[0]),
        &work,
        2,
        Some(&old),
    )
    .await
    .unwrap();
    assert_eq!((r.deltas, r.recycled), (3, 2));
    assert_same_files(&dirs[3], &root.join("out3"));
    assert_eq!(inodes(&root.join("out3")), old_inodes);
    assert!(!old.exists(), "the recycled directory is consumed");
    let left: Vec<_> = std::fs::read_dir(&work)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| {
            n != kvrouter_weights::workdir::WORK_MARK && n != kvrouter_weights::workdir::WORK_LOCK
        })
        .collect();
    assert!(left.is_empty(), "intermediates left behind: {left:?}");

    // A directory that holds the base, and one whose first delta arrives damaged, are left
    // alone (the pull fails before its files are touched).
    let holder = root.join("holder");
    copy_dir(&dirs[0], &holder.join("v0"));
    copy_dir(&dirs[1], &holder);
    let err = pull_recycling(
        &store,
        Some(2),
        &root.join("out2h"),
        Some(&holder.join("v0")),
        &work,
        2,
        Some(&holder),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("which must survive"), "{err}");
    assert!(holder.join("v0").join("weights.json").exists());
    let spare = root.join("spare");
    copy_dir(&dirs[1], &spare);
    let stored = root.join("store/delta/v0-v1/delta.kvwd");
    let good = std::fs::read(&stored).unwrap();
    let mut bad = good.clone();
    bad[20] ^= 0x40;
    std::fs::write(&stored, &bad).unwrap();
    let err = pull_recycling(
        &store,
        Some(2),
        &root.join("out2b"),
        Some(&dirs[0]),
        &root.join("work-b"),
        2,
        Some(&spare),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, WeightsError::Corrupted { .. }), "{err}");
    assert_same_files(&dirs[1], &spare);
    assert!(spare.join("weights.json").exists());
    std::fs::write(&stored, &good).unwrap();

    // Nothing to apply: the directory to recycle is left alone.
    let keep = root.join("keep");
    copy_dir(&dirs[1], &keep);
    let r = pull_recycling(
        &store,
        Some(0),
        &root.join("out0"),
        Some(&dirs[0]),
        &work,
        2,
        Some(&keep),
    )
    .await
    .unwrap();
    assert_eq!((r.deltas, r.recycled), (0, 0));
    assert_same_files(&dirs[1], &keep);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_keeps_its_newest_versions_and_writes_the_next_into_the_oldest() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    std::fs::create_dir_all(root.join("store")).unwrap();
    let store = Store::open(&format!("file://{}", root.join("store").display()), &[]).unwrap();
    let dirs = versions(root, 4);
    for (k, d) in dirs.iter().enumerate() {
        let prev = k.checked_sub(1).map(|p| dirs[p].as_path());
        publish(&store, d, k as u64, prev, 10, &opts())
            .await
            .unwrap();
    }
    let cache = root.join("cache");
    let source = Source {
        peer: None,
        store: Some(store),
        keep: Some(2),
        protect: Vec::new(),
    };
    let listing = || {
        let mut v: Vec<String> = std::fs::read_dir(&cache)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with('v'))
            .collect();
        v.sort();
        v
    };
    fetch_version(&source, 1, &cache, 2).await.unwrap();
    fetch_version(&source, 2, &cache, 2).await.unwrap();
    assert_eq!(listing(), ["v1", "v2"]);
    let v1_inodes = inodes(&cache.join("v1"));
    // v3 comes from v2 (kept: the engine runs it) into v1's files.
    fetch_version(&source, 3, &cache, 2).await.unwrap();
    assert_eq!(listing(), ["v2", "v3"]);
    assert_eq!(inodes(&cache.join("v3")), v1_inodes);
    assert_same_files(&dirs[3], &cache.join("v3"));
    assert_same_files(&dirs[2], &cache.join("v2"));
    fetch_version(&source, 4, &cache, 2).await.unwrap();
    assert_eq!(listing(), ["v3", "v4"]);
    assert_same_files(&dirs[4], &cache.join("v4"));
}

struct Moto(Child);

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// moto_server from `KVROUTER_MOTO_SERVER` or PATH, on a free loopback port.
fn start_moto() -> (Moto, String) {
    let bin = std::env::var("KVROUTER_MOTO_SERVER").unwrap_or_else(|_| "moto_server".into());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new(&bin)
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start `{bin}` (pip install 'moto[server]', or set KVROUTER_MOTO_SERVER): {e}"));
    let moto = Moto(child);
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "moto_server did not listen on {port} within 30 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    (moto, format!("http://127.0.0.1:{port}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_compatible_store_publish_and_pull() {
    let (_moto, endpoint) = start_moto();
    let created = reqwest::Client::new()
        .put(format!("{endpoint}/weights"))
        .send()
        .await
        .unwrap();
    assert!(created.status().is_success(), "{}", created.status());
    let opts: Vec<(String, String)> = [
        ("aws_endpoint", endpoint.as_str()),
        ("aws_region", "us-east-1"),
        ("aws_access_key_id", "test"),
        ("aws_secret_access_key", "test"),
        ("aws_allow_http", "true"),
        ("aws_virtual_hosted_style_request", "false"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let store = Store::open("s3://weights/policy", &opts).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    publish_and_pull(&store, tmp.path()).await;
}

/// A version published from a directory stamped before BLAKE3 (format 1) keeps one version id:
/// publish adopts the delta's marker for it, so the next delta's base is what pullers rebuild.
/// And a puller whose cached base is format 1 while the store's deltas hash bases with BLAKE3
/// hashes its base the delta's way instead of refusing it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn format_1_markers_on_either_side_keep_the_delta_chain_whole() {
    use kvrouter_weights::checkpoint::{self, stamp_with, write_marker};
    use kvrouter_weights::digest::SegmentHash;
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    std::fs::create_dir_all(root.join("store")).unwrap();
    let store = Store::open(&format!("file://{}", root.join("store").display()), &[]).unwrap();
    let dirs = versions(root, 2);
    write_marker(
        &dirs[1],
        &stamp_with(&dirs[1], 1, SegmentHash::Sha256, 2).unwrap(),
    )
    .unwrap();
    for (k, d) in dirs.iter().enumerate() {
        let prev = k.checked_sub(1).map(|p| dirs[p].as_path());
        publish(&store, d, k as u64, prev, 100, &opts())
            .await
            .unwrap();
    }
    let v1 = checkpoint::read_marker(&dirs[1]).unwrap().unwrap();
    assert_eq!(
        v1.hash(),
        SegmentHash::Blake3,
        "publish adopted the delta's marker"
    );
    let out = root.join("pulled-v2");
    pull(&store, Some(2), &out, None, &root.join("work"), 2)
        .await
        .expect("the chain v0 -> v1 -> v2 applies");
    assert_same_files(&dirs[2], &out);

    // A cache stamped the old way, pulling deltas whose bases were hashed with BLAKE3.
    let cached = root.join("cache/v0");
    copy_dir(&dirs[0], &cached);
    write_marker(
        &cached,
        &stamp_with(&cached, 0, SegmentHash::Sha256, 2).unwrap(),
    )
    .unwrap();
    let out = root.join("cache/v2");
    let r = pull(&store, Some(2), &out, Some(&cached), &root.join("work2"), 2)
        .await
        .expect("the format 1 base is hashed as the delta's base was");
    assert_eq!(r.deltas, 2);
    assert_same_files(&dirs[2], &out);
}

#[test]
fn stores_that_would_lose_data_or_ignore_an_option_are_refused() {
    let opt = |k: &str| vec![(k.to_string(), "x".to_string())];
    let err =
        |url: &str, opts: &[(String, String)]| Store::open(url, opts).unwrap_err().to_string();
    assert!(err("memory:///", &[]).contains("memory://"));
    assert!(err("s3://b/p", &opt("aws_endpont")).contains("aws_endpont"));
    assert!(err("file:///tmp/x", &opt("aws_region")).contains("aws_region"));
    Store::open("s3://b/p", &opt("aws_region")).expect("a known S3 option");
}
