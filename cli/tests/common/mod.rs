//! What every `tandem` binary test shares.

#![allow(dead_code)]

pub mod client;
pub mod load;
pub mod up;

use std::path::PathBuf;

/// The real model (`$TANDEM_MODEL`, else the default cache path); fails with the fix if absent.
pub fn model() -> PathBuf {
    let p = std::env::var_os("TANDEM_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap())
                .join(".cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    assert!(
        p.exists(),
        "model missing at {}: run scripts/setup.sh",
        p.display()
    );
    p
}
