//! The run report: JSON for machines (`--report PATH`, schema in the README) and a memory table for
//! people.

use crate::config::TrainConfig;
use crate::trainer::{median, RunOutcome};
use memfit_nn::ModelInput;
use memfit_nn::ModelSpec;
use memfit_tensor::memory::format_bytes;
use memfit_tensor::Category;
use memfit_tensor::MemoryStats;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Everything a finished run reports.
#[derive(Clone, Debug)]
pub struct RunSummary {
    pub config: TrainConfig,
    /// The model trained (sizes resolved from the data).
    pub spec: ModelSpec,
    pub data_source: String,
    pub micro_batch: usize,
    pub accumulation_steps: usize,
    pub eval_micro_batch: usize,
    /// The plan, when the planner chose the micro-batch.
    pub plan: Option<crate::planner::Plan>,
    pub outcome: RunOutcome,
    pub stats: MemoryStats,
    /// The allocator's capacity: `--memory`, or a GPU's free memory when it opened.
    pub capacity: Option<u64>,
    /// The device as reports name it (`cuda:0 (NVIDIA H100 80GB HBM3 (sm_90))`).
    pub device_name: String,
    /// A GPU's context: device memory the driver holds outside the allocator and its capacity.
    pub context_bytes: Option<u64>,
    pub threads: usize,
    /// Files of the memory profile written (`profile` or `profile_on_oom`).
    pub profile_files: Vec<PathBuf>,
    /// Segments that ran with activation checkpointing.
    pub checkpointed: Vec<String>,
    /// The dtype saved activations were stored in (`auto` resolved).
    pub precision: crate::config::Precision,
    /// How matrix products computed ([`products_label`]).
    pub products: String,
    /// Which of a GPU's alternative kernels ran (`Device::kernels_used`): attention's and biases'.
    pub kernels_used: Vec<String>,
    /// A GPU's work and how it was queued (`Device::launches`); None on cpu and meta.
    pub launches: Option<memfit_tensor::Launches>,
    /// The allocator's segments (`auto` resolved).
    pub segments: crate::config::Segments,
    /// Where the optimizer stepped (`auto` resolved).
    pub optimizer_step: crate::config::OptimizerStep,
    /// Optimizer steps skipped because a gradient overflowed (fp16 storage).
    pub skipped_steps: usize,
    /// Host memory outside the device's capacity.
    pub host: HostMemory,
    /// What accumulation and checkpointing saved (predicted; with a budget only).
    pub savings: crate::planner::Savings,
    /// Each rank's memory, when trained as several ranks (`--parallel`).
    pub ranks: Option<RanksSummary>,
}

/// A GPU run's work (Note [CUDA graphs] in memfit-cuda): everything from the device's opening,
/// warm-up and evaluation included.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct LaunchReport {
    /// Kernel launches, products, device copies and zeroings asked for.
    pub asked: u64,
    /// Calls that queued them on the GPU: each op queued alone, and each graph launch.
    pub queued: u64,
    /// Of `queued`, graph launches; `replayed` ops ran inside them.
    pub graph_launches: u64,
    pub replayed: u64,
    /// Graphs captured, and kernel nodes given new numbers (a step count) before a launch.
    pub captured: u64,
    pub updated: u64,
    /// Whether CUDA graphs were asked for (`MEMFIT_CUDA_GRAPHS=1`), and why they are off if they
    /// are (kernel times asked for too, or a capture the driver refused).
    pub graphs: bool,
    pub graphs_off: Option<String>,
}

