//! tandem prefill node: chunked prefill and KV push
//!
//! Not built yet: see README.md in this folder for what this crate will own.
