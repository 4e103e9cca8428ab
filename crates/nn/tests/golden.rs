//! Golden tests: runs every case of `manifest.json` (PyTorch reference values, see
//! `tests/golden/README.md`) against memfit's ops, optimizers, GradScaler, casts and models, and
//! compares with the manifest's tolerances.
//!
//! The data comes from `tests/golden/` next to this file, or from the directory named by the
//! environment variable `MEMFIT_GOLDEN_DIR` (same format, possibly other cases). Every case counts:
//! an op this runner does not know, an attribute value it cannot honour, an error or a panic is a
//! failure, never a skip. Each failed case prints one line naming the case, the first mismatching
//! tensor and its worst element; then one summary line `golden: N cases checked, M failed`, and the
//! test fails when M > 0.
//!
//! Comparison rule (per tensor): `|got - ref| <= rtol*|ref| + atol` with
//! `atol = atol_rel_to_max * max|ref|` over that tensor's finite values; integer and bool tensors
//! are exact; non-finite reference values must be matched exactly; casts compare bits.

use memfit_nn::amp::{GradScaler, GradScalerConfig};
use memfit_nn::models::GptConfig;
use memfit_nn::{build_model, Model, ModelKind, ModelSpec, Optimizer, OptimizerConfig};
use memfit_tensor::autograd::{backward, backward_with};
use memfit_tensor::ops::{self, Conv2dParams, Pool2dParams};
use memfit_tensor::{Category, DType, Device, DeviceConfig, DeviceKind, Tensor};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use std::collections::HashMap;
use std::fmt::Display;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

type Res<T> = Result<T, String>;

/// Turns any error into the failure message of a case, with what was being done.
trait Ctx<T> {
    fn ctx(self, what: &str) -> Res<T>;
}

impl<T, E: Display> Ctx<T> for Result<T, E> {
    fn ctx(self, what: &str) -> Res<T> {
        self.map_err(|e| format!("{what}: {e}"))
    }
}

// ---------------------------------------------------------------------------------------------
// Reference data
// ---------------------------------------------------------------------------------------------

/// One tensor of a golden file, as stored.
#[derive(Clone)]
struct RefTensor {
    key: String,
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl RefTensor {
    fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    fn is_exact_kind(&self) -> bool {
        matches!(self.dtype, Dtype::I64 | Dtype::BOOL)
    }

    fn f32s(&self) -> Vec<f32> {
        self.bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
    }

    fn f64s(&self) -> Vec<f64> {
        self.bytes.chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes"))).collect()
    }

    fn i64s(&self) -> Vec<i64> {
        self.bytes.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes"))).collect()
    }

    fn u16s(&self) -> Vec<u16> {
        self.bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect()
    }

    fn bools(&self) -> Vec<bool> {
        self.bytes.iter().map(|&b| b != 0).collect()
    }

    /// Values as f64 (exact for every stored dtype except i64 beyond 2^53, which the data never has).
    fn values(&self) -> Res<Vec<f64>> {
        Ok(match self.dtype {
            Dtype::F32 => self.f32s().into_iter().map(f64::from).collect(),
            Dtype::F64 => self.f64s(),
            Dtype::I64 => self.i64s().into_iter().map(|v| v as f64).collect(),
            Dtype::F16 => self.u16s().into_iter().map(|b| half::f16::from_bits(b).to_f64()).collect(),
            Dtype::BF16 => self.u16s().into_iter().map(|b| half::bf16::from_bits(b).to_f64()).collect(),
            Dtype::BOOL => self.bools().into_iter().map(|b| if b { 1.0 } else { 0.0 }).collect(),
            other => return Err(format!("{}: unsupported stored dtype {other:?}", self.key)),
        })
    }

    fn memfit_dtype(&self) -> Res<DType> {
        Ok(match self.dtype {
            Dtype::F32 => DType::F32,
            Dtype::F64 => DType::F64,
            Dtype::I64 => DType::I64,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            Dtype::BOOL => DType::Bool,
            other => return Err(format!("{}: unsupported stored dtype {other:?}", self.key)),
        })
    }

    /// A new tensor holding these values.
    fn to_tensor(&self, device: &Device, category: Category) -> Res<Tensor> {
        let s = &self.shape;
        let what = format!("loading {}", self.key);
        match self.dtype {
            Dtype::F32 => Tensor::from_slice(device, &self.f32s(), s, category).ctx(&what),
            Dtype::F64 => Tensor::from_slice(device, &self.f64s(), s, category).ctx(&what),
            Dtype::I64 => Tensor::from_slice(device, &self.i64s(), s, category).ctx(&what),
            Dtype::F16 => {
                let v: Vec<half::f16> = self.u16s().into_iter().map(half::f16::from_bits).collect();
                Tensor::from_slice(device, &v, s, category).ctx(&what)
            }
            Dtype::BF16 => {
                let v: Vec<half::bf16> = self.u16s().into_iter().map(half::bf16::from_bits).collect();
                Tensor::from_slice(device, &v, s, category).ctx(&what)
            }
            Dtype::BOOL => Tensor::from_slice(device, &self.bools(), s, category).ctx(&what),
            other => Err(format!("{}: unsupported stored dtype {other:?}", self.key)),
        }
    }
}

/// The golden directory: the manifest and the tensors of its files (loaded on first use).
struct Golden {
    dir: PathBuf,
    files: HashMap<String, HashMap<String, RefTensor>>,
}

impl Golden {
    fn new(dir: PathBuf) -> Self {
        Golden { dir, files: HashMap::new() }
    }

    fn load_file(&mut self, file: &str) -> Res<&HashMap<String, RefTensor>> {
        if !self.files.contains_key(file) {
            let path = self.dir.join(file);
            let bytes = std::fs::read(&path).ctx(&format!("reading {}", path.display()))?;
            let st = SafeTensors::deserialize(&bytes).ctx(&format!("parsing {}", path.display()))?;
            let mut map = HashMap::new();
            for (name, view) in st.tensors() {
                let t = RefTensor {
                    key: name.clone(),
                    dtype: view.dtype(),
                    shape: view.shape().to_vec(),
                    bytes: view.data().to_vec(),
                };
                map.insert(name, t);
            }
            self.files.insert(file.to_string(), map);
        }
        Ok(&self.files[file])
    }

