//! The files memfit reads and writes, checked in one place (Note [Paths]).
//!
//! Note [Paths]: every output is validated before any work, so a bad path costs no training time:
//! its directory exists and is writable; it is not a symbolic link (memfit does not follow one into a
//! file the user did not name), a directory, a device or any other non-regular file; and it is not the
//! same file as another output or an input. Outputs are written by [`write_atomic`] only: a temporary
//! file in the same directory, fsync'ed, renamed over the target, then the directory fsync'ed, so an
//! interrupted write leaves the old file or the new one, never half of one, and a device node or a
//! symlink placed there meanwhile is refused rather than replaced. Inputs must be regular files
//! ([`check_input`]): reading `/dev/zero` or a FIFO would never end.

use crate::error::TrainError;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// What a path is for: the flag that named it (for messages), the path, and whether it is a file
/// or a directory memfit fills.
#[derive(Clone, Debug)]
pub struct NamedPath {
    pub flag: String,
    pub path: PathBuf,
    pub kind: PathKind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathKind {
    File,
    Directory,
}

impl NamedPath {
    pub fn file(flag: &str, path: &Path) -> NamedPath {
        NamedPath { flag: flag.to_string(), path: path.to_path_buf(), kind: PathKind::File }
    }

    pub fn dir(flag: &str, path: &Path) -> NamedPath {
        NamedPath { flag: flag.to_string(), path: path.to_path_buf(), kind: PathKind::Directory }
    }
}

fn refuse(flag: &str, path: &Path, why: impl std::fmt::Display) -> TrainError {
    TrainError::Invalid(format!("{flag} {}: {why}", path.display()))
}

/// What kind of non-regular file `meta` describes, for messages.
fn describe(meta: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_symlink() {
        "a symbolic link"
    } else if t.is_block_device() || t.is_char_device() {
        "a device"
    } else if t.is_fifo() {
        "a named pipe"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// Errors unless `path` is a regular file memfit can read (a symbolic link to one is fine: it names
/// what the user chose to read).
pub fn check_input(flag: &str, path: &Path) -> Result<(), TrainError> {
    let meta = std::fs::metadata(path).map_err(|e| refuse(flag, path, format!("cannot read it: {e}")))?;
    if !meta.is_file() {
        return Err(refuse(flag, path, format!("it is {}, not a regular file; name a file", describe(&meta))));
    }
    Ok(())
}

/// The directory a file path lives in ("." for a bare name).
fn parent_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Where `path` is on disk, to compare paths: the canonical directory plus the file name (the file
/// itself may not exist yet).
fn identity(path: &Path) -> Option<PathBuf> {
    if let Ok(p) = std::fs::canonicalize(path) {
        return Some(p);
    }
    Some(std::fs::canonicalize(parent_of(path)).ok()?.join(path.file_name()?))
}

/// A unique temporary name beside `path`.
fn temporary_beside(path: &Path) -> PathBuf {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut name = std::ffi::OsString::from(".");
    name.push(path.file_name().unwrap_or_default());
    name.push(format!(".memfit-{}-{}.tmp", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed)));
    parent_of(path).join(name)
}

/// Errors unless an existing `path` may be replaced: only a regular file, never a symlink or a device.
fn check_replaceable(flag: &str, path: &Path) -> Result<(), TrainError> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(refuse(flag, path, e)),
        Ok(m) if m.file_type().is_symlink() => {
            Err(refuse(flag, path, "it is a symbolic link; memfit does not write through links: name the file itself"))
        }
        Ok(m) if !m.is_file() => {
            Err(refuse(flag, path, format!("it is {}; memfit writes only regular files: name a file", describe(&m))))
        }
        Ok(_) => Ok(()),
    }
}

/// Errors unless `dir` is a directory memfit can create files in (probed by creating one).
pub(crate) fn check_writable_dir(flag: &str, path: &Path, dir: &Path) -> Result<(), TrainError> {
    match std::fs::metadata(dir) {
        Err(_) => {
            return Err(refuse(
                flag,
                path,
                format!(
                    "the directory {} does not exist: create it first, or name a file in an existing one",
                    dir.display()
                ),
            ))
        }
        Ok(m) if !m.is_dir() => {
            return Err(refuse(flag, path, format!("{} is not a directory: name a file in a directory", dir.display())))
        }
        Ok(_) => {}
    }
    let probe = temporary_beside(&dir.join("probe"));
    match OpenOptions::new().write(true).create_new(true).open(&probe) {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => Err(refuse(flag, path, format!("cannot create files in {}: {e}", dir.display()))),
    }
}

/// The files a profile directory holds (and the only ones memfit writes there).
pub const PROFILE_FILES: [&str; 5] = ["memory.html", "snapshot.pickle", "trace.json", "summary.txt", "summary.json"];

/// Errors unless `dir` can take a profile: a directory that does not exist yet (it is created), or one
/// that holds nothing but an earlier profile's files (they are replaced). Checked before a run starts,
/// so a bad `--out` costs no training time and no user file is ever overwritten.
pub fn check_profile_dir(dir: &Path) -> Result<(), TrainError> {
    let bad = |why: String| TrainError::Invalid(format!("cannot write a profile to {}: {why}", dir.display()));
    match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(bad(e.to_string())),
        Ok(meta) if !meta.is_dir() => Err(bad("it exists and is not a directory; name a new directory".into())),
        Ok(_) => {
            let entries = std::fs::read_dir(dir).map_err(|e| bad(e.to_string()))?;
            for entry in entries {
                let entry = entry.map_err(|e| bad(e.to_string()))?;
                let name = entry.file_name();
                let ours = PROFILE_FILES.iter().any(|f| name == *f);
                let regular = entry.file_type().is_ok_and(|t| t.is_file());
                if !(ours && regular) {
                    return Err(bad(format!(
                        "it already holds {:?}, which is not a memfit profile file; name a new or empty directory",
                        name
                    )));
                }
            }
            Ok(())
        }
    }
}

