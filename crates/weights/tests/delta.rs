//! diff/apply on real safetensors files (written with the `safetensors` crate): roundtrips on
//! random tensors, and a corrupted byte anywhere (delta, base) detected and named.

use kvrouter_weights::checkpoint::{self, write_marker};
use kvrouter_weights::{apply, diff, CodecOptions, WeightsError};
use proptest::prelude::*;
use safetensors::tensor::{Dtype, TensorView};
use std::path::Path;

mod common;
use common::{assert_same_files, checkpoint_files, copy_tree};

struct T {
    name: String,
    dtype: Dtype,
    bytes: Vec<u8>,
}

fn write_st(dir: &Path, file: &str, tensors: &[T]) {
    std::fs::create_dir_all(dir).unwrap();
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|t| {
            let size = t.dtype.bitsize() / 8;
            let shape = vec![t.bytes.len() / size];
            (
                t.name.clone(),
                TensorView::new(t.dtype, shape, &t.bytes).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join(file)).unwrap();
}

fn rng(seed: &mut u64) -> u64 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    *seed >> 33
}

/// A base checkpoint (v1) and a new one (v2) where a fraction `p_change` of bytes changed, one
/// tensor is new and one has a new length; plus a config file.
fn make_pair(root: &Path, seed: u64, p_change: f64) -> (std::path::PathBuf, std::path::PathBuf) {
    let mut s = seed;
    let (base, new) = (root.join("base"), root.join("new"));
    let n_tensors = 1 + rng(&mut s) as usize % 5;
    let (mut bt, mut nt) = (Vec::new(), Vec::new());
    for i in 0..n_tensors {
        let dtype = [Dtype::BF16, Dtype::F32, Dtype::U8][rng(&mut s) as usize % 3];
        let elems = rng(&mut s) as usize % 6000;
        let len = elems * dtype.bitsize() / 8;
        let b: Vec<u8> = (0..len).map(|_| rng(&mut s) as u8).collect();
        let mut n = b.clone();
        for x in n.iter_mut() {
            if (rng(&mut s) % 10_000) as f64 / 10_000.0 < p_change {
                *x ^= 1 + (rng(&mut s) % 255) as u8;
            }
        }
        if i == 1 {
            n.extend_from_slice(&vec![7u8; 4 * dtype.bitsize() / 8]);
        }
        bt.push(T {
            name: format!("layer.{i}.w"),
            dtype,
            bytes: b,
        });
        nt.push(T {
            name: format!("layer.{i}.w"),
            dtype,
            bytes: n,
        });
    }
    nt.push(T {
        name: "only.new".into(),
        dtype: Dtype::U8,
        bytes: vec![3u8; 100],
    });
    let split = n_tensors / 2;
    write_st(&base, "a.safetensors", &bt[..split]);
    write_st(&base, "b.safetensors", &bt[split..]);
    write_st(&new, "a.safetensors", &nt[..split]);
    write_st(&new, "b.safetensors", &nt[split..]);
    std::fs::write(base.join("config.json"), b"{\"layers\": 4}").unwrap();
    std::fs::write(new.join("config.json"), b"{\"layers\": 4, \"step\": 2}").unwrap();
    // A Hugging Face repository's `original/` (files in a subdirectory are part of the
    // checkpoint) and a `--local-dir` download's `.cache/` (hidden: not part of it).
    write_st(
        &base.join("original"),
        "consolidated.safetensors",
        &bt[..split],
    );
    write_st(
        &new.join("original"),
        "consolidated.safetensors",
        &nt[..split],
    );
    for dir in [&base, &new] {
        std::fs::write(dir.join("original/params.json"), b"{\"dim\": 8}").unwrap();
        std::fs::create_dir_all(dir.join(".cache/huggingface")).unwrap();
        std::fs::write(dir.join(".cache/huggingface/a.lock"), b"").unwrap();
    }
    (base, new)
}

fn opts(threads: usize) -> CodecOptions {
    CodecOptions {
        zstd_level: 1,
        chunk_bytes: 4096,
        threads,
    }
}

