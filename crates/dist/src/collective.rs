//! Collective operations on memfit tensors (f32, contiguous). Each does its allocation identically on
//! every device and moves data only on a device that holds it, so a `meta` run with a [`Simulated`]
//! group predicts a real rank's memory exactly; buffers are tensors of category `communication`.
//!
//! [`Simulated`]: crate::Simulated

use crate::Group;
use memfit_tensor::{Category, DType, Device, Error, Result, Tensor};

/// Checks that `tensors` can cross ranks, and says whether data must move (false on a device without
/// data, where the operation is its allocations only).
fn moves_data(group: &dyn Group, tensors: &[&Tensor]) -> Result<bool> {
    for t in tensors {
        if t.dtype() != DType::F32 || !t.is_contiguous() {
            return Err(Error::invalid(format!(
                "collective operations take contiguous f32 tensors, got a {} tensor of shape {:?}{}",
                t.dtype(),
                t.shape(),
                if t.is_contiguous() { "" } else { " (strided)" }
            )));
        }
    }
    let computes = tensors.first().is_some_and(|t| t.device().computes());
    if computes && !group.carries_data() {
        return Err(Error::invalid("a simulated rank predicts memory on the meta device; it cannot move cpu data"));
    }
    Ok(computes)
}

fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(Error::shape(format!("{what}: {got} elements where {want} are needed")));
    }
    Ok(())
}

/// Reads `src` and writes `dst` (two different tensors) through `f`.
fn with_pair(src: &Tensor, dst: &Tensor, f: impl FnOnce(&[f32], &mut [f32])) -> Result<()> {
    let mut result = Ok(());
    dst.write_with(|d: &mut [f32]| {
        result = src.read_with(|s: &[f32]| f(s, d)).map(|_| ());
    })?;
    result
}

/// `out` = the element-wise sum of every rank's `t` (same shape everywhere; `out` may not be `t`).
pub fn all_reduce_sum(group: &dyn Group, t: &Tensor, out: &Tensor) -> Result<()> {
    check_len("all-reduce output", out.numel(), t.numel())?;
    if moves_data(group, &[t, out])? {
        with_pair(t, out, |s, d| group.all_reduce_sum(s, d))?;
    }
    Ok(())
}

/// Overwrites `t` on every rank with `root`'s, in place (no buffer).
pub fn broadcast(group: &dyn Group, t: &Tensor, root: usize) -> Result<()> {
    if moves_data(group, &[t])? {
        t.write_with(|buf: &mut [f32]| group.broadcast(buf, root))?;
    }
    Ok(())
}

/// `out` = every rank's `shard` in rank order (`out` holds `size` shards).
pub fn all_gather(group: &dyn Group, shard: &Tensor, out: &Tensor) -> Result<()> {
    check_len("all-gather output", out.numel(), shard.numel() * group.size())?;
    if moves_data(group, &[shard, out])? {
        with_pair(shard, out, |s, d| group.all_gather(s, d))?;
    }
    Ok(())
}

/// `out` = this rank's block (the `rank`-th of `size` equal blocks) of the sum of every rank's `full`.
pub fn reduce_scatter_sum(group: &dyn Group, full: &Tensor, out: &Tensor) -> Result<()> {
    check_len("reduce-scatter input", full.numel(), out.numel() * group.size())?;
    if moves_data(group, &[full, out])? {
        with_pair(full, out, |s, d| group.reduce_scatter_sum(s, d))?;
    }
    Ok(())
}

/// Sends `t`'s elements to rank `to` (which receives them with [`receive`] into a tensor of as many).
pub fn send(group: &dyn Group, t: &Tensor, to: usize) -> Result<()> {
    if moves_data(group, &[t])? {
        t.read_with(|buf: &[f32]| group.send(buf, to))?;
    }
    Ok(())
}

/// Fills `t` with the elements rank `from` sent.
pub fn receive(group: &dyn Group, t: &Tensor, from: usize) -> Result<()> {
    if moves_data(group, &[t])? {
        t.write_with(|buf: &mut [f32]| group.receive(buf, from))?;
    }
    Ok(())
}

/// A fingerprint of tensors' bytes (FNV-1a over the f32 bit patterns), to check that ranks hold the
/// same parameters. None on a device without data.
pub fn fingerprint(tensors: &[Tensor]) -> Result<Option<u64>> {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for t in tensors {
        let Some(()) = t.read_with(|v: &[f32]| {
            for x in v {
                hash = (hash ^ u64::from(x.to_bits())).wrapping_mul(0x0000_0100_0000_01b3);
            }
        })?
        else {
            return Ok(None);
        };
    }
    Ok(Some(hash))
}

/// The default size of the gradient bucket: gradients cross ranks in pieces of at most this many
/// bytes. Smaller pieces cost more calls (tens of microseconds each between ranks of one machine);
/// the bucket is memory every rank holds for the whole run.
pub const DEFAULT_BUCKET_BYTES: u64 = 1 << 20;

