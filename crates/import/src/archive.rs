//! Reading a `torch.export` archive: the zip, the graph in `models/model.json`, the weights in
//! `data/weights/`.
//!
//! Note [The pt2 archive] (as `torch.export.save` writes it, schema 8.x, torch 2.11-2.15): a zip, every
//! entry stored under one top-level folder `<name>/`. `<name>/models/model.json` is the exported
//! program: `schema_version` {major, minor}; `graph_module.graph` with `inputs` and `outputs` (values by
//! name), `nodes` (each `target` such as `torch.ops.aten.linear.default`, `inputs` as
//! `{name, arg: {as_tensor: {name}} | {as_tensors: [{name}...]} | {as_int} | {as_ints} | {as_float} |
//! {as_bool} | {as_none} ...}`, `outputs` as `{as_tensor: {name}}`, or one `{as_tensors: [...]}` for an
//! op of several results such as `split`) and `tensor_values` (each value's dtype and sizes: a size is
//! `{as_int}` or, for a dynamic dimension, `{as_expr}`); `graph_module.signature.input_specs` says what
//! each graph input is (`parameter` with its `parameter_name`, `buffer` with its `buffer_name`,
//! `user_input`), `output_specs` which outputs are the user's. `<name>/data/weights/
//! model_weights_config.json` maps each `state_dict` name to `path_name` (the file beside it, raw
//! little-endian bytes) and `tensor_meta` (dtype code, sizes, strides). Dtype codes are the schema's
//! `ScalarType`: 7 is float32. Only the major version is checked: minor versions add fields, which
//! are ignored.

use crate::{ImportError, Result};
use serde_json::Value;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The schema major version this reader knows.
pub const SCHEMA_MAJOR: u64 = 8;

/// The schema's dtype code of float32 (`ScalarType.FLOAT`).
pub const FLOAT32: u64 = 7;
/// The schema's dtype code of int64 (`ScalarType.LONG`).
pub const INT64: u64 = 5;
/// The schema's dtype code of bool (`ScalarType.BOOL`).
pub const BOOL: u64 = 12;

/// An op's argument, as the graph gives it.
#[derive(Clone, Debug, PartialEq)]
pub enum Arg {
    /// A graph value by name.
    Tensor(String),
    /// A list of graph values (`cat`'s `tensors`).
    Tensors(Vec<String>),
    Int(i64),
    Ints(Vec<i64>),
    Float(f64),
    Bool(bool),
    Str(String),
    /// Sizes, each a number or a symbol a `sym_size` node defined.
    SymInts(Vec<SymInt>),
    /// A symbolic integer by name (a `sym_size` node's, or arithmetic on one).
    Sym(String),
    /// A dtype, by the schema's code.
    ScalarType(u64),
    None,
    /// A kind this reader does not interpret (named, for the error if an op needs it).
    Other(String),
}

/// A size in a graph: a number, or a symbol (a dimension known when the graph runs: the batch).
#[derive(Clone, Debug, PartialEq)]
pub enum SymInt {
    Int(i64),
    Name(String),
}

/// One node of the graph: an op and its named arguments, and the values it defines.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// `torch.ops.aten.linear.default`, ...
    pub target: String,
    pub args: Vec<(String, Arg)>,
    pub outputs: Vec<String>,
    /// The modules the node was called from, outermost first, by path (`encoder.layers.0.mlp`); the
    /// root module is not listed. From the node's `nn_module_stack` metadata; empty when absent.
    pub modules: Vec<String>,
    /// Where in the user's Python source the node was called: the innermost frame of its
    /// `stack_trace` (`model.py, line 12: x = self.fc(x)`), when the export recorded one.
    pub source: Option<String>,
}

impl Node {
    /// The argument named `name`, if given.
    pub fn arg(&self, name: &str) -> Option<&Arg> {
        self.args.iter().find(|(n, _)| n == name).map(|(_, a)| a)
    }

