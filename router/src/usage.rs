//! The usage ledger and cost per token.
//!
//! ```text
//!  request completes ─▶ Ledger::record(key id, usage: tokens + node-seconds per pool)
//!                         pending (this router's unflushed additions, per key)
//!        every FLUSH_PERIOD, and at shutdown ─▶ UsageStore::add (etcd CAS, one per key)
//!  /v1/usage, tandem usage/cost ─▶ store totals (every router, every restart) + pending here
//! ```
//!
//! Node-seconds come from the nodes: each engine step's duration is shared among the requests
//! in it by the tokens each computed (the prefill node reports a request's share with its first
//! token, the decode node with its final message); a migrated request pays for every attempt.
//! Only completed requests are recorded.
//!
//! Cost per token ([`CostModel`]): a pool's cost of a node-hour (depreciation, power, network,
//! storage, operations) turns node-seconds into dollars; input tokens carry the prefill pool's
//! cost, output tokens the decode pool's. Cached input tokens are not computed (their step
//! share is zero), so their measured compute cost is 0: their price is a policy, not a
//! measurement, and is reported as what was measured.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tandem_cluster::{ClusterError, UsageStore, UsageTotals};

use crate::error::RouterError;

/// How often a router writes its additions to the store.
pub const FLUSH_PERIOD: Duration = Duration::from_secs(1);

/// Per-key usage: this router's unflushed additions over a shared store.
#[derive(Debug)]
pub struct Ledger {
    store: Arc<dyn UsageStore>,
    pending: Mutex<BTreeMap<String, UsageTotals>>,
}

impl Ledger {
    /// A ledger over `store`.
    pub fn new(store: Arc<dyn UsageStore>) -> Self {
        Ledger {
            store,
            pending: Mutex::new(BTreeMap::new()),
        }
    }

    /// Adds one completed request's usage to `key_id`.
    pub fn record(&self, key_id: &str, usage: &UsageTotals) {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key_id.to_string())
            .or_default()
            .add(usage);
    }

    /// Writes the pending additions to the store; what fails stays pending for the next flush.
    pub async fn flush(&self) -> Result<(), ClusterError> {
        let pending = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|p| p.into_inner()));
        let mut first_error = None;
        for (key, delta) in pending {
            if let Err(e) = self.store.add(&key, &delta).await {
                self.record(&key, &delta);
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Every key's totals: the store's (all routers) plus this router's unflushed additions.
    pub async fn totals(&self) -> Result<BTreeMap<String, UsageTotals>, ClusterError> {
        let mut all = self.store.list().await?;
        for (k, v) in self.pending.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            all.entry(k.clone()).or_default().add(v);
        }
        Ok(all)
    }
}

/// Flushes `ledger` every [`FLUSH_PERIOD`] until `stop`, then once more. A failing store is
/// logged once per failure streak.
pub async fn flush_loop(ledger: Arc<Ledger>, stop: tokio_util::sync::CancellationToken) {
    let mut failing = false;
    loop {
        let stopping = tokio::select! {
            _ = tokio::time::sleep(FLUSH_PERIOD) => false,
            _ = stop.cancelled() => true,
        };
        match ledger.flush().await {
            Ok(()) if failing => {
                tracing::info!("usage ledger writes succeed again");
                failing = false;
            }
            Ok(()) => {}
            Err(e) if !failing => {
                tracing::warn!(error = %e, "usage ledger write failed; additions are kept and retried");
                failing = true;
            }
            Err(_) => {}
        }
        if stopping {
            return;
        }
    }
}

/// Dollars per node-hour of one pool, by part.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NodeHourCost {
    /// Hardware depreciation.
    pub depreciation: f64,
    /// Power and cooling.
    pub power: f64,
    /// Network.
    pub network: f64,
    /// Storage.
    pub storage: f64,
    /// Operations (people, tooling).
    pub operations: f64,
}

impl NodeHourCost {
    /// The node-hour's total.
    pub fn total(&self) -> f64 {
        self.depreciation + self.power + self.network + self.storage + self.operations
    }
}

