//! tandem router: gRPC and OpenAI HTTP ingress, admission, routing
//!
//! Not built yet: see README.md in this folder for what this crate will own.