impl LaunchReport {
    fn of(l: &memfit_tensor::Launches) -> LaunchReport {
        LaunchReport {
            asked: l.asked,
            queued: l.queued,
            graph_launches: l.graph_launches,
            replayed: l.replayed,
            captured: l.captured,
            updated: l.updated,
            graphs: l.on,
            graphs_off: l.off.clone(),
        }
    }
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct PlanReport {
    pub micro_batch: usize,
    pub accumulation_steps: usize,
    pub effective_batch: usize,
}

/// Host memory of a run outside the device's capacity: what memfit holds there (each part bounded)
/// and the process's resident memory as the system counts it (null where it does not say).
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct HostMemory {
    /// The loaded data set (train and validation).
    pub dataset_bytes: u64,
    /// The allocator timeline's buffer, at most.
    pub timeline_bytes: u64,
    /// The matrix-multiply packing buffers of every worker thread, at most.
    pub kernel_workspace_bytes: u64,
    /// Pinned (page-locked) buffers batches went up to a GPU through, the most held at once (0
    /// elsewhere).
    pub pinned_bytes: u64,
    /// Resident before the job loaded anything (the program itself).
    pub rss_at_start_bytes: Option<u64>,
    /// The most ever resident (Linux `VmHWM`), at the end of the run.
    pub peak_rss_bytes: Option<u64>,
}

impl HostMemory {
    /// What memfit holds on the host besides the device's segments.
    pub fn held_bytes(&self) -> u64 {
        self.dataset_bytes + self.timeline_bytes + self.kernel_workspace_bytes + self.pinned_bytes
    }
}

/// The JSON report. Byte counts are integers; absent values are null.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub model: String,
    /// `image_classification` or `next_character` (a GPT on text).
    pub task: String,
    /// The GPT's sizes and vocabulary size (null for image models and imported ones).
    pub gpt: Option<GptReport>,
    pub device: String,
    /// The device with its name where it has one (a GPU's, with its architecture).
    pub device_name: String,
    /// The allocator's capacity: `--memory`, or a GPU's free memory when it opened; null: unlimited.
    pub capacity_bytes: Option<u64>,
    /// A GPU's context (driver, kernels, cuBLAS's handle): device memory outside the allocator, not
    /// counted against the capacity (null on cpu and meta, or where NVML could not say).
    pub context_bytes: Option<u64>,
    pub data: String,
    pub optimizer: String,
    /// How Adam's moments were stored: fp32, bf16 or int8 (`--optimizer-state`).
    pub optimizer_state: String,
    /// Learning rate.
    pub lr: f64,
    pub seed: u64,
    /// Seed of the data order (`--data-seed`, default `seed`).
    pub data_seed: u64,
    pub threads: usize,
    /// The instruction set the CPU kernels ran with (`avx512`, `avx2` or `portable`).
    pub isa: String,
    /// Epochs begun.
    pub epochs: usize,
    pub steps: usize,
    pub samples_seen: usize,
    pub plan: PlanReport,
    /// Set when the planner chose the micro-batch.
    pub planned: bool,
    /// Segments that ran with activation checkpointing (`--checkpoint`), in forward order.
    pub checkpointed_segments: Vec<String>,
    /// The dtype saved activations were stored in: fp32, bf16 or fp16.
    pub precision: String,
    /// How matrix products computed: `fp32`, or `bf16 (LEVEL)` with the kernel level (bf16
    /// operands, f32 accumulation: Note [bf16 products] in `memfit-kernels`).
    pub products: String,
    /// Which of a GPU's alternative kernels ran: attention on the tensor cores or the CUDA cores,
    /// biases in the product's epilogue or broadcast first (empty on cpu and meta).
    #[serde(default)]
    pub kernels_used: Vec<String>,
    /// A GPU run's work, and how it was queued: one by one, or in CUDA graphs (null on cpu and meta).
    pub launches: Option<LaunchReport>,
    /// The allocator's segments: fixed or expandable.
    pub segments: String,
    /// Where the optimizer stepped: after backward, or in-backward (a window of one micro-batch).
    pub optimizer_step: String,
    /// Optimizer steps skipped because a gradient overflowed (fp16 storage).
    pub skipped_steps: usize,
    pub eval_micro_batch: usize,
    pub predicted_peak_allocated_bytes: Option<u64>,
    pub predicted_peak_reserved_bytes: Option<u64>,
    pub final_train_loss: Option<f64>,
    /// Mean cross-entropy over the validation predictions (nats per character for a GPT).
    pub val_loss: Option<f64>,
    /// Share of validation predictions whose argmax is right (next-character accuracy for a GPT).
    pub val_accuracy: Option<f64>,
    /// exp(val_loss), for a GPT.
    pub val_perplexity: Option<f64>,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    /// Each category's own peak.
    pub peak_by_category: BTreeMap<String, u64>,
    /// Allocated bytes per category at the moment of the overall peak.
    pub at_peak_by_category: BTreeMap<String, u64>,
    /// 1 - peak allocated / peak reserved: the share of the reserved peak that was never in use at
    /// once (cache and split-block overhead).
    pub fragmentation: f64,
    pub allocated_bytes_at_end: u64,
    pub reserved_bytes_at_end: u64,
    pub num_allocations: u64,
    pub num_segments: u64,
    pub num_alloc_retries: u64,
    pub num_ooms: u64,
    pub num_injected_faults: u64,
    pub oom_recoveries: usize,
    pub final_micro_batch: usize,
    pub step_time_ms_median: f64,
    pub samples_per_second: f64,
    /// The step time the planner's cost model predicted (`--checkpoint auto` plans), and the measured
    /// median's relative error against it (measured / predicted - 1).
    pub predicted_step_time_ms: Option<f64>,
    pub step_time_prediction_error: Option<f64>,
    /// What the remedies in force saved, predicted on meta (with `--memory`).
    pub remedies: crate::planner::Savings,
    pub host: HostMemory,
    /// Training as several ranks (`--parallel`): the mode and every rank's memory; null for one process.
    /// The top-level memory fields are rank 0's.
    pub parallel: Option<RanksSummary>,
}

