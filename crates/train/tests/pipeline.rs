//! Pipeline stages without MPI (Note [Pipeline] in `train/src/pipeline.rs`): a GPT's stages compose
//! to the whole model, a one-stage pipeline (GPipe rounds, loss weights, retries) trains like the plain
//! loop and allocates on `meta` exactly as on `cpu`, and the planner's cut fits every stage. Real
//! multi-rank pipelines: `cli/tests/mpi.rs`.

mod common;
use common::*;
use memfit_dist::{Simulated, Solo};
use memfit_nn::{build_model, build_stage, stage_units};
use memfit_tensor::{Category, DType, DeviceKind, Tensor};
use memfit_train::samples::synthetic;
use memfit_train::{PlanRequest, Session};
use std::sync::Arc;

fn tokens(dev: &memfit_tensor::Device, b: usize, t: usize) -> Tensor {
    let ids: Vec<i64> = (0..b * t).map(|i| (i * 7 % 20) as i64).collect();
    Tensor::from_slice(dev, &ids, &[b, t], Category::Input).unwrap()
}

#[test]
fn a_gpt_cut_into_stages_is_the_whole_gpt() {
    let spec = tiny_gpt(20);
    let units = stage_units(&spec).unwrap();
    assert_eq!(units, spec.gpt.layers + 2);
    let dev = device(DeviceKind::Cpu, None, None);
    let whole = build_model(&spec, &dev, 5).unwrap();
    let x = tokens(&dev, 3, spec.gpt.max_t);
    let want = whole.forward(&x, false).unwrap().to_vec::<f32>().unwrap();
    for cut in 1..units {
        let (a, b) = (build_stage(&spec, &dev, 5, 0..cut).unwrap(), build_stage(&spec, &dev, 5, cut..units).unwrap());
        let got = b.forward(&a.forward(&x, false).unwrap(), false).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(got, want, "cut after unit {cut}");
        // The stages hold the whole model's parameters once, with its names and values.
        let mut names: Vec<String> = a.parameters().into_iter().chain(b.parameters()).map(|(n, _)| n).collect();
        let mut all: Vec<String> = whole.parameters().into_iter().map(|(n, _)| n).collect();
        names.sort();
        all.sort();
        assert_eq!(names, all, "cut after unit {cut}");
    }
    assert!(build_stage(&spec, &dev, 5, 2..2).is_err());
    assert!(build_stage(&small_spec(memfit_nn::ModelKind::Mlp), &dev, 5, 0..1).is_err());
    let wrong = Tensor::zeros(&dev, &[2, 3], DType::F32, Category::Input).unwrap();
    let err = build_stage(&spec, &dev, 5, 1..units).unwrap().forward(&wrong, false).unwrap_err();
    assert!(err.to_string().contains("residual stream"), "{err}");
}

#[test]
fn a_one_stage_pipeline_trains_like_the_plain_loop_and_meta_predicts_it() {
    let spec = tiny_gpt(20);
    let units = stage_units(&spec).unwrap();
    let samples = synthetic(&spec, 40, 3);
    let o = opts(10, 3, 3);
    let (_, plain, _) = run(device(DeviceKind::Cpu, None, None), &spec, sgd(), samples.as_ref(), &o);
    let mut devices = Vec::new();
    for (kind, group) in [
        (DeviceKind::Cpu, Arc::new(Solo) as Arc<dyn memfit_dist::Group>),
        (DeviceKind::META, Arc::new(Simulated { rank: 0, size: 1 })),
    ] {
        let dev = device(kind, None, None);
        let mut s = Session::new_stage(dev.clone(), &spec, sgd(), 3, group, vec![0..units]).unwrap();
        let out = s.run(samples.as_ref(), Some(synthetic(&spec, 7, 4).as_ref()), &o, &mut |_| {}).unwrap();
        assert_eq!(out.steps, 3);
        if kind == DeviceKind::Cpu {
            let params: Vec<(String, Vec<f64>)> =
                s.model.parameters().into_iter().map(|(n, t)| (n, t.to_f64_vec().unwrap())).collect();
            // The same gradients, summed in another order (a round back-propagates in reverse).
            assert_params_close(&params, &plain, 1e-5, "one-stage pipeline vs plain");
            assert!(out.eval.unwrap().loss.is_some());
        }
        devices.push(dev);
    }
    assert_eq!(devices[0].timeline_events(), devices[1].timeline_events());
    assert_eq!(devices[0].stats(), devices[1].stats());
}

