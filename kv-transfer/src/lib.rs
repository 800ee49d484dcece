//! Moves paged KV blocks between tandem nodes (UCX, TCP, in-process)
//!
//! Not built yet: see README.md in this folder for what this crate will own.
