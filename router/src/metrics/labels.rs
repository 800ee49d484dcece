//! The label sets of the router's metric families (see the parent module's table).

use prometheus_client::encoding::EncodeLabelSet;

/// Labels of the per-request families.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// Served model name.
    pub model: String,
    /// `interactive` or `batch`.
    pub priority: &'static str,
}

/// Key ids with their own series at most (the rest are counted under `other`).
pub const DEFAULT_MAX_KEY_IDS: usize = 100;
/// The label of key ids beyond the limit.
pub const OTHER_KEYS: &str = "other";

/// Labels of the per-key request counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KeyLabels {
    /// API key id.
    pub key: String,
}

/// Labels of the per-key token counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KeyTokenLabels {
    /// API key id.
    pub key: String,
    /// `input`, `cached_input` or `output`.
    pub kind: &'static str,
}

/// Labels of the rate-limited counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KeyLimitLabels {
    /// API key id.
    pub key: String,
    /// `requests`, `tokens` or `concurrency`.
    pub limit: &'static str,
}

/// Labels of the per-key node-seconds counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KeyPoolLabels {
    /// API key id.
    pub key: String,
    /// `prefill` or `decode`.
    pub pool: &'static str,
}

/// Labels of the canary probe counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// `ok` or `failed`.
    pub result: &'static str,
}

/// Labels of the placement counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PlacementLabels {
    /// `prefill_node` or `decode_node`.
    pub site: &'static str,
    /// [`PlacementReason::as_str`](crate::routing::PlacementReason::as_str).
    pub reason: &'static str,
}

/// Labels of the failure counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// [`RouterError::kind`](crate::RouterError::kind) (a closed set).
    pub reason: &'static str,
}
