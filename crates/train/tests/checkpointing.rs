//! Activation checkpointing through the trainer: training with checkpointed GPT blocks ends with
//! the plain run's parameters bit for bit (accumulation included), planned checkpointed runs fit
//! and peak exactly as predicted, checkpointing lowers the planned peak, and a fault at any
//! allocation of a checkpointed run (re-runs in backward included) loses no window.

mod common;

use common::*;
use memfit_nn::{GptConfig, ModelSpec};
use memfit_tensor::memory::FaultInjection;
use memfit_tensor::{Device, DeviceKind};
use memfit_train::cost::{CostModel, Costs};
use memfit_train::plan;
use memfit_train::planner::{dry_run, predict, segment_names, weigh, PlanRequest};
use memfit_train::samples::{Samples, TextWindows};
use memfit_train::trainer::RunOutcome;
use memfit_train::TrainError;
use memfit_train::{CheckpointChoice, RunOptions, Session};

fn text_spec(layers: usize, d_model: usize, max_t: usize) -> (memfit_data::TextCorpus, ModelSpec) {
    let text = memfit_data::load_embedded_text().expect("the embedded text");
    let spec = ModelSpec::gpt(GptConfig { vocab: text.vocab.len(), d_model, heads: 2, layers, max_t });
    (text, spec)
}

/// A run on a fresh session with `choice`; the outcome, the parameters and the session.
fn run_with(
    device: Device,
    spec: &ModelSpec,
    samples: &dyn Samples,
    opts: &RunOptions,
    choice: &CheckpointChoice,
) -> (RunOutcome, Vec<(String, Vec<f64>)>, Session) {
    let mut session = Session::new(device, spec, adamw(), 3).expect("session");
    session.set_checkpointing(choice).expect("segments");
    let outcome = session.run(samples, None, opts, &mut |_| {}).expect("run");
    let params = session.model.parameters().into_iter().map(|(n, t)| (n, t.to_f64_vec().unwrap())).collect();
    (outcome, params, session)
}

#[test]
fn checkpointed_training_ends_with_the_plain_parameters_bit_for_bit() {
    let (text, spec) = text_spec(3, 16, 12);
    let train = TextWindows::train(&text.train, spec.gpt.max_t);
    for micro in [12, 5] {
        let o = opts(12, micro, 3);
        let cpu = || device(DeviceKind::Cpu, None, None);
        let (plain, plain_params, _) = run_with(cpu(), &spec, &train, &o, &CheckpointChoice::None);
        for choice in [CheckpointChoice::All, CheckpointChoice::Segments(vec!["blocks.1".into()])] {
            let (ckpt, params, _) = run_with(cpu(), &spec, &train, &o, &choice);
            assert_eq!(ckpt.sample_log, plain.sample_log);
            assert_eq!(params, plain_params, "micro-batch {micro}, {choice:?}: parameters differ");
        }
    }
}

fn request(spec: &ModelSpec, effective: usize, capacity: Option<u64>, checkpoint: CheckpointChoice) -> PlanRequest {
    PlanRequest { checkpoint, ..plan_request(spec.clone(), effective, capacity) }
}

#[test]
fn checkpointing_lowers_the_peak_and_planned_checkpointed_runs_peak_as_predicted() {
    let (_, spec) = text_spec(4, 32, 32);
    let effective = 32;
    let plain =
        predict(&request(&spec, effective, None, CheckpointChoice::None), effective, None, None).unwrap().unwrap();
    let all = request(&spec, effective, None, CheckpointChoice::All);
    let ckpt = predict(&all, effective, None, None).unwrap().unwrap();
    assert!(ckpt.peak_allocated < plain.peak_allocated, "checkpointed {ckpt:?} vs plain {plain:?}");
    // A budget between the two: without checkpointing it needs accumulation, with it the whole batch fits.
    let capacity = (ckpt.peak_reserved + plain.peak_reserved) / 2;
    let plain_plan = plan(&request(&spec, effective, Some(capacity), CheckpointChoice::None)).unwrap();
    let req = request(&spec, effective, Some(capacity), CheckpointChoice::All);
    let ckpt_plan = plan(&req).unwrap();
    assert!(plain_plan.micro_batch < effective && ckpt_plan.micro_batch == effective, "{plain_plan:?} / {ckpt_plan:?}");
    let dev = device(DeviceKind::Cpu, Some(capacity), None);
    let mut session = Session::new(dev.clone(), &req.model, req.optimizer, req.seed).unwrap();
    session.set_checkpointing(&req.checkpoint).unwrap();
    let recoveries =
        dry_run(&req, ckpt_plan.micro_batch, ckpt_plan.eval_micro_batch).run(&mut session, true, true).unwrap();
    let stats = dev.stats();
    assert_eq!((stats.num_ooms, recoveries), (0, 0), "the planned run never ran out of memory");
    assert_eq!(stats.allocated_bytes.peak, ckpt_plan.predicted.peak_allocated);
    assert_eq!(stats.reserved_bytes.peak, ckpt_plan.predicted.peak_reserved);
}

