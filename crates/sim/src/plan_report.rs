//! The planner's `report.html`: the searched curve (cost against workers) with the target line,
//! and a table of every point searched. Reuses the sim report's SVG helpers.

use crate::plan::Plan;
use crate::report::{axes, esc, polyline, COLORS};
use std::fmt::Write;

/// `metric` names the cost (e.g. "TTFT p99 ms"); `params` head the page.
pub fn render(plan: &Plan, metric: &str, target: f64, params: &[(String, String)]) -> String {
    let mut out = String::with_capacity(16 * 1024);
    out.push_str("<!doctype html><html><head><meta charset=\"utf-8\"><title>kvrouter plan</title>");
    out.push_str("<style>body{font-family:sans-serif;margin:20px;max-width:1400px}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}svg{display:block;margin:12px 0;border:1px solid #eee}</style></head><body>");
    let verdict = match plan.workers {
        Some(n) => format!("workers: {n}"),
        None => "no worker count in range meets the target".to_owned(),
    };
    let _ = write!(
        out,
        "<h1>kvrouter plan — {}</h1><table class=\"params\">",
        esc(&verdict)
    );
    for (k, v) in params {
        let _ = write!(out, "<tr><th>{}</th><td>{}</td></tr>", esc(k), esc(v));
    }
    out.push_str("</table>");
    let x_max = plan.points.last().map_or(1.0, |p| p.0 as f64) * 1.05 + 1.0;
    let y_max = plan
        .points
        .iter()
        .map(|p| p.1)
        .filter(|v| v.is_finite())
        .fold(target, f64::max)
        * 1.1;
    axes(
        &mut out,
        &format!("{metric} against workers"),
        "workers",
        metric,
        x_max,
        y_max,
    );
    let curve: Vec<(f64, f64)> = plan
        .points
        .iter()
        .map(|&(n, c)| (n as f64, c.min(y_max)))
        .collect();
    polyline(&mut out, &curve, x_max, y_max, COLORS[0], metric);
    polyline(
        &mut out,
        &[(0.0, target), (x_max, target)],
        x_max,
        y_max,
        COLORS[1],
        "target",
    );
    out.push_str("</svg><table><tr><th>workers</th><th>");
    out.push_str(&esc(metric));
    out.push_str("</th><th>meets target</th></tr>");
    for &(n, c) in &plan.points {
        let _ = write!(
            out,
            "<tr><td>{n}</td><td>{c:.1}</td><td>{}</td></tr>",
            if c <= target { "yes" } else { "no" }
        );
    }
    out.push_str("</table></body></html>\n");
    out
}
