//! The seam between the model's forward pass and the kernels that compute it: the CPU kernels
//! (`tandem-kernels`, [`cpu`]) on one side, CUDA (`tandem-kernels-cuda` + cuBLAS, [`cuda`]) on
//! the other. `--device cpu|cuda[:N]` ([`Device`]) picks one at start-up.
//!
//! What a backend owns: uploaded weights (CUDA) and scratch buffers. What it does not own: the
//! KV cache, which the engine owns and passes in as a [`KvStore`] (host bytes for the CPU, device
//! memory for CUDA, in the same `tandem-kv-layout` byte layout and with the same fingerprint),
//! and everything above the forward (scheduler, block manager, prefix cache, sampler), which is
//! the same code whatever the device. Logits come back to the host either way.
//!
//! # Invariants
//! - Nothing under a CUDA name runs on the CPU: a CUDA backend runs its kernels on a GPU or
//!   returns a typed error ([`EngineError::Cuda`]); with no driver that is
//!   `CudaError::NoDriver`, naming `libcuda` and every file name tried.
//! - The CPU path is the pre-seam forward, moved, not changed: its outputs are bitwise what
//!   they were (the `engine/tests/` suite checks them against fixed references).
//! - A backend only ever sees a KV store of its own kind ([`Model::new_kv`](crate::Model::new_kv)
//!   builds the store; a mismatch is an error, not a silent copy).
//!
//! The seam's own types live here, so that the model ([`crate::model`]) uses the backends and no
//! backend reaches back into it: [`ForwardSeq`] (what a pass computes) and [`StepLogits`] (what
//! it returns).
//!
//! Disaggregated serving on CUDA stages KV through the transport's host memory ([`staging`]):
//! the engine keeps the transport's pool as a [`HostMirror`] of the device cache and copies
//! between them, layer by layer on the push side.

pub mod cpu;
pub mod cuda;
pub mod staging;

pub use staging::{HostMirror, Staging};

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tandem_kv_layout::KvLayout;

use crate::config::ModelConfig;
use crate::error::EngineError;
use crate::kv::KvPool;

/// One sequence's part of a forward batch.
#[derive(Clone, Copy, Debug)]
pub struct ForwardSeq<'a> {
    /// Tokens to run (a prefill chunk, or the single last token for decode).
    pub tokens: &'a [u32],
    /// Absolute position of `tokens[0]`; KV for positions `0..first_pos` must already be cached.
    pub first_pos: usize,
    /// Physical blocks covering positions `0..first_pos + tokens.len()`, in order.
    pub block_table: &'a [u32],
    /// Whether to compute logits for the last token of this chunk.
    pub want_logits: bool,
}

/// What a forward pass returns for its wanted rows, in `seqs` order.
#[derive(Debug)]
pub enum StepLogits<'a> {
    /// The logits, `rows × vocab_size`.
    Rows(&'a [f32]),
    /// Each row's token, picked on the device by its spec (only the ids came back).
    Picked(&'a [u32]),
}

/// Where the forward pass runs (`--device`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Device {
    /// The CPU kernels (`tandem-kernels`) on the kernel worker pool.
    #[default]
    Cpu,
    /// CUDA device `N` (`cuda` is `cuda:0`).
    Cuda(usize),
}

impl Device {
    /// A stable lowercase name without the ordinal (`cpu`, `cuda`): logs, metric labels.
    pub const fn kind(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda(_) => "cuda",
        }
    }

    /// True for a CUDA device.
    pub const fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda(_))
    }

    /// Checks the device can be used, before anything expensive (loading weights, fetching the
    /// default model): for CUDA, opens it (driver present, ordinal exists, compute capability
    /// supported) and logs its name. The CPU always can.
    pub fn check(self) -> Result<(), EngineError> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda(n) => {
                let dev = tandem_kernels_cuda::CudaDevice::open(n)?;
                tracing::info!(device = %self, name = dev.name(), "CUDA device usable");
                Ok(())
            }
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// A `--device` value that is not `cpu`, `cuda` or `cuda:N`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid device `{value}`: expected `cpu`, `cuda` or `cuda:N` (N a device ordinal, e.g. cuda:0)")]
pub struct ParseDeviceError {
    /// The value given.
    pub value: String,
}

impl FromStr for Device {
    type Err = ParseDeviceError;
    fn from_str(s: &str) -> Result<Device, ParseDeviceError> {
        let t = s.trim().to_ascii_lowercase();
        let bad = || ParseDeviceError { value: s.to_string() };
        match t.as_str() {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => {
                let n = t.strip_prefix("cuda:").ok_or_else(bad)?;
                // Digits only: `cuda:+1` and `cuda: 1` are typos, not ordinals.
                if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                n.parse().map(Device::Cuda).map_err(|_| bad())
            }
        }
    }
}

