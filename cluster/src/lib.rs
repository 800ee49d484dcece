//! tandem's control plane: etcd membership and NATS load signals
//!
//! Not built yet: see README.md in this folder for what this crate will own.