    /// Where the node comes from, for a message: its module and source line, as far as known.
    pub fn location(&self) -> String {
        let module = self.modules.last().map_or("the model itself".to_string(), |m| format!("module {m}"));
        match &self.source {
            Some(source) => format!("{module}, {source}"),
            None => module,
        }
    }

    /// Every symbolic size the node reads (a view's sizes, arithmetic's operands).
    pub fn size_reads(&self) -> impl Iterator<Item = &str> {
        self.args.iter().flat_map(|(_, arg)| {
            let names: Vec<&str> = match arg {
                Arg::Sym(n) => vec![n.as_str()],
                Arg::SymInts(list) => list
                    .iter()
                    .filter_map(|s| match s {
                        SymInt::Name(n) => Some(n.as_str()),
                        SymInt::Int(_) => None,
                    })
                    .collect(),
                _ => Vec::new(),
            };
            names
        })
    }

    /// Every graph value the node reads, in its arguments' order (a list's values one by one).
    pub fn reads(&self) -> impl Iterator<Item = &str> {
        self.args
            .iter()
            .flat_map(|(_, arg)| match arg {
                Arg::Tensor(t) => std::slice::from_ref(t),
                Arg::Tensors(list) => list.as_slice(),
                _ => &[],
            })
            .map(String::as_str)
    }
}

/// What a graph input is.
#[derive(Clone, Debug, PartialEq)]
pub enum GraphInput {
    /// A trainable weight: the graph value and its `state_dict` name.
    Parameter { value: String, name: String },
    /// A buffer (batch norm's running statistics, a mask): the graph value and its `state_dict` name.
    Buffer { value: String, name: String },
    /// The user's input.
    User { value: String },
}

/// A weight of the archive: its `state_dict` name, shape, dtype and the zip entry holding its bytes
/// (little-endian). The bytes are read when a program is made on a device that computes
/// ([`Archive::weight_reader`]), never kept on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct Weight {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: WeightDtype,
    pub entry: String,
}

/// The dtypes a weight may have: float32 parameters and buffers; int64 and bool buffers (batch norm's
/// `num_batches_tracked`, an attention mask).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDtype {
    F32,
    I64,
    Bool,
}

impl WeightDtype {
    /// Bytes per value.
    pub fn size(self) -> usize {
        match self {
            WeightDtype::F32 => 4,
            WeightDtype::I64 => 8,
            WeightDtype::Bool => 1,
        }
    }
}

impl Weight {
    /// How many values it holds.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Reads weights' bytes from an archive, one at a time through one buffer.
pub struct WeightReader {
    zip: zip::ZipArchive<std::fs::File>,
    path: PathBuf,
    buffer: Vec<u8>,
}

impl WeightReader {
    /// `weight`'s bytes, checked to be its size.
    pub fn read(&mut self, weight: &Weight) -> Result<&[u8]> {
        self.buffer.clear();
        let mut file = self
            .zip
            .by_name(&weight.entry)
            .map_err(|e| error(&self.path, format!("no {} in the archive: {e}", weight.entry)))?;
        file.read_to_end(&mut self.buffer)
            .map_err(|e| error(&self.path, format!("cannot read {}: {e}", weight.entry)))?;
        let expected = weight.numel() * weight.dtype.size();
        if self.buffer.len() != expected {
            return Err(error(
                &self.path,
                format!("{}: {} bytes where {expected} were checked: the file changed", weight.name, self.buffer.len()),
            ));
        }
        Ok(&self.buffer)
    }
}

/// An exported program: its graph, its inputs and outputs, and its weights.
#[derive(Clone, Debug)]
pub struct Archive {
    /// The file it was read from (its weights are read from it again).
    pub path: PathBuf,
    /// The archive's top-level folder (the name it was saved under).
    pub name: String,
    pub inputs: Vec<GraphInput>,
    pub nodes: Vec<Node>,
    /// The user's outputs, by value name.
    pub outputs: Vec<String>,
    /// Each graph value's dtype and sizes.
    pub values: Vec<ValueMeta>,
    pub weights: Vec<Weight>,
}

/// A graph value's dtype (the schema's code: [`FLOAT32`], [`INT64`]) and sizes (None for a dynamic
/// dimension, such as the batch).
#[derive(Clone, Debug, PartialEq)]
pub struct ValueMeta {
    pub name: String,
    pub dtype: u64,
    pub sizes: Vec<Option<usize>>,
}

impl Archive {
    /// The value named `name`'s dtype and sizes.
    pub fn value(&self, name: &str) -> Option<&ValueMeta> {
        self.values.iter().find(|v| v.name == name)
    }