impl Serialize for Device {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Device {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Device, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// The engine's KV cache, on the model's device: host bytes ([`KvPool`]) for the CPU backend,
/// device memory for CUDA. Same layout, same fingerprint, same block ids either way.
pub enum KvStore {
    /// Host memory (owned, or external memory a KV transport registered).
    Host(KvPool),
    /// Device memory of a CUDA backend.
    Cuda(cuda::CudaKv),
}

impl KvStore {
    /// The layout the store holds.
    pub fn layout(&self) -> &KvLayout {
        match self {
            KvStore::Host(p) => p.layout(),
            KvStore::Cuda(c) => c.layout(),
        }
    }

    /// Blocks in the store.
    pub fn num_blocks(&self) -> usize {
        match self {
            KvStore::Host(p) => p.num_blocks(),
            KvStore::Cuda(c) => c.num_blocks(),
        }
    }

    /// The host pool, when the KV lives in host memory.
    pub fn host(&self) -> Option<&KvPool> {
        match self {
            KvStore::Host(p) => Some(p),
            KvStore::Cuda(_) => None,
        }
    }

    /// The host pool, writable, when the KV lives in host memory.
    pub fn host_mut(&mut self) -> Option<&mut KvPool> {
        match self {
            KvStore::Host(p) => Some(p),
            KvStore::Cuda(_) => None,
        }
    }

    /// Where the KV lives (`cpu` for host memory).
    pub fn device(&self) -> Device {
        match self {
            KvStore::Host(_) => Device::Cpu,
            KvStore::Cuda(c) => Device::Cuda(c.ordinal()),
        }
    }
}

/// Checks every sequence of a step against the model's context limit and its block table, then
/// calls `each(position, cache_slot)` for every token in step order (the order of the rows the
/// forward computes). Both backends index their step with this, so they refuse the same input
/// with the same error.
///
/// A position past the context limit is [`EngineError::ContextOverflow`]; a block table too
/// short for its tokens is a bug in the block manager (a panic that says so).
pub(crate) fn token_slots(
    c: &ModelConfig,
    seqs: &[ForwardSeq<'_>],
    block_size_tokens: usize,
    mut each: impl FnMut(usize, usize),
) -> Result<(), EngineError> {
    let bs = block_size_tokens;
    for seq in seqs {
        let end = seq.first_pos + seq.tokens.len();
        if end > c.max_position_embeddings {
            return Err(EngineError::ContextOverflow {
                prompt_tokens: end,
                max_new_tokens: 0,
                max_context_tokens: c.max_position_embeddings,
            });
        }
        assert!(
            seq.block_table.len() * bs >= end,
            "block table of {} blocks cannot hold {end} tokens. This is a bug.",
            seq.block_table.len()
        );
        for p in seq.first_pos..end {
            each(p, seq.block_table[p / bs] as usize * bs + p % bs);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_from_their_flag_spellings() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("CPU".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
        assert_eq!("cuda:0".parse::<Device>().unwrap(), Device::Cuda(0));
        assert_eq!("cuda:3".parse::<Device>().unwrap(), Device::Cuda(3));
        for bad in ["gpu", "cuda:x", "cuda:", "cuda:-1", "cuda:+1", "cuda:1.5", "", "cuda0", "metal"] {
            let e = bad.parse::<Device>().unwrap_err();
            assert_eq!(e.value, bad);
            assert!(e.to_string().contains("cuda:N"), "{e}");
        }
    }

    #[test]
    fn devices_print_as_they_parse() {
        for d in [Device::Cpu, Device::Cuda(0), Device::Cuda(7)] {
            assert_eq!(d.to_string().parse::<Device>().unwrap(), d);
        }
        assert_eq!(Device::Cuda(2).to_string(), "cuda:2");
        assert_eq!(Device::Cuda(2).kind(), "cuda");
        let json = serde_json::to_string(&Device::Cuda(1)).unwrap();
        assert_eq!(json, "\"cuda:1\"");
        assert_eq!(serde_json::from_str::<Device>(&json).unwrap(), Device::Cuda(1));
        assert!(serde_json::from_str::<Device>("\"gpu\"").is_err());
    }

    #[test]
    fn checking_the_cpu_always_succeeds() {
        assert!(Device::Cpu.check().is_ok());
    }
}
