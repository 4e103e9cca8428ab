//! Character-level text: the vocabulary, the 90/10 split, loading files
//! (plain, gzip, every error) and the embedded Moby Dick, and the training
//! and evaluation windows.

mod common;

use std::io::Write;

use common::TempDir;
use flate2::write::GzEncoder;
use flate2::Compression;
use memfit_data::*;

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = GzEncoder::new(Vec::new(), Compression::default());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

// --- Vocab ------------------------------------------------------------------

#[test]
fn vocab_is_sorted_distinct_and_round_trips() {
    let text = "hello, wörld\nhé!";
    let vocab = Vocab::from_text(text);
    assert_eq!(vocab.chars(), &['\n', ' ', '!', ',', 'd', 'e', 'h', 'l', 'o', 'r', 'w', 'é', 'ö']);
    assert_eq!(vocab.len(), 13);
    assert!(!vocab.is_empty());
    assert_eq!(vocab.as_string(), "\n !,dehlorwéö");

    let ids = vocab.encode(text).unwrap();
    assert_eq!(ids.len(), text.chars().count());
    assert_eq!(&ids[..5], &[6, 5, 7, 7, 8]); // h e l l o
    let ids: Vec<usize> = ids.iter().map(|&i| i as usize).collect();
    assert_eq!(vocab.decode(&ids), text);

    // What a checkpoint stores reads back as the same vocabulary.
    assert_eq!(Vocab::from_chars(&vocab.as_string()).unwrap(), vocab);
    assert!(Vocab::from_text("").is_empty());
}

#[test]
fn decode_replaces_unknown_ids() {
    let vocab = Vocab::from_text("ab");
    assert_eq!(vocab.decode(&[1, 2, 0, usize::MAX]), "b\u{FFFD}a\u{FFFD}");
    assert_eq!(vocab.decode(&[]), "");
}

#[test]
fn unknown_character_names_it_and_its_position() {
    let vocab = Vocab::from_text("abc def");
    let err = vocab.encode("bad café").unwrap_err();
    assert!(matches!(err, DataError::UnknownChar { ch: 'é', position: 7, vocab_len: 7 }), "{err:?}");
    let msg = err.to_string();
    assert_eq!(
        msg,
        "character 'é' (U+00E9) at position 7 is not in the model's vocabulary of 7 characters; \
         use only characters of the text the model was trained on"
    );
    // Invisible characters are escaped.
    let err = vocab.encode("a\u{301}").unwrap_err();
    assert!(err.to_string().starts_with("character '\\u{301}' (U+0301) at position 1 "), "{err}");
    let err = vocab.encode("\t").unwrap_err();
    assert!(err.to_string().starts_with("character '\\t' (U+0009) at position 0 "), "{err}");
}

#[test]
fn from_chars_rejects_empty_unsorted_and_repeated() {
    assert_eq!(Vocab::from_chars("\n abc").unwrap().chars(), &['\n', ' ', 'a', 'b', 'c']);

    let err = Vocab::from_chars("").unwrap_err();
    assert!(matches!(&err, DataError::BadVocab { detail } if detail == "it is empty"), "{err:?}");
    assert!(err.to_string().starts_with("bad character vocabulary: it is empty; "), "{err}");

    let err = Vocab::from_chars("abdc").unwrap_err();
    assert!(matches!(err, DataError::BadVocab { .. }), "{err:?}");
    assert!(err.to_string().contains("character 'c' (U+0063) at position 3 comes after 'd' (U+0064)"), "{err}");

    let err = Vocab::from_chars("abbc").unwrap_err();
    assert!(err.to_string().contains("character 'b' (U+0062) appears twice (positions 1 and 2)"), "{err}");
}

// --- TextCorpus -------------------------------------------------------------

#[test]
fn split_is_90_10_by_position() {
    // 100 characters: 90 train, 10 validation.
    let text: String = (0..100).map(|i| (b'a' + (i % 26) as u8) as char).collect();
    let c = TextCorpus::from_text(&text, "test".to_string()).unwrap();
    assert_eq!((c.train.len(), c.val.len()), (90, 10));
    assert_eq!(c.vocab.len(), 26);
    assert_eq!(c.train[..3], [0, 1, 2]);
    assert_eq!(c.val[0], (90 % 26) as u32);
    assert_eq!(c.source, "test");

    // int(0.9 * 7) = 6, int(0.9 * 1) = 0; characters, not bytes, are split.
    let c = TextCorpus::from_text("ééééééé", String::new()).unwrap();
    assert_eq!((c.train.len(), c.val.len()), (6, 1));
    let c = TextCorpus::from_text("x", String::new()).unwrap();
    assert_eq!((c.train.len(), c.val.len()), (0, 1));
    // The vocabulary covers validation-only characters too.
    let c = TextCorpus::from_text("aaaaaaaaaz", String::new()).unwrap();
    assert_eq!((c.vocab.as_string().as_str(), c.val.as_slice()), ("az", &[1][..]));

    let err = TextCorpus::from_text("", "nothing".to_string()).unwrap_err();
    assert!(matches!(&err, DataError::EmptyText { name } if name == "nothing"), "{err:?}");
}

