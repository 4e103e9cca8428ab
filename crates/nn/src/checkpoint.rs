//! Safetensors checkpoints of a model's parameters and buffers under their PyTorch `state_dict` names,
//! interchangeable with PyTorch: `safetensors.torch.save_file(model.state_dict(), path)` writes a file
//! [`load`] reads, and `load_file(path)` reads what [`save`] writes (f32 parameters, f32 running stats,
//! an int64 0-d `num_batches_tracked`, a bool `mask`; metadata `{"format": "pt"}`).
//!
//! Loading is all-or-nothing: every expected tensor is checked (present, same shape, same dtype, valid
//! bool bytes) before any is overwritten, and every problem is reported with the file, the tensor and
//! what is wrong. A truncated, corrupt or unreadable file is an error, never a panic. Values are decoded
//! straight into the destination tensors (no staging copy), or through `Tensor::copy_from` for a
//! non-contiguous destination. Saving writes a temporary file
//! next to the target and renames it, so an interrupted save never leaves a half-written checkpoint.

use crate::models::Model;
use memfit_tensor::{Category, DType, Device, Element, Error, Result, Tensor};
use safetensors::tensor::{Dtype, SafeTensorError, SafeTensors, View};
use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

/// The model's state: parameters, then buffers (each group in PyTorch's order). PyTorch's own
/// `state_dict()` interleaves them per module; safetensors files are keyed by name, so order is moot.
pub fn state_dict(model: &dyn Model) -> Vec<(String, Tensor)> {
    let mut out = model.parameters();
    out.extend(model.buffers());
    out
}

/// Writes the model's parameters and buffers to `path`.
pub fn save(path: impl AsRef<Path>, model: &dyn Model) -> Result<()> {
    save_tensors(path, &state_dict(model), None)
}

/// Writes named tensors to `path` with optional string metadata (`"format": "pt"` is always added).
pub fn save_tensors(
    path: impl AsRef<Path>,
    tensors: &[(String, Tensor)],
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let path = path.as_ref();
    let bytes = to_bytes(path, tensors, metadata)?;
    let tmp = temporary_path(path);
    if let Err(e) = std::fs::write(&tmp, bytes) {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::invalid(format!("cannot write checkpoint {}: {e}", path.display())));
    }
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::invalid(format!("cannot write checkpoint {}: {e}", path.display()))
    })
}

/// The safetensors bytes of named tensors with optional string metadata (`"format": "pt"` is always
/// added); `path` names the checkpoint in messages. Callers that write files their own way (the job
/// writes every output through `memfit_train::output::write_atomic`) use this.
pub fn to_bytes(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>> {
    let mut seen = HashSet::new();
    let mut views = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        if !seen.insert(name.as_str()) {
            return Err(Error::invalid(format!("cannot save {}: the name {name:?} appears twice", path.display())));
        }
        if !t.device().computes() {
            return Err(Error::device(format!(
                "cannot save {}: tensor {name:?} is on the {} device, which holds no data",
                path.display(),
                t.device().kind()
            )));
        }
        views.push((name.clone(), HostTensor::of(t).map_err(|e| context(path, name, e))?));
    }
    let mut info = metadata.unwrap_or_default();
    info.entry("format".to_string()).or_insert_with(|| "pt".to_string());
    let bytes = safetensors::serialize(views, &Some(info))
        .map_err(|e| Error::invalid(format!("cannot write checkpoint {}: {}", path.display(), describe(&e))))?;
    canonical_header(bytes).map_err(|why| Error::invalid(format!("cannot write checkpoint {}: {why}", path.display())))
}

/// `bytes` (a safetensors file) with its JSON header's keys sorted: the crate writes the metadata in a
/// hash map's order, which differs from run to run, so the same model saved twice gave different files.
/// The header stays padded with spaces to a multiple of 8 bytes; tensor offsets are relative to the data
/// after it, so they do not change.
fn canonical_header(bytes: Vec<u8>) -> std::result::Result<Vec<u8>, String> {
    let length: [u8; 8] = bytes.get(..8).and_then(|b| b.try_into().ok()).ok_or("a header without its length")?;
    let end =
        usize::try_from(u64::from_le_bytes(length)).ok().and_then(|n| n.checked_add(8)).ok_or("a header too long")?;
    let header = bytes.get(8..end).ok_or("a header longer than the file")?;
    // serde_json's maps are ordered by key (no `preserve_order`): parsing and printing sorts them.
    let value: serde_json::Value = serde_json::from_slice(header).map_err(|e| format!("its header: {e}"))?;
    let mut text = serde_json::to_vec(&value).map_err(|e| format!("its header: {e}"))?;
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + text.len() + bytes.len() - end);
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(&text);
    out.extend_from_slice(&bytes[end..]);
    Ok(out)
}

