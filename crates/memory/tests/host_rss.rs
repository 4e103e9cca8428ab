//! The process's resident memory follows the allocator (issue 12): host segments are memory maps
//! handed back to the operating system when the cache is released, so after many rounds of filling
//! the capacity and emptying the cache, and after many out-of-memory failures (each releases the
//! cache and retries), resident memory (`VmRSS`) is back near where it started, and its peak
//! (`VmHWM`) stays within the capacity plus a small allowance. Linux only (reads `/proc/self/status`);
//! elsewhere it says SKIPPED. One test in its own binary, so no other test's memory is counted.

use memfit_memory::{Allocator, AllocatorConfig, Category, HostBackend, Phase, Request};

const MIB: u64 = 1 << 20;

/// `VmRSS` and `VmHWM` in bytes.
fn rss() -> Option<(u64, u64)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

fn request() -> Request {
    Request { category: Category::Activation, op: "rss", phase: Phase::Forward, module: 0 }
}

#[test]
fn resident_memory_returns_to_the_system_and_peaks_within_the_capacity() {
    let Some((start, _)) = rss() else {
        println!("SKIPPED: no /proc/self/status on this system");
        return;
    };
    let capacity = 192 * MIB;
    let mut alloc = Allocator::new(
        Box::new(HostBackend::default()),
        AllocatorConfig { capacity: Some(capacity), ..Default::default() },
    );
    let sizes = [3 * MIB, 700 * 1024, 24 * MIB, 5 * MIB + 12345, MIB / 2, 40 * MIB];
    let mut failures = 0;
    for round in 0..40 {
        // Fill: blocks of mixed sizes (small ones share 2 MiB segments, large ones get their own)
        // until the capacity refuses one; touch every page so it is resident.
        let mut live = Vec::new();
        for i in 0.. {
            let bytes = sizes[(round + i) % sizes.len()];
            match alloc.allocate(bytes, request()) {
                Ok(a) => {
                    let p = a.ptr.expect("host memory");
                    for off in (0..bytes as usize).step_by(4096) {
                        // SAFETY: `off` is inside the `bytes`-byte block just handed out.
                        unsafe { p.as_ptr().add(off).write(1) };
                    }
                    live.push(a.id);
                }
                Err(_) => {
                    failures += 1;
                    break;
                }
            }
        }
        // Free every other block first (fragmenting the segments), then the rest.
        let (odd, even): (Vec<_>, Vec<_>) = live.into_iter().enumerate().partition(|(i, _)| i % 2 == 1);
        for (_, id) in odd.into_iter().chain(even) {
            alloc.free(id).unwrap();
        }
        alloc.empty_cache();
        let (now, _) = rss().unwrap();
        assert!(
            now < start + 16 * MIB,
            "round {round}: resident {} MiB after emptying the cache (started at {} MiB)",
            now / MIB,
            start / MIB
        );
    }
    assert_eq!(failures, 40, "every round ran into the capacity");
    let (_, peak) = rss().unwrap();
    assert!(
        peak < start + capacity + 16 * MIB,
        "resident peak {} MiB for a {} MiB capacity (started at {} MiB)",
        peak / MIB,
        capacity / MIB,
        start / MIB
    );
    println!("resident memory: start {} MiB, peak {} MiB, capacity {} MiB", start / MIB, peak / MIB, capacity / MIB);
}
