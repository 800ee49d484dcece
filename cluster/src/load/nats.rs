//! [`NatsLoadSignals`]: load reports over core NATS pub/sub (no JetStream: the Debian server,
//! 2.9.10, refuses async-nats 0.51's KV buckets, and latest-value data needs no persistence).
//!
//! One NATS connection per instance. It reconnects forever with a capped exponential delay;
//! async-nats re-sends every live subscription after a reconnect, so views resume by
//! themselves. Connection events feed [`LoadSignalsStatus`].
//!
//! Publishing checks the connection state first and fails fast when disconnected: async-nats
//! would otherwise buffer the report and flush it on reconnect, where its old `sent_at` would
//! arrive looking fresh (and, once the buffer filled, `publish` would block the publisher).
//!
//! Cost: one JSON encode (~200 bytes) per report; one decode per received report.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::connection::State;
use async_nats::{Client, ConnectOptions, Event, Subscriber};
use async_trait::async_trait;
use futures_util::StreamExt;
use tokio::sync::{mpsc, watch};

use super::{KvEventBatch, LoadReport, LoadSignals, LoadSignalsStatus, LoadView, ReceivedReport, StatusCell};
use crate::error::ClusterError;
use crate::keys::ClusterKeys;
use crate::node::Role;

/// How to reach NATS.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NatsConfig {
    /// Server URL(s), comma-separated, e.g. `nats://127.0.0.1:4222`.
    pub url: String,
    /// The cluster name (the `{cluster}` token of every subject).
    pub cluster: String,
    /// Limit on handing one report to the client.
    pub request_timeout: Duration,
    /// Limit on one connection attempt.
    pub connect_timeout: Duration,
    /// Longest wait between reconnection attempts.
    pub reconnect_delay_max: Duration,
    /// How often the client pings the server (finds a silently dead connection).
    pub ping_interval: Duration,
}

impl NatsConfig {
    /// Defaults: request timeout 1 s, connect timeout 2 s, reconnect delay up to 2 s, ping
    /// every 10 s.
    pub fn new(url: impl Into<String>, cluster: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            cluster: cluster.into(),
            request_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(2),
            reconnect_delay_max: Duration::from_secs(2),
            ping_interval: Duration::from_secs(10),
        }
    }

    /// The delay before reconnection attempt `attempts` (0 and 1 retry at once, then 100 ms
    /// doubling up to `reconnect_delay_max`).
    pub fn reconnect_delay(&self, attempts: usize) -> Duration {
        if attempts <= 1 {
            return Duration::ZERO;
        }
        let shift = (attempts - 2).min(16) as u32;
        (Duration::from_millis(100) * 2u32.pow(shift)).min(self.reconnect_delay_max)
    }
}

/// A [`LoadSignals`] over NATS. Cheap to clone (one shared connection).
#[derive(Clone, Debug)]
pub struct NatsLoadSignals {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    client: Client,
    keys: ClusterKeys,
    config: NatsConfig,
    status: Arc<StatusCell>,
}

impl NatsLoadSignals {
    /// Starts a connection to `config.url`. The first connection is made in the background:
    /// this succeeds while NATS is down (publishing fails fast and subscriptions wait until it
    /// is up; [`LoadSignals::status`] tells). Fails only for a malformed URL or cluster name.
    pub async fn connect(config: NatsConfig) -> Result<Self, ClusterError> {
        let keys = ClusterKeys::new(&config.cluster)?;
        let status = Arc::new(StatusCell::new(false));
        let events = Arc::clone(&status);
        let delays = config.clone();
        let client = ConnectOptions::new()
            .name(format!("tandem-{}", config.cluster))
            .retry_on_initial_connect()
            .max_reconnects(None)
            .connection_timeout(config.connect_timeout)
            .ping_interval(config.ping_interval)
            .reconnect_delay_callback(move |attempts| delays.reconnect_delay(attempts))
            .event_callback(move |event| {
                let status = Arc::clone(&events);
                async move { on_event(&status, event) }
            })
            .connect(config.url.as_str())
            .await
            .map_err(|e| ClusterError::nats("connect", e))?;
        if client.connection_state() == State::Connected {
            status.set_connected(true, None);
        }
        Ok(Self {
            inner: Arc::new(Inner {
                client,
                keys,
                config,
                status,
            }),
        })
    }