    /// The user's inputs, by value name.
    pub fn user_inputs(&self) -> Vec<&str> {
        self.inputs
            .iter()
            .filter_map(|i| match i {
                GraphInput::User { value } => Some(value.as_str()),
                _ => None,
            })
            .collect()
    }
}

fn error(path: &Path, what: impl std::fmt::Display) -> ImportError {
    ImportError::Archive(format!("{}: {what}", path.display()))
}

impl Archive {
    /// Reads the archive at `path` (Note [The pt2 archive]). Every op is checked against the ops memfit
    /// runs ([`crate::SUPPORTED_OPS`]) before a weight is read.
    pub fn open(path: &Path) -> Result<Archive> {
        let file = std::fs::File::open(path).map_err(|e| error(path, format!("cannot open: {e}")))?;
        let mut zip = zip::ZipArchive::new(file).map_err(|e| {
            error(path, format!("not a torch.export archive (a .pt2 file is a zip, written by torch.export.save): {e}"))
        })?;
        let model_json = (0..zip.len())
            .filter_map(|i| zip.name_for_index(i).map(str::to_string))
            .find(|n| n.ends_with("/models/model.json") && n.matches('/').count() == 2)
            .ok_or_else(|| {
                error(path, "no <name>/models/model.json: not a torch.export archive (torch.export.save)")
            })?;
        let name = model_json.split('/').next().unwrap_or_default().to_string();
        let model: Value = serde_json::from_slice(&read_entry(&mut zip, path, &model_json)?)
            .map_err(|e| error(path, format!("{model_json} is not JSON: {e}")))?;
        check_schema(path, &model)?;
        let graph = &model["graph_module"]["graph"];
        let nodes = parse_nodes(path, graph)?;
        for node in &nodes {
            if !crate::SUPPORTED_OPS.contains(&node.target.as_str()) {
                return Err(error(
                    path,
                    format!(
                        "the graph calls {} (from {}), which memfit does not import yet (it imports {})",
                        node.target,
                        node.location(),
                        crate::SUPPORTED_OPS.join(", ")
                    ),
                ));
            }
        }
        let inputs = parse_inputs(path, &model["graph_module"]["signature"])?;
        let outputs = parse_outputs(path, &model["graph_module"]["signature"])?;
        let values = parse_values(graph);
        let config_name = format!("{name}/data/weights/model_weights_config.json");
        let wanted: Vec<&str> = inputs
            .iter()
            .filter_map(|i| match i {
                GraphInput::Parameter { name, .. } | GraphInput::Buffer { name, .. } => Some(name.as_str()),
                GraphInput::User { .. } => None,
            })
            .collect();
        let weights = if wanted.is_empty() {
            Vec::new()
        } else {
            let config: Value = serde_json::from_slice(&read_entry(&mut zip, path, &config_name)?)
                .map_err(|e| error(path, format!("{config_name} is not JSON: {e}")))?;
            let mut weights = Vec::with_capacity(wanted.len());
            for w in wanted {
                weights.push(read_weight(&mut zip, path, &name, &config["config"], w)?);
            }
            weights
        };
        Ok(Archive { path: path.to_path_buf(), name, inputs, nodes, outputs, values, weights })
    }