    fn tensor(&mut self, file: &str, key: &str) -> Res<RefTensor> {
        let map = self.load_file(file)?;
        let t = map.get(key).ok_or_else(|| format!("{file} has no tensor {key}"))?;
        Ok(t.clone())
    }
}

// ---------------------------------------------------------------------------------------------
// Manifest access
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
struct Tol {
    rtol: f64,
    atol_rel_to_max: f64,
    /// Bit-exact comparison (casts).
    bits: bool,
}

/// One entry of a case's `tensors[]`, with the stored data.
struct Entry {
    json: Value,
    local: String,
    data: RefTensor,
}

impl Entry {
    fn role(&self) -> &str {
        self.json["role"].as_str().unwrap_or("")
    }
    fn str_field(&self, field: &str) -> Option<&str> {
        self.json.get(field).and_then(Value::as_str)
    }
    fn step(&self) -> Option<u64> {
        self.json.get("step").and_then(Value::as_u64)
    }
    fn requires_grad(&self) -> bool {
        self.json.get("requires_grad").and_then(Value::as_bool).unwrap_or(false)
    }
}

struct Case {
    name: String,
    op: String,
    attrs: Value,
    tol: Tol,
    entries: Vec<Entry>,
}

impl Case {
    fn load(golden: &mut Golden, json: &Value, tolerances: &Value) -> Res<Case> {
        let name = json["name"].as_str().ok_or("a case without a name")?.to_string();
        let op = json["op"].as_str().ok_or("no op")?.to_string();
        let file = json["file"].as_str().ok_or("no file")?;
        let tol_key = json["tolerance"].as_str().ok_or("no tolerance")?;
        let tol_json = tolerances.get(tol_key).ok_or_else(|| format!("unknown tolerance {tol_key}"))?;
        let rtol = tol_json["rtol"].as_f64().ok_or("tolerance without rtol")?;
        let atol_rel_to_max = tol_json.get("atol_rel_to_max").and_then(Value::as_f64).unwrap_or(rtol);
        let tol = Tol { rtol, atol_rel_to_max, bits: tol_key == "exact" };
        let mut entries = Vec::new();
        for t in json["tensors"].as_array().ok_or("no tensors")? {
            let key = t["key"].as_str().ok_or("a tensor without a key")?;
            let local = key.strip_prefix(&format!("{name}/")).unwrap_or(key).to_string();
            let data = golden.tensor(file, key)?;
            if let Some(shape) = t.get("shape").and_then(Value::as_array) {
                let want: Vec<usize> = shape.iter().filter_map(Value::as_u64).map(|v| v as usize).collect();
                if want != data.shape {
                    return Err(format!("{key}: manifest shape {want:?} but stored {:?}", data.shape));
                }
            }
            entries.push(Entry { json: t.clone(), local, data });
        }
        Ok(Case { name, op, attrs: json.get("attrs").cloned().unwrap_or(Value::Null), tol, entries })
    }

    fn with_role<'a>(&'a self, role: &'a str) -> impl Iterator<Item = &'a Entry> + 'a {
        self.entries.iter().filter(move |e| e.role() == role)
    }

    fn entry(&self, local: &str) -> Res<&Entry> {
        self.entries.iter().find(|e| e.local == local).ok_or_else(|| format!("case has no tensor {local}"))
    }

    /// The single entry with `role` (and no `arg`), e.g. a model's input.
    fn only<'a>(&'a self, role: &'a str) -> Res<&'a Entry> {
        let mut it = self.with_role(role);
        let first = it.next().ok_or_else(|| format!("case has no {role} tensor"))?;
        if it.next().is_some() {
            return Err(format!("case has several {role} tensors"));
        }
        Ok(first)
    }

    fn attr(&self, key: &str) -> Res<&Value> {
        self.attrs.get(key).ok_or_else(|| format!("attribute {key} missing"))
    }

    fn attr_or_null(&self, key: &str) -> &Value {
        self.attrs.get(key).unwrap_or(&Value::Null)
    }
}

fn as_f64(v: &Value, what: &str) -> Res<f64> {
    v.as_f64().ok_or_else(|| format!("attribute {what} = {v} is not a number"))
}

fn as_bool(v: &Value, what: &str) -> Res<bool> {
    v.as_bool().ok_or_else(|| format!("attribute {what} = {v} is not a bool"))
}

fn as_usize(v: &Value, what: &str) -> Res<usize> {
    v.as_u64().map(|x| x as usize).ok_or_else(|| format!("attribute {what} = {v} is not a count"))
}

fn as_isize(v: &Value, what: &str) -> Res<isize> {
    v.as_i64().map(|x| x as isize).ok_or_else(|| format!("attribute {what} = {v} is not an integer"))
}

/// `[h, w]` from a list of two or a single integer (as PyTorch accepts).
fn as_pair(v: &Value, what: &str) -> Res<[usize; 2]> {
    if let Some(n) = v.as_u64() {
        return Ok([n as usize, n as usize]);
    }
    match v.as_array().map(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<_>>>()) {
        Some(Some(a)) if a.len() == 2 => Ok([a[0] as usize, a[1] as usize]),
        Some(Some(a)) if a.len() == 1 => Ok([a[0] as usize, a[0] as usize]),
        _ => Err(format!("attribute {what} = {v} is not an [h, w] pair")),
    }
}

fn unsupported(what: impl Display) -> String {
    format!("unsupported: {what}")
}

// ---------------------------------------------------------------------------------------------
// Comparison
// ---------------------------------------------------------------------------------------------

/// Collects the mismatches of one case.
#[derive(Default)]
struct Check {
    failures: Vec<(String, String)>,
}

fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut index = vec![0; shape.len()];
    for (i, &d) in shape.iter().enumerate().rev() {
        if d > 0 {
            index[i] = flat % d;
            flat /= d;
        }
    }
    index
}

impl Check {
    fn fail(&mut self, tensor: &str, msg: impl Into<String>) {
        self.failures.push((tensor.to_string(), msg.into()));
    }

    /// Compares values against a reference under `tol` (exact for integer/bool references).
    fn values(&mut self, name: &str, r: &RefTensor, shape: &[usize], got: &[f64], tol: Tol) {
        self.values_with_slack(name, r, shape, got, tol, &[]);
    }