#[test]
fn a_fault_at_every_allocation_of_a_checkpointed_run_loses_no_window() {
    let (text, spec) = text_spec(2, 8, 6);
    let train = TextWindows::train(&text.train, spec.gpt.max_t);
    let o = opts(4, 4, 2);
    let all = CheckpointChoice::All;
    let setup_requests = {
        let dev = device(DeviceKind::Cpu, None, None);
        drop(Session::new(dev.clone(), &spec, adamw(), 3).unwrap());
        dev.stats().allocation.allocated
    };
    let (clean, clean_params, clean_session) = run_with(device(DeviceKind::Cpu, None, None), &spec, &train, &o, &all);
    let clean_stats = clean_session.device.stats();
    let requests = clean_stats.allocation.allocated - setup_requests;
    for k in 1..=requests {
        let dev = device(DeviceKind::Cpu, None, Some(FaultInjection::Nth(setup_requests + k)));
        let (out, params, session) = run_with(dev, &spec, &train, &o, &all);
        let stats = session.device.stats();
        assert_eq!(stats.num_injected_faults, 1, "fault at request {k}");
        assert!(out.oom_recoveries >= 1, "fault at request {k} was recovered");
        assert_eq!(sorted(&out.sample_log), sorted(&clean.sample_log), "fault at request {k}: the same windows");
        assert_params_close(&params, &clean_params, 1e-5, &format!("fault at request {k}"));
        assert_eq!(stats.allocated_bytes.current, clean_stats.allocated_bytes.current, "fault {k}: nothing leaked");
    }
}

#[test]
fn an_unknown_segment_is_refused_with_the_model_s_segments() {
    let (_, spec) = text_spec(2, 8, 6);
    let session = Session::new(Device::meta(), &spec, adamw(), 3).unwrap();
    let err = session.set_checkpointing(&CheckpointChoice::parse("blocks.7").unwrap()).unwrap_err().to_string();
    assert!(err.contains("no segment \"blocks.7\"") && err.contains("blocks.0, blocks.1"), "{err}");
    let mlp = Session::new(Device::meta(), &small_spec(memfit_nn::ModelKind::Mlp), adamw(), 3).unwrap();
    assert!(mlp.set_checkpointing(&CheckpointChoice::All).is_err());
    assert!(mlp.set_checkpointing(&CheckpointChoice::None).unwrap().is_empty());
}

#[test]
fn when_micro_batch_one_does_not_fit_the_planner_names_checkpointing_if_it_does() {
    // A long context: activations dominate even at one sample.
    let (_, spec) = text_spec(4, 64, 512);
    let plain_one = predict(&request(&spec, 4, None, CheckpointChoice::None), 1, Some(1), None).unwrap().unwrap();
    let ckpt_one = predict(&request(&spec, 4, None, CheckpointChoice::All), 1, Some(1), None).unwrap().unwrap();
    assert!(ckpt_one.peak_reserved < plain_one.peak_reserved);
    let capacity = (ckpt_one.peak_reserved + plain_one.peak_reserved) / 2;
    // One step-time model for the doctor and the plan it is checked against (calibrating twice could
    // time the candidates differently).
    let request =
        |capacity, checkpoint| PlanRequest { costs: given_costs(4), ..request(&spec, 4, capacity, checkpoint) };
    let Err(TrainError::DoesNotFit(d)) = plan(&request(Some(capacity), CheckpointChoice::None)) else {
        panic!("micro-batch 1 without checkpointing does not fit")
    };
    assert!(d.problem.contains("even a micro-batch of 1 needs"), "{d}");
    let free = d.remedies.iter().find(|r| r.what.contains("let the planner choose")).expect("checkpointing offered");
    assert!(free.plan.contains("checkpointing") || free.plan.contains("every segment checkpointed"), "{d}");
    // The advice is a plan that fits, at the peak it names.
    let fitting = plan(&request(Some(capacity), CheckpointChoice::Auto)).unwrap();
    assert!(free.plan.starts_with(&memfit_train::planner::window_words(4, fitting.micro_batch)), "{d}");
    assert_eq!(free.predicted_peak_reserved_bytes, fitting.predicted.peak_reserved);
    assert!(fitting.predicted.peak_reserved <= capacity);
    // Below what checkpointing needs too, there is no such advice.
    let Err(TrainError::DoesNotFit(d)) = plan(&request(Some(ckpt_one.peak_reserved / 2), CheckpointChoice::None))
    else {
        panic!("half of what checkpointing needs does not fit")
    };
    assert!(d.remedies.iter().all(|r| !r.what.contains("let the planner choose")), "{d}");
}

