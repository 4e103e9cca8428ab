//! Temporary timing probe (deleted after use).
use memfit_nn::models::GptConfig;
use memfit_nn::{build_model, ModelKind, ModelSpec};
use memfit_tensor::{autograd::backward, ops::cross_entropy, Category, DType, Device, Tensor};
#[test]
fn timing() {
    let cases: Vec<(ModelSpec, Vec<usize>)> = vec![
        (ModelSpec::image(ModelKind::Mlp, [1, 28, 28], 10), vec![256, 1, 28, 28]),
        (ModelSpec::image(ModelKind::SimpleCnn, [1, 28, 28], 10), vec![128, 1, 28, 28]),
        (ModelSpec::image(ModelKind::DeepCnn, [3, 64, 64], 10), vec![64, 3, 64, 64]),
        (ModelSpec::image(ModelKind::ResNet, [3, 32, 32], 10), vec![128, 3, 32, 32]),
        (ModelSpec { kind: ModelKind::Gpt, input: [0; 3], num_classes: 0, gpt: GptConfig::default() }, vec![32, 128]),
    ];
    for (spec, shape) in cases {
        let dev = Device::cpu();
        let m = build_model(&spec, &dev, 0).unwrap();
        let gpt = spec.kind == ModelKind::Gpt;
        let x = if gpt { Tensor::zeros(&dev, &shape, DType::I64, Category::Input).unwrap() } else { Tensor::full(&dev, &shape, 0.5, DType::F32, Category::Input).unwrap() };
        let y = Tensor::zeros(&dev, if gpt { &shape[..] } else { &shape[..1] }, DType::I64, Category::Input).unwrap();
        for it in 0..3 {
            let t0 = std::time::Instant::now();
            let logits = m.forward(&x, true).unwrap();
            let c = *logits.shape().last().unwrap() as isize;
            let loss = cross_entropy(&logits.reshape(&[-1, c]).unwrap(), &y.reshape(&[-1]).unwrap(), 0.0).unwrap();
            let t1 = t0.elapsed();
            backward(&loss).unwrap();
            for (_, p) in m.parameters() { p.set_grad(None); }
            if it == 2 { println!("{:10} fwd {:>7.1} ms  fwd+bwd {:>7.1} ms  peak {:.1} MiB", spec.kind.name(), t1.as_secs_f64()*1e3, t0.elapsed().as_secs_f64()*1e3, dev.stats().requested_bytes.peak as f64 / 1048576.0); }
        }
    }
}
