//! tandem-router's integration tests, one binary: each file beside this one is a module, so the
//! set compiles and links once instead of once per file. One file's tests:
//! `cargo test -p tandem-router --test it -- FILE::`.

mod common;
mod sim;
mod bad_input;
mod etcd_nats;
mod failures;
mod fuzz_ingress;
mod grpc_api;
mod openai_http;
mod openai_surface;
mod rate_limits;
mod routing;
mod sim_control_plane;
mod tls;
