//! `DataError`: every way loading or batching data (images or text) can
//! fail, with messages that name the file (or call), say what is wrong and
//! what to do about it.

use std::fmt;
use std::io;
use std::path::PathBuf;

/// The four Fashion-MNIST IDX file names, as listed in error messages.
pub(crate) const FASHION_FILES_HINT: &str = "train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, \
t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz; gzip-compressed or not";

/// An error while reading IDX files, loading Fashion-MNIST or a text, or
/// filling a batch.
///
/// `name` fields hold the file's path (or, for embedded data, its name) as
/// shown to the user.
#[derive(Debug)]
#[non_exhaustive]
pub enum DataError {
    /// The `--data` folder does not exist or is not a folder.
    MissingDir { path: PathBuf },
    /// `--data` names a file where a folder of IDX files was expected (a text, for the GPT, given to an
    /// image model).
    NotAFolder { path: PathBuf },
    /// One of the four Fashion-MNIST files is not in the folder (neither
    /// `name.gz` nor the uncompressed `name`).
    MissingFile { path: PathBuf },
    /// Reading or writing a file failed at the operating-system level.
    Io { path: PathBuf, source: io::Error },
    /// The file starts with the gzip magic but does not decompress.
    Gzip { name: String, detail: String },
    /// The IDX magic number is not the expected one.
    BadMagic { name: String, expected: u32, found: u32 },
    /// The header announces impossible or unexpected dimensions.
    BadDimensions { name: String, detail: String },
    /// The file is shorter than its header (or its header) says.
    Truncated { name: String, detail: String },
    /// The file has bytes after the payload its header announces.
    TrailingBytes { name: String, detail: String, extra: usize },
    /// A label is not a class index (Fashion-MNIST: 0..=9).
    LabelOutOfRange { name: String, index: usize, label: u8, num_classes: usize },
    /// The image file and the label file hold different numbers of samples.
    CountMismatch { images_name: String, images: usize, labels_name: String, labels: usize },
    /// Two files of a data set disagree (e.g. train and validation image sizes).
    Inconsistent { detail: String },
    /// `fill_batch` was given output slices of the wrong length.
    BatchShape { what: &'static str, expected: usize, found: usize, detail: String },
    /// `fill_batch` was given a sample index past the end of the split.
    IndexOutOfRange { index: usize, len: usize },
    /// A text path names a folder, not a file.
    NotAFile { path: PathBuf },
    /// A text (file or embedded) has no characters.
    EmptyText { name: String },
    /// A text file is not valid UTF-8; `offset` is the byte offset of the
    /// first invalid byte (in the decompressed text for gzip files).
    NotUtf8 { name: String, offset: usize },
    /// The training or validation part of a text is shorter than one window
    /// of `context + 1` characters.
    TextTooShort { name: String, train: usize, val: usize, context: usize },
    /// A context (window length) of 0 characters was asked for.
    ZeroContext,
    /// A model vocabulary smaller than the text's characters was asked for.
    VocabTooSmall { name: String, requested: usize, chars: usize },
    /// A character to encode is not in the model's vocabulary; `position`
    /// counts characters (not bytes) from 0.
    UnknownChar { ch: char, position: usize, vocab_len: usize },
    /// A stored vocabulary is empty, unsorted or has a repeated character.
    BadVocab { detail: String },
    /// `fill_windows` was given output slices of the wrong length.
    WindowShape { what: &'static str, expected: usize, found: usize, detail: String },
    /// `fill_windows` was given a window start whose window does not fit.
    WindowOutOfRange { start: usize, context: usize, len: usize },
}

const DAMAGED: &str = "the file is damaged, download or reinstall it";

impl fmt::Display for DataError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DataError::MissingDir { path } => write!(
                f,
                "missing folder {}: --data must name a folder with the four Fashion-MNIST IDX files ({FASHION_FILES_HINT})",
                path.display()
            ),
            DataError::NotAFolder { path } => write!(
                f,
                "--data {} is a file, not a folder: image models (mlp, simplecnn, deepcnn, resnet) read a folder with \
                 the four Fashion-MNIST IDX files ({FASHION_FILES_HINT}); a text file trains the GPT (--model gpt)",
                path.display()
            ),
            DataError::MissingFile { path } => write!(
                f,
                "missing file {}: --data must name a folder with the four Fashion-MNIST IDX files ({FASHION_FILES_HINT})",
                path.display()
            ),
            DataError::Io { path, source } => write!(
                f,
                "{}: cannot read or write the file: {source}; check that it exists and that you may access it",
                path.display()
            ),
            DataError::Gzip { name, detail } => write!(
                f,
                "{name}: corrupt gzip data ({detail}); {DAMAGED}"
            ),
            DataError::BadMagic { name, expected, found } => {
                let hint = match (*expected, *found) {
                    (IMAGES, LABELS) => " (this is an IDX label file where an image file was expected)",
                    (LABELS, IMAGES) => " (this is an IDX image file where a label file was expected)",
                    _ => "",
                };
                write!(
                    f,
                    "{name}: bad magic number 0x{found:08x}, expected 0x{expected:08x} for an IDX {} file{hint}; \
                     check that the file is the right Fashion-MNIST file and is not damaged",
                    if *expected == IMAGES { "image" } else { "label" }
                )
            }
            DataError::BadDimensions { name, detail } => write!(
                f,
                "{name}: bad dimensions: {detail}; check that the file is the right Fashion-MNIST file and is not damaged"
            ),
            DataError::Truncated { name, detail } => write!(f, "{name}: truncated: {detail}; {DAMAGED}"),
            DataError::TrailingBytes { name, detail, extra } => write!(
                f,
                "{name}: {extra} unexpected trailing bytes after {detail}; {DAMAGED}"
            ),
            DataError::LabelOutOfRange { name, index, label, num_classes } => write!(
                f,
                "{name}: label {label} of sample {index} is out of range (Fashion-MNIST labels are 0..={}); {DAMAGED}",
                num_classes - 1
            ),
            DataError::CountMismatch { images_name, images, labels_name, labels } => write!(
                f,
                "{images_name} holds {images} images but {labels_name} holds {labels} labels; \
                 the two files must come from the same split (train with train, t10k with t10k)"
            ),
            DataError::Inconsistent { detail } => write!(f, "inconsistent data set: {detail}"),
            DataError::BatchShape { what, expected, found, detail } => write!(
                f,
                "fill_batch: {what} buffer has length {found} but must have {expected} ({detail}); \
                 allocate the batch buffers from the batch size and the split's image size"
            ),
            DataError::IndexOutOfRange { index, len } => write!(
                f,
                "fill_batch: sample index {index} is out of range for a split of {len} samples; \
                 build the epoch order from this split's len()"
            ),
            DataError::NotAFile { path } => write!(
                f,
                "{} is a folder, not a file: give the path of a UTF-8 text file (gzip-compressed or not)",
                path.display()
            ),
            DataError::EmptyText { name } => write!(
                f,
                "{name}: the text is empty; a character-level model needs a text to learn from, give a non-empty UTF-8 text file"
            ),
            DataError::NotUtf8 { name, offset } => write!(
                f,
                "{name}: not UTF-8 text: invalid byte at byte offset {offset}; the file must be UTF-8 text \
                 (convert it, e.g. with `iconv -t UTF-8`)"
            ),
            DataError::TextTooShort { name, train, val, context } => {
                let needed = context.saturating_add(1);
                let fits = (*train).min(*val).saturating_sub(1);
                let hint = if fits > 0 { format!(" (at most {fits})") } else { String::new() };
                write!(
                    f,
                    "{name}: too short for --context {context}: the training part holds {train} characters and the \
                     validation part {val}, but each needs at least one window of context + 1 = {needed} characters; \
                     use a smaller --context{hint} or a longer text"
                )
            }
            DataError::ZeroContext => {
                write!(f, "--context 0: a character-level model needs a context of at least 1 character")
            }
            DataError::VocabTooSmall { name, requested, chars } => write!(
                f,
                "--vocab {requested} is smaller than the {chars} characters of {name}: give --vocab {chars} or more, \
                 or leave it out (the model then predicts exactly the text's characters)"
            ),
            DataError::UnknownChar { ch, position, vocab_len } => write!(
                f,
                "character {} at position {position} is not in the model's vocabulary of {vocab_len} characters; \
                 use only characters of the text the model was trained on",
                describe_char(*ch)
            ),
            DataError::BadVocab { detail } => write!(
                f,
                "bad character vocabulary: {detail}; a vocabulary must be the sorted distinct characters of a text \
                 (as memfit stores it in a checkpoint), so the checkpoint is damaged or was not written by memfit"
            ),
            DataError::WindowShape { what, expected, found, detail } => write!(
                f,
                "fill_windows: {what} buffer has length {found} but must have {expected} ({detail}); \
                 allocate the buffers as windows x context"
            ),
            DataError::WindowOutOfRange { start, context, len } => write!(
                f,
                "fill_windows: a window of context {context} starting at {start} needs {} tokens but the part holds \
                 {len}; draw the starts with random_window_starts or eval_window_starts for this part's length",
                start.saturating_add(*context).saturating_add(1)
            ),
        }
    }
}

/// A character for messages: quoted and escaped like Rust's `{:?}`, with its
/// code point, e.g. `'é' (U+00E9)` or `'\u{301}' (U+0301)`.
pub(crate) fn describe_char(c: char) -> String {
    format!("{c:?} (U+{:04X})", c as u32)
}

const IMAGES: u32 = crate::idx::IMAGES_MAGIC;
const LABELS: u32 = crate::idx::LABELS_MAGIC;

impl std::error::Error for DataError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DataError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}
