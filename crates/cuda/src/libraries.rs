//! The shared libraries a GPU run loads, and whether they are there. `cudarc` panics on a library
//! it cannot load, so nothing calls it before [`probe`] (or [`Library::present`]) said yes.

use crate::CudaError;

/// A library memfit loads at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Library {
    /// The NVIDIA driver's CUDA library: contexts, memory, launches.
    Driver,
    /// cuBLAS: every matrix product.
    Cublas,
    /// NVRTC: compiles memfit's CUDA C kernels on first use.
    Nvrtc,
}

impl Library {
    pub const ALL: [Library; 3] = [Library::Driver, Library::Cublas, Library::Nvrtc];

    /// The file the system's loader looks for (CUDA 13's names).
    pub fn file(self) -> &'static str {
        match self {
            Library::Driver => "libcuda.so.1",
            Library::Cublas => "libcublas.so.13",
            Library::Nvrtc => "libnvrtc.so.13",
        }
    }

    /// True when the loader finds the library (any name `cudarc` would load).
    pub fn present(self) -> bool {
        // SAFETY: each only tries to open the library (running its initialisers, as loading it for
        // use would) and closes it again; nothing in it is called.
        unsafe {
            match self {
                Library::Driver => cudarc::driver::sys::is_culib_present(),
                Library::Cublas => cudarc::cublas::sys::is_culib_present(),
                Library::Nvrtc => cudarc::nvrtc::sys::is_culib_present(),
            }
        }
    }

    /// What to tell a user who lacks it.
    pub fn missing_message(self) -> String {
        match self {
            Library::Driver => format!(
                "no NVIDIA driver ({} not found): install the NVIDIA driver, or run on cpu; `--device meta:cuda` \
                 and `plan --device cuda` predict a GPU run without one",
                self.file()
            ),
            Library::Cublas => format!(
                "cuBLAS not found ({}): install CUDA 13's cuBLAS (the `nvidia-cublas` wheel or the CUDA toolkit) \
                 and put its lib folder on LD_LIBRARY_PATH",
                self.file()
            ),
            Library::Nvrtc => format!(
                "NVRTC not found ({}): install CUDA 13's NVRTC (`pip install nvidia-cuda-nvrtc`) and put its \
                 nvidia/cu13/lib folder on LD_LIBRARY_PATH",
                self.file()
            ),
        }
    }
}

/// Errors naming the first of `libraries` the loader cannot find.
pub fn probe(libraries: &[Library]) -> Result<(), CudaError> {
    match libraries.iter().find(|lib| !lib.present()) {
        Some(&lib) => Err(CudaError::Missing(lib)),
        None => Ok(()),
    }
}
