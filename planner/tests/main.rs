//! tandem-planner's integration tests, one binary: each file beside this one is a module, so the
//! set compiles and links once instead of once per file. One file's tests:
//! `cargo test -p tandem-planner --test it -- FILE::`.

mod kube;
mod manifests;
mod planner;
