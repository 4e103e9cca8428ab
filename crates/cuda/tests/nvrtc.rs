//! Every kernel source compiles with NVRTC for sm_80 and sm_90, to PTX and assembled for the real
//! architecture (ptxas inside NVRTC: the inline PTX of the tensor cores' `mma` is checked too), on
//! any machine that has NVRTC (no
//! GPU needed: `.ci/run` installs PyPI's `nvidia-cuda-nvrtc` and puts it on `LD_LIBRARY_PATH`).
//! Without NVRTC it says so on its own line, `skipped: ...`, rather than passing silently (this
//! test has no harness, so what it prints is not captured). `MEMFIT_REQUIRE_NVRTC=1` turns the
//! skip into a failure (CI sets it once it installed NVRTC).

use memfit_cuda::kernels::{assemble, compile, nvrtc_version, SOURCES};
use memfit_cuda::Library;

/// Whether `bytes` holds `part`.
fn contains(bytes: &[u8], part: &[u8]) -> bool {
    bytes.windows(part.len()).any(|w| w == part)
}

fn main() {
    let required = std::env::var_os("MEMFIT_REQUIRE_NVRTC").is_some_and(|v| v == "1");
    if !Library::Nvrtc.present() {
        let why = Library::Nvrtc.missing_message();
        if required {
            eprintln!("nvrtc: FAILED: MEMFIT_REQUIRE_NVRTC=1 but {why}");
            std::process::exit(1);
        }
        println!("nvrtc: skipped: {} kernel sources not compiled: {why}", SOURCES.len());
        return;
    }
    let version = nvrtc_version().expect("NVRTC answers its version");
    let mut failures = 0;
    for capability in [(8, 0), (9, 0)] {
        for source in &SOURCES {
            let results = [
                ("PTX", compile(source, capability).map(|ptx| ptx.to_src().contains(".entry"))),
                // A cubin is an ELF file that names its kernels (the first prefix, at least).
                (
                    "assembled",
                    assemble(source, capability)
                        .map(|c| c.starts_with(b"\x7fELF") && contains(&c, source.kernels[0].as_bytes())),
                ),
            ];
            for (how, result) in results {
                match result {
                    Ok(kernels) => assert!(kernels, "{}: {how} without kernels", source.name),
                    Err(e) => {
                        eprintln!("nvrtc: {} for sm_{}{} ({how}): {e}", source.name, capability.0, capability.1);
                        failures += 1;
                    }
                }
            }
        }
    }
    // Inline PTX the assembler refuses fails to assemble (the PTX check alone passes it through).
    let bad_asm = memfit_cuda::kernels::Source {
        name: "bad_asm",
        text: "extern \"C\" __global__ void k(float* x) { asm volatile(\"mma.sync.aligned.m16n8k17.row.col.f32.bf16.bf16.f32 {%0}, {%0}, {%0}, {%0};\" : \"+f\"(x[0])); }",
        kernels: &["k"],
    };
    match assemble(&bad_asm, (9, 0)) {
        Err(memfit_cuda::CudaError::Compile { log, .. }) => assert!(log.contains("m16n8k17"), "{log}"),
        other => panic!("unknown inline PTX assembled or failed otherwise: {:?}", other.map(|_| ())),
    }
    // A broken source is an error with NVRTC's log, not a panic.
    let broken = memfit_cuda::kernels::Source {
        name: "broken",
        text: "extern \"C\" __global__ void k() { undefined_name; }",
        kernels: &["k"],
    };
    match compile(&broken, (9, 0)) {
        Err(memfit_cuda::CudaError::Compile { kernel, log }) => {
            assert_eq!(kernel, "broken");
            assert!(log.contains("undefined_name"), "{log}");
        }
        other => panic!("a broken kernel compiled or failed otherwise: {:?}", other.map(|_| ())),
    }
    // The disk cache: the first call writes the machine code under $MEMFIT_CACHE_DIR, the second
    // reads it back; a file that is not machine code is assembled again and replaced.
    let dir = std::env::temp_dir().join(format!("memfit-nvrtc-cache-{}", std::process::id()));
    std::env::set_var("MEMFIT_CACHE_DIR", &dir);
    let first = memfit_cuda::kernels::assemble_cached(&SOURCES[0], (9, 0)).expect("assembles");
    let file = memfit_cuda::kernels::cache_file(&dir.join("cuda"), &SOURCES[0], (9, 0), version);
    assert_eq!(std::fs::read(&file).expect("the cubin was cached"), first);
    let mut marked = first.clone();
    marked.extend_from_slice(b"from the cache");
    std::fs::write(&file, &marked).unwrap();
    assert_eq!(memfit_cuda::kernels::assemble_cached(&SOURCES[0], (9, 0)).unwrap(), marked, "read from the cache");
    std::fs::write(&file, b"not a cubin").unwrap();
    assert_eq!(
        memfit_cuda::kernels::assemble_cached(&SOURCES[0], (9, 0)).unwrap(),
        first,
        "a damaged file is replaced"
    );
    assert_eq!(std::fs::read(&file).unwrap(), first);
    memfit_cuda::kernels::forget_cached(&SOURCES[0], (9, 0));
    assert!(!file.exists(), "forgotten");
    let _ = std::fs::remove_dir_all(&dir);
    if failures > 0 {
        eprintln!("nvrtc: {failures} compilations failed");
        std::process::exit(1);
    }
    println!(
        "nvrtc: {} kernel sources compiled and assembled for sm_80 and sm_90 with NVRTC {}.{}",
        SOURCES.len(),
        version.0,
        version.1
    );
}
