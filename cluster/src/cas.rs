//! Read–modify–write of one JSON record in etcd by compare-and-swap on its revision: the
//! shared step of every record several routers update at once (the usage ledger, the rate
//! limiter's buckets).
//!
//! Invariant: a write lands only if the record is unchanged since it was read (its
//! `mod_revision`, or its absence); otherwise the record is read again and `update` runs again
//! on the fresh value, up to [`MAX_CAS_ATTEMPTS`] times. `update` may therefore run more than
//! once and must not have effects beyond what it returns.

use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::etcd::timed;
use crate::error::ClusterError;

/// CAS attempts before an update gives up with [`ClusterError::EtcdConflict`].
pub(crate) const MAX_CAS_ATTEMPTS: u32 = 16;

pub(crate) fn decode<T: DeserializeOwned>(key: &str, value: &[u8]) -> Result<T, ClusterError> {
    serde_json::from_slice(value).map_err(|source| ClusterError::Serde {
        op: "decode",
        at: key.to_string(),
        source,
    })
}

fn encode<T: Serialize>(key: &str, value: &T) -> Result<Vec<u8>, ClusterError> {
    serde_json::to_vec(value).map_err(|source| ClusterError::Serde {
        op: "encode",
        at: key.to_string(),
        source,
    })
}

/// Replaces the record at `key` with `update(current)` (`None` when there is none) and
/// returns what was written. `op` names the operation in errors.
pub(crate) async fn update_json<T, F>(
    client: &Client,
    key: &str,
    timeout: Duration,
    op: &'static str,
    mut update: F,
) -> Result<T, ClusterError>
where
    T: Serialize + DeserializeOwned,
    F: FnMut(Option<T>) -> T,
{
    let mut kv = client.kv_client();
    for _ in 0..MAX_CAS_ATTEMPTS {
        let got = timed(op, timeout, kv.get(key, None)).await?;
        let (current, compare) = match got.kvs().first() {
            Some(found) => (
                Some(decode(key, found.value())?),
                Compare::mod_revision(key, CompareOp::Equal, found.mod_revision()),
            ),
            None => (None, Compare::create_revision(key, CompareOp::Equal, 0)),
        };
        let next = update(current);
        let txn = Txn::new()
            .when([compare])
            .and_then([TxnOp::put(key, encode(key, &next)?, None)]);
        if timed(op, timeout, kv.txn(txn)).await?.succeeded() {
            return Ok(next);
        }
    }
    Err(ClusterError::EtcdConflict {
        op,
        attempts: MAX_CAS_ATTEMPTS,
    })
}
