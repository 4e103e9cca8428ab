//! memfit's CUDA C kernels: their sources (`crates/cuda/kernels/*.cu`, each compiled with
//! `common.cuh` in front), compiled by NVRTC for the GPU's architecture and assembled into its
//! machine code (a cubin) on first use, and cached on disk, so a later run loads machine code
//! instead of compiling. (Before, the cache held PTX, and every new machine's driver spent about a
//! minute and a half assembling the attention kernels' PTX at load, measured on an H100.)
//!
//! The cache key is everything that changes the machine code: the source's hash, the architecture
//! and NVRTC's version. The folder is `$MEMFIT_CACHE_DIR/cuda`, else `$XDG_CACHE_HOME/memfit/cuda`,
//! else `~/.cache/memfit/cuda`; a cache that cannot be written only costs a compile next time, and
//! a cached file that is not machine code is compiled again. `tools/gpu-check prepare` fills a
//! cache on a machine without a GPU (`examples/assemble.rs`).

use crate::libraries::{probe, Library};
use crate::{call_error, CudaError};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions, Ptx};
use std::path::PathBuf;

/// Included in front of every source.
const COMMON: &str = include_str!("../kernels/common.cuh");

/// One source file: its name, text and the prefixes of the kernels it defines (`extern "C"`
/// kernels named `<op>_<dtype>`; [`source_of`] finds a kernel's source by them).
#[derive(Clone, Copy, Debug)]
pub struct Source {
    pub name: &'static str,
    pub text: &'static str,
    pub kernels: &'static [&'static str],
}

/// Every kernel source, by op family (the tensor crate's `ops/` files).
pub const SOURCES: [Source; 12] = [
    Source {
        name: "data",
        text: include_str!("../kernels/data.cu"),
        kernels: &["fill_", "gather_", "repeat_row_", "cast_", "count_up_", "round_operands_"],
    },
    Source {
        name: "elementwise",
        text: include_str!("../kernels/elementwise.cu"),
        kernels: &["unary_", "affine_", "binary_", "add_into_", "pow_scalar_", "clamp_", "compare_", "select_"],
    },
    Source { name: "dropout", text: include_str!("../kernels/dropout.cu"), kernels: &["dropout_"] },
    Source { name: "embedding", text: include_str!("../kernels/embedding.cu"), kernels: &["embedding_"] },
    Source {
        name: "reduce",
        text: include_str!("../kernels/reduce.cu"),
        kernels: &["sum_", "column_", "max_dim_", "max_all_", "count_equal_"],
    },
    Source { name: "softmax", text: include_str!("../kernels/softmax.cu"), kernels: &["softmax_"] },
    Source {
        name: "loss",
        text: include_str!("../kernels/loss.cu"),
        kernels: &["cross_entropy_", "nll_loss_", "mse_loss_"],
    },
    Source { name: "optim", text: include_str!("../kernels/optim.cu"), kernels: &["sgd_", "adam_", "unscale_"] },
    Source { name: "attention", text: include_str!("../kernels/attention.cu"), kernels: &["attention_"] },
    Source { name: "norm", text: include_str!("../kernels/norm.cu"), kernels: &["layer_norm_", "batch_norm_"] },
    Source { name: "conv", text: include_str!("../kernels/conv.cu"), kernels: &["im2col_", "col2im_"] },
    Source { name: "pool", text: include_str!("../kernels/pool.cu"), kernels: &["max_pool2d_", "avg_pool2d_"] },
];

impl Source {
    /// The text NVRTC compiles: the common header, then the source.
    pub fn program(&self) -> String {
        format!("{COMMON}\n#line 1 \"{}.cu\"\n{}", self.name, self.text)
    }
}

/// The source that defines kernel `name` (by its prefix; each prefix belongs to one source).
pub fn source_of(name: &str) -> Option<&'static Source> {
    SOURCES.iter().find(|s| s.kernels.iter().any(|p| name.starts_with(p)))
}

/// The GPU architectures memfit supports (compute capability 8.0 and later: bf16 arithmetic).
pub const MIN_CAPABILITY: (i32, i32) = (8, 0);

