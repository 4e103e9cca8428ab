//! Memory profiles of a run: the device's allocator (timeline, snapshot, statistics), its module table
//! and recorded spans become a [`memfit_profile::Recording`], written as the files `memfit profile`
//! (and `memfit train --profile-on-oom DIR`) leave in a directory:
//!
//! | file | what |
//! |---|---|
//! | `memory.html` | one self-contained page: memory over time by category, phases, the peak and what was live |
//! | `snapshot.pickle` | a PyTorch memory snapshot (`python -m torch.cuda._memory_viz trace snapshot.pickle`) |
//! | `trace.json` | a Chrome trace (Perfetto, chrome://tracing): op and module spans, memory counters |
//! | `summary.txt`, `summary.json` | the memory table, the top allocations at the peak, what made the peak |

use crate::error::TrainError;
use memfit_profile::{Recording, Span, SpanKind};
use memfit_tensor::Device;
use std::path::{Path, PathBuf};

/// Timeline capacity of a profiled device: enough for setup and several steps of the zoo's models
/// (a GPT step makes ~1,500 events), bounded (~20 MB).
pub const PROFILE_TIMELINE_EVENTS: usize = 1 << 18;

pub use crate::output::{check_profile_dir, PROFILE_FILES};

/// Everything `device` recorded, under `title`.
pub fn recording(device: &Device, title: String) -> Recording {
    let mut rec = Recording::from_state(title, device.describe(), device.memory_state());
    rec.ordinal = match device.kind() {
        memfit_tensor::DeviceKind::Cuda(n) => n,
        _ => 0,
    };
    rec.modules = device.module_names();
    rec.spans = device
        .take_spans()
        .into_iter()
        .map(|s| Span {
            name: s.name.to_string(),
            kind: match s.kind {
                memfit_tensor::SpanKind::Op => SpanKind::Op,
                memfit_tensor::SpanKind::Module => SpanKind::Module,
            },
            phase: s.phase,
            module: s.module,
            start_ns: s.start_ns,
            end_ns: s.end_ns,
        })
        .collect();
    rec
}

/// Writes the profile files of `rec` into `dir` (created if needed); returns their paths.
pub fn write_profile(dir: &Path, rec: &Recording) -> Result<Vec<PathBuf>, TrainError> {
    check_profile_dir(dir)?;
    let fail = |e: std::io::Error| TrainError::Invalid(format!("cannot write a profile to {}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(fail)?;
    let paths: Vec<PathBuf> = PROFILE_FILES.iter().map(|f| dir.join(f)).collect();
    let json = serde_json::to_string_pretty(&memfit_profile::summary_json(rec)).map_err(|e| fail(e.into()))?;
    let contents: [Vec<u8>; 5] = [
        memfit_profile::html(rec).into_bytes(),
        memfit_profile::snapshot_pickle(rec),
        memfit_profile::chrome_trace(rec).into_bytes(),
        memfit_profile::summary(rec).into_bytes(),
        (json + "\n").into_bytes(),
    ];
    for (path, bytes) in paths.iter().zip(&contents) {
        crate::output::write_atomic("profile", path, bytes)?;
    }
    Ok(paths)
}
