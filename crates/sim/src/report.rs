//! A self-contained `report.html`: inline SVG, no scripts from the network. TTFT CDFs per
//! configuration, a per-worker busy/idle timeline (GPUs working vs waiting), served hit rate over
//! time, RL step times, and the summary table.

use crate::summary::Summary;
use std::fmt::Write;

pub(crate) const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];
/// Width of the plot area's box (axes and ticks); the legend sits to its right.
const W: f64 = 640.0;
const H: f64 = 260.0;
/// Left margin: room for the y tick labels and the rotated y axis label.
const PAD: f64 = 58.0;
/// Width of the legend column right of the plot (so a legend never covers a curve).
const LEGEND_W: f64 = 210.0;

/// A tick label: few digits, no trailing zeros, k/M for large values.
fn tick(v: f64) -> String {
    let a = v.abs();
    let s = if a >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if a >= 1e4 {
        format!("{:.0}k", v / 1e3)
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    };
    match s.split_once('.') {
        Some((int, frac)) if frac.trim_end_matches(['k', 'M']).chars().all(|c| c == '0') => {
            let unit = frac.trim_start_matches(|c: char| c.is_ascii_digit());
            format!("{int}{unit}")
        }
        _ => s,
    }
}

pub(crate) fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

pub(crate) fn axes(
    out: &mut String,
    title: &str,
    x_label: &str,
    y_label: &str,
    x_max: f64,
    y_max: f64,
) {
    let _ = write!(
        out,
        r#"<svg class="plot" data-plot="{}" width="{}" height="{H}" viewBox="0 0 {} {H}" xmlns="http://www.w3.org/2000/svg">"#,
        esc(title),
        W + LEGEND_W,
        W + LEGEND_W
    );
    let _ = write!(
        out,
        r##"<rect x="0" y="0" width="{}" height="{H}" fill="#fff"/>"##,
        W + LEGEND_W
    );
    let _ = write!(
        out,
        r##"<text class="title" x="{}" y="16" font-size="13" font-family="sans-serif">{}</text>"##,
        PAD,
        esc(title)
    );
    let (x0, y0, x1, y1) = (PAD, H - PAD, W - 10.0, 24.0);
    let _ = write!(
        out,
        r##"<line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y0}" stroke="#333"/><line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y1}" stroke="#333"/>"##
    );
    for k in 0..=4 {
        let fx = k as f64 / 4.0;
        let x = x0 + fx * (x1 - x0);
        let y = y0 - fx * (y0 - y1);
        let _ = write!(
            out,
            r##"<text class="tick" x="{x}" y="{}" font-size="10" text-anchor="middle" font-family="sans-serif">{}</text>"##,
            y0 + 14.0,
            tick(fx * x_max)
        );
        let _ = write!(
            out,
            r##"<text class="tick" x="{}" y="{}" font-size="10" text-anchor="end" font-family="sans-serif">{}</text>"##,
            x0 - 4.0,
            y + 3.0,
            tick(fx * y_max)
        );
    }
    let _ = write!(
        out,
        r##"<text x="{}" y="{}" font-size="11" text-anchor="middle" font-family="sans-serif">{}</text>"##,
        (x0 + x1) / 2.0,
        H - 8.0,
        esc(x_label)
    );
    let _ = write!(
        out,
        r##"<text x="12" y="{}" font-size="11" font-family="sans-serif" transform="rotate(-90 12 {})">{}</text>"##,
        (y0 + y1) / 2.0,
        (y0 + y1) / 2.0,
        esc(y_label)
    );
}

pub(crate) fn polyline(
    out: &mut String,
    points: &[(f64, f64)],
    x_max: f64,
    y_max: f64,
    color: &str,
    label: &str,
) {
    let (x0, y0, x1, y1) = (PAD, H - PAD, W - 10.0, 24.0);
    let pts: Vec<String> = points
        .iter()
        .map(|(x, y)| {
            format!(
                "{:.1},{:.1}",
                x0 + x / x_max.max(1e-9) * (x1 - x0),
                y0 - y / y_max.max(1e-9) * (y0 - y1)
            )
        })
        .collect();
    let _ = write!(
        out,
        r#"<polyline class="series" data-series="{}" fill="none" stroke="{color}" stroke-width="1.6" points="{}"/>"#,
        esc(label),
        pts.join(" ")
    );
}