/// No `out` and no hidden partial sibling left behind.
fn assert_nothing_written(root: &Path) {
    let left: Vec<_> = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n.to_string_lossy().contains("out"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn roundtrip_rebuilds_every_byte(seed in any::<u64>(), p in 0.0f64..1.0, threads in 1usize..4) {
        let dir = tempfile::tempdir().unwrap();
        let (base, new) = make_pair(dir.path(), seed, p);
        let delta = dir.path().join("d.kvwd");
        let m = diff(&base, Some(1), &new, 2, &delta, &opts(threads)).unwrap();
        prop_assert_eq!(m.base.version, 1);
        let out = dir.path().join("out");
        let rebuilt = apply(&base, &delta, &out, threads).unwrap();
        assert_same_files(&new, &out);
        prop_assert_eq!(rebuilt.version, 2);
        checkpoint::verify(&out, &checkpoint::read_marker(&out).unwrap().unwrap(), 2).unwrap();
    }

    #[test]
    fn a_corrupted_delta_byte_is_detected_and_named(seed in any::<u64>(), pos_frac in 0.0f64..1.0) {
        let dir = tempfile::tempdir().unwrap();
        let (base, new) = make_pair(dir.path(), seed, 0.05);
        let delta = dir.path().join("d.kvwd");
        let m = diff(&base, Some(1), &new, 2, &delta, &opts(2)).unwrap();
        let mut bytes = std::fs::read(&delta).unwrap();
        let pos = ((bytes.len() - 1) as f64 * pos_frac) as u64;
        bytes[pos as usize] ^= 0x5A;
        std::fs::write(&delta, &bytes).unwrap();
        let err = apply(&base, &delta, &dir.path().join("out"), 2).expect_err("a corrupted delta must be refused");
        assert_nothing_written(dir.path());
        let names: Vec<_> = m.new.files.iter().flat_map(|f| &f.segments).map(|s| s.segment.name.clone()).collect();
        let owner = m.segments.iter().position(|d| d.frames.iter().any(|f| f.offset <= pos && pos < f.offset + f.len));
        match (err, owner) {
            (WeightsError::Corrupted { tensor, version, .. }, Some(i)) => {
                prop_assert_eq!(tensor, names[i].clone());
                prop_assert_eq!(version, "v1->v2".to_string());
            }
            (WeightsError::Corrupted { tensor, .. }, None) => prop_assert_eq!(tensor, "__manifest__".to_string()),
            (e, _) => prop_assert!(false, "unexpected error {e}"),
        }
    }
}

#[test]
fn a_corrupted_base_byte_is_named_with_the_base_version() {
    let dir = tempfile::tempdir().unwrap();
    let (base, new) = make_pair(dir.path(), 11, 0.05);
    write_marker(&base, &checkpoint::stamp(&base, 1, 1).unwrap()).unwrap();
    let delta = dir.path().join("d.kvwd");
    let m = diff(&base, None, &new, 2, &delta, &opts(2)).unwrap();
    // A byte of the base under a tensor the delta rebuilds by XOR.
    let segs: Vec<_> = m.new.files.iter().flat_map(|f| &f.segments).collect();
    let (i, d) = m
        .segments
        .iter()
        .enumerate()
        .find(|(i, d)| d.frames.iter().any(|f| f.xor) && !segs[*i].segment.name.starts_with("__"))
        .expect("an XOR tensor");
    let (bfile, boff) = d.base.clone().unwrap();
    let path = base.join(&bfile);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[boff as usize] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let last_tensor = &segs[i].segment.name;
    let err = apply(&base, &delta, &dir.path().join("out"), 2).unwrap_err();
    match err {
        WeightsError::Corrupted {
            tensor, version, ..
        } => {
            assert_eq!(&tensor, last_tensor);
            assert_eq!(version, "v1");
        }
        e => panic!("unexpected {e}"),
    }
    assert_nothing_written(dir.path());
    // The marker's digests name it too.
    let err = checkpoint::verify(&base, &checkpoint::read_marker(&base).unwrap().unwrap(), 1)
        .unwrap_err();
    assert!(
        err.to_string().contains(last_tensor.as_str()) && err.to_string().contains("v1"),
        "{err}"
    );
}

#[test]
fn a_delta_for_another_base_is_refused_naming_both_versions() {
    let dir = tempfile::tempdir().unwrap();
    let (base, new) = make_pair(dir.path(), 5, 0.05);
    let delta = dir.path().join("d.kvwd");
    diff(&base, Some(1), &new, 2, &delta, &opts(1)).unwrap();
    write_marker(&new, &checkpoint::stamp(&new, 2, 1).unwrap()).unwrap();
    let err = apply(&new, &delta, &dir.path().join("out"), 1).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, WeightsError::BaseMismatch { .. }), "{text}");
    assert!(
        text.contains("needs base v1") && text.contains("holds v2"),
        "{text}"
    );
    // An unstamped base with other bytes is refused too (hashed, then compared).
    std::fs::remove_file(new.join("weights.json")).unwrap();
    let err = apply(&new, &delta, &dir.path().join("out"), 1).unwrap_err();
    assert!(matches!(err, WeightsError::BaseMismatch { .. }), "{err}");
    // It is not called the version it was hashed as.
    assert!(
        err.to_string()
            .contains("holds a checkpoint with no weights.json"),
        "{err}"
    );
    assert_nothing_written(dir.path());
}