/// The buffer gradients are summed across ranks through, allocated once for a run (category
/// `communication`): `min(all gradients, bucket)` elements. A piece of a gradient is copied into it
/// and the sum is received straight into the gradient, so one bucket is all the extra memory.
pub struct GradientBucket {
    bucket: Tensor,
}

impl GradientBucket {
    /// A bucket for gradients of `total` elements in all, of at most `bucket_bytes`.
    pub fn new(device: &Device, total: usize, bucket_bytes: u64) -> Result<GradientBucket> {
        let elems = total.min((bucket_bytes / 4).max(1) as usize).max(1);
        Ok(GradientBucket {
            bucket: Tensor::empty(device, &[elems], DType::F32, Category::Communication, "grad_bucket")?,
        })
    }

    /// Bytes the bucket holds.
    pub fn bytes(&self) -> u64 {
        4 * self.bucket.numel() as u64
    }

    /// Replaces each parameter's gradient by the sum of every rank's, piece by piece in parameter
    /// order. A parameter without a gradient (a rank whose shard of a window was empty) contributes
    /// zeros and is given a gradient (allocated identically on every device).
    pub fn all_reduce(&self, group: &dyn Group, params: &[Tensor]) -> Result<()> {
        let mut grads = Vec::with_capacity(params.len());
        for p in params {
            let g = match p.grad() {
                Some(g) => g,
                None => {
                    let g = Tensor::zeros(p.device(), p.shape(), DType::F32, Category::Gradient)?;
                    p.set_grad(Some(g.clone()));
                    g
                }
            };
            grads.push(g);
        }
        let refs: Vec<&Tensor> = grads.iter().chain([&self.bucket]).collect();
        if !moves_data(group, &refs)? {
            return Ok(());
        }
        let capacity = self.bucket.numel();
        for g in &grads {
            let mut from = 0;
            while from < g.numel() {
                let len = (g.numel() - from).min(capacity);
                with_pair(g, &self.bucket, |s, d| d[..len].copy_from_slice(&s[from..from + len]))?;
                with_pair(&self.bucket, g, |s, d| group.all_reduce_sum(&s[..len], &mut d[from..from + len]))?;
                from += len;
            }
        }
        Ok(())
    }
}

/// Which ranks say true (each rank gives its own `flag`), in rank order: one small all-reduce.
pub fn which(group: &dyn Group, flag: bool) -> Vec<bool> {
    let mut v = vec![0.0; group.size()];
    v[group.rank()] = f64::from(u8::from(flag));
    group.all_reduce_sum_f64(&mut v);
    v.into_iter().map(|x| x > 0.0).collect()
}

/// True when any rank says true (so that every rank takes the same branch).
pub fn any(group: &dyn Group, flag: bool) -> bool {
    which(group, flag).contains(&true)
}

