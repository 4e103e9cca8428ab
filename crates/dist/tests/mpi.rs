//! Every collective between two real ranks (`memfit-collectives` under `mpirun`), and a rank that
//! panics ends the job (the panic hook calls `MPI_Abort`) instead of leaving the other waiting.
//! Needs an MPI library: `cargo test -p memfit-dist --features mpi`.
#![cfg(feature = "mpi")]

use std::process::Command;

fn mpirun(args: &[&str]) -> std::process::Output {
    Command::new("mpirun")
        .args(["--timeout", "120", "--oversubscribe", "--bind-to", "none", "-np", "2"])
        .args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .expect("mpirun runs (install openmpi-bin)")
}

#[test]
fn every_collective_is_right_between_two_ranks() {
    let out = mpirun(&[env!("CARGO_BIN_EXE_memfit-collectives"), "--bandwidth", "8"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("collectives ok on 2 ranks"), "{stdout}");
    assert!(stdout.contains("GB/s"), "{stdout}");
}

#[test]
fn a_panicking_rank_ends_the_job_at_once() {
    let start = std::time::Instant::now();
    let out = mpirun(&[env!("CARGO_BIN_EXE_memfit-collectives"), "--panic-on-rank", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("rank 1 panics on purpose"), "{stderr}");
    assert!(start.elapsed() < std::time::Duration::from_secs(60), "took {:?}", start.elapsed());
}