    /// `values`, with `slack[i]` added to element i's allowance (empty: none); see
    /// Note [Gradients that are rounding noise].
    fn values_with_slack(&mut self, name: &str, r: &RefTensor, shape: &[usize], got: &[f64], tol: Tol, slack: &[f64]) {
        if shape != r.shape.as_slice() {
            return self.fail(name, format!("shape {shape:?}, expected {:?}", r.shape));
        }
        let want = match r.values() {
            Ok(v) => v,
            Err(e) => return self.fail(name, e),
        };
        let exact = r.is_exact_kind() || tol.bits;
        let max_abs = want.iter().filter(|v| v.is_finite()).fold(0.0f64, |m, v| m.max(v.abs()));
        let atol = if exact { 0.0 } else { tol.atol_rel_to_max * max_abs };
        let rtol = if exact { 0.0 } else { tol.rtol };
        // Worst element: the largest ratio of error to allowance (non-finite mismatches are infinite).
        let mut worst: Option<(usize, f64)> = None;
        let mut bad = 0usize;
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            let (ok, ratio) = if !w.is_finite() || !g.is_finite() {
                let same = g == w || (g.is_nan() && w.is_nan());
                (same, if same { 0.0 } else { f64::INFINITY })
            } else {
                let err = (g - w).abs();
                let allowed = rtol * w.abs() + atol + slack.get(i).copied().unwrap_or(0.0);
                (
                    err <= allowed,
                    if allowed > 0.0 {
                        err / allowed
                    } else if err > 0.0 {
                        f64::INFINITY
                    } else {
                        0.0
                    },
                )
            };
            if !ok {
                bad += 1;
                if !matches!(worst, Some((_, r)) if ratio <= r) {
                    worst = Some((i, ratio));
                }
            }
        }
        if let Some((i, _)) = worst {
            let (g, w) = (got[i], want[i]);
            self.fail(
                name,
                format!(
                    "{bad}/{} elements off; worst at {:?}: got {g:.9e}, ref {w:.9e}, |diff| {:.3e} > allowed {:.3e} (rtol {rtol:e}, atol {atol:.3e})",
                    want.len(),
                    unravel(i, shape),
                    (g - w).abs(),
                    rtol * w.abs() + atol + slack.get(i).copied().unwrap_or(0.0)
                ),
            );
        }
    }

    /// Compares a tensor (dtype, shape and values) against a reference.
    fn tensor(&mut self, name: &str, r: &RefTensor, got: &Tensor, tol: Tol) {
        if tol.bits {
            return self.bits(name, r, got);
        }
        match r.memfit_dtype() {
            Ok(want) if want != got.dtype() => {
                return self.fail(name, format!("dtype {}, expected {want}", got.dtype()))
            }
            Err(e) => return self.fail(name, e),
            _ => {}
        }
        match got.to_f64_vec() {
            Ok(values) => self.values(name, r, got.shape(), &values, tol),
            Err(e) => self.fail(name, format!("reading the result: {e}")),
        }
    }

    /// Bit-exact comparison (casts: +0 and -0 differ).
    fn bits(&mut self, name: &str, r: &RefTensor, got: &Tensor) {
        if got.shape() != r.shape.as_slice() {
            return self.fail(name, format!("shape {:?}, expected {:?}", got.shape(), r.shape));
        }
        let got_bits: Res<Vec<u64>> = match (r.dtype, got.dtype()) {
            (Dtype::F16, DType::F16) => {
                got.to_vec::<half::f16>().map(|v| v.iter().map(|x| u64::from(x.to_bits())).collect()).ctx("reading")
            }
            (Dtype::BF16, DType::BF16) => {
                got.to_vec::<half::bf16>().map(|v| v.iter().map(|x| u64::from(x.to_bits())).collect()).ctx("reading")
            }
            (Dtype::F32, DType::F32) => {
                got.to_vec::<f32>().map(|v| v.iter().map(|x| u64::from(x.to_bits())).collect()).ctx("reading")
            }
            (Dtype::F64, DType::F64) => {
                got.to_vec::<f64>().map(|v| v.iter().map(|x| x.to_bits()).collect()).ctx("reading")
            }
            (want, have) => Err(format!("dtype {have}, expected {want:?}")),
        };
        let got_bits = match got_bits {
            Ok(b) => b,
            Err(e) => return self.fail(name, e),
        };
        let want_bits: Vec<u64> = match r.dtype {
            Dtype::F16 | Dtype::BF16 => r.u16s().into_iter().map(u64::from).collect(),
            Dtype::F32 => r.f32s().into_iter().map(|x| u64::from(x.to_bits())).collect(),
            _ => r.f64s().into_iter().map(f64::to_bits).collect(),
        };
        let (values, want_values) = (got.to_f64_vec().unwrap_or_default(), r.values().unwrap_or_default());
        let bad: Vec<usize> = (0..want_bits.len()).filter(|&i| got_bits[i] != want_bits[i]).collect();
        if let Some(&i) = bad.first() {
            self.fail(
                name,
                format!(
                    "{}/{} elements differ in bits; first at {:?}: got {:?} ({:#x}), ref {:?} ({:#x})",
                    bad.len(),
                    want_bits.len(),
                    unravel(i, &r.shape),
                    values.get(i),
                    got_bits[i],
                    want_values.get(i),
                    want_bits[i]
                ),
            );
        }
    }

    fn into_result(self) -> Res<()> {
        let mut it = self.failures.into_iter();
        match it.next() {
            None => Ok(()),
            Some((tensor, msg)) => {
                let rest: Vec<String> = it.map(|(t, _)| t).collect();
                let more = if rest.is_empty() { String::new() } else { format!(" [also off: {}]", rest.join(", ")) };
                Err(format!("{tensor}: {msg}{more}"))
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Op cases
// ---------------------------------------------------------------------------------------------

type Args = HashMap<String, Tensor>;

fn arg<'a>(args: &'a Args, name: &str) -> Res<&'a Tensor> {
    args.get(name).ok_or_else(|| format!("case has no argument {name}"))
}

/// Runs the op of an op-level case; returns its outputs by local tensor name.
fn dispatch(case: &Case, args: &Args, entries: &HashMap<String, &Entry>) -> Res<HashMap<String, Tensor>> {
    let a = |name: &str| arg(args, name);
    let input = || a("input");
    let one = |t: memfit_tensor::Result<Tensor>| -> Res<HashMap<String, Tensor>> {
        Ok(HashMap::from([("output".to_string(), t.ctx(&case.op)?)]))
    };
    let reduction_mean = || -> Res<()> {
        match case.attrs.get("reduction").and_then(Value::as_str) {
            None | Some("mean") => Ok(()),
            Some(other) => Err(unsupported(format!("reduction {other}"))),
        }
    };
    match case.op.as_str() {
        "relu" => one(input()?.relu()),
        "tanh" => one(input()?.tanh()),
        "sigmoid" => one(input()?.sigmoid()),
        "exp" => one(input()?.exp()),
        "log" => one(input()?.log()),
        "neg" => one(input()?.neg()),
        "gelu" => match case.attr_or_null("approximate").as_str().unwrap_or("none") {
            "none" => one(input()?.gelu()),
            "tanh" => one(input()?.gelu_tanh()),
            other => Err(unsupported(format!("gelu approximate={other}"))),
        },
        "add" => one(a("a")?.add(a("b")?)),
        "sub" => one(a("a")?.sub(a("b")?)),
        "mul" => one(a("a")?.mul(a("b")?)),
        "div" => one(a("a")?.div(a("b")?)),
        "sum" | "mean" => {
            let mean = case.op == "mean";
            let keepdim = match case.attr_or_null("keepdim") {
                Value::Null => false,
                v => as_bool(v, "keepdim")?,
            };
            let x = input()?;
            let dims: Option<Vec<isize>> = match case.attr_or_null("dim") {
                Value::Null => None,
                Value::Array(list) => Some(list.iter().map(|d| as_isize(d, "dim")).collect::<Res<_>>()?),
                v => Some(vec![as_isize(v, "dim")?]),
            };
            let out = match dims {
                None => {
                    let all = if mean { x.mean_all() } else { x.sum_all() }.ctx(&case.op)?;
                    if keepdim {
                        let ones = vec![1isize; x.rank()];
                        all.reshape(&ones).ctx("reshape")?
                    } else {
                        all
                    }
                }
                Some(dims) => {
                    // Several dims: reduce the highest first so the others keep their positions.
                    let rank = x.rank() as isize;
                    let mut resolved: Vec<isize> = dims.iter().map(|&d| if d < 0 { d + rank } else { d }).collect();
                    resolved.sort_unstable_by(|p, q| q.cmp(p));
                    let mut t = x.clone();
                    for d in resolved {
                        t = if mean { t.mean_dim(d, keepdim) } else { t.sum_dim(d, keepdim) }.ctx(&case.op)?;
                    }
                    t
                }
            };
            Ok(HashMap::from([("output".to_string(), out)]))
        }
        "max" => {
            let x = input()?;
            match case.attr_or_null("dim") {
                Value::Null => one(x.max_all()),
                d => {
                    let keepdim = as_bool(case.attr("keepdim")?, "keepdim")?;
                    let (values, indices) = x.max_dim(as_isize(d, "dim")?, keepdim).ctx("max")?;
                    let mut out = HashMap::from([("values".to_string(), values), ("indices".to_string(), indices)]);
                    if entries.contains_key("output") {
                        let v = out["values"].clone();
                        out.insert("output".into(), v);
                    }
                    Ok(out)
                }
            }
        }
        "softmax" => one(ops::softmax(input()?, as_isize(case.attr("dim")?, "dim")?)),
        "log_softmax" => one(ops::log_softmax(input()?, as_isize(case.attr("dim")?, "dim")?)),
        "matmul" => one(a("a")?.matmul(a("b")?)),
        "linear" => one(ops::linear(input()?, a("weight")?, args.get("bias"))),
        "conv2d" => {
            let p = Conv2dParams {
                stride: as_pair(case.attr("stride")?, "stride")?,
                padding: as_pair(case.attr("padding")?, "padding")?,
                dilation: as_pair(case.attr("dilation")?, "dilation")?,
                groups: as_usize(case.attr("groups")?, "groups")?,
            };
            one(ops::conv2d(input()?, a("weight")?, args.get("bias"), p))
        }
        "max_pool2d" => {
            let kernel = as_pair(case.attr("kernel_size")?, "kernel_size")?;
            let p = Pool2dParams {
                kernel,
                stride: match case.attr_or_null("stride") {
                    Value::Null => kernel,
                    v => as_pair(v, "stride")?,
                },
                padding: as_pair(case.attr("padding")?, "padding")?,
                dilation: match case.attr_or_null("dilation") {
                    Value::Null => [1, 1],
                    v => as_pair(v, "dilation")?,
                },
                ceil_mode: as_bool(case.attr("ceil_mode")?, "ceil_mode")?,
            };
            let (out, indices) = ops::max_pool2d_with_indices(input()?, p).ctx("max_pool2d")?;
            Ok(HashMap::from([("output".to_string(), out), ("indices".to_string(), indices)]))
        }
        "avg_pool2d" => {
            if !case.attr_or_null("divisor_override").is_null() {
                return Err(unsupported("avg_pool2d divisor_override"));
            }
            let kernel = as_pair(case.attr("kernel_size")?, "kernel_size")?;
            let p = Pool2dParams {
                kernel,
                stride: match case.attr_or_null("stride") {
                    Value::Null => kernel,
                    v => as_pair(v, "stride")?,
                },
                padding: as_pair(case.attr("padding")?, "padding")?,
                dilation: [1, 1],
                ceil_mode: as_bool(case.attr("ceil_mode")?, "ceil_mode")?,
            };
            let include_pad = match case.attr_or_null("count_include_pad") {
                Value::Null => true,
                v => as_bool(v, "count_include_pad")?,
            };
            one(ops::avg_pool2d(input()?, p, include_pad))
        }
        "adaptive_avg_pool2d" => {
            one(ops::adaptive_avg_pool2d(input()?, as_pair(case.attr("output_size")?, "output_size")?))
        }
        "layer_norm" => {
            let shape: Vec<usize> = match case.attr("normalized_shape")? {
                Value::Array(list) => list.iter().map(|d| as_usize(d, "normalized_shape")).collect::<Res<_>>()?,
                v => vec![as_usize(v, "normalized_shape")?],
            };
            let eps = as_f64(case.attr("eps")?, "eps")?;
            one(ops::layer_norm(input()?, &shape, args.get("weight"), args.get("bias"), eps))
        }
        "batch_norm" => {
            let training = as_bool(case.attr("training")?, "training")?;
            let momentum = as_f64(case.attr("momentum")?, "momentum")?;
            let eps = as_f64(case.attr("eps")?, "eps")?;
            let (rm, rv) = (args.get("running_mean"), args.get("running_var"));
            let out = ops::batch_norm(input()?, rm, rv, args.get("weight"), args.get("bias"), training, momentum, eps)
                .ctx("batch_norm")?;
            let mut outs = HashMap::from([("output".to_string(), out)]);
            // The running statistics are updated in place: their "after" outputs are the arguments.
            if let Some(rm) = rm {
                outs.insert("running_mean_after".into(), rm.clone());
            }
            if let Some(rv) = rv {
                outs.insert("running_var_after".into(), rv.clone());
            }
            Ok(outs)
        }
        "embedding" => {
            for key in ["padding_idx", "max_norm"] {
                if !case.attr_or_null(key).is_null() {
                    return Err(unsupported(format!("embedding {key}")));
                }
            }
            one(ops::embedding(a("indices")?, a("weight")?))
        }
        "cross_entropy" => {
            reduction_mean()?;
            if !case.attr_or_null("weight").is_null() {
                return Err(unsupported("cross_entropy class weights"));
            }
            let target = a("target")?;
            if let Some(ignore) = case.attrs.get("ignore_index").and_then(Value::as_i64) {
                let t = target.to_vec::<i64>().ctx("reading the target")?;
                if t.contains(&ignore) {
                    return Err(unsupported("targets equal to ignore_index"));
                }
            }
            let smoothing = match case.attr_or_null("label_smoothing") {
                Value::Null => 0.0,
                v => as_f64(v, "label_smoothing")?,
            };
            one(ops::cross_entropy(input()?, target, smoothing))
        }
        "nll_loss(log_softmax)" => {
            reduction_mean()?;
            let dim = match case.attr_or_null("dim") {
                Value::Null => -1,
                v => as_isize(v, "dim")?,
            };
            let lp = ops::log_softmax(input()?, dim).ctx("log_softmax")?;
            one(ops::nll_loss(&lp, a("target")?))
        }
        "mse_loss" => {
            reduction_mean()?;
            one(ops::mse_loss(input()?, a("target")?))
        }
        "scaled_dot_product_attention" => {
            if case.attrs.get("dropout_p").and_then(Value::as_f64).unwrap_or(0.0) != 0.0 {
                return Err(unsupported("attention dropout"));
            }
            let causal = match case.attr_or_null("is_causal") {
                Value::Null => false,
                v => as_bool(v, "is_causal")?,
            };
            let q = a("q")?;
            if let Some(scale) = case.attr_or_null("scale").as_f64() {
                let d = *q.shape().last().unwrap_or(&1) as f64;
                if (scale - 1.0 / d.sqrt()).abs() > 1e-12 * scale.abs() {
                    return Err(unsupported(format!("attention scale {scale}")));
                }
            }
            // PyTorch's sdpa bool attn_mask is True where attention IS allowed; memfit's mask is True
            // where it is not (nn.MultiheadAttention's convention), so invert it.
            let mask = match entries.get("attn_mask").or_else(|| entries.get("mask")) {
                None if case.attr_or_null("attn_mask").is_null() => None,
                None => return Err(unsupported("attn_mask given in attrs only")),
                Some(e) if e.data.dtype == Dtype::BOOL => {
                    let inverted: Vec<bool> = e.data.bools().into_iter().map(|b| !b).collect();
                    let device = q.device();
                    Some(Tensor::from_slice(device, &inverted, &e.data.shape, Category::Input).ctx("mask")?)
                }
                Some(_) => return Err(unsupported("additive (float) attention masks")),
            };
            one(ops::scaled_dot_product_attention(q, a("k")?, a("v")?, causal, mask.as_ref()))
        }
        other => Err(unsupported(format!("op {other:?}"))),
    }
}

fn run_op_case(case: &Case) -> Res<()> {
    let device = test_device()?;
    let mut args = Args::new();
    let mut by_local: HashMap<String, &Entry> = HashMap::new();
    for e in &case.entries {
        by_local.insert(e.local.clone(), e);
        if let Some(name) = e.str_field("arg") {
            if name == "attn_mask" || (name == "mask" && case.op == "scaled_dot_product_attention") {
                continue; // passed by `dispatch`, converted
            }
            let t = e.data.to_tensor(&device, Category::Input)?;
            let t = if e.requires_grad() { t.set_requires_grad(true) } else { t };
            args.insert(name.to_string(), t);
        }
    }
    let outputs = dispatch(case, &args, &by_local)?;
    let mut check = Check::default();
    for e in case.with_role("output") {
        match outputs.get(&e.local) {
            Some(t) => check.tensor(&e.local, &e.data, t, case.tol),
            None => check.fail(&e.local, "the runner produced no such output"),
        }
    }
    // Backpropagate the upstream gradients: one directly, several through sum_i sum(out_i * g_i).
    let grad_outs: Vec<&Entry> = case.with_role("grad_out").collect();
    if !grad_outs.is_empty() {
        let mut pairs = Vec::new();
        for g in &grad_outs {
            let of = g.str_field("of").unwrap_or("output");
            let out = outputs.get(of).ok_or_else(|| format!("{}: no output {of} to backpropagate into", g.local))?;
            pairs.push((out.clone(), g.data.to_tensor(&device, Category::Input)?));
        }
        if pairs.len() == 1 {
            let (out, g) = pairs.pop().expect("one pair");
            backward_with(&out, g).ctx("backward")?;
        } else {
            let mut total: Option<Tensor> = None;
            for (out, g) in pairs {
                let term = out.mul(&g).and_then(|t| t.sum_all()).ctx("sum(out * grad_out)")?;
                total = Some(match total {
                    None => term,
                    Some(t) => t.add(&term).ctx("add")?,
                });
            }
            backward(&total.expect("several pairs")).ctx("backward")?;
        }
    }
    for e in case.with_role("grad") {
        let wrt = e.str_field("wrt").ok_or_else(|| format!("{}: grad without wrt", e.local))?;
        let Some(leaf) = args.get(wrt) else {
            check.fail(&e.local, format!("no argument {wrt}"));
            continue;
        };
        match leaf.grad() {
            Some(g) => check.tensor(&e.local, &e.data, &g, case.tol),
            None => check.fail(&e.local, format!("no gradient reached {wrt}")),
        }
    }
    check.into_result()
}

// ---------------------------------------------------------------------------------------------
// Optimizers, GradScaler, casts
// ---------------------------------------------------------------------------------------------

fn optimizer_config(v: &Value) -> Res<OptimizerConfig> {
    let num = |key: &str, default: f64| -> Res<f64> {
        match v.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(x) => as_f64(x, key),
        }
    };
    for flag in ["amsgrad", "maximize", "capturable", "differentiable"] {
        if v.get(flag).and_then(Value::as_bool) == Some(true) {
            return Err(unsupported(format!("optimizer {flag}=true")));
        }
    }
    let lr = as_f64(v.get("lr").ok_or("optimizer without lr")?, "lr")?;
    let betas = match v.get("betas").and_then(Value::as_array) {
        Some(b) if b.len() == 2 => (as_f64(&b[0], "betas")?, as_f64(&b[1], "betas")?),
        Some(_) => return Err("betas must be a pair".into()),
        None => (0.9, 0.999),
    };
    Ok(match v.get("type").and_then(Value::as_str).ok_or("optimizer without type")? {
        "SGD" => OptimizerConfig::Sgd {
            lr,
            momentum: num("momentum", 0.0)?,
            dampening: num("dampening", 0.0)?,
            nesterov: v.get("nesterov").and_then(Value::as_bool).unwrap_or(false),
            weight_decay: num("weight_decay", 0.0)?,
        },
        "Adam" => OptimizerConfig::Adam {
            lr,
            betas,
            eps: num("eps", 1e-8)?,
            weight_decay: num("weight_decay", 0.0)?,
            state: Default::default(),
        },
        "AdamW" => OptimizerConfig::AdamW {
            lr,
            betas,
            eps: num("eps", 1e-8)?,
            weight_decay: num("weight_decay", 0.01)?,
            state: Default::default(),
        },
        other => return Err(unsupported(format!("optimizer {other}"))),
    })
}

