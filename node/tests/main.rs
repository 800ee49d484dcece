//! tandem-node's integration tests, one binary: each file beside this one is a module, so the
//! set compiles and links once instead of once per file. One file's tests:
//! `cargo test -p tandem-node --test it -- FILE::`.

mod engine_thread;
mod tls;
