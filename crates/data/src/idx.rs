//! IDX files (the MNIST / Fashion-MNIST format): reading images and labels,
//! gzip-compressed or raw (detected by the gzip magic), with strict
//! validation of magic number, dimensions and exact payload length; and a
//! tiny writer used by tests and tools to make small or damaged files.

use std::fs;
use std::io::{self, Read, Write};
use std::path::Path;

use flate2::read::GzDecoder;
use flate2::write::GzEncoder;
use flate2::Compression;

use crate::error::DataError;

/// Magic number of an IDX file of unsigned bytes with 3 dimensions (images).
pub const IMAGES_MAGIC: u32 = 0x0000_0803;
/// Magic number of an IDX file of unsigned bytes with 1 dimension (labels).
pub const LABELS_MAGIC: u32 = 0x0000_0801;
/// The two bytes every gzip stream starts with.
pub const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// Header length of an IDX image file: magic, count, rows, cols.
const IMAGES_HEADER: usize = 16;
/// Header length of an IDX label file: magic, count.
const LABELS_HEADER: usize = 8;

/// Grayscale images, row-major, one byte per pixel: image `i` is
/// `pixels[i * rows * cols .. (i + 1) * rows * cols]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Images {
    pub count: usize,
    pub rows: usize,
    pub cols: usize,
    pub pixels: Vec<u8>,
}

impl Images {
    /// Builds images, checking that `pixels.len() == count * rows * cols`.
    ///
    /// # Panics
    /// If the length does not match (a programming error, not bad input).
    pub fn new(count: usize, rows: usize, cols: usize, pixels: Vec<u8>) -> Images {
        assert_eq!(
            Some(pixels.len()),
            count.checked_mul(rows).and_then(|n| n.checked_mul(cols)),
            "Images::new: {count} images of {rows}x{cols} need {} bytes, got {}",
            count.saturating_mul(rows).saturating_mul(cols),
            pixels.len()
        );
        Images { count, rows, cols, pixels }
    }

    /// Pixels per image (`rows * cols`).
    pub fn image_size(&self) -> usize {
        self.rows * self.cols
    }

    /// Number of images.
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The pixels of image `i`.
    ///
    /// # Panics
    /// If `i >= self.count`.
    pub fn image(&self, i: usize) -> &[u8] {
        assert!(i < self.count, "image index {i} out of range for {} images", self.count);
        let n = self.image_size();
        &self.pixels[i * n..(i + 1) * n]
    }

    /// A copy of images `range` (e.g. the first 8,000).
    ///
    /// # Panics
    /// If the range goes past `self.count`.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Images {
        assert!(range.start <= range.end && range.end <= self.count, "image range {range:?} out of 0..{}", self.count);
        let n = self.image_size();
        Images {
            count: range.len(),
            rows: self.rows,
            cols: self.cols,
            pixels: self.pixels[range.start * n..range.end * n].to_vec(),
        }
    }
}

/// Whether `bytes` starts with the gzip magic.
pub fn is_gzip(bytes: &[u8]) -> bool {
    bytes.len() >= 2 && bytes[..2] == GZIP_MAGIC
}

/// Reads an IDX image file (gzip-compressed or raw).
pub fn read_idx_images(path: &Path) -> Result<Images, DataError> {
    let bytes = read_file(path)?;
    read_idx_images_from_bytes(&path.display().to_string(), &bytes)
}

/// Reads an IDX label file (gzip-compressed or raw). Labels are not range
/// checked here (see [`crate::check_labels`]); the Fashion-MNIST loaders do.
pub fn read_idx_labels(path: &Path) -> Result<Vec<u8>, DataError> {
    let bytes = read_file(path)?;
    read_idx_labels_from_bytes(&path.display().to_string(), &bytes)
}

