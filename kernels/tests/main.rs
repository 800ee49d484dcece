//! tandem-kernels's integration tests, one binary: each file beside this one is a module, so the
//! set compiles and links once instead of once per file. One file's tests:
//! `cargo test -p tandem-kernels --test it -- FILE::`.

mod attention;
mod common;
mod kv;
mod linear;
mod rowops;