/// A run killed half-way leaves `.NAME.partial-PID` beside its output; the next run that writes
/// there removes those whose process is gone and that nothing has written for a while, and
/// leaves a live or recently written one alone.
#[cfg(target_os = "linux")]
#[test]
fn partials_left_by_ended_runs_are_removed_by_the_next_one() {
    let dir = tempfile::tempdir().unwrap();
    let (base, new) = make_pair(dir.path(), 9, 0.05);
    // Above the kernel's largest pid (2^22): never a live process.
    let gone = dir.path().join(".d.kvwd.partial-4194305");
    let gone_dir = dir.path().join(".out.partial-4194306");
    // pid 1 is always running.
    let live = dir.path().join(".d.kvwd.partial-1");
    // No such pid, but written a moment ago: a writer in another pid namespace, kept.
    let recent = dir.path().join(".out.partial-4194307");
    std::fs::write(&gone, b"half a delta").unwrap();
    std::fs::create_dir(&gone_dir).unwrap();
    std::fs::write(gone_dir.join("model.safetensors"), b"half").unwrap();
    std::fs::write(&live, b"someone else's").unwrap();
    std::fs::write(&recent, b"being written").unwrap();
    let hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    for p in [&gone, &gone_dir.join("model.safetensors"), &gone_dir, &live] {
        std::fs::File::open(p)
            .unwrap()
            .set_modified(hour_ago)
            .unwrap();
    }
    let delta = dir.path().join("d.kvwd");
    diff(&base, Some(1), &new, 2, &delta, &opts(1)).unwrap();
    apply(&base, &delta, &dir.path().join("out"), 1).unwrap();
    assert!(!gone.exists() && !gone_dir.exists());
    assert!(live.exists() && recent.exists());
}

#[test]
fn generated_checkpoints_are_valid_safetensors() {
    use kvrouter_weights::gen::{write_checkpoint, GenSpec, Update};
    let dir = tempfile::tempdir().unwrap();
    let spec = GenSpec {
        total_bytes: 1 << 20,
        tensor_bytes: 256 << 10,
        cols: 256,
        files: 2,
        seed: 3,
    };
    write_checkpoint(dir.path(), &spec, Update::Rl { lr: 1e-6, steps: 0 }, 2).unwrap();
    let mut tensors = 0;
    for e in std::fs::read_dir(dir.path()).unwrap() {
        let bytes = std::fs::read(e.unwrap().path()).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (_, t) in st.tensors() {
            assert_eq!(t.dtype(), Dtype::BF16);
            tensors += 1;
        }
    }
    assert_eq!(tensors, 4);
}

