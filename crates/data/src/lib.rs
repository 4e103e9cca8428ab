//! memfit-data: host-side training data for memfit. Owns IDX reading and
//! writing, Fashion-MNIST loading (folder, system package or embedded
//! subset), character-level text (a UTF-8 file or the embedded Moby Dick,
//! its vocabulary and training windows), the seeded `Rng` the whole engine
//! shares, epoch ordering, batching and normalization. It knows nothing
//! about tensors: it yields plain `u8` / `u32` / `f32` / `i64` buffers.

pub mod batch;
pub mod error;
pub mod fashion;
pub mod idx;
pub mod rng;
pub mod text;

pub use batch::{fill_batch, image_size, EpochOrder, Normalization};
pub use error::DataError;
pub use fashion::{
    check_labels, find_file, has_fashion_files, load_embedded, load_fashion_mnist, load_fashion_mnist_dir, load_split,
    FashionMnist, Source, Split, CLASS_NAMES, EMBEDDED_TRAIN, EMBEDDED_VAL, IMAGE_COLS, IMAGE_ROWS, IMAGE_SIZE,
    NUM_CLASSES, SYSTEM_DIR, TEST_IMAGES, TEST_LABELS, TRAIN_IMAGES, TRAIN_LABELS,
};
pub use idx::{
    encode_idx_images, encode_idx_labels, is_gzip, read_idx_images, read_idx_images_from_bytes, read_idx_labels,
    read_idx_labels_from_bytes, write_idx_images, write_idx_labels, Images, IMAGES_MAGIC, LABELS_MAGIC,
};
pub use rng::Rng;
pub use text::{
    eval_window_starts, fill_windows, load_embedded_text, load_text, random_window_starts, TextCorpus, Vocab,
};
