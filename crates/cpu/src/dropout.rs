//! CPU kernels of dropout (`ops/dropout.rs`): the SplitMix64 mask draw, the scaled output with its
//! bit mask, and the masked backward, in parallel chunks of whole mask bytes.

use crate::dtype::Float;
use crate::error::Result;
use crate::view::View;
use crate::with_float;
use crate::PAR_CHUNK;
use rayon::prelude::*;

const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// The SplitMix64 finalizer.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform draw in [0, 1) for element `i` of the stream `key` (= mix(seed)).
pub fn uniform(key: u64, i: u64) -> f64 {
    let z = mix(key.wrapping_add(i.wrapping_add(1).wrapping_mul(GAMMA)));
    (z >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Bytes of mask per parallel task (8 elements per byte).
const MASK_BYTES_PER_TASK: usize = PAR_CHUNK / 8;

/// `out = x * mask / (1 - p)` with element `i` kept when `uniform(mix(seed), i) >= p`; writes the
/// mask's bits into `mask` when given (x contiguous).
pub fn dropout(x: View<'_>, p: f64, seed: u64, out: View<'_>, mask: Option<View<'_>>) -> Result<()> {
    if x.numel() == 0 {
        return Ok(());
    }
    let key = mix(seed);
    with_float!(x.dtype(), "dropout", T => {
        let scale = T::of(1.0 / (1.0 - p));
        let (src, dst) = (x.slice::<T>()?, out.slice_mut::<T>()?);
        // Processes elements [8 * byte0, ...) of one task: writes output and (optionally) mask bytes.
        let run = |byte0: usize, d: &mut [T], s: &[T], m: Option<&mut [u8]>| {
            let mut bits = [0u8; MASK_BYTES_PER_TASK];
            for (j, (d, &s)) in d.iter_mut().zip(s).enumerate() {
                let keep = uniform(key, (byte0 * 8 + j) as u64) >= p;
                *d = if keep { s * scale } else { T::of(0.0) };
                bits[j / 8] |= (keep as u8) << (j % 8);
            }
            if let Some(m) = m {
                m.copy_from_slice(&bits[..m.len()]);
            }
        };
        let per = 8 * MASK_BYTES_PER_TASK;
        match mask {
            Some(mask) => {
                let m = mask.slice_mut::<u8>()?;
                dst.par_chunks_mut(per).zip(src.par_chunks(per)).zip(m.par_chunks_mut(MASK_BYTES_PER_TASK))
                    .enumerate().for_each(|(k, ((d, s), m))| run(k * MASK_BYTES_PER_TASK, d, s, Some(m)));
            }
            None => {
                dst.par_chunks_mut(per).zip(src.par_chunks(per))
                    .enumerate().for_each(|(k, (d, s))| run(k * MASK_BYTES_PER_TASK, d, s, None));
            }
        }
    });
    Ok(())
}

/// `gx = grad * mask / (1 - p)` (grad contiguous; `mask` one bit per element).
pub fn dropout_backward(grad: View<'_>, mask: View<'_>, p: f64, gx: View<'_>) -> Result<()> {
    with_float!(grad.dtype(), "dropout_backward", T => {
        let scale = T::of(1.0 / (1.0 - p));
        let (g, m, dst) = (grad.slice::<T>()?, mask.slice::<u8>()?, gx.slice_mut::<T>()?);
        let run = |(d, (g, m)): (&mut [T], (&[T], &[u8]))| {
            for (j, (d, &g)) in d.iter_mut().zip(g).enumerate() {
                *d = if (m[j / 8] >> (j % 8)) & 1 == 1 { g * scale } else { T::of(0.0) };
            }
        };
        let per = 8 * MASK_BYTES_PER_TASK;
        dst.par_chunks_mut(per).zip(g.par_chunks(per).zip(m.par_chunks(MASK_BYTES_PER_TASK))).for_each(run);
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `mix` is SplitMix64's finalizer: the generator seeded with 0 (state advanced by `GAMMA`
    /// before each output) gives its published first outputs, so a mask is reproducible from the
    /// seed by any SplitMix64.
    #[test]
    fn mix_is_splitmix64() {
        let outputs: Vec<u64> = (1..=3u64).map(|k| mix(k.wrapping_mul(GAMMA))).collect();
        assert_eq!(outputs, [0xE220_A839_7B1D_CDAF, 0x6E78_9E6A_A1B9_65F4, 0x06C4_5D18_8009_454F]);
    }

    /// Element `i`'s draw is the top 53 bits of output `i + 1` of the stream `key`, in [0, 1).
    #[test]
    fn uniform_takes_the_top_53_bits() {
        let key = mix(42);
        for i in [0u64, 1, 7, 1 << 40] {
            let z = mix(key.wrapping_add((i + 1).wrapping_mul(GAMMA)));
            let u = uniform(key, i);
            assert_eq!(u, (z >> 11) as f64 / (1u64 << 53) as f64);
            assert!((0.0..1.0).contains(&u));
        }
    }
}