#[test]
fn the_planner_cuts_where_every_stage_fits_a_budget_the_whole_model_does_not() {
    let spec =
        memfit_nn::ModelSpec::gpt(memfit_nn::GptConfig { vocab: 40, d_model: 128, heads: 2, layers: 4, max_t: 32 });
    let request = |capacity| PlanRequest {
        seed: 1,
        checkpoint: memfit_train::CheckpointChoice::None,
        ..plan_request(spec.clone(), 16, capacity)
    };
    let whole = memfit_train::planner::predict(&request(None), 1, Some(1), None).unwrap().unwrap().peak_reserved;
    let budget = whole * 3 / 4;
    assert!(memfit_train::plan(&request(Some(budget))).is_err(), "the whole model does not fit {budget}");
    let plan = memfit_train::stages::plan_stages(&request(Some(budget)), 2, None).unwrap();
    assert_eq!(plan.stages.len(), 2);
    assert_eq!((plan.stages[0].start, plan.stages[0].end), (0, plan.stages[1].start));
    assert_eq!(plan.stages[1].end, stage_units(&spec).unwrap());
    for p in &plan.per_stage {
        assert!(p.peak_reserved <= budget, "{} > {budget}", p.peak_reserved);
    }
    assert!(plan.micro_batch >= 1);
    // Equal shares without a cost model: the most even cut of 6 units is 3 + 3.
    assert_eq!(plan.stages[0], 0..3);
    let err = memfit_train::stages::plan_stages(&request(Some(1 << 20)), 2, None).unwrap_err();
    assert!(err.to_string().contains("no cut of gpt into 2 stages fits"), "{err}");
    assert!(memfit_train::stages::plan_stages(&request(None), 7, None).is_err(), "6 units, 7 stages");
}

/// `auto` checkpointing and segments for a pipeline: a stage re-runs its blocks only where no cut fits
/// without, and the plan says what it took; its peaks are below the budget either way.
#[test]
fn auto_stages_checkpoint_their_blocks_only_where_nothing_else_fits() {
    use memfit_train::{CheckpointChoice, Segments};
    let spec =
        memfit_nn::ModelSpec::gpt(memfit_nn::GptConfig { vocab: 40, d_model: 64, heads: 2, layers: 4, max_t: 64 });
    let request = |capacity, checkpoint, segments| PlanRequest {
        model: spec.clone(),
        optimizer: adamw(),
        effective_batch: 16,
        capacity,
        safety_margin: 0.0,
        seed: 1,
        checkpoint,
        costs: Default::default(),
        micro_batch: Some(4),
        precision: Default::default(),
        parallel: None,
        target: memfit_tensor::Target::Cpu,
        segments,
        evaluate: true,
        optimizer_step: Default::default(),
        last_window: None,
    };
    let peak = |checkpoint| {
        let plan = memfit_train::stages::plan_stages(&request(None, checkpoint, Segments::Fixed), 2, None).unwrap();
        plan.per_stage.iter().map(|p| p.peak_reserved).max().unwrap()
    };
    let (plain, recomputed) = (peak(CheckpointChoice::None), peak(CheckpointChoice::All));
    assert!(recomputed < plain, "checkpointing a stage's blocks saves memory: {recomputed} vs {plain}");
    // Room for the plain stages: nothing is re-run.
    let roomy =
        memfit_train::stages::plan_stages(&request(Some(plain), CheckpointChoice::Auto, Segments::Auto), 2, None)
            .unwrap();
    assert_eq!((roomy.checkpoint.clone(), roomy.segments), (CheckpointChoice::None, Segments::Fixed));
    // Room only for checkpointed stages: they re-run their blocks.
    let tight =
        memfit_train::stages::plan_stages(&request(Some(recomputed), CheckpointChoice::Auto, Segments::Fixed), 2, None)
            .unwrap();
    assert_eq!(tight.checkpoint, CheckpointChoice::All);
    assert!(tight.per_stage.iter().all(|p| p.peak_reserved <= recomputed));
}
