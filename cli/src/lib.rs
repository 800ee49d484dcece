//! Library half of the `tandem` command (being built).
pub mod plan;
