//! `kvrouter sim --compare ... --out DIR` writes summary.json and a report.html that a real browser
//! (headless Chromium, installed by `.ci/run`) loads with every plot present.

use std::path::PathBuf;
use std::process::Command;

fn chromium() -> PathBuf {
    [
        "/usr/bin/chromium",
        "/usr/bin/chromium-browser",
        "/usr/bin/google-chrome",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|p| p.exists())
    .expect(
        "headless Chromium is needed for this test; .ci/run installs Debian's `chromium` package",
    )
}

#[test]
fn sim_writes_a_summary_and_a_report_that_renders() {
    let dir = std::env::temp_dir().join(format!("kvrouter-report-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args([
            "sim",
            "--workload",
            "grpo",
            "--workload-args",
            "prompts=4,group_size=4,steps=2,output_median=200,output_cap=1024",
        ])
        .args([
            "--workers",
            "3",
            "--compare",
            "round-robin,kv,kv:router_predicted_ttl_secs=5",
            "--quiet",
            "--out",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("| kv:router_predicted_ttl_secs=5 |"),
        "{table}"
    );
    assert!(
        table.contains("| finite ceiling |") && table.contains("| step bound s |"),
        "{table}"
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    let runs = summary.as_array().unwrap();
    assert_eq!(runs.len(), 3);
    for r in runs {
        for key in [
            "config",
            "requests",
            "ttft_ms",
            "itl_ms",
            "e2e_ms",
            "queue_ms",
            "hit_rate",
            "hit_rate_ceiling",
            "output_tokens_per_s",
            "sim_wall_s",
        ] {
            assert!(r.get(key).is_some(), "summary lacks {key}");
        }
        for stat in ["mean", "p50", "p90", "p99"] {
            assert!(r["ttft_ms"][stat].is_number());
        }
        assert!(r["rl"]["step_time_s"]["max"].is_number());
        // Physical limits: the finite-cache ceiling bounds the served hit rate, the step-time
        // lower bound every step.
        let finite = r["hit_rate_ceiling_finite"].as_f64().unwrap();
        assert!(r["hit_rate"].as_f64().unwrap() <= finite + 1e-3);
        assert!(r["hit_rate_lru_fleet"].is_number());
        let bound = r["rl"]["step_time_lower_bound_s"]["max"].as_f64().unwrap();
        assert!(bound > 0.0 && bound <= r["rl"]["step_time_s"]["max"].as_f64().unwrap());
        assert!(r["rl"]["gpu_idle_fraction"].is_number());
    }

    let profile = dir.join("chromium-profile");
    let dom = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
        ])
        .args([
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--dump-dom",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(format!("file://{}", dir.join("report.html").display()))
        .output()
        .unwrap();
    assert!(
        dom.status.success(),
        "{}",
        String::from_utf8_lossy(&dom.stderr)
    );
    let dom = String::from_utf8_lossy(&dom.stdout);
    for column in ["<th>finite ceiling</th>", "<th>step bound s</th>"] {
        assert!(
            dom.contains(column),
            "column {column} missing from the report"
        );
    }
    for plot in [
        "TTFT CDF",
        "Served prefix hit rate over time",
        "Running requests per worker over time",
        "KV usage over time",
        "RL step time",
        "busy timeline kv",
    ] {
        assert!(
            dom.contains(&format!("data-plot=\"{plot}")),
            "plot {plot:?} missing from the rendered page"
        );
    }
    assert!(
        dom.matches("class=\"series\"").count() >= 12,
        "CDF, hit-rate, running and KV lines per configuration"
    );
    assert!(
        dom.matches("class=\"cell\"").count() >= 3 * 120,
        "a busy/idle cell per worker and time bin"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Requests the router refused are said under the table: its latency columns count only the
/// requests served, so a run refusing most of them would otherwise read as fast.
#[test]
fn refused_requests_are_reported_beside_the_table() {
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/traces/mooncake_conversation_head1000/conversation_trace_head1000.jsonl"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args(["sim", "--trace", trace, "--max-requests", "200"])
        .args(["--arrival-speedup", "4", "--workers", "1"])
        .args([
            "--reject-when-overloaded",
            "--active-prefill-tokens-threshold",
            "20000",
        ])
        .args(["--out"])
        .arg(std::env::temp_dir().join(format!("kvrouter-refused-{}", std::process::id())))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find(|l| l.contains("requests refused"))
        .unwrap_or_else(|| panic!("no refusal line in {stdout}"));
    assert!(line.contains("of 200 requests refused"), "{line}");
}

#[test]
fn bad_traces_and_flags_are_named() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args(["sim", "--trace", "/nonexistent.jsonl", "--quiet"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent.jsonl"));
    let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args(["sim", "--workload", "grpo", "--workload-args", "nope=1"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("--workload-args"));
    let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args([
            "sim",
            "--workload",
            "grpo",
            "--compare",
            "kv:router_bogus=1",
        ])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("--compare"));
    // Values that panicked (a duration overflow), hung (no request ever admitted) or were
    // quietly clamped or ignored: each is refused naming its flag.
    for (flag, value) in [
        ("--network-delay-ms", "inf"),
        ("--network-delay-ms", "-5"),
        ("--kv-event-delay-ms", "nan"),
        ("--max-num-seqs", "0"),
        ("--slow-worker", "99@2"),
        ("--worker-failure", "0@nan"),
        ("--workers", "100000"),
        ("--arrival-speedup", "1e-300"),
        ("--num-gpu-blocks", "100000000000"),
        // Each within its own bound, together ~84 GB of simulated KV.
        ("--num-gpu-blocks", "16777216"),
        ("--concurrency", "0"),
        ("--compare", ","),
        ("--compare", "kv,,round-robin"),
        ("--compare", "kv:seed=1:seed=2"),
        ("--compare", "kv:router_mode=random"),
        ("--session-gap-s", "inf"),
        ("--workload-args", "prompts=abc"),
        ("--workload-args", "prompts=2,prompts=3"),
        // It saturated the simulator's clock (TTFTs of 1.8e16 ms).
        ("--ingress-us-per-token", "1e308"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
            .args(["sim", "--workload", "grpo", "--quiet"])
            .arg(format!("{flag}={value}"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag} {value} accepted");
        assert!(
            err.contains(flag) && !err.contains("panicked"),
            "{flag} {value}: {err}"
        );
    }
    // The planner's most workers count toward the fleet's blocks (it grew past the bound).
    let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args([
            "sim",
            "--workload",
            "grpo",
            "--quiet",
            "--planner",
            "--workers",
            "4",
        ])
        .args(["--num-gpu-blocks", "16777216"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--planner-max-workers"),
        "{err}"
    );
    // Generator parameters out of range (a pause that panicked, a group of none, a workload
    // too large to hold) are refused naming the field.
    for (workload, args, field) in [
        ("grpo", "sync_pause_s=1e300", "sync_pause_s"),
        ("grpo", "group_size=0", "group_size"),
        (
            "grpo",
            "prompts=4000000000,steps=10",
            "prompts × group_size × steps",
        ),
        ("agentic", "output_sigma=-1", "output_sigma"),
        ("seed001", "rate_per_s=0", "rate_per_s"),
        ("seed002", "tasks=0", "tasks"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
            .args([
                "sim",
                "--quiet",
                "--workload",
                workload,
                "--workload-args",
                args,
            ])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{workload} {args} accepted");
        assert!(
            err.contains("--workload-args") && err.contains(field) && !err.contains("panicked"),
            "{workload} {args}: {err}"
        );
    }
    // A trace time that overflows the clock names its file and line.
    let dir = std::env::temp_dir().join(format!("kvrouter-bad-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("t.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [1]}\n\
         {\"timestamp\": 1e300, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [1]}\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args(["sim", "--quiet", "--trace"])
        .arg(&trace)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("t.jsonl") && err.contains('2') && err.contains("timestamp"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sim_writes_a_perfetto_timeline_with_weight_updates() {
    let dir = std::env::temp_dir().join(format!("kvrouter-perfetto-{}", std::process::id()));
    let trace = dir.join("t.json");
    std::fs::create_dir_all(&dir).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args([
            "sim",
            "--workload",
            "grpo",
            "--workload-args",
            "prompts=2,group_size=4,steps=2,output_median=50,output_cap=200",
            "--workers",
            "2",
            "--weight-update",
            "abort",
            "--weight-load-ms",
            "300",
            "--group-need",
            "3",
            "--quiet",
            "--perfetto",
        ])
        .arg(&trace)
        .arg("--out")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("samples ended early (first-N-of-M), 0 rollouts lost"),
        "{stdout}"
    );
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = doc["traceEvents"].as_array().unwrap();
    let count = |name: &str| events.iter().filter(|e| e["name"] == name).count();
    assert_eq!(count("decode"), 16, "every request decoded");
    assert_eq!(count("weight update"), 4, "two workers, two updates each");
    assert_eq!(count("process_name"), 2);
    assert!(events
        .iter()
        .all(|e| e["ph"] != "X" || e["dur"].as_u64().unwrap() > 0));
    let bad = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args([
            "sim",
            "--workload",
            "grpo",
            "--weight-update",
            "yolo",
            "--quiet",
        ])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--weight-update"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Measures the rendered report in the browser (SVG `getBBox`): text outside its plot's view
/// box (clipped ticks or labels), legends whose box holds a point of a plotted line or a bar,
/// and tick labels that overlap each other. The result is written into the page as JSON.
const LAYOUT_CHECK: &str = r#"<script>
const problems = [];
const inside = (b, x, y) => x >= b.x && x <= b.x + b.width && y >= b.y && y <= b.y + b.height;
const meet = (a, b) => a.x < b.x + b.width && b.x < a.x + a.width && a.y < b.y + b.height && b.y < a.y + a.height;
for (const svg of document.querySelectorAll('svg')) {
  const name = svg.dataset.plot || '(unnamed)';
  const vb = svg.viewBox.baseVal;
  for (const t of svg.querySelectorAll('text')) {
    const b = t.getBBox();
    if (b.x < vb.x - 0.5 || b.y < vb.y - 0.5 || b.x + b.width > vb.x + vb.width + 0.5 || b.y + b.height > vb.y + vb.height + 0.5) {
      problems.push('clipped text "' + t.textContent + '" in ' + name);
    }
  }
  const ticks = [...svg.querySelectorAll('text.tick')].map(t => [t.textContent, t.getBBox()]);
  for (let i = 0; i < ticks.length; i++) for (let j = i + 1; j < ticks.length; j++) {
    if (meet(ticks[i][1], ticks[j][1])) problems.push('ticks ' + ticks[i][0] + ' and ' + ticks[j][0] + ' overlap in ' + name);
  }
  const legend = svg.querySelector('g.legend');
  if (!legend) continue;
  const lb = legend.getBBox();
  for (const line of svg.querySelectorAll('polyline.series')) {
    const pts = [...line.points];
    let hit = pts.length === 1 && inside(lb, pts[0].x, pts[0].y);
    for (let k = 1; k < pts.length && !hit; k++) {
      // Points every pixel along each segment.
      const [a, b] = [pts[k - 1], pts[k]];
      const n = Math.min(10000, Math.ceil(Math.hypot(b.x - a.x, b.y - a.y)) + 1);
      for (let s = 0; s <= n && !hit; s++) hit = inside(lb, a.x + (b.x - a.x) * s / n, a.y + (b.y - a.y) * s / n);
    }
    if (hit) problems.push('legend covers ' + line.dataset.series + ' in ' + name);
  }
  for (const bar of svg.querySelectorAll('rect.bar')) {
    if (meet(lb, bar.getBBox())) { problems.push('legend covers a bar in ' + name); break; }
  }
}
const out = document.createElement('pre');
out.id = 'layout';
out.textContent = JSON.stringify(problems);
document.body.appendChild(out);
</script>"#;

/// A plot whose legend sits on its line: the check must report it.
const BROKEN_PLOT: &str = r##"<svg class="plot" data-plot="broken on purpose" width="300" height="100" viewBox="0 0 300 100"><polyline class="series" data-series="x" points="0,30 300,30"/><g class="legend"><rect x="200" y="21" width="10" height="10"/><text x="215" y="30" font-size="11">x</text></g><text class="tick" x="-5" y="50">cut</text></svg>"##;

/// Loads `html` (written to `dir/name`) in headless Chromium and returns the DOM after scripts.
fn dump_dom(dir: &std::path::Path, name: &str, html: &str) -> String {
    let page = dir.join(name);
    std::fs::write(&page, html).unwrap();
    let dom = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
        ])
        .args(["--no-first-run", "--disable-background-networking"])
        .args(["--disable-component-update", "--disable-sync", "--dump-dom"])
        .arg(format!(
            "--user-data-dir={}",
            dir.join("chromium-profile").display()
        ))
        .arg(format!("file://{}", page.display()))
        .output()
        .unwrap();
    assert!(
        dom.status.success(),
        "{}",
        String::from_utf8_lossy(&dom.stderr)
    );
    String::from_utf8_lossy(&dom.stdout).into_owned()
}

/// The layout problems the in-page check wrote.
fn layout_problems(dom: &str) -> Vec<String> {
    let start = dom
        .find("<pre id=\"layout\">")
        .expect("the layout check ran")
        + 17;
    let end = start + dom[start..].find("</pre>").unwrap();
    let json = dom[start..end]
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&amp;", "&");
    serde_json::from_str(&json).unwrap()
}

#[test]
fn the_report_has_its_parameters_deltas_and_per_worker_load_and_nothing_overlaps() {
    let dir = std::env::temp_dir().join(format!("kvrouter-layout-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .args(["sim", "--workload", "grpo"])
        .args([
            "--workload-args",
            "prompts=4,group_size=4,steps=2,output_median=200,output_cap=1024",
        ])
        .args([
            "--workers",
            "3",
            "--seed",
            "7",
            "--profile",
            "h100-llama3-8b",
        ])
        .args(["--compare", "round-robin,kv,kv:router_predicted_ttl_secs=5"])
        .args(["--quiet", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let html = std::fs::read_to_string(dir.join("report.html")).unwrap();

    // The check itself finds a covered line and a clipped tick.
    let broken = html.replace("</body>", &format!("{BROKEN_PLOT}{LAYOUT_CHECK}</body>"));
    let found = layout_problems(&dump_dom(&dir, "broken.html", &broken));
    assert!(
        found
            .iter()
            .any(|p| p == "legend covers x in broken on purpose"),
        "{found:?}"
    );
    assert!(
        found
            .iter()
            .any(|p| p == "clipped text \"cut\" in broken on purpose"),
        "{found:?}"
    );

    let checked = html.replace("</body>", &format!("{LAYOUT_CHECK}</body>"));
    let dom = dump_dom(&dir, "checked.html", &checked);
    assert_eq!(
        layout_problems(&dom),
        Vec::<String>::new(),
        "layout problems"
    );
    for want in [
        "<th>workload</th><td>grpo (prompts=4,group_size=4,steps=2,output_median=200,output_cap=1024)</td>",
        "<th>workers</th><td>3</td>",
        "<th>profile</th><td>h100-llama3-8b</td>",
        "<th>seed</th><td>7</td>",
        &format!("<th>kvrouter version</th><td>{}</td>", env!("CARGO_PKG_VERSION")),
        "<th>GPU idle</th>",
        "<th>TTFT p90 ms</th>",
        "<th>ITL p90 ms</th>",
        "<th>queue p90 ms</th>",
        "round-robin (baseline)",
        "data-plot=\"Per-worker load over time kv\"",
        "simulated time (s)",
    ] {
        assert!(dom.contains(want), "{want} missing from the rendered report");
    }
    // Two configurations against the baseline, a delta for each of 16 columns (fewer without
    // step time and its bound when a run has none; this workload has steps).
    assert_eq!(dom.matches("class=\"delta\"").count(), 2 * 16);
    assert_eq!(
        dom.matches("data-plot=\"Per-worker load over time").count(),
        3
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
