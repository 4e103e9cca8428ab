//! f32 GEMM throughput of the `gemm` crate (called exactly like memfit's `gemm_into`) versus
//! OpenBLAS (Debian `libopenblas-dev`, linked directly through `cblas_sgemm`).
//!
//! Usage: gemm-compare [--threads 2,1] [--reps 21] [--min-rep-ms 20] [--no-wait]
//!
//! For every case and thread count it reports the median GFLOP/s over `reps` timed repetitions
//! (after warm-up); one repetition runs the product enough times to last >= `min-rep-ms`. The
//! repetitions come in 3 rounds alternating between the libraries (300 ms pause at each switch).
//! Before timing, both libraries' results are compared with each other and with an f64
//! reference on sampled entries, so neither can be "measuring nothing".
//! The machine is shared with other builds: unless `--no-wait`, each case first waits until no
//! `cargo`/`rustc` process runs, and is re-measured if one shows up while it is being timed.

use std::ffi::CStr;
use std::os::raw::{c_char, c_int};
use std::time::{Duration, Instant};

// ---------------------------------------------------------------- OpenBLAS (CBLAS) bindings
const CBLAS_ROW_MAJOR: c_int = 101;
const CBLAS_NO_TRANS: c_int = 111;
const CBLAS_TRANS: c_int = 112;

#[link(name = "openblas")]
extern "C" {
    #[allow(clippy::too_many_arguments)]
    fn cblas_sgemm(
        layout: c_int,
        transa: c_int,
        transb: c_int,
        m: c_int,
        n: c_int,
        k: c_int,
        alpha: f32,
        a: *const f32,
        lda: c_int,
        b: *const f32,
        ldb: c_int,
        beta: f32,
        c: *mut f32,
        ldc: c_int,
    );
    fn openblas_set_num_threads(n: c_int);
    fn openblas_get_num_threads() -> c_int;
    fn openblas_get_config() -> *const c_char;
    fn openblas_get_corename() -> *const c_char;
}

// ---------------------------------------------------------------- cases
/// How the operands are stored, as in memfit's MLP training step (all row-major buffers).
#[derive(Clone, Copy, PartialEq)]
enum Layout {
    /// C = A B, A [m x k], B [k x n] (plain matmul; input gradient `g @ W`).
    NN,
    /// C = A B^T-view, A [m x k], B stored [n x k] (forward `linear`: x W^T).
    NT,
    /// C = A^T-view B, A stored [k x m], B [k x n] (weight gradient `g^T @ x`).
    TN,
}

impl Layout {
    fn name(self) -> &'static str {
        match self {
            Layout::NN => "NN",
            Layout::NT => "NT",
            Layout::TN => "TN",
        }
    }
}

struct Case {
    name: &'static str,
    m: usize,
    n: usize,
    k: usize,
    layout: Layout,
}

fn cases() -> Vec<Case> {
    let sq = |name, s| Case { name, m: s, n: s, k: s, layout: Layout::NN };
    vec![
        sq("square 256", 256),
        sq("square 512", 512),
        sq("square 1024", 1024),
        sq("square 2048", 2048),
        // MLP 784-1024-1024-... batch 256, with the operand layouts memfit actually passes.
        Case { name: "mlp fwd  784->1024", m: 256, n: 1024, k: 784, layout: Layout::NT },
        Case { name: "mlp fwd 1024->1024", m: 256, n: 1024, k: 1024, layout: Layout::NT },
        Case { name: "mlp wgrad [1024x784]", m: 1024, n: 784, k: 256, layout: Layout::TN },
        Case { name: "mlp igrad [256x784]", m: 256, n: 784, k: 1024, layout: Layout::NN },
    ]
}

/// Operands of one case: buffers plus (row stride, col stride) of the logical A [m x k], B [k x n].
struct Operands {
    a: Vec<f32>,
    b: Vec<f32>,
    a_rs: isize,
    a_cs: isize,
    b_rs: isize,
    b_cs: isize,
}