/// Compares every `state` entry (optimizer state after the last step) with the optimizer's.
fn check_optimizer_state(check: &mut Check, case: &Case, opt: &Optimizer) {
    let state = opt.state();
    for e in case.with_role("state").filter(|e| e.str_field("state").is_some()) {
        let (param, kind) = (e.str_field("param").unwrap_or(""), e.str_field("state").unwrap_or(""));
        match state.iter().find(|(p, k, _)| p == param && *k == kind) {
            Some((_, _, t)) => check.tensor(&e.local, &e.data, t, case.tol),
            None => check.fail(&e.local, format!("the optimizer holds no {kind} for {param}")),
        }
    }
    if let Some(want) = case.attrs.get("state_step").and_then(Value::as_u64) {
        for (name, _) in opt.params() {
            if opt.param_steps(name) != Some(want) {
                check.fail("state_step", format!("{name} took {:?} steps, expected {want}", opt.param_steps(name)));
            }
        }
    }
}

fn run_optimizer_case(case: &Case) -> Res<()> {
    let device = test_device()?;
    let config = optimizer_config(&case.attrs)?;
    let n_steps = as_usize(case.attr("n_steps")?, "n_steps")? as u64;
    let mut params = Vec::new();
    for e in case.with_role("param_init") {
        let name = e.str_field("param").ok_or("param_init without param")?;
        params.push((name.to_string(), e.data.to_tensor(&device, Category::Parameter)?.set_requires_grad(true)));
    }
    if let Some(names) = case.attrs.get("param_names").and_then(Value::as_array) {
        let want: Vec<&str> = names.iter().filter_map(Value::as_str).collect();
        let have: Vec<&str> = params.iter().map(|(n, _)| n.as_str()).collect();
        if want != have {
            return Err(format!("param_init entries {have:?} do not match param_names {want:?}"));
        }
    }
    let mut opt = Optimizer::try_new(params.clone(), config).ctx("optimizer")?;
    let mut check = Check::default();
    for step in 1..=n_steps {
        for (name, p) in &params {
            let given = case
                .with_role("grad_given")
                .find(|e| e.step() == Some(step) && e.str_field("param") == Some(name))
                .map(|e| e.data.to_tensor(&device, Category::Gradient))
                .transpose()?;
            p.set_grad(given);
        }
        opt.step().ctx(&format!("step {step}"))?;
        for e in case.with_role("param_after").filter(|e| e.step() == Some(step)) {
            let name = e.str_field("param").unwrap_or("");
            match params.iter().find(|(n, _)| n == name) {
                Some((_, p)) => check.tensor(&e.local, &e.data, p, case.tol),
                None => check.fail(&e.local, format!("no parameter {name}")),
            }
        }
        opt.zero_grad();
    }
    check_optimizer_state(&mut check, case, &opt);
    check.into_result()
}

