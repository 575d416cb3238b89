//! A pull that is refused (its arguments cannot work: a `--have` that is not the base the
//! chain needs, a directory to recycle that may not be overwritten, a version past the store's
//! latest) removes the work directory it created or creates none; one that failed in transfer
//! keeps it, so a rerun resumes.

use kvrouter_weights::checkpoint::{stamp, write_marker};
use kvrouter_weights::gen::{write_checkpoint, GenSpec, Update};
use kvrouter_weights::store::{publish, pull, pull_recycling, Store};
use kvrouter_weights::{CodecOptions, WeightsError};
use std::path::Path;

fn spec(seed: u64) -> GenSpec {
    GenSpec {
        total_bytes: 1 << 20,
        tensor_bytes: 256 << 10,
        cols: 512,
        files: 2,
        seed,
    }
}

/// v0 and v1 (a delta) in a filesystem store under `root/store`.
async fn store_with_two_versions(root: &Path) -> Store {
    std::fs::create_dir_all(root.join("store")).unwrap();
    let store = Store::open(&format!("file://{}", root.join("store").display()), &[]).unwrap();
    let opts = CodecOptions {
        zstd_level: 1,
        chunk_bytes: 256 << 10,
        threads: 1,
    };
    for k in 0..=1u32 {
        let d = root.join(format!("ckpt/v{k}"));
        write_checkpoint(&d, &spec(5), Update::Rl { lr: 1e-5, steps: k }, 1).unwrap();
        let prev = (k > 0).then(|| root.join("ckpt/v0"));
        publish(&store, &d, k as u64, prev.as_deref(), 100, &opts)
            .await
            .unwrap();
    }
    store
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_pull_leaves_no_work_directory_behind() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let store = store_with_two_versions(root).await;
    // Another checkpoint that calls itself v0: the delta v0->v1 does not apply to it.
    let impostor = root.join("impostor");
    write_checkpoint(&impostor, &spec(6), Update::Rl { lr: 1e-5, steps: 0 }, 1).unwrap();
    write_marker(&impostor, &stamp(&impostor, 0, 1).unwrap()).unwrap();

    let work = root.join("out.work");
    let err = pull(
        &store,
        Some(1),
        &root.join("out"),
        Some(&impostor),
        &work,
        1,
    )
    .await
    .unwrap_err();
    assert!(matches!(err, WeightsError::BaseMismatch { .. }), "{err}");
    assert!(!work.exists(), "a refused pull left {}", work.display());
    assert!(!root.join("out").exists());

    // A directory to recycle that is not a checkpoint: refused, nothing created.
    let junk = root.join("junk");
    std::fs::create_dir_all(&junk).unwrap();
    let err = pull_recycling(
        &store,
        Some(1),
        &root.join("out"),
        Some(&root.join("ckpt/v0")),
        &work,
        1,
        Some(&junk),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, WeightsError::Invalid(_)), "{err}");
    assert!(!work.exists());

    // A directory with the caller's files is not a work directory (a success would remove it):
    // refused before anything is read, and kept.
    std::fs::create_dir_all(&work).unwrap();
    std::fs::write(work.join("notes"), b"the caller's").unwrap();
    let err = pull(&store, Some(1), &root.join("out"), None, &work, 1)
        .await
        .unwrap_err();
    assert!(matches!(err, WeightsError::Invalid(_)), "{err}");
    assert!(err.to_string().contains("no pull put there"), "{err}");
    assert!(work.join("notes").exists());
    std::fs::remove_dir_all(&work).unwrap();

    // An earlier pull's work directory (marked) that a refused pull finds is kept for the rerun.
    std::fs::create_dir_all(&work).unwrap();
    std::fs::write(work.join(kvrouter_weights::workdir::WORK_MARK), b"").unwrap();
    let err = pull(
        &store,
        Some(1),
        &root.join("out"),
        Some(&impostor),
        &work,
        1,
    )
    .await
    .unwrap_err();
    assert!(matches!(err, WeightsError::BaseMismatch { .. }), "{err}");
    assert!(work.exists());
    std::fs::remove_dir_all(&work).unwrap();

    // A version past the store's latest: refused before anything is downloaded.
    let reads = store.reads();
    let err = pull(&store, Some(2), &root.join("out"), None, &work, 1)
        .await
        .unwrap_err();
    assert!(matches!(err, WeightsError::Missing(_)), "{err}");
    assert!(err.to_string().contains("latest version is v1"), "{err}");
    assert_eq!(store.reads() - reads, 1, "only `latest` was read");
    assert!(!work.exists());

    // A delta lost from the store after data came: the work directory is kept for the rerun
    // (the base is reused).
    let delta = root.join("store/delta/v0-v1/delta.kvwd");
    let saved = root.join("delta.saved");
    std::fs::rename(&delta, &saved).unwrap();
    let err = pull(&store, Some(1), &root.join("out"), None, &work, 1)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("v0-v1"), "{err}");
    assert!(work.join("base-v0").exists());
    std::fs::rename(&saved, &delta).unwrap();

    // The right base works, and the rerun finds what it needs.
    pull(
        &store,
        Some(1),
        &root.join("out"),
        Some(&root.join("ckpt/v0")),
        &work,
        1,
    )
    .await
    .unwrap();
    assert!(root.join("out").join("weights.json").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_below_every_full_checkpoint_leaves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    std::fs::create_dir_all(root.join("store")).unwrap();
    let store = Store::open(&format!("file://{}", root.join("store").display()), &[]).unwrap();
    let opts = CodecOptions {
        zstd_level: 1,
        chunk_bytes: 256 << 10,
        threads: 1,
    };
    // The store starts at v1: there is nothing to pull for v0.
    let d = root.join("ckpt/v1");
    write_checkpoint(&d, &spec(5), Update::Rl { lr: 1e-5, steps: 1 }, 1).unwrap();
    publish(&store, &d, 1, None, 100, &opts).await.unwrap();
    let work = root.join("out.work");
    let err = pull(&store, Some(0), &root.join("out"), None, &work, 1)
        .await
        .unwrap_err();
    assert!(matches!(err, WeightsError::Missing(_)), "{err}");
    assert!(err.to_string().contains("the oldest is v1"), "{err}");
    assert!(!work.exists(), "left {}", work.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_work_directory_that_holds_the_output_the_base_or_the_store_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let store = store_with_two_versions(root).await;
    let have = root.join("ckpt/v0");
    for (out, work, needle) in [
        // `--work .`-like: the directory that holds everything.
        (root.join("out"), root.to_path_buf(), "holds --out"),
        (root.join("keep/v1"), root.join("keep"), "holds --out"),
        (root.join("out"), root.join("ckpt"), "holds --have"),
        (root.join("out"), root.join("store"), "holds --store"),
        (root.join("out"), root.join("out/w"), "inside --out"),
    ] {
        let before = std::fs::read_dir(root).unwrap().count();
        let err = pull(&store, Some(1), &out, Some(&have), &work, 1)
            .await
            .unwrap_err();
        assert!(matches!(err, WeightsError::Invalid(_)), "{err}");
        assert!(err.to_string().contains(needle), "{work:?}: {err}");
        assert_eq!(std::fs::read_dir(root).unwrap().count(), before, "{work:?}");
        assert!(!out.exists() && have.join("weights.json").exists());
        assert!(root.join("store/latest").exists());
    }
    // A new work directory: the pull succeeds, and only its work directory goes after it.
    let work = root.join("fresh.work");
    pull(&store, Some(1), &root.join("out"), Some(&have), &work, 1)
        .await
        .unwrap();
    assert!(work.join(kvrouter_weights::workdir::WORK_MARK).exists());
    kvrouter_weights::workdir::release(&work);
    assert!(!work.exists() && root.join("out/weights.json").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_latest_pointer_past_the_small_object_bound_is_refused_unread() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let store = store_with_two_versions(root).await;
    // A `latest` of 128 MiB and one byte (sparse: nothing is written).
    let latest = std::fs::OpenOptions::new()
        .write(true)
        .open(root.join("store/latest"))
        .unwrap();
    latest
        .set_len(kvrouter_weights::store::MAX_SMALL_OBJECT_BYTES + 1)
        .unwrap();
    let err = pull(&store, None, &root.join("out"), None, &root.join("w"), 1)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("latest: larger than"), "{err}");
    assert!(!root.join("w").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_into_a_held_work_directory_is_refused_and_leaves_it_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let store = store_with_two_versions(root).await;
    let work = root.join("out.work");
    // Another pull holds it, its download under way.
    let held = kvrouter_weights::workdir::claim(&work).unwrap();
    std::fs::write(work.join("base-v0.partial"), b"half").unwrap();
    let err = pull(&store, Some(1), &root.join("out"), None, &work, 1)
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("another pull is using it"),
        "{err}"
    );
    assert!(
        work.join("base-v0.partial").exists(),
        "the holder's files went"
    );
    kvrouter_weights::workdir::release(&work);
    assert!(work.exists(), "removed under its holder");
    drop(held);
    // Once the holder is gone the pull goes on.
    pull(&store, Some(1), &root.join("out"), None, &work, 1)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_in_or_as_the_work_directory_are_never_written_through_nor_removed() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let store = store_with_two_versions(root).await;
    let victim = root.join("victim.log");
    std::fs::write(&victim, b"the user's log").unwrap();
    let intact = || std::fs::read(&victim).unwrap() == b"the user's log";

    // A download's partial file planted as a link to the user's file.
    let work = root.join("w1");
    std::fs::create_dir_all(work.join("base-v0")).unwrap();
    std::fs::write(work.join(kvrouter_weights::workdir::WORK_MARK), b"").unwrap();
    let shard = "model-00001-of-00002.safetensors.partial";
    std::os::unix::fs::symlink(&victim, work.join("base-v0").join(shard)).unwrap();
    let err = pull(&store, Some(1), &root.join("o1"), None, &work, 1)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("symbolic link"), "{err}");
    assert!(intact());

    // A directory the pull writes into planted as a link to the user's directory.
    let user = root.join("user");
    std::fs::create_dir_all(&user).unwrap();
    std::fs::write(
        user.join("model-00001-of-00002.safetensors"),
        b"the user's model",
    )
    .unwrap();
    let work = root.join("w4");
    std::fs::create_dir_all(&work).unwrap();
    std::fs::write(work.join(kvrouter_weights::workdir::WORK_MARK), b"").unwrap();
    std::os::unix::fs::symlink(&user, work.join("base-v0")).unwrap();
    let err = pull(&store, Some(1), &root.join("o4"), None, &work, 1)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("symbolic link"), "{err}");
    assert_eq!(
        std::fs::read(user.join("model-00001-of-00002.safetensors")).unwrap(),
        b"the user's model"
    );
    assert_eq!(std::fs::read_dir(&user).unwrap().count(), 1);

    // A partial planted as a hard link to the user's file.
    let work = root.join("w5");
    std::fs::create_dir_all(work.join("base-v0")).unwrap();
    std::fs::write(work.join(kvrouter_weights::workdir::WORK_MARK), b"").unwrap();
    std::fs::hard_link(&victim, work.join("base-v0").join(shard)).unwrap();
    let err = pull(&store, Some(1), &root.join("o5"), None, &work, 1)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("hard links"), "{err}");
    assert!(intact());

    // The mark planted as a link to it.
    let work = root.join("w2");
    std::fs::create_dir_all(&work).unwrap();
    std::os::unix::fs::symlink(&victim, work.join(kvrouter_weights::workdir::WORK_MARK)).unwrap();
    let err = pull(&store, Some(1), &root.join("o2"), None, &work, 1)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("symbolic link"), "{err}");
    assert!(intact());

    // The work directory itself a link: refused (removing it would take the link alone).
    let target = root.join("target");
    std::fs::create_dir_all(&target).unwrap();
    std::os::unix::fs::symlink(&target, root.join("wl")).unwrap();
    let err = pull(&store, Some(1), &root.join("o3"), None, &root.join("wl"), 1)
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("give the directory itself"),
        "{err}"
    );
    assert!(root.join("wl").exists() && std::fs::read_dir(&target).unwrap().count() == 0);

    // An output reached through a link to the work directory, not made yet: refused before
    // anything is written (a success removed the output with the work directory).
    std::os::unix::fs::symlink(root.join("W"), root.join("to-w")).unwrap();
    let err = pull(
        &store,
        Some(1),
        &root.join("to-w/o"),
        None,
        &root.join("W"),
        1,
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("holds --out"), "{err}");
    assert!(!root.join("W").exists());
}
