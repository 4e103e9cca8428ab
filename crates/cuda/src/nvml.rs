//! NVML (`libnvidia-ml.so.1`, installed with the driver): the one question CUDA cannot answer, how
//! much memory is free on a GPU before this process creates a context on it. Loaded by hand (three
//! functions); absent or failing, the answer is None.

use libloading::{Library, Symbol};
use std::ffi::{c_char, c_int, c_void, CString};

#[repr(C)]
#[derive(Default)]
struct NvmlMemory {
    total: u64,
    free: u64,
    used: u64,
}

/// Free bytes on the GPU whose CUDA UUID is `uuid`, or None when NVML cannot say.
pub fn free_bytes(uuid: &[u8; 16]) -> Option<u64> {
    // SAFETY: the three functions are NVML's documented C entry points with these signatures; the
    // handle and memory struct outlive the calls; the library stays loaded until after the last.
    unsafe {
        let lib = Library::new("libnvidia-ml.so.1").ok()?;
        let init: Symbol<unsafe extern "C" fn() -> c_int> = lib.get(b"nvmlInit_v2\0").ok()?;
        let by_uuid: Symbol<unsafe extern "C" fn(*const c_char, *mut *mut c_void) -> c_int> =
            lib.get(b"nvmlDeviceGetHandleByUUID\0").ok()?;
        let memory: Symbol<unsafe extern "C" fn(*mut c_void, *mut NvmlMemory) -> c_int> =
            lib.get(b"nvmlDeviceGetMemoryInfo\0").ok()?;
        let shutdown: Symbol<unsafe extern "C" fn() -> c_int> = lib.get(b"nvmlShutdown\0").ok()?;
        if init() != 0 {
            return None;
        }
        let name = CString::new(uuid_string(uuid)).ok()?;
        let mut handle = std::ptr::null_mut();
        let mut info = NvmlMemory::default();
        let ok = by_uuid(name.as_ptr(), &mut handle) == 0 && memory(handle, &mut info) == 0;
        shutdown();
        ok.then_some(info.free)
    }
}

/// NVML's name of a GPU: `GPU-` and the UUID in the 8-4-4-4-12 hexadecimal form.
pub fn uuid_string(uuid: &[u8; 16]) -> String {
    let hex: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", &hex[0..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..32])
}

#[cfg(test)]
mod tests {
    #[test]
    fn uuid_strings_are_nvmls_form() {
        let uuid: [u8; 16] = std::array::from_fn(|i| (i * 17) as u8);
        assert_eq!(super::uuid_string(&uuid), "GPU-00112233-4455-6677-8899-aabbccddeeff");
    }
}
