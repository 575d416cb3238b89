//! Seeded draws for the generators.

use kvrouter_core::rng::SeededRng;

/// A standard normal draw (Box-Muller).
pub fn normal(rng: &mut SeededRng) -> f64 {
    let u1 = rng.unit().max(f64::MIN_POSITIVE);
    let u2 = rng.unit();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

/// Log-normal with the given median and log-space standard deviation.
pub fn lognormal(rng: &mut SeededRng, median: f64, sigma: f64) -> f64 {
    (median.ln() + sigma * normal(rng)).exp()
}

/// Log-normal, rounded and clipped to `[lo, hi]`.
pub fn lognormal_clip(rng: &mut SeededRng, median: f64, sigma: f64, lo: f64, hi: f64) -> u32 {
    lognormal(rng, median, sigma).round().clamp(lo, hi) as u32
}

/// Exponential with the given mean.
pub fn exponential(rng: &mut SeededRng, mean: f64) -> f64 {
    -mean * (1.0 - rng.unit()).ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lognormal_has_the_requested_median() {
        let mut rng = SeededRng::new(1);
        let mut v: Vec<f64> = (0..20_001)
            .map(|_| lognormal(&mut rng, 3000.0, 1.0))
            .collect();
        v.sort_by(f64::total_cmp);
        let median = v[10_000];
        assert!((median / 3000.0 - 1.0).abs() < 0.05, "{median}");
        let mean: f64 = (0..20_000).map(|_| exponential(&mut rng, 2.0)).sum::<f64>() / 20_000.0;
        assert!((mean - 2.0).abs() < 0.1);
    }
}
