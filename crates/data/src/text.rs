//! Character-level text: the `Vocab` (sorted distinct characters, token id =
//! index), the `TextCorpus` (a text encoded and split 90/10 by position),
//! loading a UTF-8 file (gzip-compressed or not) or the embedded Moby Dick,
//! and the windows a char-level language model trains on: seeded random
//! starts per epoch, evaluation starts that cover a part once, and
//! `fill_windows`, which writes input/target token ids into caller-owned i64
//! buffers. Follows the nanoGPT "shakespeare_char" recipe.

use std::collections::BTreeSet;
use std::fs;
use std::io::Read;
use std::path::Path;

use flate2::read::MultiGzDecoder;

use crate::error::{describe_char, DataError};
use crate::idx::is_gzip;
use crate::rng::Rng;

/// Moby Dick (see `assets/README.md`), gzip-compressed.
static EMBEDDED_TEXT: &[u8] = include_bytes!("../assets/moby-dick.txt.gz");

/// The sorted distinct characters of a text; token id = index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vocab {
    chars: Vec<char>,
}

impl Vocab {
    /// The vocabulary of `text` (empty for an empty text).
    pub fn from_text(text: &str) -> Vocab {
        let set: BTreeSet<char> = text.chars().collect();
        Vocab { chars: set.into_iter().collect() }
    }

    /// From a string of characters (as stored in a checkpoint): must be
    /// non-empty, sorted and distinct; else [`DataError::BadVocab`].
    pub fn from_chars(chars: &str) -> Result<Vocab, DataError> {
        let chars: Vec<char> = chars.chars().collect();
        if chars.is_empty() {
            return Err(DataError::BadVocab { detail: "it is empty".to_string() });
        }
        for (i, pair) in chars.windows(2).enumerate() {
            let (a, b) = (pair[0], pair[1]);
            if a >= b {
                let detail = if a == b {
                    format!("character {} appears twice (positions {i} and {})", describe_char(b), i + 1)
                } else {
                    format!("character {} at position {} comes after {}", describe_char(b), i + 1, describe_char(a))
                };
                return Err(DataError::BadVocab { detail });
            }
        }
        Ok(Vocab { chars })
    }

    /// Number of characters (= number of token ids).
    pub fn len(&self) -> usize {
        self.chars.len()
    }

    pub fn is_empty(&self) -> bool {
        self.chars.is_empty()
    }

    /// The characters, sorted; token id `i` is `chars()[i]`.
    pub fn chars(&self) -> &[char] {
        &self.chars
    }

    /// The characters as one string (what a checkpoint stores).
    pub fn as_string(&self) -> String {
        self.chars.iter().collect()
    }

    /// The token ids of `text`; a character outside the vocabulary is a
    /// [`DataError::UnknownChar`] naming it and its character position.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, DataError> {
        text.chars()
            .enumerate()
            .map(|(position, ch)| match self.chars.binary_search(&ch) {
                Ok(id) => Ok(id as u32),
                Err(_) => Err(DataError::UnknownChar { ch, position, vocab_len: self.len() }),
            })
            .collect()
    }

    /// The text of token ids `ids`; an id `>= len()` becomes U+FFFD (�).
    pub fn decode(&self, ids: &[usize]) -> String {
        ids.iter().map(|&i| self.chars.get(i).copied().unwrap_or(char::REPLACEMENT_CHARACTER)).collect()
    }
}

/// A text ready for training: its vocabulary and its token ids, split by
/// position into a training and a validation part.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TextCorpus {
    /// Where the text came from, for people: e.g. "Moby Dick (embedded,
    /// 1204997 bytes)" or "text file PATH (N bytes)".
    pub source: String,
    /// The vocabulary of the whole text (both parts).
    pub vocab: Vocab,
    /// Token ids of the first 90% of the characters.
    pub train: Vec<u32>,
    /// Token ids of the remaining characters.
    pub val: Vec<u32>,
}

