//! The resident memory of this process as the operating system counts it (Linux
//! `/proc/self/status`: `VmRSS` now, `VmHWM` its peak), for reports that put the device allocator's
//! bytes next to everything else the process holds. `None` where the system does not say.

/// Resident bytes of this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resident {
    /// Resident now (`VmRSS`).
    pub current: u64,
    /// The most ever resident (`VmHWM`).
    pub peak: u64,
}

/// This process's resident memory, or None when `/proc/self/status` is missing or unreadable.
pub fn resident() -> Option<Resident> {
    parse_status(&std::fs::read_to_string("/proc/self/status").ok()?)
}

/// `VmRSS` and `VmHWM` of a `/proc/PID/status` text (values in kB).
pub fn parse_status(status: &str) -> Option<Resident> {
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find_map(|l| l.strip_prefix(name))?;
        let kib: u64 = line.trim().strip_suffix("kB")?.trim().parse().ok()?;
        kib.checked_mul(1024)
    };
    Some(Resident { current: field("VmRSS:")?, peak: field("VmHWM:")? })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_rss_and_its_peak_in_bytes() {
        let status = "Name:\tmemfit\nVmPeak:\t  900 kB\nVmHWM:\t    2048 kB\nVmRSS:\t    1024 kB\nThreads:\t3\n";
        assert_eq!(parse_status(status), Some(Resident { current: 1 << 20, peak: 2 << 20 }));
        assert_eq!(parse_status("VmRSS:\t1 kB\n"), None, "no peak");
        assert_eq!(parse_status("VmRSS:\tlots kB\nVmHWM:\t1 kB\n"), None, "not a number");
        assert_eq!(parse_status("VmRSS:\t1 MB\nVmHWM:\t1 kB\n"), None, "not kB");
    }

    #[test]
    fn this_process_is_resident() {
        let r = resident();
        if cfg!(target_os = "linux") {
            assert!(r.is_some(), "Linux has /proc/self/status");
        }
        if let Some(r) = r {
            assert!(r.current > 0 && r.peak >= r.current, "{r:?}");
        }
    }
}