/// Loads `path` into the model's parameters and buffers (strict, like PyTorch's
/// `load_state_dict(strict=True)`: every expected name present with its shape and dtype, no extra names).
pub fn load(path: impl AsRef<Path>, model: &dyn Model) -> Result<()> {
    load_into(path, &state_dict(model), true)
}

/// Copies the tensors of `path` into `targets` (name, destination). Every target must be in the file
/// with the same shape and dtype; with `strict`, the file must hold nothing else. Nothing is written
/// unless every check passes.
pub fn load_into(path: impl AsRef<Path>, targets: &[(String, Tensor)], strict: bool) -> Result<()> {
    let path = path.as_ref();
    let bytes = read(path)?;
    let file = parse(path, &bytes)?;
    let mut problems = Vec::new();
    let mut sources = Vec::with_capacity(targets.len());
    for (name, dst) in targets {
        match file.tensor(name) {
            Err(_) => problems.push(format!("{name}: missing (expected {:?} {})", dst.shape(), dst.dtype())),
            Ok(view) => match dtype_of(view.dtype()) {
                None => problems.push(format!("{name}: unsupported dtype {:?}", view.dtype())),
                Some(dtype) if dtype != dst.dtype() || view.shape() != dst.shape() => problems.push(format!(
                    "{name}: the file has {:?} {dtype}, the model expects {:?} {}",
                    view.shape(),
                    dst.shape(),
                    dst.dtype()
                )),
                Some(DType::Bool) if has_bad_bool(view.data()) => {
                    problems.push(format!("{name}: bool data holds bytes other than 0 and 1 (corrupt)"))
                }
                Some(dtype) => sources.push((name, dst, dtype, view)),
            },
        }
    }
    if strict {
        let expected: HashSet<&str> = targets.iter().map(|(n, _)| n.as_str()).collect();
        let mut unexpected: Vec<&String> =
            file.names().into_iter().filter(|n| !expected.contains(n.as_str())).collect();
        unexpected.sort();
        problems.extend(unexpected.into_iter().map(|n| format!("{n}: unexpected (the model has no such tensor)")));
    }
    if !problems.is_empty() {
        return Err(Error::invalid(format!(
            "cannot load checkpoint {}: {} problem(s):\n  {}",
            path.display(),
            problems.len(),
            problems.join("\n  ")
        )));
    }
    for (name, dst, dtype, view) in sources {
        if dst.is_contiguous() {
            fill_from_bytes(dst, view.data()).map_err(|e| context(path, name, e))?;
        } else {
            let src = staging(dst.device(), dtype, view.shape(), view.data(), Category::Temporary)
                .map_err(|e| context(path, name, e))?;
            dst.copy_from(&src)?;
        }
    }
    Ok(())
}

/// Every tensor of `path`, in file order, as new tensors on `device` tagged `category`.
pub fn load_named(path: impl AsRef<Path>, device: &Device, category: Category) -> Result<Vec<(String, Tensor)>> {
    let path = path.as_ref();
    let bytes = read(path)?;
    let file = parse(path, &bytes)?;
    let (_, metadata) = SafeTensors::read_metadata(&bytes).map_err(|e| corrupt(path, &bytes, &e))?;
    let mut infos: Vec<_> = metadata.tensors().into_iter().collect();
    infos.sort_by_key(|(name, info)| (info.data_offsets, name.clone()));
    let mut out = Vec::with_capacity(infos.len());
    for (name, _) in infos {
        let view = file.tensor(&name).map_err(|e| corrupt(path, &bytes, &e))?;
        let dtype = dtype_of(view.dtype()).ok_or_else(|| {
            Error::dtype(format!(
                "checkpoint {}: tensor {name:?} has unsupported dtype {:?}",
                path.display(),
                view.dtype()
            ))
        })?;
        if dtype == DType::Bool && has_bad_bool(view.data()) {
            return Err(Error::invalid(format!(
                "checkpoint {}: bool tensor {name:?} holds bytes other than 0 and 1 (corrupt)",
                path.display()
            )));
        }
        let t = staging(device, dtype, view.shape(), view.data(), category).map_err(|e| context(path, &name, e))?;
        out.push((name, t));
    }
    Ok(out)
}