/// Training as several ranks: the mode and each rank's memory, gathered from every rank.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct RanksSummary {
    /// `data` or `zero1`.
    pub mode: String,
    pub ranks: usize,
    pub per_rank: Vec<RankMemory>,
}

/// What a pipeline stage holds and was predicted to need (`--parallel pipeline` only).
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct StageReport {
    /// Its units of the layer sequence, for people: `embeddings + blocks.0-1`.
    pub units: String,
    pub predicted_peak_allocated_bytes: u64,
    pub predicted_peak_reserved_bytes: u64,
}

/// One rank's memory in a parallel run.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct RankMemory {
    pub rank: usize,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    /// Peak bytes of optimizer state (ZeRO-1: this rank's share).
    pub optimizer_state_bytes: u64,
    /// Peak bytes of communication buffers (the gradient buckets).
    pub communication_bytes: u64,
    pub peak_rss_bytes: Option<u64>,
    /// Pipeline: this rank's stage.
    pub stage: Option<StageReport>,
}

impl RanksSummary {
    /// Every rank's memory after a run (a collective call: every rank makes it).
    pub fn gather(
        group: &dyn memfit_dist::Group,
        cfg: &crate::TrainConfig,
        stats: &memfit_tensor::MemoryStats,
        stages: Vec<String>,
        predicted: &[crate::planner::Prediction],
    ) -> RanksSummary {
        let rss = memfit_tensor::memory::process::resident().map_or(u64::MAX, |r| r.peak);
        let columns: Vec<Vec<u64>> = [
            stats.allocated_bytes.peak,
            stats.reserved_bytes.peak,
            stats.category(Category::OptimizerState).peak,
            stats.category(Category::Communication).peak,
            rss,
        ]
        .into_iter()
        .map(|v| group.all_gather_u64(v))
        .collect();
        RanksSummary {
            mode: cfg.parallel.map_or("none", |m| m.name()).to_string(),
            ranks: group.size(),
            per_rank: (0..group.size())
                .map(|r| RankMemory {
                    rank: r,
                    peak_allocated_bytes: columns[0][r],
                    peak_reserved_bytes: columns[1][r],
                    optimizer_state_bytes: columns[2][r],
                    communication_bytes: columns[3][r],
                    peak_rss_bytes: Some(columns[4][r]).filter(|&v| v != u64::MAX),
                    stage: stages.get(r).zip(predicted.get(r)).map(|(units, p)| StageReport {
                        units: units.clone(),
                        predicted_peak_allocated_bytes: p.peak_allocated,
                        predicted_peak_reserved_bytes: p.peak_reserved,
                    }),
                })
                .collect(),
        }
    }
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct GptReport {
    pub layers: usize,
    pub d_model: usize,
    pub heads: usize,
    pub context: usize,
    pub vocab: usize,
}

fn by_category(values: impl Fn(Category) -> u64) -> BTreeMap<String, u64> {
    Category::ALL.into_iter().map(|c| (c.name().to_string(), values(c))).collect()
}

impl Report {
    pub fn new(s: &RunSummary) -> Report {
        let st = &s.stats;
        let median_ms = median(&s.outcome.step_times_ms);
        let total_s: f64 = s.outcome.step_times_ms.iter().sum::<f64>() / 1e3;
        let reserved = st.reserved_bytes.current;
        let eval = s.outcome.eval.as_ref();
        Report {
            model: s.config.model_name(),
            task: match s.spec.input_kind() {
                ModelInput::Image { .. } => "image_classification",
                ModelInput::Tokens { .. } => "next_character",
            }
            .to_string(),
            // memfit's own GPT's sizes (an imported model's are its graph's, not these).
            gpt: (s.spec.kind == memfit_nn::ModelKind::Gpt).then(|| {
                let g = s.spec.gpt;
                GptReport { layers: g.layers, d_model: g.d_model, heads: g.heads, context: g.max_t, vocab: g.vocab }
            }),
            device: s.config.device.name().to_string(),
            device_name: s.device_name.clone(),
            capacity_bytes: s.capacity,
            context_bytes: s.context_bytes,
            data: s.data_source.clone(),
            optimizer: s.config.optimizer.name().to_string(),
            optimizer_state: s.config.optimizer_state.name().to_string(),
            lr: s.config.lr,
            seed: s.config.seed,
            threads: s.threads,
            isa: memfit_tensor::Isa::active().to_string(),
            data_seed: s.config.data_seed.unwrap_or(s.config.seed),
            epochs: s.outcome.epochs,
            steps: s.outcome.steps,
            samples_seen: s.outcome.samples_seen,
            plan: PlanReport {
                micro_batch: s.micro_batch,
                accumulation_steps: s.accumulation_steps,
                effective_batch: s.config.batch_size,
            },
            planned: s.plan.is_some(),
            checkpointed_segments: s.checkpointed.clone(),
            precision: s.precision.name().to_string(),
            products: s.products.clone(),
            kernels_used: s.kernels_used.clone(),
            launches: s.launches.as_ref().map(LaunchReport::of),
            segments: s.segments.name().to_string(),
            optimizer_step: s.optimizer_step.name().to_string(),
            skipped_steps: s.skipped_steps,
            eval_micro_batch: s.eval_micro_batch,
            predicted_peak_allocated_bytes: s.plan.as_ref().map(|p| p.predicted.peak_allocated),
            predicted_peak_reserved_bytes: s.plan.as_ref().map(|p| p.predicted.peak_reserved),
            final_train_loss: s.outcome.last_loss,
            val_loss: eval.and_then(|e| e.loss),
            val_accuracy: eval.and_then(|e| e.accuracy),
            val_perplexity: matches!(s.spec.input_kind(), ModelInput::Tokens { .. })
                .then(|| eval.and_then(|e| e.loss).map(f64::exp))
                .flatten(),
            peak_allocated_bytes: st.allocated_bytes.peak,
            peak_reserved_bytes: st.reserved_bytes.peak,
            peak_by_category: by_category(|c| st.category(c).peak),
            at_peak_by_category: by_category(|c| st.category_at_peak[c.index()]),
            fragmentation: if st.reserved_bytes.peak == 0 {
                0.0
            } else {
                1.0 - st.allocated_bytes.peak as f64 / st.reserved_bytes.peak as f64
            },
            allocated_bytes_at_end: st.allocated_bytes.current,
            reserved_bytes_at_end: reserved,
            num_allocations: st.allocation.allocated,
            num_segments: st.segment.allocated,
            num_alloc_retries: st.num_alloc_retries,
            num_ooms: st.num_ooms,
            num_injected_faults: st.num_injected_faults,
            oom_recoveries: s.outcome.oom_recoveries + eval.map_or(0, |e| e.oom_recoveries),
            final_micro_batch: s.outcome.final_micro_batch,
            step_time_ms_median: median_ms,
            samples_per_second: if total_s > 0.0 { s.outcome.samples_seen as f64 / total_s } else { 0.0 },
            predicted_step_time_ms: s.plan.as_ref().and_then(|p| p.predicted_step_ms),
            step_time_prediction_error: s
                .plan
                .as_ref()
                .and_then(|p| p.predicted_step_ms)
                .filter(|&p| p > 0.0 && median_ms > 0.0)
                .map(|p| median_ms / p - 1.0),
            remedies: s.savings.clone(),
            host: s.host.clone(),
            parallel: s.ranks.clone(),
        }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a report always serializes")
    }