fn run_grad_scaler_case(case: &Case) -> Res<()> {
    let device = test_device()?;
    let config = GradScalerConfig {
        init_scale: as_f64(case.attr("init_scale")?, "init_scale")?,
        growth_factor: as_f64(case.attr("growth_factor")?, "growth_factor")?,
        backoff_factor: as_f64(case.attr("backoff_factor")?, "backoff_factor")?,
        growth_interval: as_usize(case.attr("growth_interval")?, "growth_interval")? as u32,
    };
    let n_steps = as_usize(case.attr("n_steps")?, "n_steps")? as u64;
    let mut scaler = GradScaler::new(config).ctx("GradScaler")?;
    let p = case.only("param_init")?.data.to_tensor(&device, Category::Parameter)?.set_requires_grad(true);
    let mut opt = Optimizer::try_new(vec![("param".into(), p.clone())], optimizer_config(case.attr("optimizer")?)?)
        .ctx("optimizer")?;
    let mut check = Check::default();
    let per_step = |e: &Entry, role: &str, step: u64| e.role() == role && e.step() == Some(step);
    let mut record: HashMap<&str, Vec<f64>> = HashMap::new();
    for step in 1..=n_steps {
        let find = |role: &str| case.entries.iter().find(|e| per_step(e, role, step));
        let g_true = find("grad_true").ok_or_else(|| format!("no grad_true for step {step}"))?;
        let g = g_true.data.to_tensor(&device, Category::Input)?;
        record.entry("scale_used").or_default().push(scaler.scale());
        // loss_k = sum(param * grad_true_k), scaled, backpropagated.
        let loss = p.mul(&g).and_then(|t| t.sum_all()).ctx("loss")?;
        backward(&scaler.scale_loss(&loss).ctx("scale")?).ctx("backward")?;
        let grad_now = |check: &mut Check, e: Option<&Entry>| {
            if let Some(e) = e {
                match p.grad() {
                    Some(gr) => check.tensor(&e.local, &e.data, &gr, case.tol),
                    None => check.fail(&e.local, "no gradient"),
                }
            }
        };
        grad_now(&mut check, find("grad_scaled"));
        let found_inf = scaler.unscale(opt.params()).ctx("unscale")?;
        grad_now(&mut check, find("grad_unscaled"));
        let stepped = scaler.step(&mut opt).ctx("scaler step")?;
        scaler.update().ctx("update")?;
        if let Some(e) = find("param_after") {
            check.tensor(&e.local, &e.data, &p, case.tol);
        }
        opt.zero_grad();
        record.entry("found_inf").or_default().push(if found_inf { 1.0 } else { 0.0 });
        record.entry("skipped").or_default().push(if stepped { 0.0 } else { 1.0 });
        record.entry("scale_after").or_default().push(scaler.scale());
        record.entry("growth_tracker_after").or_default().push(f64::from(scaler.growth_tracker()));
    }
    for e in case.with_role("per_step") {
        match record.get(e.local.as_str()) {
            Some(values) => check.values(&e.local, &e.data, &[values.len()], values, case.tol),
            None => check.fail(&e.local, "the runner records no such per-step value"),
        }
    }
    check.into_result()
}