#[test]
fn few_changes_make_sparse_frames_and_a_recycled_apply_rebuilds_the_same_files() {
    let dir = tempfile::tempdir().unwrap();
    let (base, new) = make_pair(dir.path(), 7, 0.002);
    let delta = dir.path().join("d.kvwd");
    let m = diff(&base, Some(1), &new, 2, &delta, &opts(2)).unwrap();
    assert_eq!(m.format, 2);
    let frames: Vec<_> = m.segments.iter().flat_map(|d| &d.frames).collect();
    assert!(frames.iter().any(|f| f.sparse && f.xor), "{frames:?}");
    // An older version to recycle: a copy of the base with its marker (bigger or smaller files
    // than the result's; every byte must be rewritten).
    let old = dir.path().join("old");
    copy_tree(&base, &old, |a, b| {
        std::fs::copy(a, b).unwrap();
    });
    std::fs::write(old.join("extra.bin"), vec![9u8; 50_000]).unwrap();
    write_marker(&old, &checkpoint::stamp(&old, 1, 1).unwrap()).unwrap();
    let o2 = dir.path().join("o2");
    let refused = |recycle: &std::path::Path, delta: &std::path::Path, why: &str| {
        let err = kvrouter_weights::apply_recycling(&base, delta, &o2, 1, Some(recycle))
            .expect_err(why)
            .to_string();
        assert!(err.contains(why), "{err}");
        assert!(!o2.exists());
    };
    // The base, a directory holding it (its parent), and a directory that is not a checkpoint
    // are refused and left alone.
    refused(&base, &delta, "which must survive");
    refused(dir.path(), &delta, "which must survive");
    let junk = dir.path().join("junk");
    std::fs::create_dir_all(&junk).unwrap();
    std::fs::write(junk.join("important.txt"), "keep").unwrap();
    refused(&junk, &delta, "has no weights.json");
    assert!(junk.join("important.txt").exists());
    refused(&junk.join("important.txt"), &delta, "is not a directory");
    assert!(base.exists() && dir.path().join("d.kvwd").exists());
    // A damaged delta is found before the directory to recycle is touched.
    let bad = dir.path().join("bad.kvwd");
    let mut bytes = std::fs::read(&delta).unwrap();
    bytes[20] ^= 0x40;
    std::fs::write(&bad, &bytes).unwrap();
    let err = kvrouter_weights::apply_recycling(&base, &bad, &o2, 1, Some(&old)).unwrap_err();
    assert!(
        matches!(err, kvrouter_weights::WeightsError::Corrupted { .. }),
        "{err}"
    );
    assert!(
        checkpoint::read_marker(&old).unwrap().is_some(),
        "the directory to recycle is untouched"
    );
    // A directory on another filesystem cannot be moved into the output by renames: refused
    // before anything of it is consumed (it was emptied, then the rename failed).
    let shm = tempfile::tempdir_in("/dev/shm").expect("/dev/shm (a tmpfs on Linux)");
    {
        use std::os::unix::fs::MetadataExt;
        let dev = |p: &Path| std::fs::metadata(p).unwrap().dev();
        assert_ne!(
            dev(shm.path()),
            dev(dir.path()),
            "/dev/shm is another filesystem"
        );
    }
    let far = shm.path().join("old");
    copy_tree(&old, &far, |a, b| {
        std::fs::copy(a, b).unwrap();
    });
    refused(&far, &delta, "is on another filesystem");
    assert!(checkpoint::read_marker(&far).unwrap().is_some());
    assert_eq!(checkpoint_files(&far), checkpoint_files(&old));
    let out = dir.path().join("out");
    kvrouter_weights::apply_recycling(&base, &delta, &out, 2, Some(&old)).unwrap();
    assert_same_files(&new, &out);
    checkpoint::verify(&out, &checkpoint::read_marker(&out).unwrap().unwrap(), 2).unwrap();
    assert!(!old.exists(), "the recycled directory is consumed");
}

#[test]
fn sparse_frames_need_format_2_and_unknown_formats_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (base, new) = make_pair(dir.path(), 11, 0.002);
    let delta = dir.path().join("d.kvwd");
    diff(&base, Some(1), &new, 2, &delta, &opts(1)).unwrap();
    let m = kvrouter_weights::delta::read_manifest(&delta).unwrap();
    assert!(m.segments.iter().flat_map(|d| &d.frames).any(|f| f.sparse));
    let mut old = m.clone();
    old.format = 1;
    assert!(
        old.check().is_err(),
        "a format 1 manifest cannot hold sparse frames"
    );
    for d in &mut old.segments {
        for f in &mut d.frames {
            f.sparse = false;
        }
    }
    old.check()
        .expect("format 1 without sparse frames is still read");
    let mut next = m;
    next.format = 3;
    let err = next.check().unwrap_err().to_string();
    assert!(err.contains("unknown format"), "{err}");
}

