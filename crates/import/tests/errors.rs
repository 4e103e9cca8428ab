//! What is wrong with an archive is an error that names it, before anything runs: not a zip, not an
//! export, a schema version memfit does not read, an op it does not import, a corrupt weight.

use memfit_import::Archive;
use std::io::Write;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("memfit-import-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// A copy of `source` with each entry passed through `edit` (name, bytes) -> bytes, stored.
fn rewrite(source: &Path, target: &Path, edit: impl Fn(&str, Vec<u8>) -> Vec<u8>) {
    let mut zip = zip::ZipArchive::new(std::fs::File::open(source).unwrap()).unwrap();
    let mut out = zip::ZipWriter::new(std::fs::File::create(target).unwrap());
    let options = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for i in 0..zip.len() {
        let mut entry = zip.by_index(i).unwrap();
        let name = entry.name().to_string();
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut entry, &mut bytes).unwrap();
        out.start_file(name.as_str(), options).unwrap();
        out.write_all(&edit(&name, bytes)).unwrap();
    }
    out.finish().unwrap();
}

fn error_of(path: &Path) -> String {
    match Archive::open(path) {
        Ok(_) => panic!("{} opened", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_file_that_is_not_an_archive_is_named() {
    let path = temp("not-a-zip.pt2");
    std::fs::write(&path, b"hello").unwrap();
    let e = error_of(&path);
    assert!(e.contains("not-a-zip.pt2") && e.contains("not a torch.export archive"), "{e}");
    let e = error_of(&temp("missing.pt2"));
    assert!(e.contains("missing.pt2") && e.contains("cannot open"), "{e}");
}

#[test]
fn an_unknown_schema_major_version_is_refused_by_name() {
    let path = temp("schema9.pt2");
    rewrite(&fixture("tiny_mlp.pt2"), &path, |name, bytes| {
        if name.ends_with("models/model.json") {
            String::from_utf8(bytes).unwrap().replace("\"major\": 8", "\"major\": 9").into_bytes()
        } else {
            bytes
        }
    });
    let e = error_of(&path);
    assert!(e.contains("schema version 9.") && e.contains("reads 8.x"), "{e}");
}

#[test]
fn an_op_memfit_does_not_import_is_named_with_those_it_does() {
    let path = temp("unknown-op.pt2");
    rewrite(&fixture("tiny_mlp.pt2"), &path, |name, bytes| {
        if name.ends_with("models/model.json") {
            String::from_utf8(bytes)
                .unwrap()
                .replace("torch.ops.aten.relu.default", "torch.ops.aten.mish.default")
                .into_bytes()
        } else {
            bytes
        }
    });
    let e = error_of(&path);
    assert!(e.contains("torch.ops.aten.mish.default") && e.contains("torch.ops.aten.linear.default"), "{e}");
    // Where the user's model calls it: the module and the source line.
    assert!(e.contains("(from module 2, activation.py, line ") && e.contains("return F.relu(input"), "{e}");
}

#[test]
fn a_truncated_weight_is_a_corrupt_archive() {
    let path = temp("short-weight.pt2");
    rewrite(&fixture("tiny_mlp.pt2"), &path, |name, mut bytes| {
        if name.ends_with("data/weights/weight_1") {
            bytes.truncate(bytes.len() - 4);
        }
        bytes
    });
    let e = error_of(&path);
    assert!(e.contains("1.bias") && e.contains("corrupt"), "{e}");
}

/// Weights are read from the file when a program is made on a device that computes, never kept on
/// the host: with the file gone, meta still makes the program (it allocates only), and cpu says
/// which file it could not read.
#[test]
fn weights_are_read_from_the_file_only_where_they_are_computed_with() {
    let path = temp("gone.pt2");
    std::fs::copy(fixture("tiny_cnn.pt2"), &path).unwrap();
    let archive = std::sync::Arc::new(Archive::open(&path).unwrap());
    std::fs::remove_file(&path).unwrap();
    assert!(memfit_import::Program::new(archive.clone(), &memfit_tensor::Device::meta()).is_ok());
    let e = match memfit_import::Program::new(archive, &memfit_tensor::Device::cpu()) {
        Ok(_) => panic!("cpu made a program without the file"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("gone.pt2") && e.contains("cannot open"), "{e}");
}

/// `fill_` into a value a backward may have saved would change it behind autograd's back: only views
/// of a `new_zeros` (a mask the graph builds) may be filled.
#[test]
fn fill_into_an_activation_is_refused_by_name() {
    let path = temp("fill-activation.pt2");
    rewrite(&fixture("tiny_swin.pt2"), &path, |name, bytes| {
        if !name.ends_with("models/model.json") {
            return bytes;
        }
        // The first fill_ made to write into the patch embedding's output instead of the mask.
        let mut model: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        let nodes = model["graph_module"]["graph"]["nodes"].as_array_mut().unwrap();
        let conv = nodes.iter().find(|n| n["target"] == "torch.ops.aten.conv2d.default").unwrap()["outputs"][0]
            ["as_tensor"]["name"]
            .clone();
        let fill = nodes.iter_mut().find(|n| n["target"] == "torch.ops.aten.fill_.Scalar").unwrap();
        fill["inputs"][0]["arg"]["as_tensor"]["name"] = conv;
        serde_json::to_vec(&model).unwrap()
    });
    let archive = std::sync::Arc::new(Archive::open(&path).unwrap());
    let e = match memfit_import::Program::new(archive, &memfit_tensor::Device::meta()) {
        Ok(_) => panic!("a fill_ into an activation was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("fill_.Scalar writes into conv2d in place") && e.contains("new_zeros"), "{e}");
}