#[test]
fn check_context_and_windows_per_epoch() {
    let text = "0123456789".repeat(10); // 90 train, 10 validation
    let c = TextCorpus::from_text(&text, "ten digits".to_string()).unwrap();
    assert!(c.check_context(9).is_ok());
    assert!(c.check_context(1).is_ok());
    let err = c.check_context(10).unwrap_err();
    assert!(matches!(err, DataError::TextTooShort { train: 90, val: 10, context: 10, .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        "ten digits: too short for --context 10: the training part holds 90 characters and the validation part 10, \
         but each needs at least one window of context + 1 = 11 characters; use a smaller --context (at most 9) \
         or a longer text"
    );
    assert!(matches!(c.check_context(0), Err(DataError::ZeroContext)));
    assert!(c.check_context(usize::MAX).is_err());

    assert_eq!(c.windows_per_epoch(9), 9);
    assert_eq!(c.windows_per_epoch(8), 10);
    assert_eq!(c.windows_per_epoch(100), 0);
    assert_eq!(c.windows_per_epoch(usize::MAX), 0);
}

// --- Files ------------------------------------------------------------------

#[test]
fn loads_plain_and_gzip_files() {
    let dir = TempDir::new("text");
    let text = "It is a way I have of driving off the spleen — and regulating the circulation.\n".repeat(3);
    let plain = dir.join("t.txt");
    std::fs::write(&plain, &text).unwrap();
    let c = load_text(&plain).unwrap();
    assert_eq!(c.source, format!("text file {} ({} bytes)", plain.display(), text.len()));
    let n = text.chars().count();
    assert_eq!(c.train.len(), n * 9 / 10);
    assert_eq!(c.train.len() + c.val.len(), n);
    let all: Vec<usize> = c.train.iter().chain(&c.val).map(|&i| i as usize).collect();
    assert_eq!(c.vocab.decode(&all), text);

    let gz = dir.join("t.txt.gz");
    std::fs::write(&gz, gzip(text.as_bytes())).unwrap();
    let g = load_text(&gz).unwrap();
    assert_eq!((&g.vocab, &g.train, &g.val), (&c.vocab, &c.train, &c.val));
    assert_eq!(g.source, format!("text file {} ({} bytes)", gz.display(), text.len()));
}

#[test]
fn missing_file_is_an_io_error_with_the_path() {
    let dir = TempDir::new("text-missing");
    let path = dir.join("nope.txt");
    let err = load_text(&path).unwrap_err();
    assert!(matches!(&err, DataError::Io { path: p, .. } if *p == path), "{err:?}");
    assert!(err.to_string().starts_with(&format!("{}: cannot read", path.display())), "{err}");
}

#[test]
fn a_folder_is_not_a_text_file() {
    let dir = TempDir::new("text-dir");
    let err = load_text(dir.path()).unwrap_err();
    assert!(matches!(&err, DataError::NotAFile { path } if path == dir.path()), "{err:?}");
    assert_eq!(
        err.to_string(),
        format!(
            "{} is a folder, not a file: give the path of a UTF-8 text file (gzip-compressed or not)",
            dir.path().display()
        )
    );
}

#[test]
fn empty_files_are_rejected() {
    let dir = TempDir::new("text-empty");
    let path = dir.join("empty.txt");
    std::fs::write(&path, "").unwrap();
    let err = load_text(&path).unwrap_err();
    assert!(matches!(&err, DataError::EmptyText { name } if *name == path.display().to_string()), "{err:?}");
    assert!(err.to_string().starts_with(&format!("{}: the text is empty; ", path.display())), "{err}");

    let gz = dir.join("empty.txt.gz");
    std::fs::write(&gz, gzip(b"")).unwrap();
    let err = load_text(&gz).unwrap_err();
    assert!(matches!(&err, DataError::EmptyText { name } if *name == format!("{} (decompressed)", gz.display())));
}

#[test]
fn invalid_utf8_reports_the_byte_offset() {
    let dir = TempDir::new("text-utf8");
    // "héllo" is h(1) é(2) l l o: offset 6 is the Latin-1 byte 0xe9.
    let mut bytes = "héllo".as_bytes().to_vec();
    bytes.extend_from_slice(b"\xe9t\xe9 ok");
    let path = dir.join("latin1.txt");
    std::fs::write(&path, &bytes).unwrap();
    let err = load_text(&path).unwrap_err();
    assert!(matches!(err, DataError::NotUtf8 { offset: 6, .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        format!(
            "{}: not UTF-8 text: invalid byte at byte offset 6; the file must be UTF-8 text \
             (convert it, e.g. with `iconv -t UTF-8`)",
            path.display()
        )
    );

    // A truncated multi-byte sequence at the end, inside a gzip file.
    let gz = dir.join("cut.txt.gz");
    std::fs::write(&gz, gzip(&"abcé".as_bytes()[..4])).unwrap();
    let err = load_text(&gz).unwrap_err();
    assert!(
        matches!(&err, DataError::NotUtf8 { name, offset: 3 } if *name == format!("{} (decompressed)", gz.display())),
        "{err:?}"
    );
}

#[test]
fn corrupt_gzip_is_reported() {
    let dir = TempDir::new("text-gz");
    let mut bytes = gzip("some text".repeat(50).as_bytes());
    bytes.truncate(bytes.len() / 2);
    let path = dir.join("cut.gz");
    std::fs::write(&path, &bytes).unwrap();
    let err = load_text(&path).unwrap_err();
    assert!(matches!(&err, DataError::Gzip { name, .. } if *name == path.display().to_string()), "{err:?}");
}

#[test]
fn a_file_too_short_for_the_context_is_rejected() {
    let dir = TempDir::new("text-short");
    let path = dir.join("short.txt");
    std::fs::write(&path, "abcdefghijklmnopqrst").unwrap(); // 18 train, 2 validation
    let c = load_text(&path).unwrap();
    assert!(c.check_context(1).is_ok());
    let err = c.check_context(8).unwrap_err();
    assert!(matches!(err, DataError::TextTooShort { train: 18, val: 2, context: 8, .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.starts_with(&format!("text file {} (20 bytes): too short for --context 8", path.display())), "{msg}");
    assert!(msg.contains("context + 1 = 9 characters; use a smaller --context (at most 1) or a longer text"), "{msg}");

    // One character: no validation window for any context.
    std::fs::write(&path, "a").unwrap();
    let msg = load_text(&path).unwrap().check_context(1).unwrap_err().to_string();
    assert!(msg.contains("holds 0 characters and the validation part 1"), "{msg}");
    assert!(msg.ends_with("use a smaller --context or a longer text"), "{msg}");
}

// --- Embedded Moby Dick -------------------------------------------------------

#[test]
fn embedded_moby_dick_loads_and_splits() {
    let c = load_embedded_text().unwrap();
    assert_eq!(c.source, "Moby Dick (embedded, 1204997 bytes)");
    assert_eq!(c.vocab.len(), 83);
    assert_eq!(c.train.len(), 1_071_285);
    assert_eq!(c.val.len(), 119_032);
    assert_eq!(c.train.len() + c.val.len(), 1_190_317);
    assert_eq!(
        c.vocab.as_string(),
        "\n !$&()*,-.0123456789:;?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz—‘’“”"
    );
    let all: Vec<usize> = c.train.iter().chain(&c.val).map(|&i| i as usize).collect();
    let text = c.vocab.decode(&all);
    assert_eq!(text.len(), 1_204_997);
    assert!(text.starts_with("CHAPTER 1. Loomings.\n\nCall me Ishmael. Some years ago—never mind"));
    assert!(text.ends_with("rolled on as it rolled five thousand years ago.\n"));
    assert!(c.check_context(256).is_ok());
    assert_eq!(c.windows_per_epoch(256), 1_071_285 / 257);
    assert_eq!(
        c.summary(),
        "Moby Dick (embedded, 1204997 bytes): vocabulary of 83 characters, 1071285 train / 119032 validation tokens"
    );

    // The asset file itself loads through load_text to the same tokens.
    let asset = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/moby-dick.txt.gz");
    let f = load_text(&asset).unwrap();
    assert!(f.vocab == c.vocab && f.train == c.train && f.val == c.val);
}

// --- Windows ----------------------------------------------------------------

#[test]
fn random_window_starts_are_seeded_and_in_range() {
    let (len, context) = (1000, 63);
    let a = random_window_starts(len, context, 500, 7, 0);
    assert_eq!(a.len(), 500);
    assert!(a.iter().all(|&s| s + context < len), "{a:?}");
    assert_eq!(a, random_window_starts(len, context, 500, 7, 0));
    // A prefix does not depend on the count.
    assert_eq!(a[..100], random_window_starts(len, context, 100, 7, 0)[..]);
    assert_ne!(a, random_window_starts(len, context, 500, 8, 0));
    assert_ne!(a, random_window_starts(len, context, 500, 7, 1));
    // Both ends of 0..=len-(context+1) are reached.
    let many = random_window_starts(len, context, 20_000, 7, 0);
    assert_eq!(many.iter().min(), Some(&0));
    assert_eq!(many.iter().max(), Some(&(len - context - 1)));

    // Exactly one window fits: every start is 0.
    assert_eq!(random_window_starts(64, 63, 5, 1, 2), vec![0; 5]);
    assert!(random_window_starts(63, 63, 5, 1, 2).is_empty());
    assert!(random_window_starts(0, 0, 5, 1, 2).is_empty());
    assert!(random_window_starts(10, usize::MAX, 5, 1, 2).is_empty());
    assert!(random_window_starts(1000, 8, 0, 1, 2).is_empty());
}

#[test]
fn eval_windows_predict_every_character_once() {
    for (len, context) in [(100, 9), (101, 10), (11, 10), (10, 10), (37, 1), (5, 8), (0, 3)] {
        let starts = eval_window_starts(len, context);
        let mut predicted = vec![0; len];
        for &s in &starts {
            assert!(s + context < len, "len {len} context {context} start {s}");
            for count in &mut predicted[s + 1..=s + context] {
                *count += 1;
            }
        }
        // Every target position 1.. is predicted at most once, and all are,
        // up to a tail shorter than a window.
        assert!(predicted.iter().all(|&n| n <= 1), "len {len} context {context}: {predicted:?}");
        let covered = predicted.iter().skip(1).take_while(|&&n| n == 1).count();
        assert_eq!(covered, starts.len() * context);
        assert!(len.saturating_sub(1 + covered) < context, "len {len} context {context}: tail too long");
    }
    assert_eq!(eval_window_starts(100, 9), (0..=90).step_by(9).collect::<Vec<_>>());
    assert_eq!(eval_window_starts(11, 10), vec![0]);
    assert!(eval_window_starts(10, 10).is_empty());
    assert!(eval_window_starts(10, 0).is_empty());
    assert!(eval_window_starts(10, usize::MAX).is_empty());
}

#[test]
fn fill_windows_writes_inputs_and_shifted_targets() {
    let tokens: Vec<u32> = (0..20).map(|i| i * 10).collect();
    let (mut inputs, mut targets) = (vec![-1i64; 6], vec![-1i64; 6]);
    fill_windows(&tokens, &[4, 0], 3, &mut inputs, &mut targets).unwrap();
    assert_eq!(inputs, [40, 50, 60, 0, 10, 20]);
    assert_eq!(targets, [50, 60, 70, 10, 20, 30]);
    // The last window that fits.
    let (mut i1, mut t1) = (vec![0i64; 3], vec![0i64; 3]);
    fill_windows(&tokens, &[16], 3, &mut i1, &mut t1).unwrap();
    assert_eq!((i1, t1), (vec![160, 170, 180], vec![170, 180, 190]));
    // No windows.
    fill_windows(&tokens, &[], 3, &mut [], &mut []).unwrap();
}

#[test]
fn fill_windows_errors_write_nothing() {
    let tokens: Vec<u32> = (0..20).collect();
    let (mut inputs, mut targets) = (vec![-1i64; 6], vec![-1i64; 6]);

    let err = fill_windows(&tokens, &[0, 1], 3, &mut inputs[..5], &mut targets).unwrap_err();
    assert!(matches!(err, DataError::WindowShape { what: "input", expected: 6, found: 5, .. }), "{err:?}");
    assert!(err
        .to_string()
        .starts_with("fill_windows: input buffer has length 5 but must have 6 (2 windows x context 3)"));
    let err = fill_windows(&tokens, &[0, 1], 3, &mut inputs, &mut targets[..4]).unwrap_err();
    assert!(matches!(err, DataError::WindowShape { what: "target", expected: 6, found: 4, .. }), "{err:?}");

    // Start 17 needs tokens 17..=20 but there are 20.
    let err = fill_windows(&tokens, &[0, 17], 3, &mut inputs, &mut targets).unwrap_err();
    assert!(matches!(err, DataError::WindowOutOfRange { start: 17, context: 3, len: 20 }), "{err:?}");
    assert!(err
        .to_string()
        .starts_with("fill_windows: a window of context 3 starting at 17 needs 21 tokens but the part holds 20;"));
    let err = fill_windows(&tokens, &[usize::MAX, 0], 3, &mut inputs, &mut targets).unwrap_err();
    assert!(matches!(err, DataError::WindowOutOfRange { start: usize::MAX, .. }), "{err:?}");
    assert!(inputs.iter().chain(&targets).all(|&v| v == -1), "an error must leave the buffers untouched");

    // Context 0 has empty windows but they must still fit.
    fill_windows(&tokens, &[19], 0, &mut [], &mut []).unwrap();
    assert!(fill_windows(&tokens, &[20], 0, &mut [], &mut []).is_err());
}
