//! tandem's gRPC API, package `tandem.v1`, generated from `proto/tandem/v1/*.proto`:
//!
//! - `Inference` (public, served by the router): `Generate` (server streaming), `ListModels`.
//! - `Decode` (internal, decode nodes): `Reserve`, `Release`, `Decode` (server streaming).
//! - `Prefill` (internal, prefill nodes): `Prefill` (server streaming).
//!
//! Every rpc is documented in the .proto files. [`FILE_DESCRIPTOR_SET`] feeds gRPC server
//! reflection on every binary.

/// Generated messages, clients and servers of `tandem.v1`.
#[allow(missing_docs, clippy::all)]
pub mod v1 {
    tonic::include_proto!("tandem.v1");
}

/// Encoded `FileDescriptorSet` of `tandem.v1`, for `tonic-reflection`.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("tandem_v1_descriptor");
