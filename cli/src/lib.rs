//! Library half of the `tandem` command: each subcommand's flags and implementation, so tests and
//! other binaries can call them directly.
//!
//! | module | command |
//! |---|---|
//! | [`generate`] | `tandem generate` — one streamed completion on the local engine |
//! | [`plan`] | `tandem plan` — capacity planning (KV bytes, batch and concurrency limits) |
//! | [`bench_engine`] | `tandem bench-engine` — prefill/decode throughput vs the bandwidth bound |
//! | [`bench_prefix`] | `tandem bench-prefix` — routing by cache vs policies blind to it, shared-prefix workload |
//! | [`bench_sim`] | `tandem bench-sim` — `tandem sim` against the real 1P+1D cluster it predicts, at each concurrency |
//! | [`bench_serve`] | `tandem bench-serve` — TTFT and tokens/s, disaggregated (1P+1D) vs colocated |
//! | [`fetch`] | `tandem model fetch` — download and verify the default model |
//! | [`load`] | building an engine from flags |
//! | [`planner`] | `tandem planner` — sizes the pools from their load signals |
//! | [`ports`] | free loopback ports below the ephemeral range, for children that bind later |
//! | [`scale`] | `tandem scale` — pool sizes and bounds by hand |
//! | [`sim`] | `tandem sim` — a thousand-GPU cluster simulated, disaggregated vs colocated |
//! | [`up`] | `tandem up` — a local cluster (etcd, NATS, nodes, router) from one command |

pub mod bench_engine;
pub mod bench_placement;
pub mod bench_prefix;
pub mod bench_serve;
pub mod bench_sim;
pub mod bench_telemetry;
pub mod control;
pub mod drill;
pub mod drain;
pub mod fetch;
pub mod generate;
pub mod load;
pub mod plan;
pub mod planner;
pub mod ports;
pub mod scale;
pub mod serving;
pub mod sim;
pub mod up;
pub mod usage;