fn make_operands(c: &Case, seed: u64) -> Operands {
    let mut rng = XorShift(seed);
    let a: Vec<f32> = (0..c.m * c.k).map(|_| rng.uniform()).collect();
    let b: Vec<f32> = (0..c.k * c.n).map(|_| rng.uniform()).collect();
    let (m, n, k) = (c.m as isize, c.n as isize, c.k as isize);
    let ((a_rs, a_cs), (b_rs, b_cs)) = match c.layout {
        Layout::NN => ((k, 1), (n, 1)),
        Layout::NT => ((k, 1), (1, k)), // B stored [n x k]
        Layout::TN => ((1, m), (n, 1)), // A stored [k x m]
    };
    Operands { a, b, a_rs, a_cs, b_rs, b_cs }
}

struct XorShift(u64);
impl XorShift {
    fn uniform(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

// ---------------------------------------------------------------- the two products
/// C = A B with the `gemm` crate, exactly as memfit's `gemm_into` calls it
/// (dst col stride 1, row stride n, read_dst = false, alpha = beta = 1, Rayon(threads) if threads > 1).
fn run_gemm(c: &Case, o: &Operands, dst: &mut [f32], threads: usize) {
    let par = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // SAFETY: buffers sized for the case; strides describe in-bounds views; dst does not alias.
    unsafe {
        gemm::gemm(
            c.m,
            c.n,
            c.k,
            dst.as_mut_ptr(),
            1,
            c.n as isize,
            false,
            o.a.as_ptr(),
            o.a_cs,
            o.a_rs,
            o.b.as_ptr(),
            o.b_cs,
            o.b_rs,
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            par,
        );
    }
}

/// The same product with OpenBLAS `cblas_sgemm` (row-major, beta = 0).
fn run_openblas(c: &Case, o: &Operands, dst: &mut [f32]) {
    let (m, n, k) = (c.m as c_int, c.n as c_int, c.k as c_int);
    let (ta, lda, tb, ldb) = match c.layout {
        Layout::NN => (CBLAS_NO_TRANS, k, CBLAS_NO_TRANS, n),
        Layout::NT => (CBLAS_NO_TRANS, k, CBLAS_TRANS, k),
        Layout::TN => (CBLAS_TRANS, m, CBLAS_NO_TRANS, n),
    };
    // SAFETY: buffers sized for the case, leading dimensions match the storage.
    unsafe {
        cblas_sgemm(
            CBLAS_ROW_MAJOR,
            ta,
            tb,
            m,
            n,
            k,
            1.0,
            o.a.as_ptr(),
            lda,
            o.b.as_ptr(),
            ldb,
            0.0,
            dst.as_mut_ptr(),
            n,
        );
    }
}

// ---------------------------------------------------------------- measurement
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let l = v.len();
    if l % 2 == 1 {
        v[l / 2]
    } else {
        0.5 * (v[l / 2 - 1] + v[l / 2])
    }
}

/// Warm-up (spins up thread pools, faults pages) for >= 200 ms and >= 3 calls; returns how many
/// calls make one timed repetition last >= `min_rep`.
fn warm_up(min_rep: Duration, mut f: impl FnMut()) -> usize {
    let t0 = Instant::now();
    let mut warm = 0usize;
    while warm < 3 || t0.elapsed() < Duration::from_millis(200) {
        f();
        warm += 1;
    }
    let per_call = t0.elapsed().as_secs_f64() / warm as f64;
    ((min_rep.as_secs_f64() / per_call).ceil() as usize).max(1)
}

/// GFLOP/s of `reps` repetitions of `inner` calls of `f`, pushed onto `rates`. Sets `*disturbed`
/// if a cargo/rustc process was seen between repetitions (when `watch`).
#[allow(clippy::too_many_arguments)]
fn time_reps(
    flops: f64,
    reps: usize,
    inner: usize,
    watch: bool,
    disturbed: &mut bool,
    rates: &mut Vec<f64>,
    mut f: impl FnMut(),
) {
    for _ in 0..reps {
        let t = Instant::now();
        for _ in 0..inner {
            f();
        }
        rates.push(flops * inner as f64 / t.elapsed().as_secs_f64() / 1e9);
        if watch && !busy_pids().is_empty() {
            *disturbed = true;
        }
    }
}

/// Pause between the two libraries so that the other one's worker threads (OpenBLAS threads
/// busy-wait for a while after a call, rayon's briefly) have gone to sleep.
fn settle() {
    std::thread::sleep(Duration::from_millis(300));
}

/// Rounds of alternating gemm / OpenBLAS blocks, so slow phases of the (virtual) machine hit both.
const ROUNDS: usize = 3;

struct Row {
    threads: usize,
    name: &'static str,
    layout: &'static str,
    m: usize,
    n: usize,
    k: usize,
    gemm: f64,
    openblas: f64,
    max_diff: f32,
    max_ref_err: f64,
    clean: bool,
    foreign: f64,
    steal: f64,
}

/// Parent pid of `pid`, from /proc/<pid>/stat.
fn parent_of(pid: &str) -> Option<String> {
    let st = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    st.rsplit(')').next()?.split_whitespace().nth(1).map(str::to_string)
}

/// Pids of running `cargo` / `rustc` processes (other builds that would steal the 2 cores),
/// except our own ancestors (so `cargo run` does not wait for itself).
fn busy_pids() -> Vec<String> {
    let mut ancestors = Vec::new();
    let mut p = parent_of("self");
    while let Some(pid) = p {
        if pid == "0" || ancestors.contains(&pid) {
            break;
        }
        p = parent_of(&pid);
        ancestors.push(pid);
    }
    let mut out = Vec::new();
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.bytes().all(|b| b.is_ascii_digit()) || ancestors.contains(&name) {
                continue;
            }
            if let Ok(comm) = std::fs::read_to_string(e.path().join("comm")) {
                let comm = comm.trim();
                if comm == "cargo" || comm == "rustc" {
                    out.push(format!("{name}:{comm}"));
                }
            }
        }
    }
    out
}

