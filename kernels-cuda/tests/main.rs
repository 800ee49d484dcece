//! tandem-kernels-cuda's integration tests, one binary: each file beside this one is a module, so the
//! set compiles and links once instead of once per file. One file's tests:
//! `cargo test -p tandem-kernels-cuda --test it -- FILE::`.
//! Kept as their own binaries (Cargo.toml): `cache_dir.rs`, `gpu.rs`.

mod common;
mod compile;
mod device;
mod hash_host;
mod ptx_cache;
mod sample_host;