    /// The underlying client, for other subjects (e.g. KV events) on the same connection.
    pub fn client(&self) -> &Client {
        &self.inner.client
    }

    /// The key and subject builder of this cluster.
    pub fn keys(&self) -> &ClusterKeys {
        &self.inner.keys
    }
}

fn on_event(status: &StatusCell, event: Event) {
    match event {
        Event::Connected => {
            tracing::info!("NATS connected");
            status.set_connected(true, None);
        }
        Event::Disconnected => {
            tracing::warn!("NATS disconnected; load reports pause until it reconnects");
            status.set_connected(false, Some("disconnected from NATS".into()));
        }
        Event::Closed => status.set_connected(false, Some("NATS connection closed".into())),
        other => status.set_error(other.to_string()),
    }
}

#[async_trait]
impl LoadSignals for NatsLoadSignals {
    fn cluster(&self) -> &str {
        self.inner.keys.cluster()
    }

    async fn publish(&self, report: &LoadReport) -> Result<(), ClusterError> {
        let inner = &self.inner;
        let subject = inner.keys.load_subject(report.role, &report.node_id)?;
        let result = if inner.client.connection_state() != State::Connected {
            Err(ClusterError::Unavailable {
                service: "nats",
                op: "publish",
            })
        } else {
            let payload = serde_json::to_vec(report).map_err(|source| ClusterError::Serde {
                op: "encode",
                at: subject.clone(),
                source,
            })?;
            match tokio::time::timeout(
                inner.config.request_timeout,
                inner.client.publish(subject, payload.into()),
            )
            .await
            {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(ClusterError::nats("publish", e)),
                Err(_) => Err(ClusterError::Unavailable {
                    service: "nats",
                    op: "publish (timed out)",
                }),
            }
        };
        match &result {
            Ok(()) => inner.status.published(),
            Err(e) => inner.status.publish_failed(e),
        }
        result
    }

    async fn subscribe(&self, role: Role) -> Result<watch::Receiver<LoadView>, ClusterError> {
        let inner = &self.inner;
        let subscriber = inner
            .client
            .subscribe(inner.keys.load_wildcard(role))
            .await
            .map_err(|e| ClusterError::nats("subscribe", e))?;
        let (tx, rx) = watch::channel(LoadView::new());
        tokio::spawn(follow(Arc::clone(inner), role, subscriber, tx));
        Ok(rx)
    }

    fn status(&self) -> watch::Receiver<LoadSignalsStatus> {
        self.inner.status.subscribe()
    }

    async fn publish_kv_events(&self, batch: &KvEventBatch) -> Result<(), ClusterError> {
        let inner = &self.inner;
        let subject = inner.keys.kv_subject(&batch.node_id)?;
        if inner.client.connection_state() != State::Connected {
            return Err(ClusterError::Unavailable {
                service: "nats",
                op: "publish kv events",
            });
        }
        let payload = serde_json::to_vec(batch).map_err(|source| ClusterError::Serde {
            op: "encode",
            at: subject.clone(),
            source,
        })?;
        match tokio::time::timeout(
            inner.config.request_timeout,
            inner.client.publish(subject, payload.into()),
        )
        .await
        {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(ClusterError::nats("publish kv events", e)),
            Err(_) => Err(ClusterError::Unavailable {
                service: "nats",
                op: "publish kv events (timed out)",
            }),
        }
    }

