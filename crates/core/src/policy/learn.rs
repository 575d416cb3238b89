//! What the `cost` policy learns online: output lengths (global, per RL group, per prompt),
//! cache churn per worker, and a least-squares fit of step times for engines without a profile.
//! Pure: every update takes the observation (and `now` where rates need it).

use crate::fast_map::FastMap;
use crate::time::Time;

/// The longest output learned as a sample, tokens: a longer one (a report that cannot be true:
/// no model writes a million tokens in one answer) counts as this many, so one bad report
/// cannot set the expected length of every request for hundreds of requests after it.
pub const MAX_OUTPUT_SAMPLE: u64 = 1 << 20;
/// Output length assumed before anything finished, tokens.
pub const PRIOR_OUTPUT_TOKENS: f64 = 256.0;
/// Weight of the global (or prompt) mean when shrinking a group's mean: a group with `k`
/// finished samples of mean `m` predicts `(k·m + K0·prior) / (k + K0)`.
pub const GROUP_SHRINK: f64 = 1.0;
/// Keys remembered per map before the oldest half is forgotten.
const MAX_KEYS: usize = 65_536;
/// Smoothing of the global and per-prompt means (weight of the newest sample).
const EMA: f64 = 0.05;

#[derive(Clone, Copy, Debug, Default)]
struct Mean {
    sum: f64,
    count: f64,
    seen: u64,
}

/// Coefficient of variation of group lengths assumed before eight grouped samples finished.
pub const PRIOR_GROUP_CV: f64 = 1.0;

/// Output lengths learned as requests finish.
#[derive(Debug, Default)]
pub struct OutputLengths {
    global: Option<f64>,
    /// EMA of (group mean / global mean − 1)², and the grouped samples seen.
    group_dev: f64,
    grouped: u64,
    groups: FastMap<u64, Mean>,
    prompts: FastMap<u64, Mean>,
    tick: u64,
}

fn forget_oldest(map: &mut FastMap<u64, Mean>) {
    if map.len() <= MAX_KEYS {
        return;
    }
    let mut seen: Vec<u64> = map.values().map(|m| m.seen).collect();
    seen.sort_unstable();
    let cut = seen[seen.len() / 2];
    map.retain(|_, m| m.seen > cut);
}

impl OutputLengths {
    /// Records a finished request's output length, with its RL group and prompt key if any.
    pub fn observe(&mut self, tokens: u64, group: Option<u64>, prompt: Option<u64>) {
        let t = tokens.min(MAX_OUTPUT_SAMPLE) as f64;
        self.tick += 1;
        self.global = Some(match self.global {
            None => t,
            Some(g) => g + EMA * (t - g),
        });
        let tick = self.tick;
        if let Some(g) = group {
            let m = self.groups.entry(g).or_default();
            m.sum += t;
            m.count += 1.0;
            m.seen = tick;
            let dev = (m.sum / m.count) / self.global.unwrap_or(t).max(1.0) - 1.0;
            self.grouped += 1;
            self.group_dev += EMA.max(1.0 / self.grouped as f64) * (dev * dev - self.group_dev);
            forget_oldest(&mut self.groups);
        }
        if let Some(p) = prompt {
            let m = self.prompts.entry(p).or_default();
            // An exponential mean across steps: the policy drifts.
            if m.count == 0.0 {
                m.sum = t;
                m.count = 1.0;
            } else {
                m.sum += 0.5 * (t - m.sum);
                m.count += 1.0;
            }
            m.seen = tick;
            forget_oldest(&mut self.prompts);
        }
    }

    /// Whether any output length has been observed (before that every expectation is the prior).
    pub fn observed(&self) -> bool {
        self.global.is_some()
    }

    /// The coefficient of variation of a group's mean length around the global mean (how far
    /// siblings move together), [`PRIOR_GROUP_CV`] until eight grouped samples finished.
    pub fn group_cv(&self) -> f64 {
        if self.grouped < 8 {
            PRIOR_GROUP_CV
        } else {
            self.group_dev.sqrt()
        }
    }

    /// The expected output of a request: its group's finished siblings shrunk toward the prompt's
    /// history (or the global mean, or [`PRIOR_OUTPUT_TOKENS`]).
    pub fn expected(&self, group: Option<u64>, prompt: Option<u64>) -> f64 {
        let global = self.global.unwrap_or(PRIOR_OUTPUT_TOKENS);
        let prior = prompt
            .and_then(|p| self.prompts.get(&p))
            .map_or(global, |m| m.sum);
        match group.and_then(|g| self.groups.get(&g)) {
            Some(m) => (m.sum + GROUP_SHRINK * prior) / (m.count + GROUP_SHRINK),
            None => prior,
        }
    }
}