fn run_cast_case(case: &Case) -> Res<()> {
    let device = test_device()?;
    let to = match case.attr("to")?.as_str() {
        Some("float16") => DType::F16,
        Some("bfloat16") => DType::BF16,
        Some("float32") => DType::F32,
        Some("float64") => DType::F64,
        other => return Err(unsupported(format!("cast to {other:?}"))),
    };
    let input = case.only("input")?.data.to_tensor(&device, Category::Input)?;
    let out = input.to_dtype(to).ctx("to_dtype")?;
    let mut check = Check::default();
    for e in case.with_role("output") {
        let got = if e.data.memfit_dtype()? == to {
            out.clone()
        } else {
            // e.g. `output_as_f32`: the rounded values widened back.
            out.to_dtype(e.data.memfit_dtype()?).ctx("to_dtype back")?
        };
        check.tensor(&e.local, &e.data, &got, case.tol);
    }
    check.into_result()
}

// ---------------------------------------------------------------------------------------------
// Model cases
// ---------------------------------------------------------------------------------------------

/// Builds the case's model and loads its `init/*` tensors (parameters and buffers, by name).
fn model_for(case: &Case, device: &Device) -> Res<Box<dyn Model>> {
    let a = &case.attrs;
    let model_name = a.get("model").and_then(Value::as_str).ok_or("model attribute missing")?;
    let spec = match model_name {
        "SimpleCNN" => {
            let x = case.only("input")?;
            let classes = case
                .entries
                .iter()
                .find(|e| e.local == "logits")
                .and_then(|e| e.data.shape.last().copied())
                .unwrap_or(10);
            if x.data.shape.len() != 4 {
                return Err(format!("SimpleCNN input shape {:?}", x.data.shape));
            }
            ModelSpec::image(ModelKind::SimpleCnn, [x.data.shape[1], x.data.shape[2], x.data.shape[3]], classes)
        }
        "GPT" => {
            let n = |k: &str| -> Res<usize> { as_usize(a.get(k).ok_or_else(|| format!("attribute {k} missing"))?, k) };
            let gpt = GptConfig {
                vocab: n("vocab")?,
                d_model: n("d_model")?,
                heads: n("n_heads")?,
                layers: n("n_layers")?,
                max_t: n("max_T")?,
            };
            ModelSpec { kind: ModelKind::Gpt, input: [1, 1, gpt.max_t], num_classes: gpt.vocab, gpt, exported: None }
        }
        other => return Err(unsupported(format!("model {other}"))),
    };
    let model = build_model(&spec, device, 0).ctx("build_model")?;
    let mut named: HashMap<String, Tensor> = model.parameters().into_iter().collect();
    named.extend(model.buffers());
    let mut loaded = Vec::new();
    for e in case.with_role("param_init") {
        let name = e.str_field("param").unwrap_or("");
        let dst = named.get(name).ok_or_else(|| format!("the model has no parameter or buffer {name}"))?;
        let src = e.data.to_tensor(device, Category::Input)?;
        dst.copy_from(&src).ctx(&format!("loading {name}"))?;
        loaded.push(name.to_string());
    }
    // The parameters must be exactly the reference's, in state_dict order.
    let buffers: Vec<String> = model.buffers().into_iter().map(|(n, _)| n).collect();
    let have: Vec<String> = model.parameters().into_iter().map(|(n, _)| n).collect();
    let want: Vec<String> = loaded.into_iter().filter(|n| !buffers.contains(n)).collect();
    if have != want {
        return Err(format!("model parameters {have:?} differ from the reference's {want:?} (names or order)"));
    }
    Ok(model)
}

