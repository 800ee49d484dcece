//! The fail-closed behaviours over the TCP transport (loopback, one process, port 0).

#[macro_use]
mod common;

scenario_tests!(common::tcp_pair);