#[test]
fn auto_checkpoints_only_what_the_budget_forces_and_the_plan_holds() {
    let (_, spec) = text_spec(4, 64, 512);
    let auto = |capacity| PlanRequest { costs: given_costs(4), ..request(&spec, 2, capacity, CheckpointChoice::Auto) };
    // An ample budget: no checkpointing.
    assert_eq!(plan(&auto(Some(1 << 30))).unwrap().checkpoint, CheckpointChoice::None);
    // Between what checkpointing everything and nothing need at micro-batch 1: a prefix of the blocks.
    let need =
        |c: CheckpointChoice| predict(&request(&spec, 2, None, c), 1, Some(1), None).unwrap().unwrap().peak_reserved;
    let (plain, all) = (need(CheckpointChoice::None), need(CheckpointChoice::All));
    let capacity = all + (plain - all) / 3;
    let req = auto(Some(capacity));
    let chosen = plan(&req).unwrap();
    assert_ne!(chosen.checkpoint, CheckpointChoice::None, "nothing checkpointed does not fit");
    assert!(!chosen.candidates[0].fits(), "{:?}", chosen.candidates);
    // The fastest candidate that fits: recomputing costs time, so no more than that.
    let best = chosen.candidates.iter().filter(|c| c.fits()).map(|c| c.step_ms).fold(f64::INFINITY, f64::min);
    assert_eq!(chosen.predicted_step_ms, Some(best));
    // The planned run on cpu with that budget never runs out of memory and peaks as predicted.
    assert_plan_holds_on_cpu(&req, &chosen, capacity);
    // Below what checkpointing everything needs, the error says so.
    let err = plan(&auto(Some(all / 2))).unwrap_err().to_string();
    assert!(err.contains("with every segment checkpointed needs"), "{err}");
}

/// A step-time model for planner tests: fixed work per micro-batch, so larger micro-batches run
/// faster per sample; recomputing every block adds 35%; the blocks cost the same.
fn given_costs(segments: usize) -> Costs {
    Costs::Given(CostModel {
        micro: vec![1, 4, 16],
        plain_ms: vec![10.0, 16.0, 40.0],
        recompute: 0.35,
        optimizer_ms: 2.0,
        half_overhead: 0.1,
        bf16_overhead: None,
        segments: (0..segments).map(|i| (format!("blocks.{i}"), 1.0 / segments as f64)).collect(),
        calibration_ms: 0.0,
        nominal: false,
        sample_rounds: 0,
    })
}

/// Issue 10: which segments to checkpoint is an optimisation. Over budgets from what checkpointing
/// every block needs at micro-batch 1 to what the whole batch needs plainly, the plan is the fastest
/// candidate that fits, and at some mid budget it is strictly faster than checkpointing every block
/// and than checkpointing sqrt(n) = 2 of the 4; that plan, run on cpu, fits and peaks as predicted.
#[test]
fn at_a_mid_budget_the_chosen_checkpointing_beats_all_and_sqrt_n_and_holds_on_cpu() {
    let (_, spec) = text_spec(4, 64, 128);
    let effective = 32;
    let with =
        |capacity, checkpoint| PlanRequest { costs: given_costs(4), ..request(&spec, effective, capacity, checkpoint) };
    let training = |c: CheckpointChoice, m| predict(&with(None, c), m, None, None).unwrap().unwrap().peak_reserved;
    let (low, high) = (training(CheckpointChoice::All, 1), training(CheckpointChoice::None, effective));
    let mut beaten = None;
    for i in 1..16u64 {
        let capacity = low + (high - low) * i / 16;
        let chosen = plan(&with(Some(capacity), CheckpointChoice::Auto)).unwrap();
        assert_eq!(chosen.candidates.len(), 5, "none, then 1 to 4 blocks");
        let fitting: Vec<_> = chosen.candidates.iter().filter(|c| c.fits()).collect();
        let best = fitting.iter().map(|c| c.step_ms).fold(f64::INFINITY, f64::min);
        assert_eq!(chosen.predicted_step_ms, Some(best), "budget {capacity}: the fastest candidate is chosen");
        assert!(chosen.training.peak_reserved <= capacity && chosen.predicted.peak_reserved <= capacity);
        let (all, sqrt) = (&chosen.candidates[4], &chosen.candidates[2]);
        if all.fits() && sqrt.fits() && best < all.step_ms && best < sqrt.step_ms && beaten.is_none() {
            beaten = Some((capacity, chosen));
        }
    }
    let (capacity, chosen) = beaten.expect("a budget where the choice beats both fixed rules");
    assert_plan_holds_on_cpu(&with(Some(capacity), CheckpointChoice::Auto), &chosen, capacity);
}

