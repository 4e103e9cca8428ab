//! `Rng`: a small, self-contained, seeded pseudo-random generator
//! (SplitMix64) shared by the whole engine: epoch shuffling here, seeded
//! weight initialization and dropout masks in other crates. Same seed, same
//! sequence, on every platform and in every build.

/// SplitMix64 increment (the golden ratio in 64-bit fixed point).
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function: a bijective 64-bit mixer.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A SplitMix64 generator. Not cryptographic; fast, tiny, and good enough
/// for shuffling, initialization and dropout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng { state: seed }
    }

    /// An independent generator for sub-stream `stream` of `seed` (e.g. one
    /// per epoch, per layer, per dropout site): distinct `(seed, stream)`
    /// pairs give unrelated sequences.
    pub fn derive(seed: u64, stream: u64) -> Rng {
        Rng { state: mix64(seed ^ mix64(stream.wrapping_add(GOLDEN))) }
    }

    /// The internal state, to save (e.g. in a checkpoint) and restore with
    /// [`Rng::from_state`].
    pub fn state(&self) -> u64 {
        self.state
    }

    /// A generator that continues exactly where the one with `state` was.
    pub fn from_state(state: u64) -> Rng {
        Rng { state }
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN);
        mix64(self.state)
    }

    /// The next 32 random bits.
    #[inline]
    pub fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }

    /// Uniform in `[0, 1)`, with 24 bits of precision (every value exactly
    /// representable, never 1.0).
    #[inline]
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u32 << 24) as f32)
    }

    /// Uniform in `[0, 1)`, with 53 bits of precision.
    #[inline]
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `[low, high)`.
    #[inline]
    pub fn uniform_f32(&mut self, low: f32, high: f32) -> f32 {
        low + (high - low) * self.next_f32()
    }

    /// Standard normal (mean 0, std 1), by the Box–Muller transform.
    pub fn normal_f32(&mut self) -> f32 {
        // 1 - u is in (0, 1], so the log is finite.
        let u1 = 1.0 - self.next_f64();
        let u2 = self.next_f64();
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }

    /// Uniform integer in `0..n`, without modulo bias (Lemire's method).
    ///
    /// # Panics
    /// If `n == 0`.
    #[inline]
    pub fn gen_range(&mut self, n: u64) -> u64 {
        assert!(n > 0, "Rng::gen_range: empty range 0..0");
        let mut m = (self.next_u64() as u128) * (n as u128);
        if (m as u64) < n {
            let threshold = n.wrapping_neg() % n;
            while (m as u64) < threshold {
                m = (self.next_u64() as u128) * (n as u128);
            }
        }
        (m >> 64) as u64
    }

    /// Uniform index in `0..n` (`gen_range` for `usize`).
    ///
    /// # Panics
    /// If `n == 0`.
    #[inline]
    pub fn gen_index(&mut self, n: usize) -> usize {
        self.gen_range(n as u64) as usize
    }

    /// `true` with probability `p` (e.g. dropout's keep decision).
    #[inline]
    pub fn gen_bool(&mut self, p: f32) -> bool {
        self.next_f32() < p
    }

    /// Shuffles `items` in place (Fisher–Yates): every permutation equally likely.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.gen_index(i + 1);
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_reference_values() {
        // Reference outputs of SplitMix64 seeded with 1234567.
        let mut r = Rng::new(1234567);
        let expected = [6457827717110365317u64, 3203168211198807973, 9817491932198370423];
        for e in expected {
            assert_eq!(r.next_u64(), e);
        }
    }

    #[test]
    fn same_seed_same_sequence_different_seed_different_sequence() {
        let a: Vec<u64> = (0..8).scan(Rng::new(7), |r, _| Some(r.next_u64())).collect();
        let b: Vec<u64> = (0..8).scan(Rng::new(7), |r, _| Some(r.next_u64())).collect();
        let c: Vec<u64> = (0..8).scan(Rng::new(8), |r, _| Some(r.next_u64())).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn derive_streams_differ() {
        let mut a = Rng::derive(42, 0);
        let mut b = Rng::derive(42, 1);
        let mut c = Rng::derive(43, 0);
        let (x, y, z) = (a.next_u64(), b.next_u64(), c.next_u64());
        assert!(x != y && x != z && y != z);
    }

    #[test]
    fn state_round_trip_continues_sequence() {
        let mut a = Rng::new(99);
        a.next_u64();
        let mut b = Rng::from_state(a.state());
        assert_eq!(a.next_u64(), b.next_u64());
    }

    #[test]
    fn next_f32_in_unit_interval_with_sane_mean() {
        let mut r = Rng::new(3);
        let n = 100_000;
        let mut sum = 0.0f64;
        for _ in 0..n {
            let x = r.next_f32();
            assert!((0.0..1.0).contains(&x));
            sum += x as f64;
        }
        let mean = sum / n as f64;
        assert!((mean - 0.5).abs() < 0.01, "mean {mean}");
    }

    #[test]
    fn gen_range_stays_in_range_and_covers_it() {
        let mut r = Rng::new(5);
        let mut seen = [0usize; 7];
        for _ in 0..7000 {
            let k = r.gen_range(7);
            assert!(k < 7);
            seen[k as usize] += 1;
        }
        assert!(seen.iter().all(|&c| c > 800), "{seen:?}");
        assert_eq!(Rng::new(0).gen_range(1), 0);
    }

    #[test]
    #[should_panic(expected = "empty range")]
    fn gen_range_zero_panics() {
        Rng::new(0).gen_range(0);
    }

    #[test]
    fn normal_has_mean_zero_std_one() {
        let mut r = Rng::new(11);
        let n = 100_000;
        let xs: Vec<f64> = (0..n).map(|_| r.normal_f32() as f64).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.02, "mean {mean}");
        assert!((var.sqrt() - 1.0).abs() < 0.02, "std {}", var.sqrt());
        assert!(xs.iter().all(|x| x.is_finite()));
    }

    #[test]
    fn shuffle_is_a_permutation() {
        let mut r = Rng::new(17);
        let mut v: Vec<usize> = (0..100).collect();
        r.shuffle(&mut v);
        assert_ne!(v, (0..100).collect::<Vec<_>>());
        let mut s = v.clone();
        s.sort_unstable();
        assert_eq!(s, (0..100).collect::<Vec<_>>());
        let mut empty: [u8; 0] = [];
        r.shuffle(&mut empty);
        let mut one = [1];
        r.shuffle(&mut one);
        assert_eq!(one, [1]);
    }
}
