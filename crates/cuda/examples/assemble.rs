//! Fills memfit's cache of kernel machine code for a GPU this machine need not have:
//! `cargo run --release -p memfit-cuda --example assemble -- 9.0` assembles every kernel source for
//! compute capability 9.0 with the NVRTC on the loader's path, into `$MEMFIT_CACHE_DIR/cuda` (or the
//! usual cache folder). A GPU machine whose NVRTC has the same version then loads the machine code
//! instead of compiling (`tools/gpu-check prepare` does this for the H100's CUDA 13.0).

use memfit_cuda::kernels::{assemble_cached, cache_dir, nvrtc_version, SOURCES};

fn main() {
    let arg = std::env::args().nth(1).unwrap_or_default();
    let Some(capability) = arg.split_once('.').and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?))) else {
        eprintln!("usage: assemble MAJOR.MINOR   (a compute capability, 9.0 for an H100)");
        std::process::exit(2);
    };
    let version = match nvrtc_version() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("assemble: {e}");
            std::process::exit(1);
        }
    };
    let started = std::time::Instant::now();
    for source in &SOURCES {
        if let Err(e) = assemble_cached(source, capability) {
            eprintln!("assemble: {}: {e}", source.name);
            std::process::exit(1);
        }
    }
    println!(
        "assemble: {} kernel sources for sm_{}{} with NVRTC {}.{} in {:.0} s, cached in {}",
        SOURCES.len(),
        capability.0,
        capability.1,
        version.0,
        version.1,
        started.elapsed().as_secs_f64(),
        cache_dir().map_or("no folder (no home known)".into(), |d| d.display().to_string())
    );
}
