//! Tests of the timing models and profiles.

use super::*;

#[test]
fn dynamo_poly_matches_its_published_formula() {
    let m = DynamoPoly;
    assert_eq!(m.prefill_ms(0).unwrap(), 0.0);
    let t = 1000.0f64;
    let want = 4.209989e-7 * t * t + 0.01518344 * t + 16.50142;
    assert!((m.prefill_ms(1000).unwrap() - want).abs() < 1e-9);
    let half = StepShape {
        decode_seqs: 1,
        active_kv_tokens: 50,
        kv_capacity_tokens: 100,
        ..Default::default()
    };
    let want = -25.74 * 0.25 + 54.01 * 0.5 + 5.74;
    assert!((m.decode_ms(&half).unwrap() - want).abs() < 1e-9);
    let empty = StepShape {
        decode_seqs: 1,
        kv_capacity_tokens: 100,
        ..Default::default()
    };
    assert_eq!(m.decode_ms(&empty).unwrap(), 5.74);
}

#[test]
fn speedup_divides_every_time() {
    let m = SpeedUp {
        inner: DynamoPoly,
        ratio: 10.0,
    };
    assert!(
        (m.prefill_ms(1000).unwrap() * 10.0 - DynamoPoly.prefill_ms(1000).unwrap()).abs() < 1e-9
    );
}

fn table(extrapolate: bool) -> TableProfile {
    TableProfile::new(ProfileTable {
        name: "t".into(),
        source: "test".into(),
        extrapolate,
        prefill: vec![(100.0, 10.0), (1000.0, 100.0)],
        decode_batch_sizes: vec![1.0, 8.0],
        decode_contexts: vec![0.0, 1000.0],
        decode_ms: vec![vec![5.0, 6.0], vec![7.0, 9.0]],
    })
    .unwrap()
}

#[test]
fn tables_interpolate_and_extrapolate_or_refuse() {
    let t = table(true);
    assert!((t.prefill_ms(550).unwrap() - 55.0).abs() < 1e-9);
    assert!((t.prefill_ms(2000).unwrap() - 200.0).abs() < 1e-9);
    assert!(t.prefill_ms(1).unwrap() > 0.0, "never a silent zero");
    let shape = StepShape {
        decode_seqs: 8,
        decode_mean_context: 500.0,
        ..Default::default()
    };
    assert!((t.decode_ms(&shape).unwrap() - 8.0).abs() < 1e-9);
    let strict = table(false);
    assert!(strict.prefill_ms(2000).is_err());
    let big = StepShape {
        decode_seqs: 64,
        decode_mean_context: 10.0,
        ..Default::default()
    };
    assert_eq!(
        strict.decode_ms(&big).unwrap_err().what,
        "decode batch size"
    );
}

#[test]
fn builtin_profiles_load_and_h200_is_faster_at_decode() {
    let h100 = TableProfile::builtin("h100").unwrap();
    let h200 = TableProfile::builtin("h200").unwrap();
    let shape = StepShape {
        decode_seqs: 64,
        decode_mean_context: 4000.0,
        ..Default::default()
    };
    assert!(h200.decode_ms(&shape).unwrap() < h100.decode_ms(&shape).unwrap());
    assert!(h100.prefill_ms(4096).unwrap() > h100.prefill_ms(512).unwrap());
    assert!(TableProfile::builtin("a100").is_none());
}

#[test]
fn profile_files_are_read_bounded_and_only_when_regular() {
    let dir = std::env::temp_dir().join(format!("kvr-profile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("good.json");
    std::fs::write(&good, serde_json::to_string(table(true).table()).unwrap()).unwrap();
    assert_eq!(TableProfile::load(&good).unwrap(), table(true));
    let big = dir.join("big.json");
    std::fs::write(&big, vec![b' '; MAX_PROFILE_FILE_BYTES as usize + 1]).unwrap();
    for (path, why) in [
        (big.as_path(), "larger than"),
        (Path::new("/dev/zero"), "not a regular file"),
        (dir.as_path(), "not a regular file"),
    ] {
        let err = TableProfile::load(path).unwrap_err().to_string();
        assert!(err.contains(why), "{}: {err}", path.display());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn malformed_tables_are_refused_with_a_reason() {
    let good = table(true).table().clone();
    let refused = |change: &dyn Fn(&mut ProfileTable), why: &str| {
        let mut bad = good.clone();
        change(&mut bad);
        let err = TableProfile::new(bad).unwrap_err().to_string();
        assert!(err.contains(why), "{err}");
    };
    refused(
        &|t| t.prefill = vec![(10.0, 1.0)],
        "prefill points' tokens need 2",
    );
    // Times that overflow, vanish or are not numbers: every estimate would be one too.
    for ms in [1e300, 1e-320, f64::NAN, -1.0, 0.0] {
        refused(&|t| t.prefill[1].1 = ms, "every time must be");
        refused(&|t| t.decode_ms[0][0] = ms, "every time must be");
    }
    refused(&|t| t.prefill[0].0 = -100.0, "the first at least 0");
    refused(&|t| t.decode_batch_sizes[0] = -5.0, "the first above 0");
    refused(&|t| t.decode_contexts[1] = f64::INFINITY, "finite");
    refused(
        &|t| t.prefill = (0..=MAX_PROFILE_POINTS).map(|i| (i as f64, 1.0)).collect(),
        "2 to 1024",
    );
    assert!(TableProfile::from_json("x.json", "{").is_err());
    // An error in a file names the file (its `name` may be anything, a built-in's too).
    let mut named = good.clone();
    named.prefill[1].1 = f64::MAX;
    named.name = "h100-llama3-8b".into();
    let text = serde_json::to_string(&named).unwrap();
    let err = TableProfile::from_json("mine.json", &text)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("profile mine.json (named \"h100-llama3-8b\")"),
        "{err}"
    );
}

#[test]
fn queries_read_the_two_points_around_them() {
    // The grid's own points come back exactly, between them the line, beyond the last
    // point the line extended; the same figures as interpolating every row first.
    let p = table(true);
    let t = p.table().clone();
    for (b, &batch) in t.decode_batch_sizes.iter().enumerate() {
        for (c, &ctx) in t.decode_contexts.iter().enumerate() {
            let shape = StepShape {
                decode_seqs: batch as u64,
                decode_mean_context: ctx,
                ..Default::default()
            };
            let ms = p.decode_ms(&shape).unwrap();
            assert!((ms - t.decode_ms[b][c]).abs() < 1e-9, "{b} {c}: {ms}");
        }
    }
    let (x0, y0) = t.prefill[0];
    let (x1, y1) = t.prefill[1];
    let mid = ((x0 + x1) / 2.0).round();
    let want = y0 + (y1 - y0) * (mid - x0) / (x1 - x0);
    assert!((p.prefill_ms(mid as u64).unwrap() - want).abs() < 1e-9);
}