    async fn subscribe_kv_events(&self) -> Result<mpsc::Receiver<KvEventBatch>, ClusterError> {
        let inner = Arc::clone(&self.inner);
        let mut subscriber = inner
            .client
            .subscribe(inner.keys.kv_wildcard())
            .await
            .map_err(|e| ClusterError::nats("subscribe kv events", e))?;
        let (tx, rx) = mpsc::channel(super::kv_events::KV_EVENT_QUEUE);
        tokio::spawn(async move {
            loop {
                let message = tokio::select! {
                    _ = tx.closed() => break,
                    message = subscriber.next() => match message {
                        Some(message) => message,
                        None => break,
                    },
                };
                match decode_kv(&inner.keys, &message.subject, &message.payload) {
                    // A full queue drops the message: the receiver sees a gap in `seq`.
                    Ok(batch) => {
                        let _ = tx.try_send(batch);
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "rejected a KV event message");
                        inner.status.rejected(&e);
                    }
                }
            }
        });
        Ok(rx)
    }
}

/// Decodes a KV event batch and checks it against the subject it came on.
fn decode_kv(keys: &ClusterKeys, subject: &str, payload: &[u8]) -> Result<KvEventBatch, ClusterError> {
    let node_id = keys.parse_kv_subject(subject)?;
    let batch: KvEventBatch =
        serde_json::from_slice(payload).map_err(|source| ClusterError::Serde {
            op: "decode",
            at: subject.to_string(),
            source,
        })?;
    if batch.node_id != node_id {
        return Err(ClusterError::MalformedAddress {
            what: "NATS subject",
            value: subject.to_string(),
            reason: "KV events' node id does not match their subject",
        });
    }
    Ok(batch)
}

/// Feeds one subscription into its view until every receiver is dropped (dropping the
/// subscriber then unsubscribes) or the connection is closed for good.
async fn follow(
    inner: Arc<Inner>,
    role: Role,
    mut subscriber: Subscriber,
    tx: watch::Sender<LoadView>,
) {
    loop {
        let message = tokio::select! {
            _ = tx.closed() => break,
            message = subscriber.next() => match message {
                Some(message) => message,
                None => break,
            },
        };
        let received_at = Instant::now();
        match decode(&inner.keys, role, &message.subject, &message.payload) {
            Ok(report) => {
                inner.status.received();
                tx.send_modify(|view| {
                    view.insert(
                        report.node_id.clone(),
                        ReceivedReport {
                            report,
                            received_at,
                        },
                    );
                });
            }
            Err(e) => {
                tracing::debug!(error = %e, "rejected a load message");
                inner.status.rejected(&e);
            }
        }
    }
}

/// Decodes a report and checks it against the subject it came on.
fn decode(
    keys: &ClusterKeys,
    role: Role,
    subject: &str,
    payload: &[u8],
) -> Result<LoadReport, ClusterError> {
    let (subject_role, node_id) = keys.parse_load_subject(subject)?;
    let report: LoadReport =
        serde_json::from_slice(payload).map_err(|source| ClusterError::Serde {
            op: "decode",
            at: subject.to_string(),
            source,
        })?;
    if subject_role != role || report.role != role || report.node_id != node_id {
        return Err(ClusterError::MalformedAddress {
            what: "NATS subject",
            value: subject.to_string(),
            reason: "report's node id or role does not match its subject",
        });
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconnect_delay_starts_immediately_then_doubles_to_its_cap() {
        let config = NatsConfig::new("nats://x", "c");
        let delays: Vec<u128> = (0..8)
            .map(|a| config.reconnect_delay(a).as_millis())
            .collect();
        assert_eq!(delays, [0, 0, 100, 200, 400, 800, 1600, 2000]);
        assert_eq!(config.reconnect_delay(usize::MAX), Duration::from_secs(2));
    }

    #[test]
    fn a_report_that_disagrees_with_its_subject_is_rejected() {
        let keys = ClusterKeys::new("c").unwrap();
        let report = LoadReport::idle("d0", Role::Decode, 4);
        let payload = serde_json::to_vec(&report).unwrap();
        let own = keys.load_subject(Role::Decode, "d0").unwrap();
        assert_eq!(decode(&keys, Role::Decode, &own, &payload).unwrap(), report);
        let other = keys.load_subject(Role::Decode, "d1").unwrap();
        assert!(decode(&keys, Role::Decode, &other, &payload).is_err());
        assert!(matches!(
            decode(&keys, Role::Decode, &own, b"{not json"),
            Err(ClusterError::Serde { op: "decode", .. })
        ));
    }
}
