//! What a drill reads from the cluster while it runs: the nodes' and the router's Prometheus
//! metrics (busy nodes, KV blocks still held, the router's recoveries).
//!
//! Invariant: an unreadable metric is `None` (or 0 for a count the router restarted), never a
//! guess that could turn a leak into a pass: `settle` reports `None` when a node cannot be read.

use std::time::{Duration, Instant};

use crate::cluster::NodeEndpoint;

/// The router's repeated attempts so far (retries, re-prefills, migrations).
pub(crate) async fn router_recoveries(http: &reqwest::Client, url: &str) -> u64 {
    let mut total = 0.0;
    for kind in ["retry", "reprefill", "migration"] {
        let label = format!("kind=\"{kind}\"");
        total += metric(http, url, "tandem_router_recoveries_total", &label)
            .await
            .unwrap_or(0.0);
    }
    total as u64
}

/// Reads one node's metrics: `family{...label="value"...} number` lines, summed.
pub async fn metric(
    http: &reqwest::Client,
    url: &str,
    family: &str,
    label: &str,
) -> Option<f64> {
    let body = http.get(url).send().await.ok()?.text().await.ok()?;
    let mut total = None;
    for line in body.lines() {
        let Some(rest) = line.strip_prefix(family) else {
            continue;
        };
        if !rest.starts_with('{') && !rest.starts_with(' ') {
            continue;
        }
        if !label.is_empty() && !rest.contains(label) {
            continue;
        }
        let v: f64 = line.rsplit(' ').next()?.parse().ok()?;
        *total.get_or_insert(0.0) += v;
    }
    total
}

pub(crate) async fn node_busy(http: &reqwest::Client, url: &str) -> bool {
    let running = metric(http, url, "tandem_node_running_sequences", "")
        .await
        .unwrap_or(0.0);
    let transfers = metric(http, url, "tandem_kv_transfer_live", "what=\"transfers\"")
        .await
        .unwrap_or(0.0);
    running > 0.0 || transfers > 0.0
}

/// Waits up to `limit` for every node's used and reserved KV blocks to reach zero; returns
/// what is still held then (`None` if a node's metrics could not be read) and, per node still
/// holding blocks, `node: U used, R reserved`.
pub(crate) async fn settle(
    http: &reqwest::Client,
    nodes: &[&NodeEndpoint],
    limit: Duration,
) -> (Option<u64>, Vec<String>) {
    let t0 = Instant::now();
    loop {
        let mut held = Some(0u64);
        let mut holders = Vec::new();
        for n in nodes {
            let used = metric(
                http,
                &n.metrics_url,
                "tandem_node_kv_blocks",
                "state=\"used\"",
            )
            .await;
            let reserved = metric(
                http,
                &n.metrics_url,
                "tandem_node_kv_blocks",
                "state=\"reserved\"",
            )
            .await;
            held = match (held, used, reserved) {
                (Some(h), Some(u), Some(r)) => {
                    if u + r > 0.0 {
                        holders.push(format!("{}: {u} used, {r} reserved", n.name));
                    }
                    Some(h + (u + r) as u64)
                }
                _ => None,
            };
        }
        if held == Some(0) || t0.elapsed() > limit {
            return (held, holders);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
