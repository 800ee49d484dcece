//! tandem-engine's integration tests, one binary: each file beside this one is a module, so the
//! set compiles and links once instead of once per file. One file's tests:
//! `cargo test -p tandem-engine --test it -- FILE::`.
//! Kept as their own binaries (Cargo.toml): `cuda.rs`.

mod common;
mod bad_input;
mod batch_invariance;
mod block_manager_invariants;
mod disaggregated;
mod fuzz_gguf;
mod kv_int8;
mod loaders;
mod reference;