/// The cost of a node-hour per pool (`--cost-file`, TOML with `[prefill]` and `[decode]`
/// tables of the parts above, in dollars).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CostModel {
    /// The prefill pool's node-hour.
    pub prefill: NodeHourCost,
    /// The decode pool's node-hour.
    pub decode: NodeHourCost,
}

impl CostModel {
    /// Reads a cost file; errors name the file.
    pub fn from_file(path: &Path) -> Result<Self, RouterError> {
        let invalid = |reason: String| RouterError::Config {
            field: "cost-file",
            value: path.display().to_string(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| invalid(e.to_string()))?;
        let m: CostModel = toml::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        for (pool, c) in [("prefill", &m.prefill), ("decode", &m.decode)] {
            for v in [c.depreciation, c.power, c.network, c.storage, c.operations] {
                if !v.is_finite() || v < 0.0 {
                    return Err(invalid(format!("[{pool}] parts must be ≥ 0 dollars")));
                }
            }
        }
        Ok(m)
    }

    /// What `t` cost, and per million tokens of each kind.
    pub fn price(&self, t: &UsageTotals) -> Cost {
        let prefill = t.prefill_node_seconds / 3600.0 * self.prefill.total();
        let decode = t.decode_node_seconds / 3600.0 * self.decode.total();
        let per_m = |usd: f64, tokens: u64| (tokens > 0).then(|| usd / tokens as f64 * 1e6);
        let computed_input = t.input_tokens.saturating_sub(t.cached_input_tokens);
        Cost {
            usd_total: prefill + decode,
            usd_prefill: prefill,
            usd_decode: decode,
            usd_per_million_input: per_m(prefill, computed_input),
            usd_per_million_cached_input: (t.cached_input_tokens > 0).then_some(0.0),
            usd_per_million_output: per_m(decode, t.output_tokens),
        }
    }
}

/// Dollars of some usage.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Cost {
    /// Everything.
    pub usd_total: f64,
    /// The prefill pool's share.
    pub usd_prefill: f64,
    /// The decode pool's share.
    pub usd_decode: f64,
    /// Per million computed (uncached) input tokens.
    pub usd_per_million_input: Option<f64>,
    /// Per million cached input tokens: their measured compute is zero.
    pub usd_per_million_cached_input: Option<f64>,
    /// Per million output tokens.
    pub usd_per_million_output: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_cluster::MemoryUsageStore;

    #[tokio::test]
    async fn additions_are_pending_until_flushed_and_totals_include_both() {
        let store = Arc::new(MemoryUsageStore::default());
        let l = Ledger::new(store.clone());
        let u = UsageTotals {
            requests: 1,
            input_tokens: 100,
            output_tokens: 10,
            ..Default::default()
        };
        l.record("a", &u);
        l.record("a", &u);
        assert!(store.list().await.unwrap().is_empty());
        assert_eq!(l.totals().await.unwrap()["a"].requests, 2);
        l.flush().await.unwrap();
        assert_eq!(store.list().await.unwrap()["a"].input_tokens, 200);
        assert_eq!(l.totals().await.unwrap()["a"].requests, 2, "not counted twice");
    }

    #[test]
    fn node_hours_price_input_by_prefill_time_and_output_by_decode_time() {
        let m = CostModel {
            prefill: NodeHourCost {
                depreciation: 2.0,
                power: 1.6,
                ..Default::default()
            },
            decode: NodeHourCost {
                operations: 1.8,
                ..Default::default()
            },
        };
        let t = UsageTotals {
            requests: 10,
            input_tokens: 1_000_000,
            cached_input_tokens: 0,
            output_tokens: 500_000,
            prefill_node_seconds: 100.0, // 100 s at $3.60/h = $0.10
            decode_node_seconds: 1000.0, // 1000 s at $1.80/h = $0.50
        };
        let c = m.price(&t);
        assert!((c.usd_prefill - 0.1).abs() < 1e-9 && (c.usd_decode - 0.5).abs() < 1e-9);
        assert!((c.usd_per_million_input.unwrap() - 0.1).abs() < 1e-9);
        assert!((c.usd_per_million_output.unwrap() - 1.0).abs() < 1e-9);
        assert_eq!(c.usd_per_million_cached_input, None);
    }
}