/// Markers written before BLAKE3 (format 1: SHA-256 digests in a `sha256` field) are still read
/// and verified, and a delta made against such a base applies to the base without its marker:
/// the base is hashed with SHA-256, as its digest was.
#[test]
fn sha256_markers_of_format_1_still_verify_and_a_delta_on_one_hashes_its_base_alike() {
    use kvrouter_weights::digest::SegmentHash;
    let dir = tempfile::tempdir().unwrap();
    let (base, new) = make_pair(dir.path(), 21, 0.05);
    let old = checkpoint::stamp_with(&base, 1, SegmentHash::Sha256, 1).unwrap();
    assert_eq!((old.format, old.hash()), (1, SegmentHash::Sha256));
    // Written as the old binary wrote it: each segment's digest under `sha256`.
    let text = serde_json::to_string(&old).unwrap();
    assert!(
        text.contains("\"sha256\"") && !text.contains("\"digest\": \""),
        "{text}"
    );
    std::fs::write(base.join("weights.json"), text).unwrap();
    let read = checkpoint::read_marker(&base).unwrap().unwrap();
    assert_eq!(read, old);
    checkpoint::verify(&base, &read, 1).unwrap();
    let fresh = checkpoint::stamp(&base, 1, 1).unwrap();
    assert_eq!((fresh.format, fresh.hash()), (2, SegmentHash::Blake3));
    assert_ne!(
        fresh.digest, old.digest,
        "the two hashes give other digests"
    );

    let delta = dir.path().join("d.kvwd");
    let m = diff(&base, None, &new, 2, &delta, &opts(1)).unwrap();
    assert_eq!(
        (m.base.digest.as_str(), m.base.marker_format),
        (old.digest.as_str(), 1)
    );
    assert_eq!(m.new.hash(), SegmentHash::Blake3);
    std::fs::remove_file(base.join("weights.json")).unwrap();
    let out = dir.path().join("out");
    apply(&base, &delta, &out, 1).expect("the marker-less base is hashed with SHA-256");
    assert_same_files(&new, &out);
    let marker = checkpoint::read_marker(&out).unwrap().unwrap();
    checkpoint::verify(&out, &marker, 1).unwrap();
    // A flipped byte is named with the marker's own hash.
    let seg = &marker.files[0].segments.last().unwrap().segment;
    let path = out.join(&marker.files[0].name);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[seg.offset as usize] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let err = checkpoint::verify(&out, &marker, 1)
        .unwrap_err()
        .to_string();
    assert!(err.contains("BLAKE3") && err.contains(&seg.name), "{err}");

    // A delta written before `marker_format` was recorded reads as format 1.
    let mut v = serde_json::to_value(&m).unwrap();
    v["base"].as_object_mut().unwrap().remove("marker_format");
    let back: kvrouter_weights::delta::DeltaManifest = serde_json::from_value(v).unwrap();
    assert_eq!(back.base.marker_format, 1);
}

/// A format 1 marker is written back as format 1 binaries read it (`sha256` per segment); a
/// marker relabelled to the other format, or to an unknown one, is refused by name.
#[test]
fn markers_are_written_in_their_format_and_relabelled_ones_are_refused() {
    use kvrouter_weights::digest::SegmentHash;
    let dir = tempfile::tempdir().unwrap();
    let (base, _) = make_pair(dir.path(), 22, 0.05);
    let old = checkpoint::stamp_with(&base, 1, SegmentHash::Sha256, 1).unwrap();
    let new = checkpoint::stamp(&base, 1, 1).unwrap();
    let segments = |m: &checkpoint::CheckpointManifest| -> Vec<serde_json::Value> {
        let v = serde_json::to_value(m).unwrap();
        v["files"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|f| f["segments"].as_array().unwrap().clone())
            .collect()
    };
    assert!(segments(&old)
        .iter()
        .all(|s| s.get("sha256").is_some() && s.get("digest").is_none()));
    assert!(segments(&new)
        .iter()
        .all(|s| s.get("digest").is_some() && s.get("sha256").is_none()));
    for m in [&old, &new] {
        let back: checkpoint::CheckpointManifest =
            serde_json::from_slice(&serde_json::to_vec(m).unwrap()).unwrap();
        assert_eq!(&back, m);
    }
    let mut relabelled = old.clone();
    relabelled.format = 2;
    assert!(relabelled.check().unwrap_err().contains("does not match"));
    let mut unknown = new.clone();
    unknown.format = 3;
    let err = checkpoint::verify(&base, &unknown, 1)
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown marker format 3"), "{err}");
    write_marker(&base, &unknown).unwrap();
    let err = diff(&base, None, &base, 2, &dir.path().join("d.kvwd"), &opts(1))
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown marker format 3"), "{err}");
    assert!(!dir.path().join("d.kvwd").exists());
}