    /// Opens the archive again to read its weights' bytes (see [`Weight`]).
    pub fn weight_reader(&self) -> Result<WeightReader> {
        let file = std::fs::File::open(&self.path).map_err(|e| error(&self.path, format!("cannot open: {e}")))?;
        let zip = zip::ZipArchive::new(file).map_err(|e| error(&self.path, format!("no longer a zip: {e}")))?;
        Ok(WeightReader { zip, path: self.path.clone(), buffer: Vec::new() })
    }
}

fn read_entry(zip: &mut zip::ZipArchive<std::fs::File>, path: &Path, entry: &str) -> Result<Vec<u8>> {
    let mut file = zip.by_name(entry).map_err(|e| error(path, format!("no {entry} in the archive: {e}")))?;
    // Grown as the bytes come, not sized by what the entry claims.
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).map_err(|e| error(path, format!("cannot read {entry}: {e}")))?;
    Ok(bytes)
}

fn check_schema(path: &Path, model: &Value) -> Result<()> {
    let version = &model["schema_version"];
    let (major, minor) = (version["major"].as_u64(), version["minor"].as_u64());
    match major {
        Some(SCHEMA_MAJOR) => Ok(()),
        Some(m) => Err(error(
            path,
            format!(
                "torch.export schema version {m}.{} is not one memfit reads (it reads {SCHEMA_MAJOR}.x, written by \
                 torch 2.11-2.15): export it with such a torch",
                minor.unwrap_or(0)
            ),
        )),
        None => Err(error(path, "models/model.json has no schema_version: not a torch.export program")),
    }
}

fn value_name(v: &Value) -> Option<String> {
    v["as_tensor"]["name"].as_str().map(str::to_string)
}

/// A node output's names: a tensor's, a symbolic integer's, or each of a list's (`split`'s pieces).
fn output_names(v: &Value) -> Vec<String> {
    if let Some(list) = v["as_tensors"].as_array() {
        return list.iter().filter_map(|t| t["name"].as_str().map(str::to_string)).collect();
    }
    value_name(v).or_else(|| v["as_sym_int"]["as_name"].as_str().map(str::to_string)).into_iter().collect()
}

fn parse_arg(arg: &Value) -> Arg {
    let Some((kind, v)) = arg.as_object().and_then(|o| o.iter().next()) else { return Arg::Other("empty".into()) };
    match kind.as_str() {
        "as_tensor" => v["name"].as_str().map_or(Arg::Other(kind.clone()), |n| Arg::Tensor(n.into())),
        "as_tensors" => v
            .as_array()
            .and_then(|a| a.iter().map(|t| t["name"].as_str().map(str::to_string)).collect::<Option<Vec<_>>>())
            .map_or(Arg::Other(kind.clone()), Arg::Tensors),
        "as_int" => v.as_i64().map_or(Arg::Other(kind.clone()), Arg::Int),
        "as_ints" => v
            .as_array()
            .and_then(|a| a.iter().map(Value::as_i64).collect::<Option<Vec<_>>>())
            .map_or(Arg::Other(kind.clone()), Arg::Ints),
        "as_float" => match v {
            Value::Number(n) => n.as_f64().map_or(Arg::Other(kind.clone()), Arg::Float),
            // Infinities and NaN are strings in the schema's JSON.
            Value::String(s) => s.parse::<f64>().map_or(Arg::Other(kind.clone()), Arg::Float),
            _ => Arg::Other(kind.clone()),
        },
        "as_bool" => v.as_bool().map_or(Arg::Other(kind.clone()), Arg::Bool),
        "as_scalar_type" => v.as_u64().map_or(Arg::Other(kind.clone()), Arg::ScalarType),
        "as_string" => v.as_str().map_or(Arg::Other(kind.clone()), |s| Arg::Str(s.to_string())),
        "as_sym_int" => match (v["as_int"].as_i64(), v["as_name"].as_str()) {
            (Some(i), _) => Arg::Int(i),
            (None, Some(n)) => Arg::Sym(n.to_string()),
            _ => Arg::Other(kind.clone()),
        },
        "as_sym_ints" => v
            .as_array()
            .and_then(|a| {
                a.iter()
                    .map(|d| match (d["as_int"].as_i64(), d["as_name"].as_str()) {
                        (Some(i), _) => Some(SymInt::Int(i)),
                        (None, Some(n)) => Some(SymInt::Name(n.to_string())),
                        _ => None,
                    })
                    .collect::<Option<Vec<_>>>()
            })
            .map_or(Arg::Other(kind.clone()), Arg::SymInts),
        "as_none" => Arg::None,
        _ => Arg::Other(kind.clone()),
    }
}

