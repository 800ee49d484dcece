//! The fail-closed behaviours, through the in-process transport.

use crate::common;

scenario_tests!(|src, dst| async move { common::inproc_pair(src, dst) });