/// Forward + mean cross-entropy loss over all positions.
fn model_loss(model: &dyn Model, x: &Tensor, y: &Tensor) -> Res<(Tensor, Tensor)> {
    let logits = model.forward(x, true).ctx("forward")?;
    let classes = *logits.shape().last().ok_or("0-d logits")? as isize;
    let flat = logits.reshape(&[-1, classes]).ctx("reshape logits")?;
    let target = y.reshape(&[-1]).ctx("reshape target")?;
    let loss = ops::cross_entropy(&flat, &target, 0.0).ctx("cross_entropy")?;
    Ok((logits, loss))
}

fn check_params(check: &mut Check, case: &Case, model: &dyn Model, entries: Vec<&Entry>, grads: bool) {
    check_params_with_slack(check, case, model, entries, grads, &HashMap::new());
}

fn check_params_with_slack(
    check: &mut Check,
    case: &Case,
    model: &dyn Model,
    entries: Vec<&Entry>,
    grads: bool,
    slack: &HashMap<String, Vec<f64>>,
) {
    let params: HashMap<String, Tensor> = model.parameters().into_iter().collect();
    for e in entries {
        let name = e.str_field("param").unwrap_or("");
        let Some(p) = params.get(name) else {
            check.fail(&e.local, format!("no parameter {name}"));
            continue;
        };
        let got = if grads {
            match p.grad() {
                Some(g) => g,
                None => {
                    check.fail(&e.local, "no gradient");
                    continue;
                }
            }
        } else {
            p.clone()
        };
        match slack.get(name) {
            Some(sl) if got.dtype() == DType::F32 || got.dtype() == DType::F64 => match got.to_f64_vec() {
                Ok(values) => check.values_with_slack(&e.local, &e.data, got.shape(), &values, case.tol, sl),
                Err(err) => check.fail(&e.local, format!("reading the result: {err}")),
            },
            _ => check.tensor(&e.local, &e.data, &got, case.tol),
        }
    }
}

/// Note [Gradients that are rounding noise]: some reference gradients are zero in exact arithmetic
/// and only rounding noise in float32 (the GPT's key bias: softmax is invariant to adding q.b_k to
/// every score of a row, so d loss / d b_k = 0; PyTorch stores ~1e-10). The manifest's gradient
/// tolerance accepts any noise of that size, but Adam divides by sqrt(v) + eps (1e-8), so its first
/// steps turn that noise into updates of up to lr in either direction: the reference parameters
/// after a step are not determined there, and no correct implementation can match them. For those
/// elements only (reference gradient nonzero but below 1e-6 * the tensor's largest |gradient|, about
/// what float32 sums can resolve), the parameters after step t are allowed Adam's largest possible
/// movement, 2 * lr * t, on top of the manifest tolerance; exact zero gradients stay strict. Returns
/// the per-element slack of each parameter at step 1 (scale by the step) and the count of relaxed elements.
fn noise_gradient_slack(case: &Case, config: &OptimizerConfig) -> Res<(HashMap<String, Vec<f64>>, usize)> {
    let lr = match *config {
        OptimizerConfig::Adam { lr, .. } | OptimizerConfig::AdamW { lr, .. } => lr,
        OptimizerConfig::Sgd { .. } => return Ok((HashMap::new(), 0)),
    };
    let mut slack = HashMap::new();
    let mut count = 0;
    for e in case.with_role("grad") {
        let Some(name) = e.str_field("param") else { continue };
        let g = e.data.values()?;
        let max = g.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let noise: Vec<f64> =
            g.iter().map(|v| if *v != 0.0 && v.abs() <= 1e-6 * max { 2.0 * lr } else { 0.0 }).collect();
        let n = noise.iter().filter(|&&s| s > 0.0).count();
        if n > 0 {
            count += n;
            slack.insert(name.to_string(), noise);
        }
    }
    Ok((slack, count))
}

fn run_model_train_case(case: &Case) -> Res<()> {
    let device = test_device()?;
    let model = model_for(case, &device)?;
    let x = case.only("input")?.data.to_tensor(&device, Category::Input)?;
    let y = case.only("target")?.data.to_tensor(&device, Category::Input)?;
    let config = optimizer_config(case.attr("optimizer")?)?;
    let n_steps = as_usize(&case.attr("optimizer")?["n_steps"], "n_steps")? as u64;
    let mut opt = Optimizer::try_new(model.parameters(), config).ctx("optimizer")?;
    let (slack, relaxed) = noise_gradient_slack(case, &config)?;
    if relaxed > 0 {
        println!(
            "golden NOTE {}: {relaxed} parameter elements with rounding-noise gradients compared within Adam's step bound \
             after each step (Note [Gradients that are rounding noise])",
            case.name
        );
    }
    let mut check = Check::default();
    let mut losses = Vec::new();
    for step in 1..=n_steps {
        let (logits, loss) = model_loss(model.as_ref(), &x, &y)?;
        losses.push(loss.item().ctx("loss")?);
        backward(&loss).ctx("backward")?;
        if step == 1 {
            if let Ok(e) = case.entry("logits") {
                check.tensor("logits", &e.data, &logits, case.tol);
            }
            if let Ok(e) = case.entry("loss") {
                check.tensor("loss", &e.data, &loss, case.tol);
            }
            check_params(&mut check, case, model.as_ref(), case.with_role("grad").collect(), true);
        }
        drop((logits, loss));
        opt.step().ctx(&format!("optimizer step {step}"))?;
        opt.zero_grad();
        let after: Vec<&Entry> = case.with_role("param_after").filter(|e| e.step() == Some(step)).collect();
        let step_slack: HashMap<String, Vec<f64>> =
            slack.iter().map(|(k, v)| (k.clone(), v.iter().map(|s| s * step as f64).collect())).collect();
        check_params_with_slack(&mut check, case, model.as_ref(), after, false, &step_slack);
    }
    if let Ok(e) = case.entry("losses") {
        check.values("losses", &e.data, &[losses.len()], &losses, case.tol);
    }
    check_optimizer_state(&mut check, case, &opt);
    check.into_result()
}