    /// The memory table printed at the end of a run.
    pub fn memory_table(&self) -> String {
        let mut s = String::new();
        let cap = self.capacity_bytes.map_or("unlimited".to_string(), format_bytes);
        let device =
            if self.device_name == self.device { format!("{} device", self.device) } else { self.device_name.clone() };
        s.push_str(&format!("memory ({device}, capacity {cap})\n"));
        s.push_str(&format!("  {:<16} {:>12} {:>14}\n", "category", "own peak", "at overall peak"));
        let mut cats: Vec<(&String, &u64)> = self.at_peak_by_category.iter().collect();
        cats.sort_by_key(|(_, b)| std::cmp::Reverse(**b));
        for (name, at_peak) in cats {
            let own = self.peak_by_category[name];
            if own > 0 {
                s.push_str(&format!("  {:<16} {:>12} {:>14}\n", name, format_bytes(own), format_bytes(*at_peak)));
            }
        }
        s.push_str(&format!(
            "  {:<16} {:>12}   reserved {}\n",
            "peak allocated",
            format_bytes(self.peak_allocated_bytes),
            format_bytes(self.peak_reserved_bytes)
        ));
        if let (Some(a), Some(r)) = (self.predicted_peak_allocated_bytes, self.predicted_peak_reserved_bytes) {
            s.push_str(&format!("  {:<16} {:>12}   reserved {}\n", "predicted", format_bytes(a), format_bytes(r)));
        }
        s.push_str(&format!(
            "  fragmentation {:.1}% (reserved peak not in use at once); {} allocations, {} {}segments, {} cache retries\n",
            self.fragmentation * 100.0,
            self.num_allocations,
            self.num_segments,
            if self.segments == "expandable" { "expandable " } else { "" },
            self.num_alloc_retries
        ));
        let end = match self.final_micro_batch == self.plan.micro_batch {
            true => String::new(),
            false => format!(", micro-batch {} at the end", self.final_micro_batch),
        };
        s.push_str(&format!(
            "  out-of-memory: {} ({} injected), recovered {} time{} with no sample lost; planned micro-batch {} x {}{end}\n",
            self.num_ooms,
            self.num_injected_faults,
            self.oom_recoveries,
            if self.oom_recoveries == 1 { "" } else { "s" },
            self.plan.micro_batch,
            self.plan.accumulation_steps,
        ));
        let r = &self.remedies;
        let mut saved = Vec::new();
        if let Some(b) = r.accumulation_saved_bytes {
            saved.push(format!(
                "micro-batch {} x {} instead of {} saves {}",
                self.plan.micro_batch,
                self.plan.accumulation_steps,
                self.plan.effective_batch,
                format_bytes(b)
            ));
        }
        if let Some(b) = r.checkpointing_saved_bytes {
            let time = r
                .recompute_time_share
                .map_or(String::new(), |t| format!(" for ~{:.0}% of the step in recomputation", t * 100.0));
            saved.push(format!(
                "checkpointing {} saves {}{time}",
                self.checkpointed_segments.join(", "),
                format_bytes(b)
            ));
        }
        if let Some(b) = r.precision_saved_bytes {
            saved.push(format!("{} storage saves {}", self.precision, format_bytes(b)));
        }
        if !saved.is_empty() {
            s.push_str(&format!("  remedies (predicted peak reserved): {}\n", saved.join("; ")));
        }
        if let Some(c) = self.context_bytes {
            s.push_str(&format!(
                "  context: {} of the GPU held by its driver (CUDA context, kernels, cuBLAS handle), outside the capacity\n",
                format_bytes(c)
            ));
        }
        let h = &self.host;
        s.push_str(&format!(
            "  host: data {}, timeline {}, kernel workspace {} (outside the device capacity, each bounded)",
            format_bytes(h.dataset_bytes),
            format_bytes(h.timeline_bytes),
            format_bytes(h.kernel_workspace_bytes)
        ));
        if h.pinned_bytes > 0 {
            s.push_str(&format!(", pinned upload buffers {}", format_bytes(h.pinned_bytes)));
        }
        if let (Some(start), Some(peak)) = (h.rss_at_start_bytes, h.peak_rss_bytes) {
            s.push_str(&format!("; process peak RSS {} ({} at start)", format_bytes(peak), format_bytes(start)));
        }
        s.push('\n');
        s
    }
}

/// Writes the report of `summary` to `path` and its training curves beside it (`.svg`), atomically.
pub fn write(path: &std::path::Path, summary: &RunSummary) -> Result<(), crate::TrainError> {
    let report = Report::new(summary);
    crate::output::write_atomic("--report", path, (report.to_json() + "\n").as_bytes())?;
    let svg = memfit_profile::curves_svg(&curves(summary));
    crate::output::write_atomic("--report", &path.with_extension("svg"), svg.as_bytes())
}

/// A plan for people: `plan`'s output and what `train` prints when it plans (the figures are the
/// plan's own).
impl crate::planner::Plan {
    /// A few lines a person reads: the choice, the predicted peak by category, what dominates, and
    /// what would change it.
    pub fn describe(&self, model: &str) -> String {
        let mut s = String::new();
        let budget = self.budget.map_or("unlimited memory".to_string(), |b| format!("a budget of {}", format_bytes(b)));
        let evaluation = match self.evaluates {
            true => format!(" (evaluation micro-batch {})", self.eval_micro_batch),
            false => " (no evaluation)".to_string(),
        };
        s.push_str(&format!(
            "plan for {model} with {budget}: {}{evaluation}\n",
            crate::planner::window_words(self.effective_batch, self.micro_batch)
        ));
        match &self.checkpoint {
            crate::config::CheckpointChoice::All => s.push_str("activation checkpointing: every segment\n"),
            crate::config::CheckpointChoice::Segments(names) => s.push_str(&format!(
                "activation checkpointing: {} (each keeps only its input; its forward runs again in backward)\n",
                names.join(", ")
            )),
            crate::config::CheckpointChoice::None | crate::config::CheckpointChoice::Auto => {}
        }
        if self.precision.saved_dtype().is_some() {
            s.push_str(&format!(
                "saved activations stored in {} (converted back to f32 when backward reads them)\n",
                self.precision.name()
            ));
        }
        if self.precision.products() != memfit_tensor::Products::F32 {
            s.push_str(&format!(
                "matrix products: {} operands, f32 accumulation (the cpu's rounding kernels, a GPU's tensor cores)\n",
                self.precision.name()
            ));
        }
        if self.segments.expandable() {
            s.push_str(
                "expandable segments: each pool one segment that grows and shrinks by 2 MiB pages, so reserved \
                 follows allocated (no number changes)\n",
            );
        }
        if self.optimizer_step == crate::config::OptimizerStep::InBackward {
            s.push_str(
                "optimizer step inside backward: each parameter updated as soon as its gradient is complete, and \
                 the gradient freed (no number changes)\n",
            );
        }
        match self.evaluates {
            true => s.push_str(&format!(
                "predicted peak of the whole run: {} allocated, {} reserved (training steps alone: {} allocated, {} reserved)\n",
                format_bytes(self.predicted.peak_allocated),
                format_bytes(self.predicted.peak_reserved),
                format_bytes(self.training.peak_allocated),
                format_bytes(self.training.peak_reserved),
            )),
            false => s.push_str(&format!(
                "predicted peak of the run: {} allocated, {} reserved\n",
                format_bytes(self.predicted.peak_allocated),
                format_bytes(self.predicted.peak_reserved),
            )),
        }
        s.push_str("a training step at its peak holds:\n");
        let t = &self.training;
        let total = t.peak_allocated.max(1) as f64;
        let mut cats: Vec<Category> = Category::ALL.to_vec();
        cats.sort_by_key(|c| std::cmp::Reverse(t.at_peak[c.index()]));
        for c in cats {
            let b = t.at_peak[c.index()];
            if b > 0 {
                s.push_str(&format!(
                    "  {:<16} {:>12}  {:>5.1}%\n",
                    c.name(),
                    format_bytes(b),
                    100.0 * b as f64 / total
                ));
            }
        }
        s.push_str(&format!("dominated by {}\n", t.dominant().name()));
        if let Some((micro, needs)) = self.larger {
            s.push_str(&format!(
                "a budget of {} would allow micro-batch {micro} ({} accumulation step{})\n",
                format_bytes(needs),
                self.effective_batch.div_ceil(micro),
                if self.effective_batch.div_ceil(micro) == 1 { "" } else { "s" }
            ));
        }
        if !self.candidates.is_empty() {
            s.push_str(&self.candidates_table());
        }
        s.push_str(&format!("planned in {:.0} ms ({} dry runs on meta)", self.planning_ms, self.dry_runs));
        if self.calibration_ms > 0.0 {
            s.push_str(&format!(
                ", {:.1} s of it calibrating step times on this machine (cached)",
                self.calibration_ms / 1e3
            ));
        }
        s.push('\n');
        s
    }