/// (busy jiffies of the whole machine excluding steal, steal jiffies, this process's jiffies).
fn cpu_jiffies() -> (u64, u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let f: Vec<u64> =
        stat.lines().next().unwrap_or("").split_whitespace().skip(1).map(|x| x.parse().unwrap_or(0)).collect();
    let g = |i: usize| f.get(i).copied().unwrap_or(0);
    // user nice system idle iowait irq softirq steal
    let busy = g(0) + g(1) + g(2) + g(5) + g(6);
    let me = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // fields after the ")" of comm: state is field 3; utime, stime are fields 14, 15.
    let rest: Vec<u64> = me
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(11)
        .take(2)
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    (busy, g(7), rest.iter().sum())
}

/// CPU used by other processes (and stolen by the hypervisor) during a timed window, as a
/// percentage of the machine's capacity in that window.
struct Foreign {
    start: (u64, u64, u64),
    t: Instant,
}
impl Foreign {
    fn start() -> Self {
        Foreign { start: cpu_jiffies(), t: Instant::now() }
    }
    /// (foreign busy %, steal %)
    fn stop(&self) -> (f64, f64) {
        let end = cpu_jiffies();
        let hz = 100.0; // USER_HZ
        let cap = self.t.elapsed().as_secs_f64()
            * hz
            * std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) as f64;
        let other = (end.0 - self.start.0) as f64 - (end.2 - self.start.2) as f64;
        let steal = (end.1 - self.start.1) as f64;
        (100.0 * other.max(0.0) / cap, 100.0 * steal / cap)
    }
}