/// NVRTC's name of a virtual architecture, `compute_90` for capability (9, 0).
pub fn arch_name(capability: (i32, i32)) -> Option<&'static str> {
    architectures(capability).map(|(virtual_arch, _)| virtual_arch)
}

/// The virtual and the real architecture of a capability: `("compute_90", "sm_90")` for (9, 0).
fn architectures(capability: (i32, i32)) -> Option<(&'static str, &'static str)> {
    Some(match capability {
        (8, 0) => ("compute_80", "sm_80"),
        (8, 6) => ("compute_86", "sm_86"),
        (8, 7) => ("compute_87", "sm_87"),
        (8, 9) => ("compute_89", "sm_89"),
        (9, 0) => ("compute_90", "sm_90"),
        (10, 0) => ("compute_100", "sm_100"),
        (12, 0) => ("compute_120", "sm_120"),
        _ => return None,
    })
}

/// Compiles `source` for `capability` to PTX (no cache). Errors name a missing NVRTC, an
/// architecture memfit does not know, or the kernel with NVRTC's log.
pub fn compile(source: &Source, capability: (i32, i32)) -> Result<Ptx, CudaError> {
    let (virtual_arch, _) = known(source, capability)?;
    let options = CompileOptions {
        arch: Some(virtual_arch),
        name: Some(format!("{}.cu", source.name)),
        // No include path: the sources need no header (the GPU machine may have none).
        options: vec!["--std=c++17".into()],
        ..Default::default()
    };
    compile_ptx_with_opts(source.program(), options).map_err(|e| match e {
        CompileError::CompileError { log, .. } => {
            CudaError::Compile { kernel: source.name.to_string(), log: log.to_string_lossy().into_owned() }
        }
        other => call_error(&format!("NVRTC on {}", source.name), other),
    })
}

/// Compiles `source` for `capability`'s real architecture and assembles it (ptxas inside NVRTC):
/// the GPU's machine code, a cubin, which the driver loads without compiling anything. Inline PTX
/// (the tensor cores' `mma`) is checked here as the GPU would check it, on a machine without a
/// GPU. Errors as [`compile`]'s.
pub fn assemble(source: &Source, capability: (i32, i32)) -> Result<Vec<u8>, CudaError> {
    use cudarc::nvrtc::{result, sys};
    let (_, real_arch) = known(source, capability)?;
    let nvrtc = |what: &str, e: result::NvrtcError| call_error(&format!("{what} on {}", source.name), e);
    let text = std::ffi::CString::new(source.program()).map_err(|e| call_error("NVRTC", e))?;
    let name = std::ffi::CString::new(format!("{}.cu", source.name)).map_err(|e| call_error("NVRTC", e))?;
    let program = result::create_program(&text, Some(&name)).map_err(|e| nvrtc("nvrtcCreateProgram", e))?;
    let options = [format!("--gpu-architecture={real_arch}"), "--std=c++17".to_string()];
    // SAFETY: `program` is live until destroyed below; each call writes within the sizes NVRTC gave.
    unsafe {
        let assembled = match result::compile_program(program, &options) {
            Err(_) => {
                // The log up to its terminating zero (none at all if NVRTC could not give it).
                let log: Vec<u8> = result::get_program_log(program)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|c| c as u8)
                    .take_while(|&b| b != 0)
                    .collect();
                let log = String::from_utf8_lossy(&log).into_owned();
                Err(CudaError::Compile { kernel: source.name.to_string(), log })
            }
            Ok(()) => {
                let mut size = 0usize;
                sys::nvrtcGetCUBINSize(program, &mut size).result().map_err(|e| nvrtc("nvrtcGetCUBINSize", e)).and_then(
                    |()| {
                        let mut cubin = vec![0u8; size];
                        sys::nvrtcGetCUBIN(program, cubin.as_mut_ptr().cast())
                            .result()
                            .map_err(|e| nvrtc("nvrtcGetCUBIN", e))?;
                        Ok(cubin)
                    },
                )
            }
        };
        let _ = result::destroy_program(program);
        assembled
    }
}