/// An exponentially weighted rate (amount per second) with a time constant of
/// [`Rate::WINDOW_S`]: blocks stored per second (churn, from KV events), prefill seconds placed
/// per second (utilisation).
#[derive(Clone, Copy, Debug, Default)]
pub struct Rate {
    rate: f64,
    last: Option<Time>,
}

impl Rate {
    /// Time constant of the rate, seconds.
    pub const WINDOW_S: f64 = 30.0;

    /// `amount` happened at `now`.
    pub fn add(&mut self, amount: f64, now: Time) {
        let decay = match self.last {
            Some(t) => (-now.since(t).as_secs_f64() / Self::WINDOW_S).exp(),
            None => 1.0,
        };
        self.rate = self.rate * decay + amount / Self::WINDOW_S;
        self.last = Some(now);
    }

    /// Whether nothing was ever added.
    pub fn is_unset(&self) -> bool {
        self.last.is_none()
    }

    /// The rate at `now`, blocks per second.
    pub fn rate(&self, now: Time) -> f64 {
        match self.last {
            Some(t) => self.rate * (-now.since(t).as_secs_f64() / Self::WINDOW_S).exp(),
            None => 0.0,
        }
    }
}

/// How hot each prefix is: per prefix key (the hash of its last block), the requests that
/// arrived on it in the last [`Rate::WINDOW_S`] seconds, exponentially weighted, and since when
/// its traffic has lasted (the start of its current run: a request on a prefix not seen for a
/// window starts a new one). Bounded: past 65,536 keys (`MAX_KEYS`) the least
/// recently seen half is forgotten.
#[derive(Debug, Default)]
pub struct PrefixHeat {
    keys: FastMap<u64, Heat>,
}

#[derive(Clone, Copy, Debug, Default)]
struct Heat {
    rate: Rate,
    since: Time,
}

impl PrefixHeat {
    /// One request arrived on prefix `key` at `now`.
    pub fn observe(&mut self, key: u64, now: Time) {
        let h = self.keys.entry(key).or_default();
        if h.rate
            .last
            .is_none_or(|t| now.since(t).as_secs_f64() > Rate::WINDOW_S)
        {
            h.since = now;
        }
        h.rate.add(1.0, now);
        if self.keys.len() > MAX_KEYS {
            let mut last: Vec<Time> = self.keys.values().filter_map(|h| h.rate.last).collect();
            last.sort_unstable();
            let cut = last[last.len() / 2];
            self.keys
                .retain(|_, h| h.rate.last.is_some_and(|t| t > cut));
        }
    }

    /// Requests on `key` in the last window (rate × window), as of `now`; 0 if never seen.
    pub fn recent(&self, key: u64, now: Time) -> f64 {
        self.keys
            .get(&key)
            .map_or(0.0, |h| h.rate.rate(now) * Rate::WINDOW_S)
    }

    /// Seconds the prefix's current run of traffic has lasted as of `now` (0 if never seen).
    /// A burst (every request within a few milliseconds) is young however many it brought.
    pub fn lasted_s(&self, key: u64, now: Time) -> f64 {
        self.keys
            .get(&key)
            .map_or(0.0, |h| now.since(h.since).as_secs_f64())
    }
}

/// Ordinary least squares `y ≈ a + b·x` over exponentially forgotten samples (each new sample
/// multiplies the old sums by `1 − 1/window`), updated in O(1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LineFit {
    n: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
    keep: f64,
}

impl LineFit {
    /// A fit remembering about `window` samples.
    pub fn new(window: f64) -> Self {
        Self {
            n: 0.0,
            sx: 0.0,
            sy: 0.0,
            sxx: 0.0,
            sxy: 0.0,
            keep: 1.0 - 1.0 / window.max(1.0),
        }
    }

    /// Adds one observation.
    pub fn add(&mut self, x: f64, y: f64) {
        if !(x.is_finite() && y.is_finite()) {
            return;
        }
        let k = self.keep;
        self.n = self.n * k + 1.0;
        self.sx = self.sx * k + x;
        self.sy = self.sy * k + y;
        self.sxx = self.sxx * k + x * x;
        self.sxy = self.sxy * k + x * y;
    }

