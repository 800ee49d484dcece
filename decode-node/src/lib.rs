//! tandem decode node: KV receive, continuous batching, token streams
//!
//! Not built yet: see README.md in this folder for what this crate will own.