impl TextCorpus {
    /// Encodes `text` with its own vocabulary and splits it by position: the
    /// first `floor(0.9 * n)` of its `n` characters (computed like the
    /// PyTorch reference's `int(0.9 * len(data))`) train, the rest validate.
    /// An empty text is a [`DataError::EmptyText`] naming `source`.
    pub fn from_text(text: &str, source: String) -> Result<TextCorpus, DataError> {
        if text.is_empty() {
            return Err(DataError::EmptyText { name: source });
        }
        let vocab = Vocab::from_text(text);
        let mut train = vocab.encode(text)?;
        let split = (0.9 * train.len() as f64) as usize;
        let val = train.split_off(split);
        Ok(TextCorpus { source, vocab, train, val })
    }

    /// Checks that `context` is at least 1 and that both the training and
    /// the validation part hold at least one window of `context + 1`
    /// characters; else an error naming the source and the lengths.
    pub fn check_context(&self, context: usize) -> Result<(), DataError> {
        if context == 0 {
            return Err(DataError::ZeroContext);
        }
        let needed = context.saturating_add(1);
        if self.train.len() < needed || self.val.len() < needed {
            return Err(DataError::TextTooShort {
                name: self.source.clone(),
                train: self.train.len(),
                val: self.val.len(),
                context,
            });
        }
        Ok(())
    }

    /// The vocabulary of a model of this text: `requested` (the text's characters, then tokens it
    /// never has, as GPT-2 pads its vocabulary to 50,304) when given, else the text's characters;
    /// an error naming both when `requested` is smaller.
    pub fn model_vocab(&self, requested: Option<usize>) -> Result<usize, DataError> {
        let chars = self.vocab.len();
        match requested {
            Some(requested) if requested < chars => {
                Err(DataError::VocabTooSmall { name: self.source.clone(), requested, chars })
            }
            Some(requested) => Ok(requested),
            None => Ok(chars),
        }
    }

    /// Windows per training epoch: `train.len() / (context + 1)`, as many as
    /// fit side by side (random windows overlap, so this is a convention).
    pub fn windows_per_epoch(&self, context: usize) -> usize {
        self.train.len() / context.saturating_add(1)
    }

    /// One line for the CLI, e.g. "Moby Dick (embedded, 1204997 bytes):
    /// vocabulary of 83 characters, 1071285 train / 119032 validation tokens".
    pub fn summary(&self) -> String {
        format!(
            "{}: vocabulary of {} characters, {} train / {} validation tokens",
            self.source,
            self.vocab.len(),
            self.train.len(),
            self.val.len()
        )
    }
}

/// Loads a UTF-8 text file as a [`TextCorpus`]; a gzip-compressed file
/// (recognized by its magic bytes, e.g. `name.txt.gz`) is decompressed
/// first. Errors: a folder, a missing or unreadable file (`Io` with the
/// path), corrupt gzip data, an empty text, or bytes that are not UTF-8.
pub fn load_text(path: &Path) -> Result<TextCorpus, DataError> {
    if path.is_dir() {
        return Err(DataError::NotAFile { path: path.to_path_buf() });
    }
    let bytes = fs::read(path).map_err(|source| DataError::Io { path: path.to_path_buf(), source })?;
    let name = path.display().to_string();
    let text = decode_text(&name, bytes)?;
    TextCorpus::from_text(&text, format!("text file {name} ({} bytes)", text.len()))
}

/// Moby Dick, compiled into the binary (see `assets/README.md`): 1,204,997
/// bytes, 1,190,317 characters.
pub fn load_embedded_text() -> Result<TextCorpus, DataError> {
    let text = decode_text("embedded moby-dick.txt.gz", EMBEDDED_TEXT.to_vec())?;
    TextCorpus::from_text(&text, format!("Moby Dick (embedded, {} bytes)", text.len()))
}

