//! memfit-nn (being written).