/// Waits (polling every 30 s, at most `max`) until no cargo/rustc runs. Returns whether idle.
fn wait_idle(max: Duration) -> bool {
    let t = Instant::now();
    loop {
        let b = busy_pids();
        if b.is_empty() {
            return true;
        }
        if t.elapsed() >= max {
            eprintln!("  [still busy after {:?}: {:?}; measuring anyway]", max, b);
            return false;
        }
        eprintln!("  [waiting: other builds running {:?}]", b);
        std::thread::sleep(Duration::from_secs(30));
    }
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn main() {
    let mut threads_list = vec![2usize, 1];
    let mut reps = 21usize;
    let mut min_rep_ms = 20u64;
    let mut watch = true;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let val = args.get(i + 1).cloned().unwrap_or_default();
        match args[i].as_str() {
            "--threads" => threads_list = val.split(',').map(|t| t.trim().parse().expect("--threads 2,1")).collect(),
            "--reps" => reps = val.parse().expect("--reps N"),
            "--min-rep-ms" => min_rep_ms = val.parse().expect("--min-rep-ms N"),
            "--no-wait" => {
                watch = false;
                i += 1;
                continue;
            }
            "-h" | "--help" => {
                println!("gemm-compare [--threads 2,1] [--reps 21] [--min-rep-ms 20] [--no-wait]");
                println!("  by default waits until no cargo/rustc process runs before each case, and");
                println!("  re-measures a case (up to 20 times) if one appeared while it was timed");
                return;
            }
            a => panic!("unknown argument {a}"),
        }
        i += 2;
    }
    assert!(reps >= 15, "use at least 15 repetitions");
    let max_threads = *threads_list.iter().max().unwrap();
    rayon::ThreadPoolBuilder::new().num_threads(max_threads).build_global().expect("rayon pool");

    // SAFETY: plain OpenBLAS queries returning static C strings.
    let (config, core) = unsafe {
        (
            CStr::from_ptr(openblas_get_config()).to_string_lossy().into_owned(),
            CStr::from_ptr(openblas_get_corename()).to_string_lossy().into_owned(),
        )
    };
    let cpu = cpu_model();
    println!(
        "CPU: {cpu}  (avx2={} fma={} avx512f={})",
        is_x86_feature_detected!("avx2"),
        is_x86_feature_detected!("fma"),
        is_x86_feature_detected!("avx512f")
    );
    println!("OpenBLAS: {config}  core={core}");
    println!("gemm crate 0.17 (Parallelism::Rayon(t) for t>1, None for t=1), rayon global pool of {max_threads}");
    let reps = reps.div_ceil(ROUNDS) * ROUNDS;
    println!("f32, median of {reps} reps (each >= {min_rep_ms} ms; {ROUNDS} alternating rounds gemm/OpenBLAS) after >= 200 ms warm-up\n");

    let min_rep = Duration::from_millis(min_rep_ms);
    let mut rows = Vec::new();
    for &t in &threads_list {
        // SAFETY: plain OpenBLAS call.
        unsafe { openblas_set_num_threads(t as c_int) };
        let ob_threads = unsafe { openblas_get_num_threads() };
        println!("== {t} thread(s)  (OpenBLAS reports {ob_threads}) ==");
        println!(
            "{:<22} {:>3} {:>16} {:>10} {:>10} {:>8} {:>10} {:>10}",
            "case", "lay", "m x n x k", "gemm", "OpenBLAS", "OB/gemm", "max|diff|", "other/stl"
        );
        println!(
            "{:<22} {:>3} {:>16} {:>10} {:>10} {:>8} {:>10} {:>10}",
            "", "", "", "GFLOP/s", "GFLOP/s", "", "", "cpu %"
        );
        for (ci, c) in cases().iter().enumerate() {
            let o = make_operands(c, 0x9E37_79B9_7F4A_7C15 ^ (ci as u64 + 1));
            let mut d_gemm = vec![f32::NAN; c.m * c.n];
            let mut d_ob = vec![f32::NAN; c.m * c.n];
            run_gemm(c, &o, &mut d_gemm, t);
            run_openblas(c, &o, &mut d_ob);
            // Correctness: the two against each other, and both against f64 on sampled entries.
            let max_diff = d_gemm.iter().zip(&d_ob).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
            let mut rng = XorShift(12345 + ci as u64);
            let mut max_ref_err = 0.0f64;
            let mut max_ref = 0.0f64;
            for _ in 0..256 {
                let i = ((rng.uniform() * 0.5 + 0.5) * c.m as f32) as usize % c.m;
                let j = ((rng.uniform() * 0.5 + 0.5) * c.n as f32) as usize % c.n;
                let r: f64 = (0..c.k)
                    .map(|p| {
                        let a = o.a[(i as isize * o.a_rs + p as isize * o.a_cs) as usize] as f64;
                        let b = o.b[(p as isize * o.b_rs + j as isize * o.b_cs) as usize] as f64;
                        a * b
                    })
                    .sum();
                max_ref = max_ref.max(r.abs());
                for d in [&d_gemm, &d_ob] {
                    max_ref_err = max_ref_err.max((d[i * c.n + j] as f64 - r).abs());
                }
            }
            let tol = 1e-3 * (c.k as f64).sqrt();
            assert!(
                max_diff.is_finite() && (max_diff as f64) < tol,
                "{}: gemm vs OpenBLAS differ by {max_diff}",
                c.name
            );
            assert!(max_ref_err < tol && max_ref > 1.0, "{}: result wrong vs f64 reference ({max_ref_err})", c.name);

            let flops = 2.0 * (c.m * c.n * c.k) as f64;
            let (mut g, mut b, mut clean, mut foreign, mut steal) = (0.0, 0.0, false, 0.0, 0.0);
            for attempt in 0..20 {
                if watch {
                    // if the machine never goes idle, the measurement is kept but flagged not clean.
                    wait_idle(Duration::from_secs(600));
                }
                let mut disturbed = watch && !busy_pids().is_empty();
                let fw = Foreign::start();
                let ig = warm_up(min_rep, || run_gemm(c, &o, &mut d_gemm, t));
                settle();
                let ib = warm_up(min_rep, || run_openblas(c, &o, &mut d_ob));
                settle();
                let (mut rg, mut rb) = (Vec::new(), Vec::new());
                let per_round = reps.div_ceil(ROUNDS);
                for _ in 0..ROUNDS {
                    time_reps(flops, per_round, ig, watch, &mut disturbed, &mut rg, || run_gemm(c, &o, &mut d_gemm, t));
                    settle();
                    time_reps(flops, per_round, ib, watch, &mut disturbed, &mut rb, || run_openblas(c, &o, &mut d_ob));
                    settle();
                }
                (g, b) = (median(&mut rg), median(&mut rb));
                (foreign, steal) = fw.stop();
                // > 3 % of the cores used by other processes, or stolen by the hypervisor (a 2-thread
                // product stalls whenever either vCPU is descheduled): the timing is not clean.
                if watch && (foreign > 3.0 || steal > 3.0) {
                    disturbed = true;
                }
                clean = !disturbed;
                if clean || !watch {
                    break;
                }
                eprintln!("  [{}: other processes ran during timing (other cpu {foreign:.1}%, steal {steal:.1}%, attempt {}), re-measuring]", c.name, attempt + 1);
                std::thread::sleep(Duration::from_secs(5));
            }
            println!(
                "{:<22} {:>3} {:>16} {:>10.1} {:>10.1} {:>8.2} {:>10.2e} {:>5.1}/{:<4.1}{}",
                c.name,
                c.layout.name(),
                format!("{}x{}x{}", c.m, c.n, c.k),
                g,
                b,
                b / g,
                max_diff,
                foreign,
                steal,
                if watch && !clean { "  (NOT clean: other builds ran)" } else { "" }
            );
            rows.push(Row {
                threads: t,
                name: c.name,
                layout: c.layout.name(),
                m: c.m,
                n: c.n,
                k: c.k,
                gemm: g,
                openblas: b,
                max_diff,
                max_ref_err,
                clean: clean || !watch,
                foreign,
                steal,
            });
        }
        let mlp: Vec<&Row> = rows.iter().filter(|r| r.threads == t && r.name.starts_with("mlp")).collect();
        let (fg, fb): (f64, f64) = mlp
            .iter()
            .map(|r| (2.0 * (r.m * r.n * r.k) as f64 / r.gemm, 2.0 * (r.m * r.n * r.k) as f64 / r.openblas))
            .fold((0.0, 0.0), |a, x| (a.0 + x.0, a.1 + x.1));
        println!(
            "MLP step (4 products) total time: gemm {:.3} ms, OpenBLAS {:.3} ms -> OpenBLAS/gemm speed {:.2}x\n",
            fg / 1e6,
            fb / 1e6,
            fg / fb
        );
    }

    // one JSON line (hand-written: no serde dependency)
    let items: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{{\"threads\":{},\"case\":\"{}\",\"layout\":\"{}\",\"m\":{},\"n\":{},\"k\":{},\"gemm_gflops\":{:.2},\"openblas_gflops\":{:.2},\"ratio_openblas_over_gemm\":{:.3},\"max_abs_diff\":{:.3e},\"max_err_vs_f64\":{:.3e},\"clean\":{},\"other_cpu_pct\":{:.1},\"steal_pct\":{:.1}}}",
                r.threads, r.name, r.layout, r.m, r.n, r.k, r.gemm, r.openblas, r.openblas / r.gemm, r.max_diff, r.max_ref_err, r.clean, r.foreign, r.steal
            )
        })
        .collect();
    println!(
        "JSON {{\"cpu\":\"{}\",\"openblas\":\"{} {}\",\"gemm_crate\":\"0.17\",\"dtype\":\"f32\",\"reps\":{},\"results\":[{}]}}",
        cpu, config.trim(), core, reps, items.join(",")
    );
}
