//! `kvrouter sim --clusters FILE` as a process: every policy runs on the same workload and
//! writes summary.json and report.html; bad clusters files and policies are refused naming
//! the flag.

use std::path::PathBuf;
use std::process::Command;

const EXAMPLE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../bench/global/seed002.toml"
);

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvrouter-gsim-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn sim(args: &[&str], out: &std::path::Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .arg("sim")
        .args(args)
        .args(["--kv-cache-block-size", "16", "--quiet", "--out"])
        .arg(out)
        .output()
        .unwrap()
}

/// A small seed-002 run: one step of 24 rollouts.
const SMALL: &str = "steps=1,tasks=6,group_size=4,turns_median=4,harness_tokens=1000";

#[test]
fn the_example_clusters_file_runs_every_policy() {
    let out = dir("ok");
    let o = sim(
        &[
            "--clusters",
            EXAMPLE,
            "--workload",
            "seed002",
            "--workload-args",
            SMALL,
        ],
        &out,
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let policies: Vec<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["policy"].as_str().unwrap())
        .collect();
    assert_eq!(policies, ["static-split", "least-loaded", "kv"]);
    for r in v.as_array().unwrap() {
        assert_eq!(r["clusters"].as_array().unwrap().len(), 4);
        assert!(r["step_time_mean_s"].as_f64().unwrap() > 0.0);
        assert!(r["clusters"][3]["tail_idle_s"].as_f64().is_some());
    }
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(html.contains("apac") && html.contains("tail idle"));
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn bad_clusters_files_and_policies_are_refused_naming_the_flag() {
    let out = dir("bad");
    std::fs::create_dir_all(&out).unwrap();
    let cases = [
        ("[[cluster]]\nname = \"a\"\nworkers = 0\n", "workers"),
        (
            "[[cluster]]\nname = \"a\"\nworkers = 1\nspeed = -1\n",
            "speed",
        ),
        (
            "[global]\nsummary_refresh_ms = 0\n[[cluster]]\nname = \"a\"\nworkers = 1\n",
            "summary_refresh_ms",
        ),
        (
            "[[cluster]]\nname = \"a\"\nworkers = 1\nbogus = 3\n",
            "bogus",
        ),
        ("not toml [", "--clusters"),
        // Values that overflowed a duration (a panic) or stalled the run.
        (
            "[global]\nmax_summary_age_s = 1e300\n[[cluster]]\nname = \"a\"\nworkers = 1\n",
            "max_summary_age_s",
        ),
        (
            "[global]\nsummary_refresh_ms = 1e-300\n[[cluster]]\nname = \"a\"\nworkers = 1\n",
            "summary_refresh_ms",
        ),
        (
            "[[cluster]]\nname = \"a\"\nworkers = 1\nspeed = 1e-300\n",
            "speed",
        ),
        (
            "[[cluster]]\nname = \"a\"\nworkers = 1\nnetwork_delay_ms = 1e300\n",
            "network_delay_ms",
        ),
        (
            "[[cluster]]\nname = \"a\"\nworkers = 100000000\n",
            "workers",
        ),
    ];
    for (i, (text, needle)) in cases.iter().enumerate() {
        let path = out.join(format!("c{i}.toml"));
        std::fs::write(&path, text).unwrap();
        let o = sim(
            &[
                "--clusters",
                path.to_str().unwrap(),
                "--workload",
                "seed002",
                "--workload-args",
                SMALL,
            ],
            &out.join("o"),
        );
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "case {i} accepted");
        assert!(
            err.contains("--clusters") && err.contains(needle),
            "case {i}: {err}"
        );
    }
    let o = sim(
        &[
            "--clusters",
            EXAMPLE,
            "--global-policy",
            "nearest",
            "--workload",
            "seed002",
        ],
        &out.join("o"),
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("--global-policy"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&out);
}

/// Found by probing: flags of one cluster's simulation that the global simulation does not
/// read were accepted and ignored (a fault, a Perfetto file, the planner, a comparison), and
/// `--global-policy` without `--clusters` too; each is refused naming the flag. The clusters'
/// blocks are bounded as one fleet's.
#[test]
fn flags_the_global_simulation_does_not_read_are_refused() {
    let out = dir("unread");
    let base = ["--workload", "seed002", "--workload-args", SMALL];
    for (extra, named) in [
        (&["--perfetto", "p.json"][..], "--perfetto"),
        (&["--worker-failure", "0@1"][..], "--worker-failure"),
        (&["--planner"][..], "--planner"),
        (&["--compare", "kv,round-robin"][..], "--compare"),
        (&["--arrival-speedup", "10"][..], "--arrival-speedup"),
        (&["--workers", "4"][..], "--workers"),
        (&["--weight-update", "drain"][..], "--weight-update"),
    ] {
        let mut args = vec!["--clusters", EXAMPLE];
        args.extend(base);
        args.extend(extra);
        let o = sim(&args, &out.join("o"));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{extra:?} accepted");
        assert!(
            err.contains(named) && err.contains("--clusters"),
            "{extra:?}: {err}"
        );
    }
    for (list, says) in [("kv,,kv", "empty item"), ("kv,kv", "twice")] {
        let mut args = vec!["--clusters", EXAMPLE, "--global-policy", list];
        args.extend(base);
        let o = sim(&args, &out.join("o"));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(says), "{list}: {err}");
    }
    let mut args = vec!["--global-policy", "kv"];
    args.extend(base);
    let o = sim(&args, &out.join("o"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("needs --clusters"),
        "{err}"
    );

    let big = out.join("big.toml");
    std::fs::create_dir_all(&out).unwrap();
    let cluster = "[[cluster]]\nname = \"N\"\nworkers = 4096\nnum_gpu_blocks = 16384\n";
    std::fs::write(&big, cluster.replace('N', "a") + &cluster.replace('N', "b")).unwrap();
    let mut args = vec!["--clusters", big.to_str().unwrap()];
    args.extend(base);
    let o = sim(&args, &out.join("o"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("a simulation holds"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&out);
}