/// Checks every output before any work (Note [Paths]): each can be written, and no two paths (outputs
/// among themselves, or an output and an input) are the same file.
pub fn check_outputs(outputs: &[NamedPath], inputs: &[NamedPath]) -> Result<(), TrainError> {
    for out in outputs {
        match out.kind {
            PathKind::File => {
                check_replaceable(&out.flag, &out.path)?;
                check_writable_dir(&out.flag, &out.path, &parent_of(&out.path))?;
            }
            PathKind::Directory => {
                check_profile_dir(&out.path).map_err(|e| TrainError::Invalid(format!("{}: {e}", out.flag)))?;
                // The directory, or the nearest existing folder it will be created in, must take files.
                let existing = out.path.ancestors().find(|a| !a.as_os_str().is_empty() && a.exists());
                check_writable_dir(&out.flag, &out.path, existing.unwrap_or(Path::new(".")))?;
            }
        }
    }
    let ids: Vec<(&NamedPath, Option<PathBuf>)> =
        outputs.iter().chain(inputs).map(|p| (p, identity(&p.path))).collect();
    for (i, (a, ida)) in ids.iter().enumerate().take(outputs.len()) {
        for (b, idb) in &ids[i + 1..] {
            let same = match (ida, idb) {
                (Some(x), Some(y)) => x == y || same_inode(x, y),
                _ => false,
            };
            if same {
                return Err(TrainError::Invalid(format!(
                    "{} {} and {} {} are the same file: give each its own path",
                    a.flag,
                    a.path.display(),
                    b.flag,
                    b.path.display()
                )));
            }
        }
    }
    Ok(())
}

/// Two existing paths that are hard links of one file.
fn same_inode(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

/// Writes `bytes` to `path` atomically and durably (Note [Paths]): temporary file in the same
/// directory, fsync, rename over the target, fsync the directory. Refuses to replace anything but a
/// regular file. `flag` names the output in messages.
pub fn write_atomic(flag: &str, path: &Path, bytes: &[u8]) -> Result<(), TrainError> {
    check_replaceable(flag, path)?;
    let fail = |e: std::io::Error| refuse(flag, path, format!("cannot write it: {e}"));
    let tmp = temporary_beside(path);
    let written = (|| -> std::io::Result<()> {
        let mut file = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        Ok(())
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(fail(e));
    }
    // Checked again just before the rename: a device or link put there since is not replaced.
    if let Err(e) = check_replaceable(flag, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(fail(e));
    }
    File::open(parent_of(path)).and_then(|d| d.sync_all()).map_err(fail)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("memfit-output-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn write_atomic_replaces_regular_files_and_nothing_else() {
        let dir = scratch("atomic");
        let file = dir.join("out.json");
        write_atomic("--report", &file, b"one").unwrap();
        write_atomic("--report", &file, b"two").unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"two");
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("out.json")], "no temporary file is left behind");
        let link = dir.join("link.json");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        let e = write_atomic("--save", &link, b"three").unwrap_err().to_string();
        assert!(e.contains("--save") && e.contains("symbolic link"), "{e}");
        assert_eq!(std::fs::read(&file).unwrap(), b"two", "the link's target is untouched");
        let e = write_atomic("--save", Path::new("/dev/null"), b"x").unwrap_err().to_string();
        assert!(e.contains("a device"), "{e}");
        let e = write_atomic("--save", &dir, b"x").unwrap_err().to_string();
        assert!(e.contains("a directory"), "{e}");
    }

    #[test]
    fn two_names_of_one_file_are_the_same_output() {
        let dir = scratch("same");
        let a = dir.join("a.safetensors");
        std::fs::write(&a, b"x").unwrap();
        let hard = dir.join("b.safetensors");
        std::fs::hard_link(&a, &hard).unwrap();
        let outputs = [NamedPath::file("--save", &a)];
        let e = check_outputs(&outputs, &[NamedPath::file("--load", &hard)]).unwrap_err().to_string();
        assert!(e.contains("the same file"), "{e}");
        // A relative and an absolute name of one new file.
        let dotted = dir.join(".").join("c.json");
        let outputs = [NamedPath::file("--save", &dir.join("c.json")), NamedPath::file("--report", &dotted)];
        assert!(check_outputs(&outputs, &[]).unwrap_err().to_string().contains("the same file"));
        let distinct =
            [NamedPath::file("--save", &dir.join("c.json")), NamedPath::file("--report", &dir.join("d.json"))];
        check_outputs(&distinct, &[]).unwrap();
        // A profile directory whose parent folder does not exist yet is created; one under a file is refused.
        check_outputs(&[NamedPath::dir("--out", &dir.join("new").join("profile"))], &[]).unwrap();
        let under_file = a.join("profile");
        assert!(check_outputs(&[NamedPath::dir("--out", &under_file)], &[]).is_err());
    }

    #[test]
    fn inputs_must_be_regular_files() {
        let dir = scratch("inputs");
        for (path, kind) in [(Path::new("/dev/zero"), "a device"), (dir.as_path(), "a directory")] {
            let e = check_input("--load", path).unwrap_err().to_string();
            assert!(e.contains("--load") && e.contains(kind), "{e}");
        }
        let missing = check_input("--data", &dir.join("missing.txt")).unwrap_err().to_string();
        assert!(missing.contains("--data") && missing.contains("cannot read it"), "{missing}");
    }
}
