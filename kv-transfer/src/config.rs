//! Knobs of the network transports (TCP and UCX), validated once at construction.

use std::time::Duration;

use crate::error::TransferError;

/// Limits and timeouts of a network transport. `Default` is what a node should start with.
#[derive(Clone, Debug, PartialEq)]
pub struct TransferConfig {
    /// Largest chunk (layers × blocks × slab bytes) sent as one unit; at least one layer is
    /// always sent together. Smaller chunks interleave transfers more finely and start
    /// verification earlier; larger ones cost fewer descriptors.
    pub max_chunk_bytes: usize,
    /// Bound on opening a connection and exchanging `Hello`.
    pub connect_timeout: Duration,
    /// How long a receiver waits for a writer to confirm an abort before closing its connection.
    pub fence_timeout: Duration,
    /// Connections a server accepts at once (more wait in the listen backlog).
    pub max_connections: usize,
    /// Chunks a sender keeps in flight per transfer (checksumming the next while one moves).
    pub chunks_in_flight: usize,
    /// Transfers at least this large are copied into a peer's mapped pool (UCX shared memory)
    /// with non-temporal stores: they stream through memory either way, and plain stores would
    /// first read every destination line for ownership (a third byte of memory traffic per byte
    /// moved). Smaller transfers use plain stores and stay in the cache that the receiver's
    /// checksum (and soon its decode step) reads them from. `0` streams every transfer.
    pub streaming_store_min_transfer_bytes: usize,
}

impl Default for TransferConfig {
    fn default() -> Self {
        Self {
            max_chunk_bytes: 16 << 20,
            connect_timeout: Duration::from_secs(5),
            fence_timeout: Duration::from_secs(2),
            max_connections: 256,
            chunks_in_flight: 2,
            streaming_store_min_transfer_bytes: 8 << 20,
        }
    }
}

impl TransferConfig {
    /// Checks every field; the error names the field, the value and the reason.
    pub fn validate(&self) -> Result<(), TransferError> {
        let bad = |field, reason: &str| Err(TransferError::invalid(field, reason.to_string()));
        if self.max_chunk_bytes == 0 {
            return bad("max_chunk_bytes", "must be > 0");
        }
        if self.connect_timeout.is_zero() {
            return bad("connect_timeout", "must be > 0");
        }
        if self.fence_timeout.is_zero() {
            return bad("fence_timeout", "must be > 0");
        }
        if self.max_connections == 0 {
            return bad("max_connections", "must be > 0");
        }
        if self.chunks_in_flight == 0 {
            return bad("chunks_in_flight", "must be > 0");
        }
        Ok(())
    }
}

/// How block bytes travel over UCX.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum UcxDataMode {
    /// RMA where UCX's `rma_bw` lanes are native, tagged sends otherwise (see the `ucx` module).
    #[default]
    Auto,
    /// Always one-sided puts.
    Rma,
    /// Always tagged sends.
    Tag,
}

impl std::str::FromStr for UcxDataMode {
    type Err = TransferError;
    fn from_str(s: &str) -> Result<Self, TransferError> {
        match s {
            "auto" => Ok(Self::Auto),
            "rma" => Ok(Self::Rma),
            "tag" => Ok(Self::Tag),
            _ => Err(TransferError::invalid(
                "ucx_data_mode",
                format!("`{s}` is not auto, rma or tag"),
            )),
        }
    }
}

/// UCX settings tandem passes through.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UcxConfig {
    /// UCX transports (`UCX_TLS` syntax, e.g. `shm,cma` or `tcp`); `None` keeps UCX's choice
    /// (and the `UCX_TLS` environment).
    pub tls: Option<String>,
    /// RMA or tagged sends.
    pub data_mode: UcxDataMode,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_config_is_valid_and_zero_limits_are_refused_by_name() {
        assert!(TransferConfig::default().validate().is_ok());
        let c = TransferConfig {
            chunks_in_flight: 0,
            ..Default::default()
        };
        assert!(matches!(
            c.validate(),
            Err(TransferError::InvalidRequest {
                field: "chunks_in_flight",
                ..
            })
        ));
    }
}
