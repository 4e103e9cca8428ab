//! The MPI transport (feature `mpi`): ranks started by `mpirun`, collectives by the MPI library.
//!
//! Failure never hangs the job: a panic on any rank calls `MPI_Abort` from the panic hook, and the
//! CLI aborts the job when a rank's run ends in an error ([`Group::abort`]). `mpirun --timeout` bounds
//! a whole job from outside.

use crate::Group;
use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use mpi::Threading;
use std::sync::{Mutex, MutexGuard};

/// `MPI_COMM_WORLD` of an initialised MPI library, finalised when dropped.
pub struct Mpi {
    world: SimpleCommunicator,
    lock: Mutex<()>,
    _universe: Universe,
}

// SAFETY: MPI is initialised with MPI_THREAD_SERIALIZED or more (checked in `init`), which allows any
// thread to call MPI as long as no two calls overlap; every call below holds `lock`.
unsafe impl Send for Mpi {}
// SAFETY: as above.
unsafe impl Sync for Mpi {}

impl Mpi {
    /// Initialises MPI (once per process) and installs a panic hook that aborts the whole job. Errors
    /// when MPI was already initialised or cannot give serialized threading.
    pub fn init() -> Result<Mpi, String> {
        let (universe, threading) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| "MPI was already initialised in this process".to_string())?;
        if threading < Threading::Serialized {
            return Err(format!(
                "the MPI library gives only {threading:?} threading; memfit needs Serialized (calls from its worker thread)"
            ));
        }
        let world = universe.world();
        let default_hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            default_hook(info);
            // SAFETY: MPI is initialised (the hook is installed after `initialize`); MPI_Abort may be
            // called from any thread and does not return.
            unsafe {
                mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, 101);
            }
        }));
        Ok(Mpi { world, lock: Mutex::new(()), _universe: universe })
    }

    fn serial(&self) -> MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Group for Mpi {
    fn rank(&self) -> usize {
        self.world.rank() as usize
    }
    fn size(&self) -> usize {
        self.world.size() as usize
    }
    fn all_reduce_sum(&self, send: &[f32], recv: &mut [f32]) {
        let _g = self.serial();
        self.world.all_reduce_into(send, recv, SystemOperation::sum());
    }
    fn all_reduce_sum_f64(&self, values: &mut [f64]) {
        let send = values.to_vec();
        let _g = self.serial();
        self.world.all_reduce_into(&send[..], values, SystemOperation::sum());
    }
    fn all_gather(&self, send: &[f32], recv: &mut [f32]) {
        let _g = self.serial();
        self.world.all_gather_into(send, recv);
    }
    fn all_gather_u64(&self, value: u64) -> Vec<u64> {
        let mut all = vec![0u64; self.size()];
        let _g = self.serial();
        self.world.all_gather_into(&value, &mut all[..]);
        all
    }
    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) {
        let _g = self.serial();
        self.world.reduce_scatter_block_into(send, recv, SystemOperation::sum());
    }
    fn broadcast(&self, buf: &mut [f32], root: usize) {
        let _g = self.serial();
        self.world.process_at_rank(root as i32).broadcast_into(buf);
    }
    fn send(&self, buf: &[f32], to: usize) {
        let _g = self.serial();
        self.world.process_at_rank(to as i32).send(buf);
    }
    fn receive(&self, buf: &mut [f32], from: usize) {
        let _g = self.serial();
        self.world.process_at_rank(from as i32).receive_into(buf);
    }
    fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }
}
