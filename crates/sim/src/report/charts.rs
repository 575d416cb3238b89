//! The report's charts: TTFT CDFs, served hit rate over time, per-worker load and busy/idle
//! timelines, RL step bars and GPU idle.

use super::*;

pub(super) fn ttft_cdf(out: &mut String, runs: &[Summary]) {
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

pub(super) fn hit_rate_over_time(out: &mut String, runs: &[Summary]) {
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

pub(super) fn series_over_time(
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
pub(super) fn worker_load(out: &mut String, run: &Summary) {
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
pub(super) fn busy_timeline(out: &mut String, run: &Summary) {
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

pub(super) fn step_bars(out: &mut String, runs: &[Summary]) {
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
