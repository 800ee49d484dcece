//! The fail-closed behaviours, through the in-process transport.

#[macro_use]
mod common;

scenario_tests!(|src, dst| async move { common::inproc_pair(src, dst) });