/// Start offsets of `count` training windows of `context + 1` tokens in a
/// part of `len` tokens, for `epoch` of a run seeded with `seed`: start `i`
/// is uniform in `0..=len - (context + 1)` and depends only on
/// `(seed, epoch, i)`, so any prefix or element can be recomputed alone (and
/// in any thread). Empty if `len < context + 1`.
pub fn random_window_starts(len: usize, context: usize, count: usize, seed: u64, epoch: u64) -> Vec<usize> {
    // Number of possible starts; like the reference's
    // `torch.randint(len(data) - block_size, ...)`.
    let positions = match len.checked_sub(context) {
        Some(n) if n > 0 => n,
        _ => return Vec::new(),
    };
    let epoch_seed = Rng::derive(seed, epoch).next_u64();
    (0..count).map(|i| Rng::derive(epoch_seed, i as u64).gen_index(positions)).collect()
}

/// Evaluation windows that cover a part of `len` tokens once: starts `0,
/// context, 2 * context, ...` while `start + context + 1 <= len`. Windows
/// overlap by one token, so every token after the first is a target exactly
/// once, except a tail shorter than a window. Empty if `context == 0`.
pub fn eval_window_starts(len: usize, context: usize) -> Vec<usize> {
    if context == 0 {
        return Vec::new();
    }
    let last = match context.checked_add(1).and_then(|w| len.checked_sub(w)) {
        Some(last) => last,
        None => return Vec::new(),
    };
    (0..=last).step_by(context).collect()
}

/// Writes the windows starting at `starts` into the batch buffers (row `r`
/// is window `r`): `inputs[r * context + j] = tokens[starts[r] + j]` and
/// `targets[r * context + j] = tokens[starts[r] + j + 1]`, as i64. Both
/// buffers must have `starts.len() * context` elements and every window
/// must fit in `tokens`; else an error and nothing is written.
pub fn fill_windows(
    tokens: &[u32],
    starts: &[usize],
    context: usize,
    inputs: &mut [i64],
    targets: &mut [i64],
) -> Result<(), DataError> {
    let expected = starts.len().saturating_mul(context);
    for (what, found) in [("input", inputs.len()), ("target", targets.len())] {
        if found != expected {
            return Err(DataError::WindowShape {
                what,
                expected,
                found,
                detail: format!("{} windows x context {context}", starts.len()),
            });
        }
    }
    let fits = |&start: &usize| {
        context.checked_add(1).and_then(|w| start.checked_add(w)).is_some_and(|end| end <= tokens.len())
    };
    if let Some(&start) = starts.iter().find(|s| !fits(s)) {
        return Err(DataError::WindowOutOfRange { start, context, len: tokens.len() });
    }
    if context == 0 {
        return Ok(());
    }
    let rows = inputs.chunks_exact_mut(context).zip(targets.chunks_exact_mut(context));
    for (&start, (input, target)) in starts.iter().zip(rows) {
        let window = &tokens[start..start + context + 1];
        for (o, &t) in input.iter_mut().zip(&window[..context]) {
            *o = t as i64;
        }
        for (o, &t) in target.iter_mut().zip(&window[1..]) {
            *o = t as i64;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------

/// The text of a file's bytes: gunzipped if they start with the gzip magic,
/// then checked to be UTF-8 and non-empty. `name` names the file in errors.
fn decode_text(name: &str, bytes: Vec<u8>) -> Result<String, DataError> {
    let (bytes, text_name) = if is_gzip(&bytes) {
        let mut out = Vec::new();
        MultiGzDecoder::new(&bytes[..])
            .read_to_end(&mut out)
            .map_err(|e| DataError::Gzip { name: name.to_string(), detail: e.to_string() })?;
        (out, format!("{name} (decompressed)"))
    } else {
        (bytes, name.to_string())
    };
    if bytes.is_empty() {
        return Err(DataError::EmptyText { name: text_name });
    }
    String::from_utf8(bytes).map_err(|e| DataError::NotUtf8 { name: text_name, offset: e.utf8_error().valid_up_to() })
}
