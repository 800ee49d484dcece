//! tandem's gRPC API (package tandem.v1) and its generated code.
//!
//! Not built yet: see README.md in this folder for what this crate will own.