fn legend(out: &mut String, names: &[String]) {
    out.push_str(r#"<g class="legend">"#);
    for (i, n) in names.iter().enumerate() {
        let y = 30.0 + 14.0 * i as f64;
        let _ = write!(
            out,
            r#"<rect x="{}" y="{}" width="10" height="10" fill="{}"/><text x="{}" y="{}" font-size="11" font-family="sans-serif">{}</text>"#,
            W + 4.0,
            y - 9.0,
            COLORS[i % COLORS.len()],
            W + 18.0,
            y,
            esc(&short(n))
        );
    }
    out.push_str("</g>");
}

/// A legend entry that fits its column (about 30 characters at 11 px).
fn short(n: &str) -> String {
    if n.chars().count() <= 30 {
        return n.to_owned();
    }
    let head: String = n.chars().take(29).collect();
    format!("{head}…")
}

fn ttft_cdf(out: &mut String, runs: &[Summary]) {
    let x_max = runs
        .iter()
        .filter_map(|r| {
            r.timeline
                .ttft_sorted_ms
                .get((r.timeline.ttft_sorted_ms.len() as f64 * 0.99) as usize)
                .copied()
        })
        .fold(1.0f64, f64::max);
    axes(
        out,
        "TTFT CDF",
        "time to first token (ms, up to p99)",
        "share of requests",
        x_max,
        1.0,
    );
    for (i, r) in runs.iter().enumerate() {
        let v = &r.timeline.ttft_sorted_ms;
        let step = (v.len() / 200).max(1);
        let pts: Vec<(f64, f64)> = v
            .iter()
            .enumerate()
            .step_by(step)
            .filter(|(_, x)| **x <= x_max)
            .map(|(k, x)| (*x, (k + 1) as f64 / v.len() as f64))
            .collect();
        polyline(out, &pts, x_max, 1.0, COLORS[i % COLORS.len()], &r.config);
    }
    legend(
        out,
        &runs.iter().map(|r| r.config.clone()).collect::<Vec<_>>(),
    );
    out.push_str("</svg>\n");
}

fn hit_rate_over_time(out: &mut String, runs: &[Summary]) {
    let t_max = runs
        .iter()
        .map(|r| r.timeline.hit_rate.len() as f64 * r.timeline.bin_s)
        .fold(1e-9, f64::max);
    axes(
        out,
        "Served prefix hit rate over time",
        "simulated time (s)",
        "hit rate (share of prompt tokens)",
        t_max,
        1.0,
    );
    for (i, r) in runs.iter().enumerate() {
        let bin_s = r.timeline.bin_s;
        let pts: Vec<(f64, f64)> = r
            .timeline
            .hit_rate
            .iter()
            .enumerate()
            .filter_map(|(k, h)| h.map(|h| (k as f64 * bin_s, h)))
            .collect();
        polyline(out, &pts, t_max, 1.0, COLORS[i % COLORS.len()], &r.config);
    }
    legend(
        out,
        &runs.iter().map(|r| r.config.clone()).collect::<Vec<_>>(),
    );
    out.push_str("</svg>\n");
}

fn series_over_time(
    out: &mut String,
    runs: &[Summary],
    title: &str,
    y_label: &str,
    pick: fn(&Summary) -> &Vec<f64>,
) {
    let t_max = runs
        .iter()
        .map(|r| pick(r).len() as f64 * r.timeline.bin_s)
        .fold(1e-9, f64::max);
    let y_max = runs
        .iter()
        .flat_map(|r| pick(r).iter().copied())
        .fold(1e-9, f64::max);
    axes(out, title, "simulated time (s)", y_label, t_max, y_max);
    for (i, r) in runs.iter().enumerate() {
        let bin_s = r.timeline.bin_s;
        let pts: Vec<(f64, f64)> = pick(r)
            .iter()
            .enumerate()
            .map(|(k, v)| (k as f64 * bin_s, *v))
            .collect();
        polyline(out, &pts, t_max, y_max, COLORS[i % COLORS.len()], &r.config);
    }
    legend(
        out,
        &runs.iter().map(|r| r.config.clone()).collect::<Vec<_>>(),
    );
    out.push_str("</svg>\n");
}

/// Each worker's busy fraction over time (one line per worker) for one configuration.
fn worker_load(out: &mut String, run: &Summary) {
    let bin_s = run.timeline.bin_s;
    let bins = run.timeline.busy.iter().map(Vec::len).max().unwrap_or(0);
    let t_max = (bins as f64 * bin_s).max(1e-9);
    axes(
        out,
        &format!("Per-worker load over time {}", run.config),
        "simulated time (s)",
        "busy fraction",
        t_max,
        1.0,
    );
    let mut names = Vec::new();
    for (w, busy) in run.timeline.busy.iter().enumerate() {
        let pts: Vec<(f64, f64)> = busy
            .iter()
            .enumerate()
            .map(|(k, v)| (k as f64 * bin_s, *v))
            .collect();
        let name = format!("worker {w}");
        polyline(out, &pts, t_max, 1.0, COLORS[w % COLORS.len()], &name);
        names.push(name);
    }
    legend(out, &names);
    out.push_str("</svg>\n");
}

/// A Gantt of GPUs working (dark) versus waiting (light), one row per worker.
fn busy_timeline(out: &mut String, run: &Summary) {
    let rows = run.timeline.busy.len().max(1);
    let row_h = (180.0 / rows as f64).clamp(3.0, 18.0);
    let h = 40.0 + row_h * rows as f64 + 20.0;
    let bins = run.timeline.busy.first().map_or(1, Vec::len).max(1);
    let cell = (W - 60.0) / bins as f64;
    let _ = write!(
        out,
        r#"<svg class="plot gantt" data-plot="busy timeline {}" width="{W}" height="{h}" viewBox="0 0 {W} {h}" xmlns="http://www.w3.org/2000/svg">"#,
        esc(&run.config)
    );
    let _ = write!(
        out,
        r##"<rect x="0" y="0" width="{W}" height="{h}" fill="#fff"/><text x="10" y="16" font-size="13" font-family="sans-serif">Workers busy (dark) vs waiting (light): {} — {:.1} s per bin</text>"##,
        esc(&run.config),
        run.timeline.bin_s
    );
    for (w, row) in run.timeline.busy.iter().enumerate() {
        let y = 28.0 + row_h * w as f64;
        let _ = write!(
            out,
            r#"<text x="4" y="{}" font-size="9" font-family="sans-serif">w{w}</text>"#,
            y + row_h * 0.8
        );
        for (k, b) in row.iter().enumerate() {
            let shade = 235.0 - 200.0 * b.clamp(0.0, 1.0);
            let x = 40.0 + cell * k as f64;
            let (width, height, blue) = (cell + 0.2, row_h - 1.0, (shade + 20.0).min(255.0));
            let _ = write!(
                out,
                r#"<rect class="cell" x="{x:.1}" y="{y:.1}" width="{width:.2}" height="{height:.1}" fill="rgb({shade:.0},{shade:.0},{blue:.0})"/>"#
            );
        }
    }
    out.push_str("</svg>\n");
}

fn step_bars(out: &mut String, runs: &[Summary]) {
    let with: Vec<&Summary> = runs
        .iter()
        .filter(|r| !r.timeline.step_times_s.is_empty())
        .collect();
    if with.is_empty() {
        return;
    }
    let steps = with
        .iter()
        .map(|r| r.timeline.step_times_s.len())
        .max()
        .unwrap_or(1);
    let y_max = with
        .iter()
        .flat_map(|r| r.timeline.step_times_s.iter().copied())
        .fold(1e-9, f64::max);
    axes(
        out,
        "RL step time",
        "step",
        "step time (s)",
        steps as f64,
        y_max,
    );
    let group_w = (W - PAD - 20.0) / steps as f64;
    let bar_w = group_w / (with.len() as f64 + 1.0);
    for (i, r) in with.iter().enumerate() {
        for (k, t) in r.timeline.step_times_s.iter().enumerate() {
            let hgt = t / y_max * (H - PAD - 24.0);
            let _ = write!(
                out,
                r#"<rect class="bar" x="{:.1}" y="{:.1}" width="{:.1}" height="{hgt:.1}" fill="{}"/>"#,
                PAD + group_w * k as f64 + bar_w * i as f64 + 2.0,
                H - PAD - hgt,
                bar_w,
                COLORS[i % COLORS.len()]
            );
        }
    }
    legend(
        out,
        &with.iter().map(|r| r.config.clone()).collect::<Vec<_>>(),
    );
    out.push_str("</svg>\n");
}

/// GPU idle: the RL figure when there is one, else the share of worker time not busy.
fn gpu_idle(r: &Summary) -> f64 {
    match &r.rl {
        Some(rl) => rl.gpu_idle_fraction,
        None if r.workers.is_empty() => 0.0,
        None => {
            1.0 - r.workers.iter().map(|w| w.busy_fraction).sum::<f64>() / r.workers.len() as f64
        }
    }
}

/// The table's columns: header, value, decimals.
type Column = (&'static str, fn(&Summary) -> Option<f64>, usize);

const COLUMNS: [Column; 16] = [
    ("TTFT p50 ms", |r| Some(r.ttft_ms.p50), 1),
    ("TTFT p90 ms", |r| Some(r.ttft_ms.p90), 1),
    ("TTFT p99 ms", |r| Some(r.ttft_ms.p99), 1),
    ("ITL p50 ms", |r| Some(r.itl_ms.p50), 2),
    ("ITL p90 ms", |r| Some(r.itl_ms.p90), 2),
    ("queue p90 ms", |r| Some(r.queue_ms.p90), 1),
    ("E2E p50 ms", |r| Some(r.e2e_ms.p50), 1),
    ("hit rate", |r| Some(r.hit_rate), 3),
    ("predicted", |r| Some(r.predicted_hit_rate), 3),
    ("ceiling", |r| Some(r.hit_rate_ceiling), 3),
    ("finite ceiling", |r| r.hit_rate_ceiling_finite, 3),
    ("fleet LRU", |r| r.hit_rate_lru_fleet, 3),
    ("GPU idle", |r| Some(gpu_idle(r)), 3),
    ("output tok/s", |r| Some(r.output_tokens_per_s), 0),
    (
        "step time s",
        |r| r.rl.as_ref().map(|rl| rl.step_time_s.mean),
        2,
    ),
    (
        "step bound s",
        |r| {
            r.rl.as_ref()
                .and_then(|rl| rl.step_time_lower_bound_s)
                .map(|b| b.mean)
        },
        2,
    ),
];

/// The summary table; rows after the first show their change against it (the baseline).
fn table(out: &mut String, runs: &[Summary]) {
    out.push_str("<table class=\"summary\"><tr><th>config</th>");
    for (name, _, _) in COLUMNS {
        let _ = write!(out, "<th>{name}</th>");
    }
    out.push_str("</tr>\n");
    let base = runs.first();
    for (i, r) in runs.iter().enumerate() {
        let label = if i == 0 && runs.len() > 1 {
            " (baseline)"
        } else {
            ""
        };
        let _ = write!(out, "<tr><td>{}{label}</td>", esc(&r.config));
        for (_, pick, digits) in COLUMNS {
            let Some(v) = pick(r) else {
                out.push_str("<td>–</td>");
                continue;
            };
            let _ = write!(out, "<td>{v:.digits$}");
            if let (true, Some(b)) = (i > 0, base.and_then(pick)) {
                let _ = write!(
                    out,
                    "<br><span class=\"delta\">{}</span>",
                    delta(v, b, digits)
                );
            }
            out.push_str("</td>");
        }
        out.push_str("</tr>\n");
    }
    out.push_str("</table>\n");
}

/// `v` against the baseline `b`: the difference, and the relative change when `b` is not 0.
fn delta(v: f64, b: f64, digits: usize) -> String {
    let d = v - b;
    if b.abs() > 1e-12 {
        format!("{d:+.digits$} ({:+.1}%)", d / b * 100.0)
    } else {
        format!("{d:+.digits$}")
    }
}

/// The run's parameters, as the host gives them (trace, workers, profile, seed, version).
fn parameters(out: &mut String, params: &[(String, String)]) {
    if params.is_empty() {
        return;
    }
    out.push_str("<table class=\"params\">");
    for (k, v) in params {
        let _ = write!(out, "<tr><th>{}</th><td>{}</td></tr>", esc(k), esc(v));
    }
    out.push_str("</table>\n");
}

/// The report for one or more configurations run on the same workload.
pub fn render(runs: &[Summary]) -> String {
    render_with(runs, &[])
}

/// The report, headed by the run's parameters (name, value).
pub fn render_with(runs: &[Summary], params: &[(String, String)]) -> String {
    let mut out = String::with_capacity(64 * 1024);
    let workload = runs.first().map_or("", |r| r.workload.as_str());
    let _ = write!(
        out,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>kvrouter sim: {}</title>",
        esc(workload)
    );
    out.push_str("<style>body{font-family:sans-serif;margin:20px;max-width:1400px}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}table.params th{text-align:left}.delta{font-size:80%;color:#555}svg{display:block;margin:12px 0;border:1px solid #eee}</style></head><body>");
    let _ = write!(out, "<h1>kvrouter sim — {}</h1>", esc(workload));
    parameters(&mut out, params);
    table(&mut out, runs);
    crate::fleet_report::render(&mut out, runs);
    ttft_cdf(&mut out, runs);
    hit_rate_over_time(&mut out, runs);
    series_over_time(
        &mut out,
        runs,
        "Running requests per worker over time",
        "requests per worker (mean)",
        |r| &r.timeline.running,
    );
    series_over_time(
        &mut out,
        runs,
        "KV usage over time",
        "share of blocks in use",
        |r| &r.timeline.kv_usage,
    );
    step_bars(&mut out, runs);
    for r in runs {
        worker_load(&mut out, r);
        busy_timeline(&mut out, r);
    }
    out.push_str("</body></html>\n");
    out
}
