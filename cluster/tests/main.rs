//! tandem-cluster's integration tests, one binary: each file beside this one is a module, so the
//! set compiles and links once instead of once per file. One file's tests:
//! `cargo test -p tandem-cluster --test it -- FILE::`.

mod common;
mod discovery;
mod etcd_recovery;
mod load_signals;
mod scale;
