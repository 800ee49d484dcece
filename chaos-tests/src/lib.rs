//! Failover drills and deterministic simulations for tandem
//!
//! Not built yet: see README.md in this folder for what this crate will own.