/// The string metadata of `path` (`__metadata__`), if any. Only the header is read (its length and its
/// JSON), not the tensors' bytes; a file whose header is not well formed is read whole, for the error
/// that says what it is. The tensors are checked when they are loaded.
pub fn read_metadata(path: impl AsRef<Path>) -> Result<Option<HashMap<String, String>>> {
    let path = path.as_ref();
    if let Some(metadata) = header_metadata(path) {
        return Ok(metadata);
    }
    let bytes = read(path)?;
    let (_, metadata) = SafeTensors::read_metadata(&bytes).map_err(|e| corrupt(path, &bytes, &e))?;
    Ok(metadata.metadata().clone())
}

/// The largest header the safetensors format allows (its crate's `MAX_HEADER_SIZE`).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// `__metadata__` read from the header alone: Some(None) when the header has none, None when the header
/// is not a well-formed safetensors header.
fn header_metadata(path: &Path) -> Option<Option<HashMap<String, String>>> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).ok()?;
    let file_len = file.metadata().ok()?.len();
    let mut length = [0u8; 8];
    file.read_exact(&mut length).ok()?;
    let n = u64::from_le_bytes(length);
    if n > MAX_HEADER_BYTES || n.checked_add(8)? > file_len {
        return None;
    }
    let mut header = vec![0u8; usize::try_from(n).ok()?];
    file.read_exact(&mut header).ok()?;
    let value: serde_json::Value = serde_json::from_slice(&header).ok()?;
    match value.as_object()?.get("__metadata__") {
        None => Some(None),
        Some(m) => Some(Some(serde_json::from_value(m.clone()).ok()?)),
    }
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::invalid(format!("cannot read checkpoint {}: {e}", path.display())))
}

fn parse<'a>(path: &Path, bytes: &'a [u8]) -> Result<SafeTensors<'a>> {
    SafeTensors::deserialize(bytes).map_err(|e| corrupt(path, bytes, &e))
}

fn corrupt(path: &Path, bytes: &[u8], e: &SafeTensorError) -> Error {
    if let Some(kind) = pytorch_pickle(bytes) {
        return Error::invalid(format!(
            "checkpoint {} is a PyTorch pickle ({kind}, written by torch.save), not safetensors: memfit reads \
             safetensors; convert it in Python with `safetensors.torch.save_file(torch.load(PATH), \"model.safetensors\")`",
            path.display()
        ));
    }
    if bytes.trim_ascii_start().starts_with(b"{") {
        return Error::invalid(format!(
            "checkpoint {} is JSON, not safetensors: a training checkpoint (step-N.json) is continued with `memfit \
             train --resume DIR` naming its folder; --load takes a model saved with --save (.safetensors)",
            path.display()
        ));
    }
    Error::invalid(format!("checkpoint {} is not a valid safetensors file: {}", path.display(), describe(e)))
}

/// What kind of PyTorch `torch.save` file `bytes` start like, if any: a zip archive (PyTorch 1.6 and
/// later) or a bare pickle (protocol 2 and up start with 0x80 and the protocol number).
fn pytorch_pickle(bytes: &[u8]) -> Option<&'static str> {
    match bytes {
        [b'P', b'K', 3, 4, ..] => Some("a zip archive"),
        [0x80, 2..=5, ..] => Some("a pickle"),
        _ => None,
    }
}

fn context(path: &Path, name: &str, e: Error) -> Error {
    match e {
        Error::OutOfMemory(_) => e,
        other => Error::invalid(format!("checkpoint {}, tensor {name:?}: {other}", path.display())),
    }
}

