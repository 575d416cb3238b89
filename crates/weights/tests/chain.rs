//! The store's chain as pullers walk it: `publish` keeps it whole (a delta starts from the
//! store's latest and from the bytes it published), and `pull` finds a way along it (a local
//! copy whose next delta is missing gives way to a full checkpoint, an incomplete full one to an
//! older one) and refuses a file filed under the wrong version instead of answering it.

use kvrouter_weights::checkpoint::{read_marker, stamp, write_marker};
use kvrouter_weights::gen::{write_checkpoint, GenSpec, Update};
use kvrouter_weights::store::{publish, pull, Store};
use kvrouter_weights::{CodecOptions, WeightsError};
use std::path::{Path, PathBuf};

fn spec() -> GenSpec {
    GenSpec {
        total_bytes: 1 << 20,
        tensor_bytes: 256 << 10,
        cols: 512,
        files: 2,
        seed: 11,
    }
}

fn opts() -> CodecOptions {
    CodecOptions {
        zstd_level: 1,
        chunk_bytes: 256 << 10,
        threads: 1,
    }
}

/// Versions 0..=n of the RL model under `root/ckpt/vK`.
fn versions(root: &Path, n: u32) -> Vec<PathBuf> {
    (0..=n)
        .map(|k| {
            let d = root.join(format!("ckpt/v{k}"));
            write_checkpoint(&d, &spec(), Update::Rl { lr: 1e-5, steps: k }, 1).unwrap();
            d
        })
        .collect()
}

fn open(root: &Path, name: &str) -> Store {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    Store::open(&format!("file://{}", dir.display()), &[]).unwrap()
}