/// `file.py, line N: code` of a Python stack trace's last frame (`File "/x/file.py", line N, in f` and
/// the code on the line after).
fn innermost_frame(trace: &str) -> Option<String> {
    let start = trace.rfind("File \"")?;
    let frame = &trace[start + 6..];
    let (file, rest) = frame.split_once('"')?;
    let line = rest.trim_start_matches(", line ").split(|c: char| !c.is_ascii_digit()).next()?;
    let file = file.rsplit('/').next().unwrap_or(file);
    let code = rest.split_once('\n').map(|(_, code)| code.trim()).filter(|c| !c.is_empty());
    Some(match code {
        Some(code) => format!("{file}, line {line}: {code}"),
        None => format!("{file}, line {line}"),
    })
}

fn parse_nodes(path: &Path, graph: &Value) -> Result<Vec<Node>> {
    let nodes = graph["nodes"].as_array().ok_or_else(|| error(path, "the graph has no nodes list"))?;
    nodes
        .iter()
        .map(|n| {
            let target = n["target"].as_str().ok_or_else(|| error(path, "a graph node without a target"))?;
            let args = n["inputs"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|i| (i["name"].as_str().unwrap_or_default().to_string(), parse_arg(&i["arg"])))
                        .collect()
                })
                .unwrap_or_default();
            let outputs =
                n["outputs"].as_array().map(|o| o.iter().flat_map(output_names).collect()).unwrap_or_default();
            let metadata = &n["metadata"];
            // `key,path,class` per module, outermost first; the root's path is empty.
            let modules = metadata["nn_module_stack"]
                .as_str()
                .map(|stack| {
                    stack
                        .split(';')
                        .filter_map(|entry| entry.split(',').nth(1))
                        .filter(|path| !path.is_empty())
                        .map(str::to_string)
                        .collect()
                })
                .unwrap_or_default();
            let source = metadata["stack_trace"].as_str().and_then(innermost_frame);
            Ok(Node { target: target.to_string(), args, outputs, modules, source })
        })
        .collect()
}

fn parse_inputs(path: &Path, signature: &Value) -> Result<Vec<GraphInput>> {
    let specs = signature["input_specs"].as_array().ok_or_else(|| error(path, "the signature has no input_specs"))?;
    specs
        .iter()
        .map(|spec| {
            if let Some(p) = spec.get("parameter") {
                let value = p["arg"]["name"].as_str().unwrap_or_default().to_string();
                let name = p["parameter_name"].as_str().unwrap_or_default().to_string();
                return Ok(GraphInput::Parameter { value, name });
            }
            if let Some(b) = spec.get("buffer") {
                let value = b["arg"]["name"].as_str().unwrap_or_default().to_string();
                let name = b["buffer_name"].as_str().unwrap_or_default().to_string();
                return Ok(GraphInput::Buffer { value, name });
            }
            if let Some(u) = spec.get("user_input") {
                let value = value_name(&u["arg"])
                    .ok_or_else(|| error(path, "a user input that is not a tensor (memfit takes one tensor input)"))?;
                return Ok(GraphInput::User { value });
            }
            let kind = spec.as_object().and_then(|o| o.keys().next().cloned()).unwrap_or_default();
            Err(error(path, format!("an input of kind {kind:?}, which memfit does not import yet")))
        })
        .collect()
}