fn run_grad_accumulation_case(case: &Case) -> Res<()> {
    let device = test_device()?;
    let model = model_for(case, &device)?;
    let xe = case.only("input")?;
    let ye = case.only("target")?;
    let micro = as_usize(case.attr("micro_batches")?, "micro_batches")?;
    let n = xe.data.shape[0];
    if micro == 0 || n % micro != 0 {
        return Err(format!("{n} samples do not split into {micro} micro-batches"));
    }
    let mut check = Check::default();
    let params = model.parameters();
    let zero_grad = || params.iter().for_each(|(_, p)| p.set_grad(None));

    // The full batch.
    let x = xe.data.to_tensor(&device, Category::Input)?;
    let y = ye.data.to_tensor(&device, Category::Input)?;
    let (_, loss) = model_loss(model.as_ref(), &x, &y)?;
    if let Ok(e) = case.entry("loss_full") {
        check.tensor("loss_full", &e.data, &loss, case.tol);
    }
    backward(&loss).ctx("backward")?;
    let full: Vec<&Entry> = case.with_role("grad").filter(|e| e.local.starts_with("grad_full/")).collect();
    check_params(&mut check, case, model.as_ref(), full, true);
    zero_grad();

    // Micro-batches of loss / micro, gradients accumulated in .grad.
    let per = n / micro;
    let (xs, ys) = (xe.data.values()?, ye.data.i64s());
    let sample = xe.data.numel() / n;
    let mut micro_losses = Vec::new();
    for m in 0..micro {
        let mut xshape = xe.data.shape.clone();
        xshape[0] = per;
        let xm: Vec<f32> = xs[m * per * sample..(m + 1) * per * sample].iter().map(|&v| v as f32).collect();
        let xm = Tensor::from_slice(&device, &xm, &xshape, Category::Input).ctx("micro-batch")?;
        let ym =
            Tensor::from_slice(&device, &ys[m * per..(m + 1) * per], &[per], Category::Input).ctx("micro-batch")?;
        let (_, loss) = model_loss(model.as_ref(), &xm, &ym)?;
        micro_losses.push(loss.item().ctx("loss")?);
        backward(&loss.mul_scalar(1.0 / micro as f64).ctx("scale")?).ctx("backward")?;
    }
    if let Ok(e) = case.entry("micro_losses") {
        check.values("micro_losses", &e.data, &[micro_losses.len()], &micro_losses, case.tol);
    }
    let acc: Vec<&Entry> = case.with_role("grad").filter(|e| e.local.starts_with("grad_accum/")).collect();
    check_params(&mut check, case, model.as_ref(), acc, true);
    check.into_result()
}

// ---------------------------------------------------------------------------------------------
// The test
// ---------------------------------------------------------------------------------------------

fn run_case(case: &Case) -> Res<()> {
    match case.op.as_str() {
        "optimizer_step" => run_optimizer_case(case),
        "grad_scaler_sequence" => run_grad_scaler_case(case),
        "cast" => run_cast_case(case),
        "model_train" => run_model_train_case(case),
        "grad_accumulation" => run_grad_accumulation_case(case),
        _ => run_op_case(case),
    }
}

/// The device the cases run on: `MEMFIT_TEST_DEVICE` (`cpu` by default; `cuda` on a GPU, or on
/// the emulator with `MEMFIT_CUDA_EMULATOR=1`).
fn test_device() -> Res<Device> {
    let name = std::env::var("MEMFIT_TEST_DEVICE").unwrap_or_else(|_| "cpu".to_string());
    let kind = DeviceKind::parse(&name).ctx("MEMFIT_TEST_DEVICE")?;
    Device::new(DeviceConfig::new(kind)).ctx("opening the test device")
}

fn golden_dir() -> PathBuf {
    match std::env::var_os("MEMFIT_GOLDEN_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("tests").join("golden"),
    }
}

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

#[test]
fn golden_cases_match_pytorch() {
    let dir = golden_dir();
    let manifest_path = dir.join("manifest.json");
    let text = std::fs::read_to_string(&manifest_path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", manifest_path.display()));
    let manifest: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("bad manifest: {e}"));
    let cases = manifest["cases"].as_array().expect("manifest without cases");
    let tolerances = &manifest["tolerances"];
    let mut golden = Golden::new(dir);
    let mut failed = 0usize;
    for json in cases {
        let name = json["name"].as_str().unwrap_or("<unnamed>").to_string();
        let result = match Case::load(&mut golden, json, tolerances) {
            Err(e) => Err(format!("loading: {e}")),
            Ok(case) => match catch_unwind(AssertUnwindSafe(|| run_case(&case))) {
                Ok(r) => r,
                Err(p) => Err(format!("panicked: {}", panic_message(p))),
            },
        };
        if let Err(msg) = result {
            failed += 1;
            println!("golden FAIL {name}: {msg}");
        }
    }
    // Written straight to stderr (not through println!) so that the summary shows even when the
    // test harness captures the output of passing tests, as in CI.
    let device = std::env::var("MEMFIT_TEST_DEVICE").unwrap_or_else(|_| "cpu".to_string());
    let summary = format!("golden: {} cases checked on {device}, {failed} failed\n", cases.len());
    let _ = std::io::Write::write_all(&mut std::io::stderr(), summary.as_bytes());
    assert!(failed == 0, "golden: {failed} of {} cases failed (see the lines above)", cases.len());
}

/// The comparison rule itself: tolerances, exactness of integers and non-finite values.
#[test]
fn golden_comparison_rule() {
    let r = |dtype: Dtype, bytes: Vec<u8>, n: usize| RefTensor { key: "t".into(), dtype, shape: vec![n], bytes };
    let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let tol = Tol { rtol: 1e-5, atol_rel_to_max: 1e-5, bits: false };
    let reference = r(Dtype::F32, f32s(&[100.0, 1.0, f32::INFINITY]), 3);
    // atol = 1e-5 * 100 = 1e-3 (max over finite values): 1.0009 passes, 1.002 does not.
    let mut c = Check::default();
    c.values("t", &reference, &[3], &[100.0, 1.0009, f64::INFINITY], tol);
    assert!(c.failures.is_empty(), "{:?}", c.failures);
    c.values("t", &reference, &[3], &[100.0, 1.002, f64::INFINITY], tol);
    assert_eq!(c.failures.len(), 1);
    assert!(c.failures[0].1.contains("[1]"), "{}", c.failures[0].1);
    // Non-finite values must match exactly.
    let mut c = Check::default();
    c.values("t", &reference, &[3], &[100.0, 1.0, f64::NEG_INFINITY], tol);
    c.values("t", &reference, &[3], &[100.0, 1.0, 3e38], tol);
    assert_eq!(c.failures.len(), 2);
    // Integers are exact whatever the tolerance.
    let ints = r(Dtype::I64, [3i64, 4].iter().flat_map(|x| x.to_le_bytes()).collect(), 2);
    let mut c = Check::default();
    c.values("i", &ints, &[2], &[3.0, 4.0], tol);
    assert!(c.failures.is_empty());
    c.values("i", &ints, &[2], &[3.0, 4.00001], tol);
    assert_eq!(c.failures.len(), 1);
    // Shapes must match.
    let mut c = Check::default();
    c.values("i", &ints, &[1, 2], &[3.0, 4.0], tol);
    assert_eq!(c.failures.len(), 1);
    // Bits: -0 and +0 differ.
    let device = Device::cpu();
    let zero = r(Dtype::F32, f32s(&[0.0]), 1);
    let got = Tensor::from_slice(&device, &[-0.0f32], &[1], Category::Input).unwrap();
    let mut c = Check::default();
    c.bits("z", &zero, &got);
    assert_eq!(c.failures.len(), 1);
    assert_eq!(unravel(7, &[2, 2, 3]), vec![1, 0, 1]);
}