/// Note [Planning on every core]: the candidates weighed at once on rayon's pool are those one
/// thread weighs, in the same order, with the same count of dry runs, at a budget where some fit
/// and some do not.
#[test]
fn weighing_on_every_core_is_weighing_one_at_a_time() {
    // The budget of `auto_checkpoints_only_what_the_budget_forces_and_the_plan_holds`: nothing
    // checkpointed does not fit, more does.
    let (_, spec) = text_spec(4, 64, 512);
    let with = |capacity, checkpoint| PlanRequest { costs: given_costs(4), ..request(&spec, 2, capacity, checkpoint) };
    let need = |c| predict(&with(None, c), 1, Some(1), None).unwrap().unwrap().peak_reserved;
    let (all, none) = (need(CheckpointChoice::All), need(CheckpointChoice::None));
    let req = with(Some(all + (none - all) / 3), CheckpointChoice::Auto);
    let names = segment_names(&req).unwrap();
    let weigh_on = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| weigh(&req, &names).unwrap())
    };
    let (one, many) = (weigh_on(1), weigh_on(4));
    assert_eq!(one.candidates, many.candidates);
    assert_eq!(one.dry_runs, many.dry_runs);
    assert_eq!(one.candidates.len(), 5, "none, then 1 to 4 blocks");
    assert!(
        one.candidates.iter().any(|c| c.fits()) && one.candidates.iter().any(|c| !c.fits()),
        "{:?}",
        one.candidates
    );
    // The count: the lone segments' peaks (and none's), then every candidate's own dry runs.
    assert!(one.dry_runs > names.len() + 1 + one.candidates.len(), "{}", one.dry_runs);
}

/// The out-of-memory doctor: when a request does not fit, the diagnosis lists remedies, those that keep
/// the numbers first and each group fastest first, each with the flags that apply it; every listed
/// remedy fits when applied, at the peak it names.
#[test]
fn the_doctor_lists_remedies_that_fit_when_applied() {
    let (_, spec) = text_spec(4, 64, 512);
    let with = |capacity, checkpoint| PlanRequest { costs: given_costs(4), ..request(&spec, 4, capacity, checkpoint) };
    let need = |c| predict(&with(None, c), 1, Some(1), None).unwrap().unwrap().peak_reserved;
    let capacity = (need(CheckpointChoice::All) + need(CheckpointChoice::None)) / 2;
    let asked = PlanRequest { micro_batch: Some(1), ..with(Some(capacity), CheckpointChoice::None) };
    let Err(TrainError::DoesNotFit(d)) = plan(&asked) else { panic!("it does not fit") };
    assert!(d.remedies.len() >= 2, "the planner's choice and a budget: {d}");
    let mut last = (false, false, 0.0);
    for r in &d.remedies {
        let mut applied = asked.clone();
        for (flag, value) in &r.flags {
            match (flag.as_str(), value.as_deref()) {
                ("--memory", Some(m)) => applied.capacity = Some(memfit_tensor::memory::parse_bytes(m).unwrap()),
                ("--checkpoint", Some(c)) => applied.checkpoint = CheckpointChoice::parse(c).unwrap(),
                ("--micro-batch", None) => applied.micro_batch = None,
                ("--precision", Some(p)) => applied.precision = memfit_train::Precision::parse(p).unwrap(),
                ("--optimizer-state", Some(f)) => {
                    applied.optimizer = applied.optimizer.with_state_format(memfit_nn::StateFormat::parse(f).unwrap())
                }
                ("--segments", Some(s)) => applied.segments = memfit_train::Segments::parse(s).unwrap(),
                ("--parallel", Some("zero1")) => {
                    applied.parallel = Some((memfit_train::parallel::ParallelMode::Zero1, r.ranks))
                }
                ("--parallel", Some("pipeline")) => continue,
                other => panic!("unexpected flag {other:?}: {d}"),
            }
        }
        if r.flags.iter().any(|(f, v)| f == "--parallel" && v.as_deref() == Some("pipeline")) {
            continue;
        }
        let p = plan(&applied).unwrap_or_else(|e| panic!("`{}` does not fit: {e}", r.command));
        assert_eq!(p.predicted.peak_reserved, r.predicted_peak_reserved_bytes, "{}", r.what);
        let key = (r.changes_numbers, r.unavailable.is_some(), r.predicted_step_time_ms.unwrap_or(f64::INFINITY));
        assert!((key.0, key.1) > (last.0, last.1) || key.2 >= last.2, "ordered: {d}");
        last = key;
    }
}

