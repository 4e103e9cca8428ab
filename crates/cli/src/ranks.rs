//! The command line's side of `--parallel`: joining the ranks `mpirun` started, ending the whole job
//! when one rank fails (so no rank waits for it forever), and the per-rank memory table.

use crate::Failure;
use memfit_dist::Group;
use memfit_tensor::memory::format_bytes;
use memfit_train::parallel::ParallelMode;
use memfit_train::report::RanksSummary;
use std::sync::Arc;

/// The ranks this process was started among by `mpirun`, from the launchers' environment (Open MPI,
/// MPICH/PMI); 1 when started alone.
fn launched_ranks() -> usize {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
        .unwrap_or(1)
}

/// Joins the job's ranks for `mode`; None for a run alone. Refuses a run that `mpirun` started as
/// several ranks without `--parallel` (each would train alone and write the same files).
pub fn join(mode: Option<ParallelMode>) -> Result<Option<Arc<dyn Group>>, Failure> {
    let launched = launched_ranks();
    let Some(mode) = mode else {
        if launched > 1 {
            return Err(Failure::from(format!(
                "this process is one of {launched} ranks started by mpirun, but --parallel is not given: each rank \
                 would train alone and write the same files; give --parallel data, zero1 or pipeline"
            )));
        }
        return Ok(None);
    };
    connect(mode)
}

#[cfg(feature = "mpi")]
fn connect(_mode: ParallelMode) -> Result<Option<Arc<dyn Group>>, Failure> {
    let mpi = memfit_dist::mpi::Mpi::init().map_err(|e| Failure::from(format!("--parallel: {e}")))?;
    Ok(Some(Arc::new(mpi)))
}

#[cfg(not(feature = "mpi"))]
fn connect(mode: ParallelMode) -> Result<Option<Arc<dyn Group>>, Failure> {
    Err(Failure::from(format!(
        "--parallel {} needs a memfit built with MPI: install an MPI library (Debian: apt-get install \
         libopenmpi-dev openmpi-bin libclang-dev), build with `cargo build --release --features mpi`, and start \
         it with `mpirun -np N target/release/memfit train --parallel {} ...`",
        mode.name(),
        mode.name()
    )))
}

/// Ends a rank's command: a failure on any rank of several aborts the whole job (after printing why,
/// naming the rank), as the others would otherwise wait in their next collective; success leaves
/// MPI cleanly (the group is dropped here, before the process exits).
pub fn finish(group: Option<Arc<dyn Group>>, result: Result<(), Failure>) -> Result<(), Failure> {
    match (group, result) {
        (Some(g), Err(f)) if g.size() > 1 => {
            eprintln!("error (rank {} of {}): {}", g.rank(), g.size(), f.message);
            g.abort(i32::from(f.code))
        }
        (_, result) => result,
    }
}

/// Each rank's memory, printed after the memory table.
pub fn table(p: &RanksSummary) -> String {
    let mut s = format!("ranks ({} parallel, {} ranks)\n", p.mode, p.ranks);
    s.push_str(&format!(
        "  {:<6} {:>14} {:>14} {:>16} {:>14}\n",
        "rank", "peak allocated", "peak reserved", "optimizer state", "communication"
    ));
    for r in &p.per_rank {
        s.push_str(&format!(
            "  {:<6} {:>14} {:>14} {:>16} {:>14}\n",
            r.rank,
            format_bytes(r.peak_allocated_bytes),
            format_bytes(r.peak_reserved_bytes),
            format_bytes(r.optimizer_state_bytes),
            format_bytes(r.communication_bytes)
        ));
    }
    s
}
