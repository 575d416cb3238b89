//! Checkpoint markers, stamps and verification, against real files in temporary directories.

use super::*;

#[test]
fn an_occupied_output_says_what_it_holds() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("v1");
    std::fs::create_dir(&out).unwrap();
    let text = |out: &Path| occupied(out).to_string();
    assert!(text(&out).contains("no weights.json"), "{}", text(&out));
    std::fs::write(out.join(MARKER), r#"{"format": 2, "sha256": 1}"#).unwrap();
    assert!(text(&out).contains("cannot be read"), "{}", text(&out));
    write_marker(
        &out,
        &CheckpointManifest::new(7, SegmentHash::WRITTEN, Vec::new()),
    )
    .unwrap();
    assert!(text(&out).contains("it holds v7"), "{}", text(&out));
}

#[test]
fn a_manifest_lists_each_file_once_and_covers_it_end_to_end() {
    // Hand-edited deltas whose digests were recomputed: apply wrote what verify refused,
    // or a file far larger than its segments, every byte past them unchecked.
    let seg = |offset, len| SegmentDigest {
        segment: Segment {
            name: format!("__file__:{offset}"),
            dtype: "BLOB".into(),
            shape: Vec::new(),
            offset,
            len,
        },
        digest: "00".into(),
    };
    let file = |name: &str, size, segments| FileDigests {
        name: name.into(),
        size,
        segments,
    };
    let check = |files| CheckpointManifest::new(1, SegmentHash::WRITTEN, files).check();
    assert_eq!(
        check(vec![file("a", 10, vec![seg(0, 4), seg(4, 6)])]),
        Ok(())
    );
    assert_eq!(check(vec![file("e", 0, vec![])]), Ok(()));
    for (files, why) in [
        (
            vec![file("a", 4, vec![seg(0, 4)]), file("a", 4, vec![seg(0, 4)])],
            "twice",
        ),
        (vec![file(MARKER, 4, vec![seg(0, 4)])], "marker"),
        (
            vec![file("a", 10, vec![seg(0, 4), seg(5, 5)])],
            "end to end",
        ),
        (vec![file("a", 1 << 40, vec![seg(0, 4)])], "cover 4 of"),
    ] {
        let e = check(files).unwrap_err();
        assert!(e.contains(why), "{e}");
    }
}

#[test]
fn a_file_the_marker_does_not_list_fails_verification() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    std::fs::create_dir_all(ck.join("sub")).unwrap();
    std::fs::write(ck.join("config.json"), "{}").unwrap();
    std::fs::write(ck.join("sub/tok.json"), "[]").unwrap();
    let m = stamp(&ck, 3, 1).unwrap();
    write_marker(&ck, &m).unwrap();
    verify(&ck, &m, 1).unwrap();
    // Hidden entries are never part of a checkpoint: still fine.
    std::fs::write(ck.join(".lock"), "").unwrap();
    verify(&ck, &m, 1).unwrap();
    for extra in ["extra.safetensors", "sub/more.bin"] {
        std::fs::write(ck.join(extra), "x").unwrap();
        let err = verify(&ck, &m, 1).unwrap_err().to_string();
        assert!(
            err.contains(extra) && err.contains("not in its marker"),
            "{err}"
        );
        std::fs::remove_file(ck.join(extra)).unwrap();
    }
}