/// Calibration measures real steps: times grow with the micro-batch, the segments' shares add up to
/// one, and a cached model is reused, not measured again.
#[test]
fn calibration_measures_this_machine_and_is_cached() {
    let (_, spec) = text_spec(2, 16, 16);
    let req = request(&spec, 16, Some(1 << 30), CheckpointChoice::Auto);
    let names = vec!["blocks.0".to_string(), "blocks.1".to_string()];
    let model = memfit_train::calibration::calibrate(&req, &names).unwrap();
    assert_eq!(model.micro[0], 1);
    assert!(model.micro.windows(2).all(|w| w[0] < w[1]) && *model.micro.last().unwrap() <= 16, "{model:?}");
    assert!(model.plain_ms.iter().all(|&t| t > 0.0), "{model:?}");
    assert!(model.recompute >= 0.0 && model.optimizer_ms >= 0.0, "{model:?}");
    let shares: f64 = model.segments.values().sum();
    assert!((shares - 1.0).abs() < 1e-9 && model.segments.len() == 2, "{model:?}");
    assert!(model.step_ms(16, 4, &names) > model.step_ms(16, 4, &[]) || model.recompute == 0.0);

    let path = std::env::temp_dir().join(format!("memfit-costs-{}/costs.json", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let cached = PlanRequest { costs: Costs::Cached(path.clone()), ..req.clone() };
    let (first, measured) = memfit_train::calibration::model_for(&cached, &names).unwrap();
    assert!(measured && path.exists(), "the model is measured and kept");
    let second = memfit_train::calibration::model_for(&cached, &names).unwrap();
    assert_eq!(second, (first.clone(), false), "the second plan reads the cache");
    let other = PlanRequest { costs: Costs::Cached(path.clone()), seed: 9, ..req };
    let third = memfit_train::calibration::model_for(&other, &names).unwrap();
    assert_eq!(third, (first, false), "the seed does not change the key");
}

#[test]
fn a_cost_cache_entry_of_another_build_is_measured_again_and_a_pinned_one_is_read() {
    let spec = small_spec(memfit_nn::ModelKind::SimpleCnn);
    let names = vec!["conv1".to_string()];
    let dir = std::env::temp_dir().join(format!("memfit-costs-builds-{}", std::process::id()));
    let path = dir.join("costs.json");
    let _ = std::fs::remove_dir_all(&dir);
    let req = PlanRequest { costs: Costs::Cached(path.clone()), ..plan_request(spec, 8, None) };
    let (measured, fresh) = memfit_train::calibration::model_for(&req, &names).unwrap();
    assert!(fresh);
    let cache: std::collections::BTreeMap<String, serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let (key, _) = cache.iter().next().unwrap();
    let base = key.split(" | build ").next().unwrap().to_string();
    assert!(key.len() > base.len(), "the entry names its build: {key}");
    // The same entry under another build's name (an older binary's) is not read, and is replaced.
    let mut model = serde_json::to_value(&measured).unwrap();
    model["optimizer_ms"] = serde_json::json!(123456.0);
    let other = serde_json::json!({ format!("{base} | build 1 B 2 ns"): model.clone() });
    std::fs::write(&path, other.to_string()).unwrap();
    let (again, fresh) = memfit_train::calibration::model_for(&req, &names).unwrap();
    assert!(fresh && again.optimizer_ms != 123456.0, "measured again");
    let kept: std::collections::BTreeMap<String, serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(kept.len(), 1, "the other build's entry is gone: {:?}", kept.keys());
    // A pinned entry is read by every build.
    let pinned = serde_json::json!({ format!("{base} | pinned"): model });
    std::fs::write(&path, pinned.to_string()).unwrap();
    let (read, fresh) = memfit_train::calibration::model_for(&req, &names).unwrap();
    assert!(!fresh && read.optimizer_ms == 123456.0, "the pinned entry");
}