/// Parses an IDX image file held in memory; `name` is used in errors.
pub fn read_idx_images_from_bytes(name: &str, bytes: &[u8]) -> Result<Images, DataError> {
    let mut input = Input::new(name, bytes);
    let header = input.read_up_to(IMAGES_HEADER)?;
    if header.len() < 4 {
        return Err(short_header(name, "image", IMAGES_HEADER, header.len()));
    }
    check_magic(name, IMAGES_MAGIC, be_u32(&header[0..4]))?;
    if header.len() < IMAGES_HEADER {
        return Err(short_header(name, "image", IMAGES_HEADER, header.len()));
    }
    let count = be_u32(&header[4..8]) as usize;
    let rows = be_u32(&header[8..12]) as usize;
    let cols = be_u32(&header[12..16]) as usize;
    if rows == 0 || cols == 0 {
        return Err(DataError::BadDimensions {
            name: name.to_string(),
            detail: format!(
                "header says {count} images of {rows}x{cols}; images must have at least one row and column"
            ),
        });
    }
    let expected =
        count.checked_mul(rows).and_then(|n| n.checked_mul(cols)).filter(|&n| n <= MAX_PAYLOAD).ok_or_else(|| {
            DataError::BadDimensions {
                name: name.to_string(),
                detail: format!(
                    "header says {count} images of {rows}x{cols}, which is far too large for an image file"
                ),
            }
        })?;
    let what = format!("{count} images of {rows}x{cols} ({expected} bytes)");
    let pixels = input.read_payload(expected, &what)?;
    Ok(Images { count, rows, cols, pixels })
}

/// Parses an IDX label file held in memory; `name` is used in errors.
pub fn read_idx_labels_from_bytes(name: &str, bytes: &[u8]) -> Result<Vec<u8>, DataError> {
    let mut input = Input::new(name, bytes);
    let header = input.read_up_to(LABELS_HEADER)?;
    if header.len() < 4 {
        return Err(short_header(name, "label", LABELS_HEADER, header.len()));
    }
    check_magic(name, LABELS_MAGIC, be_u32(&header[0..4]))?;
    if header.len() < LABELS_HEADER {
        return Err(short_header(name, "label", LABELS_HEADER, header.len()));
    }
    let count = be_u32(&header[4..8]) as usize;
    let what = format!("{count} labels ({count} bytes)");
    input.read_payload(count, &what)
}

/// Encodes images as an IDX image file, gzip-compressed if `gzip`.
pub fn encode_idx_images(images: &Images, gzip: bool) -> Vec<u8> {
    let mut raw = Vec::with_capacity(IMAGES_HEADER + images.pixels.len());
    for v in [IMAGES_MAGIC, to_u32(images.count), to_u32(images.rows), to_u32(images.cols)] {
        raw.extend_from_slice(&v.to_be_bytes());
    }
    raw.extend_from_slice(&images.pixels);
    maybe_gzip(raw, gzip)
}

/// Encodes labels as an IDX label file, gzip-compressed if `gzip`.
pub fn encode_idx_labels(labels: &[u8], gzip: bool) -> Vec<u8> {
    let mut raw = Vec::with_capacity(LABELS_HEADER + labels.len());
    raw.extend_from_slice(&LABELS_MAGIC.to_be_bytes());
    raw.extend_from_slice(&to_u32(labels.len()).to_be_bytes());
    raw.extend_from_slice(labels);
    maybe_gzip(raw, gzip)
}

/// Writes images as an IDX image file, gzip-compressed if `gzip`.
pub fn write_idx_images(path: &Path, images: &Images, gzip: bool) -> Result<(), DataError> {
    write_file(path, &encode_idx_images(images, gzip))
}

/// Writes labels as an IDX label file, gzip-compressed if `gzip`.
pub fn write_idx_labels(path: &Path, labels: &[u8], gzip: bool) -> Result<(), DataError> {
    write_file(path, &encode_idx_labels(labels, gzip))
}

// ---------------------------------------------------------------------------

/// Largest payload accepted (4 GiB): guards against absurd headers.
const MAX_PAYLOAD: usize = 1 << 32;

fn to_u32(n: usize) -> u32 {
    u32::try_from(n).expect("IDX dimensions must fit in u32")
}

