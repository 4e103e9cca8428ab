//! memfit command line (being written).
fn main() {}
