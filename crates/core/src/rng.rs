//! A small seeded generator (xoshiro256**, seeded through SplitMix64).
//!
//! Owned by every randomized policy. Written here rather than taken from a crate so that a seed
//! gives the same stream forever, which keeps simulator summaries byte-identical across
//! dependency upgrades.

/// A deterministic pseudo-random generator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeededRng {
    s: [u64; 4],
}

/// The SplitMix64 finalizer: a fixed, well-mixing bijection of 64-bit values, for deriving
/// deterministic ids and tokens from seeds.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    mix64(*state)
}

impl SeededRng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        let mut state = seed;
        Self {
            s: [0; 4].map(|_| splitmix64(&mut state)),
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// A uniform index in `0..n` (`n` > 0), without modulo bias.
    pub fn below(&mut self, n: usize) -> usize {
        assert!(n > 0, "below(0)");
        let n = n as u64;
        let zone = u64::MAX - (u64::MAX % n);
        loop {
            let x = self.next_u64();
            if x < zone {
                return (x % n) as usize;
            }
        }
    }

    /// A uniform float in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream() {
        let mut a = SeededRng::new(7);
        let mut b = SeededRng::new(7);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        assert_ne!(SeededRng::new(7).next_u64(), SeededRng::new(8).next_u64());
    }

    #[test]
    fn the_stream_is_pinned() {
        // Golden values from an independent Python rendering of xoshiro256** seeded by
        // SplitMix64: a change here changes every seeded simulation result.
        let mut rng = SeededRng::new(0);
        let first: Vec<u64> = (0..3).map(|_| rng.next_u64()).collect();
        assert_eq!(first, GOLDEN);
    }

    const GOLDEN: [u64; 3] = [
        11091344671253066420,
        13793997310169335082,
        1900383378846508768,
    ];

    #[test]
    fn below_is_roughly_uniform() {
        let mut rng = SeededRng::new(42);
        let mut counts = [0u32; 4];
        for _ in 0..40_000 {
            counts[rng.below(4)] += 1;
        }
        for c in counts {
            assert!((9_000..11_000).contains(&c), "{counts:?}");
        }
        let u = rng.unit();
        assert!((0.0..1.0).contains(&u));
    }
}