fn be_u32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

fn check_magic(name: &str, expected: u32, found: u32) -> Result<(), DataError> {
    if found == expected {
        Ok(())
    } else {
        Err(DataError::BadMagic { name: name.to_string(), expected, found })
    }
}

fn short_header(name: &str, kind: &str, header: usize, found: usize) -> DataError {
    DataError::Truncated {
        name: name.to_string(),
        detail: format!("an IDX {kind} file starts with a {header}-byte header but the file holds only {found} bytes"),
    }
}

fn read_file(path: &Path) -> Result<Vec<u8>, DataError> {
    fs::read(path).map_err(|source| {
        if source.kind() == io::ErrorKind::NotFound {
            DataError::MissingFile { path: path.to_path_buf() }
        } else {
            DataError::Io { path: path.to_path_buf(), source }
        }
    })
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), DataError> {
    fs::write(path, bytes).map_err(|source| DataError::Io { path: path.to_path_buf(), source })
}

fn maybe_gzip(raw: Vec<u8>, gzip: bool) -> Vec<u8> {
    if !gzip {
        return raw;
    }
    let mut enc = GzEncoder::new(Vec::new(), Compression::default());
    enc.write_all(&raw).expect("writing to a Vec cannot fail");
    enc.finish().expect("writing to a Vec cannot fail")
}

/// The decompressed (or raw) byte stream of one file, read in two steps:
/// header, then exactly the payload the header announces.
struct Input<'a> {
    name: &'a str,
    reader: Box<dyn Read + 'a>,
    gzip: bool,
    header_len: usize,
}

impl<'a> Input<'a> {
    fn new(name: &'a str, bytes: &'a [u8]) -> Self {
        let gzip = is_gzip(bytes);
        let reader: Box<dyn Read + 'a> = if gzip { Box::new(GzDecoder::new(bytes)) } else { Box::new(bytes) };
        Input { name, reader, gzip, header_len: 0 }
    }

    /// Reads up to `n` bytes (fewer only at the end of the stream).
    fn read_up_to(&mut self, n: usize) -> Result<Vec<u8>, DataError> {
        let mut buf = Vec::with_capacity(n);
        (&mut self.reader).take(n as u64).read_to_end(&mut buf).map_err(|e| self.stream_error(e))?;
        self.header_len = buf.len();
        Ok(buf)
    }

    /// Reads exactly `expected` bytes and checks that nothing follows.
    fn read_payload(&mut self, expected: usize, what: &str) -> Result<Vec<u8>, DataError> {
        // Never pre-allocate more than the input could plausibly hold.
        let mut buf = Vec::with_capacity(expected.min(64 << 20));
        (&mut self.reader).take(expected as u64).read_to_end(&mut buf).map_err(|e| self.stream_error(e))?;
        if buf.len() < expected {
            return Err(DataError::Truncated {
                name: self.name.to_string(),
                detail: format!(
                    "header says {what} but the file holds {} bytes after its {}-byte header",
                    buf.len(),
                    self.header_len
                ),
            });
        }
        // Count what follows (for gzip this also reaches the end of the
        // stream, where the decoder checks the CRC and length trailer).
        let extra = io::copy(&mut self.reader, &mut io::sink()).map_err(|e| self.stream_error(e))?;
        if extra > 0 {
            return Err(DataError::TrailingBytes {
                name: self.name.to_string(),
                detail: format!("the {what} the header announces"),
                extra: extra as usize,
            });
        }
        Ok(buf)
    }

    fn stream_error(&self, e: io::Error) -> DataError {
        // Reading from memory cannot fail, so any error comes from the decoder.
        debug_assert!(self.gzip, "raw in-memory reads cannot fail: {e}");
        let detail = if e.kind() == io::ErrorKind::UnexpectedEof {
            format!("the compressed stream ends early: {e}")
        } else {
            e.to_string()
        };
        DataError::Gzip { name: self.name.to_string(), detail }
    }
}