    /// `(a, b)`, once two distinct x values were seen; `b` is floored at 0 (work never makes a
    /// step faster) and `a` at 0.
    pub fn line(&self) -> Option<(f64, f64)> {
        let var = self.n * self.sxx - self.sx * self.sx;
        if self.n < 2.0 || var <= 1e-9 * self.n * self.sxx.max(1.0) {
            return None;
        }
        let b = ((self.n * self.sxy - self.sx * self.sy) / var).max(0.0);
        let a = ((self.sy - b * self.sx) / self.n).max(0.0);
        Some((a, b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn group_means_shrink_toward_the_prior_and_learn() {
        let mut o = OutputLengths::default();
        assert_eq!(o.expected(Some(1), None), PRIOR_OUTPUT_TOKENS);
        o.observe(1000, Some(1), None);
        // Global is now 1000; the group's one sample of 1000 with the global prior of 1000.
        assert_eq!(o.expected(Some(1), None), 1000.0);
        o.observe(100, Some(2), None);
        let g = 1000.0 + EMA * (100.0 - 1000.0);
        assert!((o.expected(Some(2), None) - (100.0 + g) / 2.0).abs() < 1e-9);
        assert!((o.expected(None, None) - g).abs() < 1e-9);
        o.observe(5000, None, Some(7));
        assert!(o.expected(Some(99), Some(7)) == 5000.0);
    }

    #[test]
    fn churn_rate_converges_to_the_stored_rate() {
        let mut c = Rate::default();
        let mut now = Time::ZERO;
        for _ in 0..2000 {
            now = now + Duration::from_millis(100);
            c.add(10.0, now);
        }
        // 10 blocks every 0.1 s = 100 blocks/s (discretisation error under 1 %).
        assert!((c.rate(now) - 100.0).abs() < 2.0, "{}", c.rate(now));
        assert!(c.rate(now + Duration::from_secs(300)) < 1.0);
    }

    #[test]
    fn prefix_heat_counts_the_recent_requests_of_a_prefix() {
        let mut h = PrefixHeat::default();
        let mut now = Time::ZERO;
        assert_eq!(h.recent(7, now), 0.0);
        // Two requests a second on prefix 7: about 60 in a 30 s window once steady.
        for _ in 0..1000 {
            now = now + Duration::from_millis(500);
            h.observe(7, now);
        }
        assert!(
            (h.recent(7, now) - 60.0).abs() < 2.0,
            "{}",
            h.recent(7, now)
        );
        assert_eq!(h.recent(8, now), 0.0);
        // Its traffic has lasted since the first request (1000 × 0.5 s).
        assert!((h.lasted_s(7, now) - 499.5).abs() < 1e-6);
        // It cools once the prefix stops arriving.
        assert!(h.recent(7, now + Duration::from_secs(300)) < 0.1);
        // A request on the cooled prefix starts a new run; a burst right after it stays young.
        let later = now + Duration::from_secs(300);
        for ms in 0..12 {
            h.observe(7, later + Duration::from_millis(ms));
        }
        let end = later + Duration::from_millis(11);
        assert!(h.recent(7, end) > 11.0);
        assert!((h.lasted_s(7, end) - 0.011).abs() < 1e-9);
        assert_eq!(h.lasted_s(9, end), 0.0);
        // Bounded: a flood of one-off prefixes keeps the map near MAX_KEYS.
        for k in 0..(MAX_KEYS as u64 + 10) {
            now = now + Duration::from_millis(1);
            h.observe(1000 + k, now);
        }
        assert!(h.keys.len() <= MAX_KEYS);
    }

    #[test]
    fn line_fit_recovers_a_line_and_matches_brute_force_least_squares() {
        let mut f = LineFit::new(1e12);
        assert!(f.line().is_none());
        let pts: Vec<(f64, f64)> = (0..50)
            .map(|i| {
                let x = f64::from(i) * 100.0;
                (x, 16.5 + 0.015 * x + if i % 2 == 0 { 0.3 } else { -0.3 })
            })
            .collect();
        for (x, y) in &pts {
            f.add(*x, *y);
        }
        let (a, b) = f.line().unwrap();
        // Brute force: the normal equations solved directly.
        let n = pts.len() as f64;
        let mx = pts.iter().map(|p| p.0).sum::<f64>() / n;
        let my = pts.iter().map(|p| p.1).sum::<f64>() / n;
        let bb = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum::<f64>()
            / pts.iter().map(|p| (p.0 - mx).powi(2)).sum::<f64>();
        assert!((b - bb).abs() < 1e-9 && (a - (my - bb * mx)).abs() < 1e-6);
        assert!((b - 0.015).abs() < 1e-3 && (a - 16.5).abs() < 0.5);
    }
}
