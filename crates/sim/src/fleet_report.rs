//! The planner's part of `report.html` (`kvrouter sim --planner`): GPU-seconds and step time
//! against the fixed fleet of its peak, and the fleet over time (provisioned, serving and
//! recommended workers).

use crate::summary::{FleetSample, Summary};
use std::fmt::Write;

const W: f64 = 900.0;
const H: f64 = 260.0;
const PAD: f64 = 40.0;

/// The section, for every run with a planner.
pub(crate) fn render(out: &mut String, runs: &[Summary]) {
    for r in runs {
        let Some(f) = &r.fleet else { continue };
        let _ = write!(
            out,
            "<h2>Planner: {}</h2><table><tr><th>fleet</th><th>GPU-seconds</th><th>mean workers</th><th>peak</th><th>mean step time s</th></tr>",
            esc(&r.config)
        );
        let step = r.rl.as_ref().map_or(0.0, |x| x.step_time_s.mean);
        let _ = write!(
            out,
            "<tr><td>planner (startup {:.0} s)</td><td>{:.1}</td><td>{:.2}</td><td>{}</td><td>{:.2}</td></tr>",
            f.startup_s, f.gpu_seconds, f.mean_workers, f.peak_workers, step
        );
        if let Some(b) = &f.baseline {
            let _ = write!(
                out,
                "<tr><td>fixed {} workers</td><td>{:.1}</td><td>{}</td><td>{}</td><td>{:.2}</td></tr></table><p>{:.1} % fewer GPU-seconds; step time {:.3}× the fixed fleet's.</p>",
                b.workers,
                b.gpu_seconds,
                b.workers,
                b.workers,
                b.step_time_s,
                b.gpu_seconds_saved * 100.0,
                b.step_time_ratio
            );
        } else {
            out.push_str("</table>");
        }
        plot(out, &f.samples, r.makespan_s);
    }
}

/// Step lines of provisioned (paid), serving and recommended workers over simulated time.
fn plot(out: &mut String, samples: &[FleetSample], makespan_s: f64) {
    let t_max = samples
        .iter()
        .map(|s| s.t_s)
        .fold(makespan_s, f64::max)
        .max(1e-9);
    let y_max = samples
        .iter()
        .map(|s| s.provisioned.max(s.recommended))
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let x = |t: f64| PAD + t / t_max * (W - 2.0 * PAD);
    let y = |v: f64| H - PAD - v / y_max * (H - 2.0 * PAD);
    let _ = write!(
        out,
        r##"<svg class="plot" data-plot="planner fleet" width="{W}" height="{H}" viewBox="0 0 {W} {H}" xmlns="http://www.w3.org/2000/svg"><rect x="0" y="0" width="{W}" height="{H}" fill="#fff"/><text x="10" y="16" font-size="13" font-family="sans-serif">Workers over time (s): provisioned (black), serving (blue), recommended (orange dashed); max {y_max}</text>"##
    );
    for (pick, color, dash) in [
        (0usize, "#000", ""),
        (1, "#1f77b4", ""),
        (2, "#ff7f0e", " stroke-dasharray=\"4 3\""),
    ] {
        let mut points = String::new();
        let mut prev: Option<f64> = None;
        for s in samples {
            let v = f64::from([s.provisioned, s.serving, s.recommended][pick]);
            if let Some(p) = prev {
                let _ = write!(points, "{:.1},{:.1} ", x(s.t_s), y(p));
            }
            let _ = write!(points, "{:.1},{:.1} ", x(s.t_s), y(v));
            prev = Some(v);
        }
        if let Some(p) = prev {
            let _ = write!(points, "{:.1},{:.1}", x(t_max), y(p));
        }
        let _ = write!(
            out,
            r#"<polyline fill="none" stroke="{color}" stroke-width="1.5"{dash} points="{points}"/>"#
        );
    }
    out.push_str("</svg>");
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
