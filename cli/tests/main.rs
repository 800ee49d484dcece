//! tandem-cli's integration tests, one binary: each file beside this one is a module, so the
//! set compiles and links once instead of once per file. One file's tests:
//! `cargo test -p tandem-cli --test it -- FILE::`.

mod common;
mod e2e {
    pub mod harness;
}
mod bench_serve;
mod cluster;
mod device;
mod drills;
mod generate;
mod lifecycle;
mod node_failure;
mod observability;
mod plan;
mod prefix_routing;
mod runbook;
mod scaling;
mod sim_vs_real;
mod trace_ui;
mod up_hygiene;
mod usage;
