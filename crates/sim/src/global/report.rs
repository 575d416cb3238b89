//! The global run's self-contained `report.html`: step times per policy, and per datacenter a
//! row over time, green where its GPUs work and gray where they wait (the seed's picture).

use super::summary::GlobalSummary;
use std::fmt::Write;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Renders the report for runs of several policies on one workload and set of clusters.
pub fn render(runs: &[GlobalSummary], parameters: &[(String, String)]) -> String {
    let mut h = String::from(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>kvrouter global sim</title>\
         <style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}\
         td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}\
         .row{display:flex;height:18px;margin:1px 0}.row div{flex:1}\
         .lbl{width:14em;font-size:12px}</style></head><body><h1>Global routing</h1><table>",
    );
    for (k, v) in parameters {
        let _ = write!(
            h,
            "<tr><th>{}</th><td style=\"text-align:left\">{}</td></tr>",
            esc(k),
            esc(v)
        );
    }
    h.push_str("</table><h2>Policies</h2><table><tr><th>policy</th><th>step time s (mean)</th>\
                <th>vs static-split</th><th>TTFT p50 ms</th><th>TTFT p99 ms</th><th>hit rate</th>\
                <th>session moves</th><th>sketch |err| blocks</th><th>decision |err| blocks</th></tr>");
    let base = runs
        .iter()
        .find(|r| r.policy == "static-split")
        .map(|r| r.step_time_mean_s);
    for r in runs {
        let vs = base.map_or("–".to_owned(), |b| {
            format!("{:+.1} %", (r.step_time_mean_s / b.max(1e-9) - 1.0) * 100.0)
        });
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{:.2}</td><td>{vs}</td><td>{:.0}</td><td>{:.0}</td><td>{:.3}</td>\
             <td>{}</td><td>{:.2}</td><td>{:.2}</td></tr>",
            esc(&r.policy),
            r.step_time_mean_s,
            r.ttft_ms.p50,
            r.ttft_ms.p99,
            r.hit_rate,
            r.session_moves,
            r.sketch_error.mean_abs_blocks,
            r.decision_error.mean_abs_blocks
        );
    }
    h.push_str("</table>");
    for r in runs {
        let _ = write!(
            h,
            "<h2>{}</h2><p>Each row is a datacenter over {:.0} s; green = GPUs working \
             (darker = more of them), gray = idle and waiting. Steps: {}</p>",
            esc(&r.policy),
            r.sim_end_s,
            r.steps
                .iter()
                .map(|(a, b)| format!("{a:.1}–{b:.1} s"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        for c in &r.clusters {
            let _ = write!(
                h,
                "<div class=\"row\"><span class=\"lbl\">{} ({} × {} @{}) tail idle {:.1} s</span>",
                esc(&c.name),
                c.workers,
                esc(&c.profile),
                c.speed,
                c.tail_idle_s
            );
            for b in &c.timeline {
                let color = if *b <= 0.001 {
                    "#d0d0d0".to_owned()
                } else {
                    format!("rgba(30,160,60,{:.2})", 0.25 + 0.75 * b.min(1.0))
                };
                let _ = write!(h, "<div style=\"background:{color}\"></div>");
            }
            h.push_str("</div>");
        }
        h.push_str(
            "<table><tr><th>datacenter</th><th>requests</th><th>hit rate</th>\
                    <th>busy</th><th>idle in steps</th><th>tail idle s</th></tr>",
        );
        for c in &r.clusters {
            let _ = write!(
                h,
                "<tr><td>{}</td><td>{}</td><td>{:.3}</td><td>{:.3}</td><td>{:.3}</td><td>{:.2}</td></tr>",
                esc(&c.name),
                c.requests,
                c.hit_rate,
                c.busy_fraction,
                c.step_idle_fraction,
                c.tail_idle_s
            );
        }
        h.push_str("</table>");
    }
    h.push_str("</body></html>\n");
    h
}