    /// The configurations weighed, one a line, the chosen one marked.
    pub fn candidates_table(&self) -> String {
        let nominal = self.costs.as_ref().is_some_and(|c| c.nominal);
        let mut s = String::from(match nominal {
            false => {
                "candidates weighed (peak exact from meta; step time from the cost model calibrated on this machine):\n"
            }
            true => {
                "candidates weighed (peak exact from meta; the model is too large to time on this host, so step \
                     times are nominal: one unit a sample, a re-run forward a third of a step):\n"
            }
        });
        let chosen = self.checkpoint.segment_names();
        let segments = self.candidates.iter().map(|c| c.checkpointed.len()).max().unwrap_or(0);
        let labels: Vec<String> = self
            .candidates
            .iter()
            .map(|c| match c.checkpointed.len() {
                0 => "none".to_string(),
                k if k == segments && chosen == ["all"] || k == segments && segments > 3 => "all".to_string(),
                k if k > 3 => format!("{k} of {segments}: {}, ...", c.checkpointed[..2].join(",")),
                _ => c.checkpointed.join(","),
            })
            .collect();
        // Wide enough for the longest (an imported model's module paths are long).
        let width = labels.iter().map(String::len).max().unwrap_or(0).max(32);
        s.push_str(&format!(
            "    {:<9} {:<width$} {:>14} {:>14} {:>12}\n",
            "storage", "checkpointed", "micro-batch", "peak reserved", "step time"
        ));
        for (c, names) in self.candidates.iter().zip(labels) {
            let is_chosen = c.fits()
                && c.precision == self.precision
                && c.micro_batch == self.micro_batch
                && (c.checkpointed == chosen || (chosen == ["all"] && c.checkpointed.len() == segments));
            let micro = if c.fits() {
                format!("{} x {}", c.micro_batch, c.accumulation_steps)
            } else {
                "does not fit".to_string()
            };
            let time = match nominal {
                false => format!("{:.0} ms", c.step_ms),
                true => format!("{:.1} units", c.step_ms),
            };
            s.push_str(&format!(
                "  {} {:<9} {:<width$} {:>14} {:>14} {:>12}\n",
                if is_chosen { "*" } else { " " },
                c.precision.name(),
                names,
                micro,
                format_bytes(c.peak_reserved),
                time
            ));
        }
        s
    }
}

/// Errors when `--report PATH`, or the curves written beside it (`PATH` with `.svg`), names an existing
/// file memfit did not write: a report replaces only a report (a JSON object with a report's fields),
/// and curves only curves (marked with [`memfit_profile::CURVES_MARK`], or beside a report: older
/// curves carry no mark). Checked before any work.
pub fn check_replaceable(path: &std::path::Path) -> Result<(), crate::TrainError> {
    // A report is a few kilobytes: a large file is not one, and is not read.
    const LARGEST_REPORT: u64 = 64 << 20;
    let small = |p: &std::path::Path| std::fs::metadata(p).is_ok_and(|m| m.len() <= LARGEST_REPORT);
    let is_report = |p: &std::path::Path| {
        let read = small(p).then(|| std::fs::read(p).ok()).flatten();
        read.and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok()).is_some_and(|v| {
            ["model", "samples_seen", "peak_reserved_bytes", "plan"].iter().all(|k| v.get(k).is_some())
        })
    };
    let refuse = |p: &std::path::Path, what: &str| {
        crate::TrainError::Invalid(format!(
            "--report {}: {} exists and is not {what} memfit wrote; memfit does not overwrite it: name another file \
             or move it away",
            path.display(),
            p.display()
        ))
    };
    let exists = |p: &std::path::Path| std::fs::symlink_metadata(p).is_ok();
    if exists(path) && !is_report(path) {
        return Err(refuse(path, "a report"));
    }
    let svg = path.with_extension("svg");
    let marked = || {
        small(&svg)
            && std::fs::read(&svg).is_ok_and(|b| String::from_utf8_lossy(&b).contains(memfit_profile::CURVES_MARK))
    };
    if exists(&svg) && !marked() && !is_report(path) {
        return Err(refuse(&svg, "training curves"));
    }
    Ok(())
}