fn describe(e: &SafeTensorError) -> String {
    match e {
        SafeTensorError::HeaderTooSmall => "shorter than the 8-byte header length (empty or truncated)".into(),
        SafeTensorError::InvalidHeaderLength => "the header length runs past the end of the file (truncated?)".into(),
        SafeTensorError::HeaderTooLarge => "the header length is implausibly large (corrupt)".into(),
        SafeTensorError::InvalidHeader | SafeTensorError::InvalidHeaderStart => "the header is not UTF-8 JSON".into(),
        SafeTensorError::InvalidHeaderDeserialization => "the header is not valid safetensors JSON".into(),
        SafeTensorError::MetadataIncompleteBuffer => {
            "the tensor data does not match the file size (truncated or padded)".into()
        }
        SafeTensorError::InvalidOffset(name) => format!("tensor {name:?} has invalid data offsets"),
        SafeTensorError::TensorInvalidInfo => "a tensor's byte size does not match its shape and dtype".into(),
        SafeTensorError::ValidationOverflow => "a tensor's shape overflows".into(),
        SafeTensorError::IoError(io) => format!("I/O error: {io}"),
        other => format!("{other}"),
    }
}

fn temporary_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(format!(".tmp{}", std::process::id()));
    path.with_file_name(name)
}

fn dtype_of(d: Dtype) -> Option<DType> {
    Some(match d {
        Dtype::F32 => DType::F32,
        Dtype::F64 => DType::F64,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I64 => DType::I64,
        Dtype::U8 => DType::U8,
        Dtype::BOOL => DType::Bool,
        _ => return None,
    })
}

fn safetensors_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I64 => Dtype::I64,
        DType::U8 => Dtype::U8,
        DType::Bool => Dtype::BOOL,
    }
}

/// A tensor's elements as little-endian bytes on the host, for serialization.
struct HostTensor {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl HostTensor {
    fn of(t: &Tensor) -> Result<Self> {
        fn le<T, const N: usize>(values: Vec<T>, f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
            values.into_iter().flat_map(f).collect()
        }
        let data = match t.dtype() {
            DType::F32 => le(t.to_vec::<f32>()?, f32::to_le_bytes),
            DType::F64 => le(t.to_vec::<f64>()?, f64::to_le_bytes),
            DType::F16 => le(t.to_vec::<half::f16>()?, half::f16::to_le_bytes),
            DType::BF16 => le(t.to_vec::<half::bf16>()?, half::bf16::to_le_bytes),
            DType::I64 => le(t.to_vec::<i64>()?, i64::to_le_bytes),
            DType::U8 => t.to_vec::<u8>()?,
            DType::Bool => t.to_vec::<bool>()?.into_iter().map(u8::from).collect(),
        };
        Ok(HostTensor { dtype: safetensors_dtype(t.dtype()), shape: t.shape().to_vec(), data })
    }
}

impl View for HostTensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Writes little-endian `bytes` of `dst`'s dtype into `dst` in place (nothing to do on meta). The
/// caller has checked the byte count and that bool bytes are 0 or 1.
fn fill_from_bytes(dst: &Tensor, bytes: &[u8]) -> Result<()> {
    if bytes.len() != dst.numel() * dst.dtype().size() {
        return Err(Error::invalid(format!("{} bytes do not hold {:?} {}", bytes.len(), dst.shape(), dst.dtype())));
    }
    fn decode<T: Element, const N: usize>(dst: &Tensor, bytes: &[u8], f: impl Fn([u8; N]) -> T) -> Result<()> {
        dst.overwrite_with::<T>(|values| {
            for (v, chunk) in values.iter_mut().zip(bytes.chunks_exact(N)) {
                *v = f(chunk.try_into().unwrap_or([0; N]));
            }
        })
    }
    match dst.dtype() {
        DType::F32 => decode(dst, bytes, f32::from_le_bytes),
        DType::F64 => decode(dst, bytes, f64::from_le_bytes),
        DType::F16 => decode(dst, bytes, half::f16::from_le_bytes),
        DType::BF16 => decode(dst, bytes, half::bf16::from_le_bytes),
        DType::I64 => decode(dst, bytes, i64::from_le_bytes),
        DType::U8 => decode(dst, bytes, |[b]: [u8; 1]| b),
        DType::Bool => decode(dst, bytes, |[b]: [u8; 1]| b == 1),
    }
}

/// A new tensor holding little-endian `bytes` of `dtype` (on meta: the same allocation, no data).
fn staging(device: &Device, dtype: DType, shape: &[usize], bytes: &[u8], category: Category) -> Result<Tensor> {
    let t = Tensor::empty(device, shape, dtype, category, "load")?;
    fill_from_bytes(&t, bytes)?;
    Ok(t)
}

fn has_bad_bool(bytes: &[u8]) -> bool {
    bytes.iter().any(|&b| b > 1)
}
