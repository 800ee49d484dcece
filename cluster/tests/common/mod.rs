//! Helpers shared by the integration tests: layouts, node records, bounded waits.
#![allow(dead_code)] // each test binary uses a different subset

use std::fmt::Debug;
use std::time::Duration;

use tandem_cluster::{NodeInfo, Role};
use tandem_kv_layout::{KvDtype, KvLayout};
use tokio::sync::watch;

/// Lease TTL used by every etcd test: dead holders must vanish within this (plus slack).
pub const TEST_TTL: Duration = Duration::from_secs(2);

/// Logs go to the test's captured output; `RUST_LOG=tandem_cluster=debug` shows more.
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("tandem_cluster=info")),
        )
        .try_init();
}

/// SmolLM2-135M's KV shape, tied to model fingerprint `model`.
pub fn layout(model: u64) -> KvLayout {
    KvLayout::new(30, 3, 64, 16, KvDtype::F16, model).expect("valid layout")
}

/// A node record with the default test layout.
pub fn node(id: &str, role: Role) -> NodeInfo {
    node_with_layout(id, role, layout(1))
}

/// A node record with `layout`.
pub fn node_with_layout(id: &str, role: Role, layout: KvLayout) -> NodeInfo {
    NodeInfo::new(id, role, format!("http://127.0.0.1:1/{id}"), layout, 1024)
        .with_kv_transfer_addr("tcp://127.0.0.1:2")
}

/// A cluster name no other test uses (tests of one binary share nothing else, but the name
/// also shows up in logs).
pub fn cluster_name(test: &str) -> String {
    format!("test-{test}")
}

/// Waits until `pred` holds for the receiver's value, or panics naming `what` and showing the
/// last value. Returns the value that satisfied it.
pub async fn wait_for<T: Clone + Debug>(
    rx: &mut watch::Receiver<T>,
    within: Duration,
    what: &str,
    pred: impl FnMut(&T) -> bool,
) -> T {
    let outcome = match tokio::time::timeout(within, rx.wait_for(pred)).await {
        Ok(Ok(value)) => Ok(value.clone()),
        Ok(Err(_)) => Err("the sender was dropped"),
        Err(_) => Err("timed out"),
    };
    outcome.unwrap_or_else(|why| {
        panic!(
            "{what}: not within {within:?} ({why}); last value {:?}",
            *rx.borrow()
        )
    })
}

/// Runs `fut` with a limit, panicking with `what` if it takes longer.
pub async fn within<F: std::future::Future>(limit: Duration, what: &str, fut: F) -> F::Output {
    tokio::time::timeout(limit, fut)
        .await
        .unwrap_or_else(|_| panic!("{what}: not within {limit:?}"))
}