fn parse_outputs(path: &Path, signature: &Value) -> Result<Vec<String>> {
    let specs = signature["output_specs"].as_array().ok_or_else(|| error(path, "the signature has no output_specs"))?;
    specs
        .iter()
        .map(|spec| match spec.get("user_output") {
            Some(u) => value_name(&u["arg"]).ok_or_else(|| error(path, "a user output that is not a tensor")),
            None => {
                let kind = spec.as_object().and_then(|o| o.keys().next().cloned()).unwrap_or_default();
                Err(error(
                    path,
                    format!("an output of kind {kind:?} (a buffer mutation?), which memfit does not import yet"),
                ))
            }
        })
        .collect()
}

fn parse_values(graph: &Value) -> Vec<ValueMeta> {
    let Some(values) = graph["tensor_values"].as_object() else { return Vec::new() };
    values
        .iter()
        .map(|(name, meta)| {
            let sizes = meta["sizes"]
                .as_array()
                .map(|s| s.iter().map(|d| d["as_int"].as_u64().map(|v| v as usize)).collect())
                .unwrap_or_default();
            ValueMeta { name: name.clone(), dtype: meta["dtype"].as_u64().unwrap_or(u64::MAX), sizes }
        })
        .collect()
}

fn read_weight(
    zip: &mut zip::ZipArchive<std::fs::File>,
    path: &Path,
    folder: &str,
    config: &Value,
    name: &str,
) -> Result<Weight> {
    let entry = &config[name];
    let file = entry["path_name"]
        .as_str()
        .ok_or_else(|| error(path, format!("the weights config has no entry for {name}")))?;
    let meta = &entry["tensor_meta"];
    let dtype = meta["dtype"].as_u64().unwrap_or(u64::MAX);
    let is_param = entry["is_param"].as_bool().unwrap_or(true);
    let imported = dtype == FLOAT32 || ((dtype == INT64 || dtype == BOOL) && !is_param);
    if !imported {
        return Err(error(
            path,
            format!(
                "{name} has dtype code {dtype}; memfit imports float32 weights (code {FLOAT32}) and int64 or bool \
                 buffers (codes {INT64}, {BOOL}): export in float32"
            ),
        ));
    }
    let dims = |key: &str| -> Option<Vec<usize>> {
        meta[key].as_array()?.iter().map(|d| d["as_int"].as_u64().map(|v| v as usize)).collect()
    };
    let shape = dims("sizes").ok_or_else(|| error(path, format!("{name}: sizes are not plain integers")))?;
    let strides = dims("strides").ok_or_else(|| error(path, format!("{name}: strides are not plain integers")))?;
    let mut expected = 1;
    for (i, &d) in shape.iter().enumerate().rev() {
        if d > 1 && strides[i] != expected {
            return Err(error(path, format!("{name} is not contiguous (strides {strides:?} for sizes {shape:?})")));
        }
        expected *= d;
    }
    let dtype = match dtype {
        INT64 => WeightDtype::I64,
        BOOL => WeightDtype::Bool,
        _ => WeightDtype::F32,
    };
    let numel: usize = shape.iter().product();
    let entry_name = format!("{folder}/data/weights/{file}");
    let stored =
        zip.by_name(&entry_name).map_err(|e| error(path, format!("no {entry_name} in the archive: {e}")))?.size();
    if stored != (numel * dtype.size()) as u64 {
        return Err(error(
            path,
            format!(
                "{name}: {stored} bytes for {numel} values of {} bytes, shape {shape:?}: a corrupt archive",
                dtype.size()
            ),
        ));
    }
    Ok(Weight { name: name.to_string(), shape, dtype, entry: entry_name })
}