/// `--recycle` never overwrites a file another name shares (a hard-linked copy of the base),
/// nor consumes the delta being applied when it lies in the recycled directory.
#[test]
fn recycling_refuses_linked_files_and_a_directory_holding_the_delta() {
    let dir = tempfile::tempdir().unwrap();
    let (base, new) = make_pair(dir.path(), 23, 0.05);
    write_marker(&base, &checkpoint::stamp(&base, 1, 1).unwrap()).unwrap();
    let delta = dir.path().join("d.kvwd");
    diff(&base, None, &new, 2, &delta, &opts(1)).unwrap();
    let linked = dir.path().join("linked");
    copy_tree(&base, &linked, |a, b| std::fs::hard_link(a, b).unwrap());
    let out = dir.path().join("out");
    let err = kvrouter_weights::apply_recycling(&base, &delta, &out, 1, Some(&linked))
        .unwrap_err()
        .to_string();
    assert!(err.contains("other hard links"), "{err}");
    checkpoint::verify(&base, &checkpoint::read_marker(&base).unwrap().unwrap(), 1)
        .expect("the base is intact");
    assert!(linked.exists() && !out.exists());

    // Symbolic links likewise (a directory of links into a model cache).
    let symlinked = dir.path().join("symlinked");
    copy_tree(&base, &symlinked, |a, b| {
        std::os::unix::fs::symlink(a, b).unwrap()
    });
    let err = kvrouter_weights::apply_recycling(&base, &delta, &out, 1, Some(&symlinked))
        .unwrap_err()
        .to_string();
    assert!(err.contains("a symbolic link"), "{err}");
    checkpoint::verify(&base, &checkpoint::read_marker(&base).unwrap().unwrap(), 1)
        .expect("the base is intact");
    assert!(!out.exists());

    let spare = dir.path().join("spare");
    copy_tree(&new, &spare, |a, b| {
        std::fs::copy(a, b).unwrap();
    });
    write_marker(&spare, &checkpoint::stamp(&spare, 9, 1).unwrap()).unwrap();
    let inner = spare.join("d.kvwd");
    std::fs::copy(&delta, &inner).unwrap();
    let err = kvrouter_weights::apply_recycling(&base, &inner, &out, 1, Some(&spare))
        .unwrap_err()
        .to_string();
    assert!(err.contains("which must survive"), "{err}");
    assert!(inner.exists() && !out.exists());

    let err = diff(&base, None, &new, 3, &linked, &opts(1))
        .unwrap_err()
        .to_string();
    assert!(err.contains("is a directory"), "{err}");
}

/// `diff` writes only a new file outside both checkpoints, for the version `--new` says it is.
#[test]
fn diff_never_writes_over_a_file_or_into_a_checkpoint_nor_relabels_the_new_version() {
    let dir = tempfile::tempdir().unwrap();
    let (base, new) = make_pair(dir.path(), 31, 0.05);
    write_marker(&base, &checkpoint::stamp(&base, 1, 1).unwrap()).unwrap();
    write_marker(&new, &checkpoint::stamp(&new, 2, 1).unwrap()).unwrap();
    let shard = std::fs::read_dir(&new)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .unwrap();
    let before = std::fs::read(&shard).unwrap();
    let existing = dir.path().join("existing.kvwd");
    std::fs::write(&existing, b"keep").unwrap();
    for (out, version, needle) in [
        (shard.clone(), 2, "it exists"),
        (new.join("weights.json"), 2, "it exists"),
        (existing.clone(), 2, "it exists"),
        (new.join("sub/d.kvwd"), 2, "inside --new"),
        (base.join("d.kvwd"), 2, "inside --base"),
        (dir.path().join("d.kvwd"), 3, "is stamped v2"),
    ] {
        let err = diff(&base, None, &new, version, &out, &opts(1))
            .unwrap_err()
            .to_string();
        assert!(err.contains(needle), "{out:?}: {err}");
    }
    assert_eq!(std::fs::read(&shard).unwrap(), before);
    assert_eq!(std::fs::read(&existing).unwrap(), b"keep");
    assert!(!dir.path().join("d.kvwd").exists() && !base.join("d.kvwd").exists());
    diff(&base, None, &new, 2, &dir.path().join("d.kvwd"), &opts(1)).unwrap();
}
