//! A self-contained `report.html`: inline SVG, no scripts from the network. TTFT CDFs per
//! configuration, a per-worker busy/idle timeline (GPUs working vs waiting), served hit rate over
//! time, RL step times, and the summary table. The charts are in `report/charts.rs`; this file
//! keeps the SVG primitives, the table and the page.

mod charts;

use crate::summary::Summary;
use charts::*;
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

/// The summary table; rows after the first show their change against it (the baseline).
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
