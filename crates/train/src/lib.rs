//! memfit-train (being written).
