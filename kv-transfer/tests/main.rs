//! tandem-kv-transfer's integration tests, one binary: each file beside this one is a module, so the
//! set compiles and links once instead of once per file. One file's tests:
//! `cargo test -p tandem-kv-transfer --test it -- FILE::`.

#[macro_use]
mod common;
mod inproc;
mod ipc;
mod streaming;
mod tcp;
mod two_process;
mod ucx;