/// `root`'s bytes on every rank (small host messages: a plan's inputs). Each byte travels as one f32,
/// exactly.
pub fn broadcast_bytes(group: &dyn Group, bytes: &[u8], root: usize) -> Vec<u8> {
    if group.size() == 1 || !group.carries_data() {
        return bytes.to_vec();
    }
    let len = group.all_gather_u64(bytes.len() as u64)[root] as usize;
    let mut buf: Vec<f32> =
        if group.rank() == root { bytes.iter().map(|&b| f32::from(b)).collect() } else { vec![0.0; len] };
    group.broadcast(&mut buf, root);
    buf.into_iter().map(|v| v as u8).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Simulated, Solo};
    use memfit_tensor::{DeviceConfig, DeviceKind};

    fn cpu() -> Device {
        Device::new(DeviceConfig::new(DeviceKind::Cpu)).unwrap()
    }

    fn f32s(device: &Device, v: &[f32]) -> Tensor {
        Tensor::from_slice(device, v, &[v.len()], Category::Other).unwrap()
    }

    #[test]
    fn one_rank_collectives_are_the_identity() {
        let d = cpu();
        let (t, out) = (f32s(&d, &[1.0, 2.0, 3.0]), f32s(&d, &[0.0; 3]));
        all_reduce_sum(&Solo, &t, &out).unwrap();
        assert_eq!(out.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0]);
        let out = f32s(&d, &[0.0; 3]);
        all_gather(&Solo, &t, &out).unwrap();
        assert_eq!(out.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0]);
        let out = f32s(&d, &[0.0; 3]);
        reduce_scatter_sum(&Solo, &t, &out).unwrap();
        assert_eq!(out.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0]);
        broadcast(&Solo, &t, 0).unwrap();
        assert_eq!(t.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0]);
        assert_eq!(broadcast_bytes(&Solo, b"plan", 0), b"plan");
        assert_eq!((any(&Solo, true), any(&Solo, false)), (true, false));
        assert_eq!(which(&Simulated { rank: 1, size: 3 }, true), [false, true, false], "a rank's own flag, in place");
    }

    #[test]
    fn collectives_refuse_what_cannot_cross_ranks() {
        let d = cpu();
        let t = f32s(&d, &[1.0, 2.0, 3.0, 4.0]);
        let ints = Tensor::zeros(&d, &[4], DType::I64, Category::Other).unwrap();
        assert!(broadcast(&Solo, &ints, 0).unwrap_err().to_string().contains("f32"));
        let strided = t.reshape(&[2, 2]).unwrap().transpose(0, 1).unwrap();
        assert!(broadcast(&Solo, &strided, 0).unwrap_err().to_string().contains("strided"));
        let short = f32s(&d, &[0.0; 3]);
        assert!(all_reduce_sum(&Solo, &t, &short).is_err());
        assert!(all_gather(&Simulated { rank: 0, size: 2 }, &t, &f32s(&d, &[0.0; 4])).is_err(), "needs 8");
        assert!(reduce_scatter_sum(&Simulated { rank: 0, size: 2 }, &t, &f32s(&d, &[0.0; 4])).is_err(), "needs 2");
        // A simulated rank moves no cpu data: every operation says so instead of pretending.
        let sim = Simulated { rank: 1, size: 2 };
        for result in [
            broadcast(&sim, &t, 0),
            send(&sim, &t, 0),
            receive(&sim, &t, 0),
            all_reduce_sum(&sim, &t, &f32s(&d, &[0.0; 4])),
            all_gather(&sim, &f32s(&d, &[0.0; 2]), &t),
            reduce_scatter_sum(&sim, &t, &f32s(&d, &[0.0; 2])),
        ] {
            assert!(result.unwrap_err().to_string().contains("simulated rank"));
        }
        assert_eq!(t.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn on_meta_collectives_allocate_nothing_and_move_nothing() {
        let meta = Device::meta();
        let sim = Simulated { rank: 1, size: 2 };
        let t = Tensor::empty(&meta, &[4], DType::F32, Category::Other, "t").unwrap();
        let before = meta.stats();
        broadcast(&sim, &t, 0).unwrap();
        send(&sim, &t, 0).unwrap();
        receive(&sim, &t, 0).unwrap();
        all_reduce_sum(&sim, &t, &t.clone()).unwrap();
        assert_eq!(meta.stats(), before);
        assert_eq!(fingerprint(std::slice::from_ref(&t)).unwrap(), None);
        assert_eq!(broadcast_bytes(&sim, b"x", 0), b"x");
    }

    #[test]
    fn a_bucket_sums_gradients_in_pieces_and_gives_missing_ones_zeros() {
        let d = cpu();
        let params: Vec<Tensor> = [5, 3, 4].iter().map(|&n| f32s(&d, &vec![0.0; n])).collect();
        params[0].set_grad(Some(f32s(&d, &[1.0, 2.0, 3.0, 4.0, 5.0])));
        params[2].set_grad(Some(f32s(&d, &[6.0, 7.0, 8.0, 9.0])));
        // A bucket of 2 elements: every gradient crosses in pieces.
        let bucket = GradientBucket::new(&d, 12, 8).unwrap();
        assert_eq!(bucket.bytes(), 8);
        assert_eq!(d.stats().category(Category::Communication).current, 512);
        bucket.all_reduce(&Solo, &params).unwrap();
        assert_eq!(params[0].grad().unwrap().to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(params[1].grad().unwrap().to_vec::<f32>().unwrap(), [0.0; 3]);
        assert_eq!(params[2].grad().unwrap().to_vec::<f32>().unwrap(), [6.0, 7.0, 8.0, 9.0]);
        // At most the whole gradient, at least one element.
        assert_eq!(GradientBucket::new(&d, 3, 1 << 20).unwrap().bytes(), 12);
        assert_eq!(GradientBucket::new(&d, 3, 0).unwrap().bytes(), 4);
    }

    #[test]
    fn fingerprints_tell_parameters_apart() {
        let d = cpu();
        let a = [f32s(&d, &[1.0, 2.0]), f32s(&d, &[3.0])];
        let b = [f32s(&d, &[1.0, 2.0]), f32s(&d, &[3.5])];
        let swapped = [f32s(&d, &[2.0, 1.0]), f32s(&d, &[3.0])];
        let f = |t: &[Tensor]| fingerprint(t).unwrap().unwrap();
        assert_eq!(f(&a), f(&[f32s(&d, &[1.0, 2.0]), f32s(&d, &[3.0])]));
        assert_ne!(f(&a), f(&b));
        assert_ne!(f(&a), f(&swapped));
        assert_ne!(f(&a), f(&[]));
    }
}
