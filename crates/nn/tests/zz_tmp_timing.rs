//! Temporary timing probe (deleted after use).
use memfit_tensor::{autograd::backward, ops, Category, DType, Device, Tensor};
fn t(name: &str, f: impl Fn()) { f(); let t0 = std::time::Instant::now(); for _ in 0..3 { f(); } println!("{name:30} {:>8.1} ms", t0.elapsed().as_secs_f64() * 1e3 / 3.0); }
#[test]
fn timing() {
    let dev = Device::cpu();
    let p = |s: &[usize]| Tensor::full(&dev, s, 0.01, DType::F32, Category::Parameter).unwrap().set_requires_grad(true);
    let x = p(&[32, 128, 256]);
    let w = p(&[768, 256]); let b = p(&[768]);
    let w4 = p(&[1024, 256]); let b4 = p(&[1024]);
    let q = p(&[32, 4, 128, 64]);
    let mask = Tensor::zeros(&dev, &[128, 128], DType::Bool, Category::Other).unwrap();
    let lw = p(&[256]);
    t("linear 256->768 fwd", || { ops::linear(&x, &w, Some(&b)).unwrap(); });
    t("linear 256->768 fwd+bwd", || { let y = ops::linear(&x, &w, Some(&b)).unwrap(); backward(&y.sum_all().unwrap()).unwrap(); });
    t("linear 256->1024 fwd+bwd", || { let y = ops::linear(&x, &w4, Some(&b4)).unwrap(); backward(&y.sum_all().unwrap()).unwrap(); });
    t("sdpa mask fwd", || { ops::scaled_dot_product_attention(&q, &q, &q, false, Some(&mask)).unwrap(); });
    t("sdpa mask fwd+bwd", || { let y = ops::scaled_dot_product_attention(&q, &q, &q, false, Some(&mask)).unwrap(); backward(&y.sum_all().unwrap()).unwrap(); });
    t("sdpa causal fwd+bwd", || { let y = ops::scaled_dot_product_attention(&q, &q, &q, true, None).unwrap(); backward(&y.sum_all().unwrap()).unwrap(); });
    t("layer_norm fwd+bwd", || { let y = ops::layer_norm(&x, &[256], Some(&lw), Some(&lw), 1e-5).unwrap(); backward(&y.sum_all().unwrap()).unwrap(); });
    t("gelu fwd+bwd [32,128,1024]", || { let h = p(&[32,128,1024]); let y = h.gelu().unwrap(); backward(&y.sum_all().unwrap()).unwrap(); });
    t("permute+contiguous qkv", || { let y = x.reshape(&[32,128,4,64]).unwrap().permute(&[0,2,1,3]).unwrap().contiguous().unwrap(); backward(&y.sum_all().unwrap()).unwrap(); });
}
