//! memfit across ranks: a [`Group`] of processes that train together, and the collective operations
//! the trainer needs on memfit tensors (`collective.rs`), whose buffers come from the device's allocator
//! (category `communication`), so a rank's peak is planned on `meta` like everything else.
//!
//! Groups:
//! - [`Solo`]: one rank; every collective is the identity.
//! - [`Simulated`]: rank `r` of `n` on the `meta` device, for planning: collectives allocate exactly
//!   what they allocate on a real rank and move nothing (a meta tensor has no data).
//! - `mpi::Mpi` (feature `mpi`): real ranks started by `mpirun`. An error or panic on any rank aborts
//!   the whole job (`MPI_Abort`), so a failing rank never leaves the others waiting.
//!
//! `partition.rs` says who does what: the share of a window's samples (and under ZeRO-1 of the
//! parameters' elements) each rank takes.

pub mod collective;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod partition;

pub use collective::GradientBucket;

/// This build carries the MPI transport (feature `mpi`): `mpirun` can start its ranks.
pub const MPI: bool = cfg!(feature = "mpi");

/// A group of ranks and the transport between them. Buffers are host slices (the cpu device's
/// memory); the tensor-level operations in [`collective`] call these only on a device that holds data.
/// Calls are collective: every rank makes the same calls in the same order.
pub trait Group: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Whether the group moves data (false for [`Simulated`]: its ranks are predictions).
    fn carries_data(&self) -> bool {
        true
    }
    /// `recv[i] = sum over ranks of send[i]`.
    fn all_reduce_sum(&self, send: &[f32], recv: &mut [f32]);
    /// Element-wise sum of `values` over all ranks, in place (small host values: losses, counts).
    fn all_reduce_sum_f64(&self, values: &mut [f64]);
    /// Every rank's `send` (equal lengths), concatenated in rank order into `recv`.
    fn all_gather(&self, send: &[f32], recv: &mut [f32]);
    /// Every rank's `value`, in rank order.
    fn all_gather_u64(&self, value: u64) -> Vec<u64>;
    /// Sums `send` over all ranks and gives rank r the r-th of `size` equal blocks of the sum.
    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]);
    /// Overwrites `buf` on every rank with `root`'s.
    fn broadcast(&self, buf: &mut [f32], root: usize);
    fn send(&self, buf: &[f32], to: usize);
    fn receive(&self, buf: &mut [f32], from: usize);
    /// Ends every rank of the job with `code` (after the caller has printed why).
    fn abort(&self, code: i32) -> !;
}

/// One rank alone: every collective is the identity.
pub struct Solo;

impl Group for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, send: &[f32], recv: &mut [f32]) {
        recv.copy_from_slice(send);
    }
    fn all_reduce_sum_f64(&self, _values: &mut [f64]) {}
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) {
        recv.copy_from_slice(send);
    }
    fn all_gather_u64(&self, value: u64) -> Vec<u64> {
        vec![value]
    }
    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) {
        recv.copy_from_slice(send);
    }
    fn broadcast(&self, _buf: &mut [f32], _root: usize) {}
    fn send(&self, _buf: &[f32], to: usize) {
        unreachable!("a group of one rank has no rank {to} to send to")
    }
    fn receive(&self, _buf: &mut [f32], from: usize) {
        unreachable!("a group of one rank has no rank {from} to receive from")
    }
    fn abort(&self, code: i32) -> ! {
        std::process::exit(code)
    }
}

/// Rank `rank` of `size`, predicted on the `meta` device: the tensor-level collectives allocate what
/// they would on a real rank and never call the transport (meta tensors hold no data), so a meta run
/// with this group predicts each rank's peak to the byte.
pub struct Simulated {
    pub rank: usize,
    pub size: usize,
}

impl Simulated {
    fn no_data(&self) -> ! {
        unreachable!("a simulated rank moves no data: collective.rs calls the transport only for devices with data")
    }
}

impl Group for Simulated {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn carries_data(&self) -> bool {
        false
    }
    fn all_reduce_sum(&self, _: &[f32], _: &mut [f32]) {
        self.no_data()
    }
    fn all_reduce_sum_f64(&self, _: &mut [f64]) {}
    fn all_gather(&self, _: &[f32], _: &mut [f32]) {
        self.no_data()
    }
    fn all_gather_u64(&self, value: u64) -> Vec<u64> {
        vec![value; self.size]
    }
    fn reduce_scatter_sum(&self, _: &[f32], _: &mut [f32]) {
        self.no_data()
    }
    fn broadcast(&self, _: &mut [f32], _: usize) {
        self.no_data()
    }
    fn send(&self, _: &[f32], _: usize) {
        self.no_data()
    }
    fn receive(&self, _: &mut [f32], _: usize) {
        self.no_data()
    }
    fn abort(&self, code: i32) -> ! {
        std::process::exit(code)
    }
}