/// `capability`'s virtual and real architectures, with NVRTC present; or why not.
fn known(source: &Source, capability: (i32, i32)) -> Result<(&'static str, &'static str), CudaError> {
    probe(&[Library::Nvrtc])?;
    architectures(capability).ok_or_else(|| CudaError::Call {
        what: format!("compiling {} for sm_{}{}", source.name, capability.0, capability.1),
        detail: format!(
            "memfit knows compute capabilities 8.0, 8.6, 8.7, 8.9, 9.0, 10.0 and 12.0 (at least {}.{})",
            MIN_CAPABILITY.0, MIN_CAPABILITY.1
        ),
    })
}

/// NVRTC's version, `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    probe(&[Library::Nvrtc])?;
    let mut version = (0, 0);
    // SAFETY: NVRTC is loaded (probed above); the call writes two ints.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut version.0, &mut version.1) };
    if status != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(call_error("nvrtcVersion", status));
    }
    Ok(version)
}

/// The cache folder (see the module's docs), or None when no home is known.
pub fn cache_dir() -> Option<PathBuf> {
    let var = |name| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    let base = var("MEMFIT_CACHE_DIR")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("memfit")))
        .or_else(|| var("HOME").map(|h| h.join(".cache").join("memfit")))?;
    Some(base.join("cuda"))
}

/// The file a source's machine code is cached in for `capability` and NVRTC `version`.
pub fn cache_file(dir: &std::path::Path, source: &Source, capability: (i32, i32), version: (i32, i32)) -> PathBuf {
    let hash = fnv1a(source.program().as_bytes());
    dir.join(format!(
        "{}-{hash:016x}-sm{}{}-nvrtc{}.{}.cubin",
        source.name, capability.0, capability.1, version.0, version.1
    ))
}

/// [`assemble`] through the disk cache: the cached machine code when there is some (an ELF file,
/// as a cubin is), else an assembly whose cubin is written for next time (atomically: a temporary
/// file renamed into place).
pub fn assemble_cached(source: &Source, capability: (i32, i32)) -> Result<Vec<u8>, CudaError> {
    let version = nvrtc_version()?;
    let file = cache_file_for(source, capability, version);
    if let Some(cubin) = file.as_ref().and_then(|f| std::fs::read(f).ok()).filter(|c| c.starts_with(b"\x7fELF")) {
        return Ok(cubin);
    }
    let cubin = assemble(source, capability)?;
    if let Some(file) = file {
        let _ = write_cache(&file, &cubin);
    }
    Ok(cubin)
}

/// Forgets `source`'s cached machine code (one the driver refused to load), so the next
/// [`assemble_cached`] assembles it again.
pub fn forget_cached(source: &Source, capability: (i32, i32)) {
    if let Some(file) = nvrtc_version().ok().and_then(|v| cache_file_for(source, capability, v)) {
        let _ = std::fs::remove_file(file);
    }
}

fn cache_file_for(source: &Source, capability: (i32, i32), version: (i32, i32)) -> Option<PathBuf> {
    cache_dir().map(|dir| cache_file(&dir, source, capability, version))
}

fn write_cache(file: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let temporary = file.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&temporary, bytes)?;
    std::fs::rename(&temporary, file)
}

/// FNV-1a, 64 bits: a stable hash of a source (the standard library's is not stable across builds).
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_supported_capability_has_an_architecture_and_older_ones_are_refused() {
        assert_eq!(arch_name((9, 0)), Some("compute_90"));
        assert_eq!(arch_name((8, 0)), Some("compute_80"));
        assert_eq!(arch_name((7, 5)), None);
    }

    #[test]
    fn cache_files_change_with_the_source_the_architecture_and_nvrtc() {
        let dir = std::path::Path::new("/c");
        let a = cache_file(dir, &SOURCES[0], (9, 0), (13, 0));
        assert_eq!(a, cache_file(dir, &SOURCES[0], (9, 0), (13, 0)));
        assert_ne!(a, cache_file(dir, &SOURCES[1], (9, 0), (13, 0)));
        assert_ne!(a, cache_file(dir, &SOURCES[0], (8, 0), (13, 0)));
        assert_ne!(a, cache_file(dir, &SOURCES[0], (9, 0), (13, 1)));
        assert!(a.to_string_lossy().starts_with("/c/data-"), "{a:?}");
    }

    #[test]
    fn fnv1a_is_the_published_function() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
