//! Where a GPU step's time goes, without a profiler: with `MEMFIT_CUDA_KERNEL_TIMES=FILE`, every
//! kernel launch and cuBLAS product is bracketed by two CUDA events, and when the GPU is closed the
//! elapsed times are summed by kernel (products by their shape) and written to FILE as a table, the
//! largest first. Two event records per launch are the cost, and a wait for the stream every
//! [`PENDING_MARKS`] launches, when their events are read and destroyed (so a long run holds a
//! bounded number of events and a total per kernel); nothing is timed without the variable.
//!
//! Beside each kernel's GPU time the table gives the host's time inside its launch call and the
//! GPU's idle time just before it (from the previous launch's end event to this one's start): a
//! GPU that waits for the host shows there, not as slow kernels. (On an H100, GPT-2's QKV product
//! took 368 us a launch by its events and 42 us by Nsight Compute: the rest was the GPU waiting.)
//! An event pair measures from when the GPU reaches the start event, so a launch call that is slow
//! on the host (a library's first call for a shape) counts in its kernel's GPU time too.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;

/// The variable that asks for kernel times, and names the file they go to.
pub const VARIABLE: &str = "MEMFIT_CUDA_KERNEL_TIMES";

/// The file kernel times are asked for in, if any.
pub fn requested() -> Option<PathBuf> {
    std::env::var_os(VARIABLE).filter(|v| !v.is_empty()).map(PathBuf::from)
}

/// Launches whose events are pending before they are read and destroyed (so a long run holds at
/// most this many pairs of events).
pub(crate) const PENDING_MARKS: usize = 4096;

/// One timed launch, pending: its name, start and end events (as addresses), and the host's
/// milliseconds inside the launch call.
pub(crate) struct Mark {
    pub name: String,
    pub start: u64,
    pub end: u64,
    pub host_ms: f64,
}

/// Launches timed so far: the pending ones, the last read launch's end event (kept for the GPU's
/// idle time before the next pending one), and the totals of those already read.
pub(crate) struct KernelTimes {
    pub path: PathBuf,
    pub marks: Mutex<Vec<Mark>>,
    pub last_end: Mutex<Option<u64>>,
    pub read: Mutex<Totals>,
}

/// One kernel's total: its name, how many launches, their summed milliseconds on the GPU, inside
/// the launch calls on the host, and of the GPU idle just before them.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelTotal {
    pub name: String,
    pub launches: usize,
    pub ms: f64,
    pub host_ms: f64,
    pub idle_ms: f64,
}

/// One read launch: its GPU, host and preceding idle milliseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Launched {
    pub ms: f64,
    pub host_ms: f64,
    pub idle_ms: f64,
}

/// Launch times summed by kernel as they are read.
#[derive(Default)]
pub struct Totals(HashMap<String, KernelTotal>);

impl Totals {
    pub fn add(&mut self, name: String, l: Launched) {
        let zero = KernelTotal { name: name.clone(), launches: 0, ms: 0.0, host_ms: 0.0, idle_ms: 0.0 };
        let t = self.0.entry(name).or_insert(zero);
        t.launches += 1;
        t.ms += l.ms;
        t.host_ms += l.host_ms;
        t.idle_ms += l.idle_ms;
    }

    /// The kernels, the largest total first (ties by name).
    pub fn sorted(&self) -> Vec<KernelTotal> {
        let mut all: Vec<KernelTotal> = self.0.values().cloned().collect();
        all.sort_by(|a, b| b.ms.total_cmp(&a.ms).then_with(|| a.name.cmp(&b.name)));
        all
    }
}

/// Sums launches by kernel, the largest total first (ties by name).
pub fn totals(launches: impl IntoIterator<Item = (String, Launched)>) -> Vec<KernelTotal> {
    let mut t = Totals::default();
    launches.into_iter().for_each(|(name, l)| t.add(name, l));
    t.sorted()
}

/// The table written to the file: one line per kernel with its share of the whole GPU time, the
/// host's mean time in its launch call, and the GPU's idle time before its launches.
pub fn table(totals: &[KernelTotal]) -> String {
    let whole: f64 = totals.iter().map(|t| t.ms).sum();
    let idle: f64 = totals.iter().map(|t| t.idle_ms).sum();
    let mut s = format!(
        "GPU time by kernel (CUDA events around each launch): {:.3} ms in {} launches; the GPU idle \
         between launches {:.3} ms (waiting for the host)\n{:>12} {:>7} {:>9} {:>11} {:>9} {:>10}  kernel\n",
        whole,
        totals.iter().map(|t| t.launches).sum::<usize>(),
        idle,
        "total ms",
        "share",
        "launches",
        "mean us",
        "host us",
        "idle ms"
    );
    for t in totals {
        let share = if whole > 0.0 { 100.0 * t.ms / whole } else { 0.0 };
        let per = |ms: f64| 1e3 * ms / t.launches.max(1) as f64;
        s.push_str(&format!(
            "{:>12.3} {:>6.1}% {:>9} {:>11.2} {:>9.2} {:>10.3}  {}\n",
            t.ms,
            share,
            t.launches,
            per(t.ms),
            per(t.host_ms),
            t.idle_ms,
            t.name
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launches_are_summed_by_kernel_largest_first_with_their_shares() {
        let launches = [("a", 1.0, 0.5), ("b", 3.0, 0.0), ("a", 2.5, 0.25), ("c", 0.5, 2.0)]
            .map(|(n, ms, idle_ms)| (n.to_string(), Launched { ms, host_ms: ms / 100.0, idle_ms }));
        let t = totals(launches);
        let names: Vec<&str> = t.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "c"]);
        assert_eq!((t[0].launches, t[0].ms, t[0].host_ms, t[0].idle_ms), (2, 3.5, 0.035, 0.75));
        let text = table(&t);
        assert!(
            text.starts_with(
                "GPU time by kernel (CUDA events around each launch): 7.000 ms in 4 launches; the GPU idle \
                 between launches 2.750 ms (waiting for the host)\n"
            ),
            "{text}"
        );
        // a: 3.5 ms in 2 launches, 1,750 us each on the GPU and 17.5 us on the host, 0.75 ms idle before.
        assert!(text.contains("       3.500   50.0%         2     1750.00     17.50      0.750  a\n"), "{text}");
        assert!(text.lines().last().unwrap().ends_with("  c"));
        // Launches that took no time (an emulator's): shares of 0, not NaN.
        let none = table(&totals([("d".to_string(), Launched { ms: 0.0, host_ms: 0.0, idle_ms: 0.0 })]));
        assert!(none.contains("       0.000    0.0%         1        0.00      0.00      0.000  d\n"), "{none}");
    }
}
