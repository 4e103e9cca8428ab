//! Deterministic pseudo-random inputs for the kernels' unit tests (one generator for all of them).

/// `len` values in [-0.5, 0.5) from `seed` (xorshift64; the same seed always gives the same values).
pub(crate) fn uniform(len: usize, seed: u64) -> impl Iterator<Item = f64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len).map(move |_| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64 - 0.5
    })
}