/// Loss and memory per step, the validation loss after the last one, the run's peaks and its budget:
/// the training curves of a run, with the figures of its report.
pub fn curves(summary: &crate::RunSummary) -> memfit_profile::Curves {
    let last = summary.outcome.curve.len();
    let points = summary
        .outcome
        .curve
        .iter()
        .map(|p| memfit_profile::CurvePoint {
            step: p.step,
            train_loss: p.loss,
            val_loss: if p.step == last { summary.outcome.eval.as_ref().and_then(|e| e.loss) } else { None },
            allocated: p.allocated,
            peak_allocated: p.peak_allocated,
            reserved: p.reserved,
        })
        .collect();
    memfit_profile::Curves {
        points,
        peak_allocated: summary.stats.allocated_bytes.peak,
        peak_reserved: summary.stats.reserved_bytes.peak,
        // The budget's line (a GPU's whole free memory would flatten every curve).
        capacity: summary.config.memory,
    }
}

/// How a device computes matrix products, for reports: `fp32`, or `bf16 (WHERE)` or `fp16 (WHERE)`:
/// the kernel level on the cpu, cuBLAS's tensor cores on a GPU target.
pub fn products_label(device: &memfit_tensor::Device) -> String {
    let gpu = device.target() == memfit_tensor::Target::Cuda;
    let level = |cpu: &str| if gpu { "tensor cores".to_string() } else { cpu.to_string() };
    match device.products() {
        memfit_tensor::Products::Bf16 => {
            format!("bf16 ({}): bf16 operands, f32 accumulation", level(memfit_tensor::Bf16Level::active().name()))
        }
        memfit_tensor::Products::F16 => {
            format!("fp16 ({}): fp16 operands, f32 accumulation", level(memfit_kernels::Isa::active().name()))
        }
        memfit_tensor::Products::F32 => "fp32".to_string(),
    }
}