fn version_of(dir: &Path) -> u64 {
    read_marker(dir).unwrap().unwrap().version
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_keeps_the_chain_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let v = versions(root, 2);
    let store = open(root, "store");
    // No published version: a delta has nothing to start from.
    let err = publish(&store, &v[1], 1, Some(&v[0]), 10, &opts())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("no published version"), "{err}");
    publish(&store, &v[0], 0, None, 10, &opts()).await.unwrap();
    // A delta from a version the store never published (v1 skipped).
    let err = publish(&store, &v[2], 2, Some(&v[1]), 10, &opts())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("latest is v0"), "{err}");
    publish(&store, &v[1], 1, Some(&v[0]), 10, &opts())
        .await
        .unwrap();
    // A --prev whose bytes were changed after it was stamped (its marker still v1's).
    let edited = root.join("edited1");
    std::fs::create_dir_all(&edited).unwrap();
    for e in std::fs::read_dir(&v[1]).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), edited.join(e.file_name())).unwrap();
    }
    let shard = edited.join("model-00001-of-00002.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let at = bytes.len() - 10;
    bytes[at] ^= 1;
    std::fs::write(&shard, bytes).unwrap();
    let err = publish(&store, &v[2], 2, Some(&edited), 10, &opts())
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("not those its marker names"),
        "{err}"
    );
    // A --prev of another version is named as --prev.
    let err = publish(&store, &v[2], 2, Some(&v[0]), 10, &opts())
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("--prev") && err.to_string().contains("stamped v0"),
        "{err}"
    );
    // A --prev stamped v1 whose bytes are not the published v1's.
    let fake = root.join("fake1");
    write_checkpoint(&fake, &spec(), Update::Rl { lr: 1e-5, steps: 0 }, 1).unwrap();
    write_marker(&fake, &stamp(&fake, 1, 1).unwrap()).unwrap();
    let err = publish(&store, &v[2], 2, Some(&fake), 10, &opts())
        .await
        .unwrap_err();
    assert!(matches!(err, WeightsError::Invalid(_)), "{err}");
    assert!(
        err.to_string().contains("not the v1 the store published"),
        "{err}"
    );
    assert!(!root.join("store/delta/v1-v2").exists());
    // Nothing of it landed: the right --prev then publishes, and v2 pulls.
    publish(&store, &v[2], 2, Some(&v[1]), 10, &opts())
        .await
        .unwrap();
    let r = pull(&store, None, &root.join("out"), None, &root.join("w"), 1)
        .await
        .unwrap();
    assert_eq!((r.version, r.deltas), (2, 2));
    assert_eq!(version_of(&root.join("out")), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_delta_or_an_incomplete_full_checkpoint_gives_way_to_another_start() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let v = versions(root, 4);
    // v0 full, then v1 as a full checkpoint only (no delta v0-v1).
    let store = open(root, "store");
    publish(&store, &v[0], 0, None, 10, &opts()).await.unwrap();
    publish(&store, &v[1], 1, None, 10, &opts()).await.unwrap();
    let r = pull(
        &store,
        Some(1),
        &root.join("p1"),
        Some(&v[0]),
        &root.join("w1"),
        1,
    )
    .await
    .unwrap();
    assert!(r.downloaded_full && r.started_from == 1, "{r:?}");
    assert_eq!(version_of(&root.join("p1")), 1);

    // Every delta, full checkpoints at v0 and v3; v3's upload incomplete (no marker).
    let store = open(root, "store2");
    publish(&store, &v[0], 0, None, 3, &opts()).await.unwrap();
    for k in 1..=4 {
        publish(&store, &v[k], k as u64, Some(&v[k - 1]), 3, &opts())
            .await
            .unwrap();
    }
    std::fs::remove_file(root.join("store2/base/v3/weights.json")).unwrap();
    let r = pull(&store, Some(4), &root.join("p4"), None, &root.join("w4"), 1)
        .await
        .unwrap();
    assert_eq!((r.started_from, r.deltas), (0, 4), "{r:?}");
    assert_eq!(version_of(&root.join("p4")), 4);

    // No way at all: the error names the missing delta of each way tried.
    std::fs::remove_dir_all(root.join("store2/delta/v1-v2")).unwrap();
    let err = pull(&store, Some(2), &root.join("p2"), None, &root.join("w2"), 1)
        .await
        .unwrap_err();
    assert!(matches!(err, WeightsError::Missing(_)), "{err}");
    assert!(err.to_string().contains("delta/v1-v2"), "{err}");
    assert!(!root.join("p2").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_or_delta_filed_under_the_wrong_version_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let v = versions(root, 3);
    let store = open(root, "store");
    publish(&store, &v[0], 0, None, 2, &opts()).await.unwrap();
    for k in 1..=3 {
        publish(&store, &v[k], k as u64, Some(&v[k - 1]), 2, &opts())
            .await
            .unwrap();
    }
    // base/v2 holding v1 (its files and marker).
    let base2 = root.join("store/base/v2");
    let saved = root.join("base2.saved");
    std::fs::rename(&base2, &saved).unwrap();
    std::fs::create_dir_all(&base2).unwrap();
    for e in std::fs::read_dir(&v[1]).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), base2.join(e.file_name())).unwrap();
    }
    let err = pull(&store, Some(2), &root.join("o1"), None, &root.join("w1"), 1)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("is the marker of v1"), "{err}");
    assert!(!root.join("o1").exists());
    std::fs::remove_dir_all(&base2).unwrap();
    std::fs::rename(&saved, &base2).unwrap();

    // delta/v0-v1 replaced by a delta from v0 to v2: it applies to v0, but builds v2.
    let wrong = root.join("d02.kvwd");
    kvrouter_weights::diff(&v[0], Some(0), &v[2], 2, &wrong, &opts()).unwrap();
    std::fs::copy(&wrong, root.join("store/delta/v0-v1/delta.kvwd")).unwrap();
    let err = pull(&store, Some(1), &root.join("o2"), None, &root.join("w2"), 1)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("builds v2"), "{err}");
    assert!(!root.join("o2").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_publishs_partial_delta_is_removed_by_the_next_publish() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let v = versions(root, 1);
    let store = open(root, "store");
    publish(&store, &v[0], 0, None, 10, &opts()).await.unwrap();
    // What a publish killed during its diff left: its partial, by a process that is gone,
    // untouched for an hour.
    let left = root.join(format!("ckpt/.v1.delta-v0.partial-{}", u32::MAX));
    std::fs::write(&left, vec![0u8; 4096]).unwrap();
    let hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    std::fs::File::options()
        .write(true)
        .open(&left)
        .unwrap()
        .set_modified(hour_ago)
        .unwrap();
    publish(&store, &v[1], 1, Some(&v[0]), 10, &opts())
        .await
        .unwrap();
    assert!(!left.exists(), "the partial stayed");
    let partials: Vec<_> = std::fs::read_dir(root.join("ckpt"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n.to_string_lossy().contains("partial"))
        .collect();
    assert!(partials.is_empty(), "{partials:?}");
}
