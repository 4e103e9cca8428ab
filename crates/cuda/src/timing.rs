//! Where a GPU step's time goes, without a profiler: with `MEMFIT_CUDA_KERNEL_TIMES=FILE`, every
//! kernel launch and cuBLAS product is bracketed by two CUDA events, and when the GPU is closed the
//! elapsed times are summed by kernel (products by their shape) and written to FILE as a table, the
//! largest first. Two event records per launch are the cost, and a wait for the stream every
//! [`PENDING_MARKS`] launches, when their events are read and destroyed (so a long run holds a
//! bounded number of events and a total per kernel); nothing is timed without the variable.

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

/// Launches timed so far: the pending ones with their start and end events (as addresses), and
/// the totals of those already read.
pub(crate) struct KernelTimes {
    pub path: PathBuf,
    pub marks: Mutex<Vec<(String, u64, u64)>>,
    pub read: Mutex<Totals>,
}

/// One kernel's total: its name, how many launches, their summed milliseconds.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelTotal {
    pub name: String,
    pub launches: usize,
    pub ms: f64,
}

/// Launch times summed by kernel as they are read.
#[derive(Default)]
pub struct Totals(HashMap<String, KernelTotal>);

impl Totals {
    pub fn add(&mut self, name: String, ms: f64) {
        let t = self.0.entry(name.clone()).or_insert(KernelTotal { name, launches: 0, ms: 0.0 });
        t.launches += 1;
        t.ms += ms;
    }

    /// The kernels, the largest total first (ties by name).
    pub fn sorted(&self) -> Vec<KernelTotal> {
        let mut all: Vec<KernelTotal> = self.0.values().cloned().collect();
        all.sort_by(|a, b| b.ms.total_cmp(&a.ms).then_with(|| a.name.cmp(&b.name)));
        all
    }
}

/// Sums launches by kernel, the largest total first (ties by name).
pub fn totals(launches: impl IntoIterator<Item = (String, f64)>) -> Vec<KernelTotal> {
    let mut t = Totals::default();
    launches.into_iter().for_each(|(name, ms)| t.add(name, ms));
    t.sorted()
}

/// The table written to the file: one line per kernel with its share of the whole.
pub fn table(totals: &[KernelTotal]) -> String {
    let whole: f64 = totals.iter().map(|t| t.ms).sum();
    let mut s = format!(
        "GPU time by kernel (CUDA events around each launch): {:.3} ms in {} launches\n{:>12} {:>7} {:>9} {:>11}  kernel\n",
        whole,
        totals.iter().map(|t| t.launches).sum::<usize>(),
        "total ms",
        "share",
        "launches",
        "mean us"
    );
    for t in totals {
        let share = if whole > 0.0 { 100.0 * t.ms / whole } else { 0.0 };
        s.push_str(&format!(
            "{:>12.3} {:>6.1}% {:>9} {:>11.2}  {}\n",
            t.ms,
            share,
            t.launches,
            1e3 * t.ms / t.launches.max(1) as f64,
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
        let launches = [("a", 1.0), ("b", 3.0), ("a", 2.5), ("c", 0.5)].map(|(n, ms)| (n.to_string(), ms));
        let t = totals(launches);
        let names: Vec<&str> = t.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "c"]);
        assert_eq!((t[0].launches, t[0].ms), (2, 3.5));
        let text = table(&t);
        assert!(
            text.starts_with("GPU time by kernel (CUDA events around each launch): 7.000 ms in 4 launches\n"),
            "{text}"
        );
        assert!(text.contains("       3.500   50.0%         2     1750.00  a\n"), "{text}");
        assert!(text.lines().last().unwrap().ends_with("  c"));
    }
}
