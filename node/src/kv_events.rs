//! Publishing a node's KV events: what its prefix cache holds, so routers send prompts where
//! their prefix is cached (the stream's format and loss rules: `tandem_cluster::load::kv_events`).
//!
//! ```text
//! engine thread: CacheEventSink::tick after every loop turn
//!     drain the block manager's log ──▶ Delta ─┐ bounded mpsc (a full queue: no more deltas
//!     every SNAPSHOT_PERIOD, or asked ────────▶ Snapshot    until the next snapshot is sent)
//! tokio: publish_kv_events ── nets deltas for BATCH_WINDOW, numbers batches ──▶ NATS
//!     a publish that fails ── asks the engine thread for a snapshot
//! ```
//!
//! Invariants: a delta is only sent while every earlier change reached the queue (after any
//! loss the sink sends a snapshot before deltas again), so what a receiver applies in `seq`
//! order equals the cache; the engine thread never blocks on the queue.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tandem_cluster::{KvEventBatch, KvEventBody, LoadSignals};
use tandem_engine::Engine;
use tandem_engine::kv::CacheEvent;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// How often the whole set is sent even without loss (bounds how long a receiver that missed
/// a batch routes without this node's cache).
pub const SNAPSHOT_PERIOD: Duration = Duration::from_secs(5);
/// Deltas arriving within this window go out as one batch.
pub const BATCH_WINDOW: Duration = Duration::from_millis(50);
/// Updates the engine thread may queue ahead of the publisher.
const QUEUE: usize = 256;

/// What the engine thread hands the publisher.
#[derive(Debug)]
pub enum CacheUpdate {
    /// Changes, in order.
    Delta(Vec<CacheEvent>),
    /// The whole set.
    Snapshot(Vec<u64>),
}

/// The engine thread's end: drains the engine's cache log into the queue.
#[derive(Debug)]
pub struct CacheEventSink {
    tx: mpsc::Sender<CacheUpdate>,
    want_snapshot: Arc<AtomicBool>,
    last_snapshot: Option<Instant>,
}

/// The publisher's end.
#[derive(Debug)]
pub struct CacheEventSource {
    rx: mpsc::Receiver<CacheUpdate>,
    want_snapshot: Arc<AtomicBool>,
}

/// A connected sink and source.
pub fn channel() -> (CacheEventSink, CacheEventSource) {
    let (tx, rx) = mpsc::channel(QUEUE);
    let want_snapshot = Arc::new(AtomicBool::new(true));
    (
        CacheEventSink {
            tx,
            want_snapshot: Arc::clone(&want_snapshot),
            last_snapshot: None,
        },
        CacheEventSource { rx, want_snapshot },
    )
}

impl CacheEventSink {
    /// Called once on the engine thread before the first step.
    pub fn start(&mut self, engine: &mut Engine) {
        engine.log_cache_events();
    }

    /// Called on the engine thread after every loop turn.
    pub fn tick(&mut self, engine: &mut Engine) {
        let drained = engine.drain_cache_events();
        let due = self
            .last_snapshot
            .is_none_or(|t| t.elapsed() >= SNAPSHOT_PERIOD);
        if drained.is_none() || due || self.want_snapshot.load(Ordering::Acquire) {
            // The set now includes every drained change.
            let update = CacheUpdate::Snapshot(engine.cached_hashes());
            if self.tx.try_send(update).is_ok() {
                self.want_snapshot.store(false, Ordering::Release);
                self.last_snapshot = Some(Instant::now());
            } else {
                self.want_snapshot.store(true, Ordering::Release);
            }
            return;
        }
        match drained {
            Some(events) if !events.is_empty() => {
                if self.tx.try_send(CacheUpdate::Delta(events)).is_err() {
                    // Lost: no deltas until a snapshot went out.
                    self.want_snapshot.store(true, Ordering::Release);
                }
            }
            _ => {}
        }
    }
}

/// Publishes `source` as `node_id`'s KV events on `signals` until `cancel`.
pub async fn publish(
    mut source: CacheEventSource,
    signals: Arc<dyn LoadSignals>,
    node_id: String,
    block_size_tokens: u32,
    cancel: CancellationToken,
) {
    let mut seq = 0u64;
    let mut failing = false;
    loop {
        let first = tokio::select! {
            _ = cancel.cancelled() => return,
            update = source.rx.recv() => match update {
                Some(u) => u,
                None => return,
            },
        };
        let batches = match first {
            CacheUpdate::Snapshot(hashes) => {
                KvEventBatch::snapshot(&node_id, block_size_tokens, seq, &hashes)
            }
            CacheUpdate::Delta(events) => {
                // Net the changes of one window; a snapshot arriving meanwhile replaces them.
                let mut net: HashMap<u64, bool> = HashMap::new();
                let mut apply = |events: Vec<CacheEvent>| {
                    for e in events {
                        match e {
                            CacheEvent::Stored(h) => net.insert(h, true),
                            CacheEvent::Removed(h) => net.insert(h, false),
                        };
                    }
                };
                apply(events);
                let deadline = tokio::time::Instant::now() + BATCH_WINDOW;
                let mut snapshot = None;
                while let Ok(Some(update)) =
                    tokio::time::timeout_at(deadline, source.rx.recv()).await
                {
                    match update {
                        CacheUpdate::Delta(events) => apply(events),
                        CacheUpdate::Snapshot(hashes) => {
                            snapshot = Some(hashes);
                            break;
                        }
                    }
                }
                match snapshot {
                    Some(hashes) => {
                        KvEventBatch::snapshot(&node_id, block_size_tokens, seq, &hashes)
                    }
                    None => {
                        let (mut stored, mut removed) = (Vec::new(), Vec::new());
                        for (h, present) in net {
                            if present {
                                stored.push(h)
                            } else {
                                removed.push(h)
                            }
                        }
                        vec![KvEventBatch {
                            node_id: node_id.clone(),
                            seq,
                            block_size_tokens,
                            body: KvEventBody::Delta { stored, removed },
                        }]
                    }
                }
            }
        };
        for batch in &batches {
            seq = batch.seq + 1;
            match signals.publish_kv_events(batch).await {
                Ok(()) => {
                    if std::mem::take(&mut failing) {
                        tracing::info!("KV events published again");
                    }
                }
                Err(error) => {
                    // Receivers see the gap; the next snapshot (asked for now) resyncs them.
                    source.want_snapshot.store(true, Ordering::Release);
                    if !std::mem::replace(&mut failing, true) {
                        tracing::warn!(%error, "KV events not published; routers route without this node's cache until they are");
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn deltas_are_netted_numbered_and_a_snapshot_replaces_them() {
        let signals = tandem_cluster::MemoryLoadSignals::new("kv").unwrap();
        let mut rx = signals.subscribe_kv_events().await.unwrap();
        let (sink, source) = channel();
        let cancel = CancellationToken::new();
        let task = tokio::spawn(publish(
            source,
            Arc::new(signals.clone()),
            "p0".into(),
            16,
            cancel.clone(),
        ));
        sink.tx
            .send(CacheUpdate::Snapshot(vec![1, 2]))
            .await
            .unwrap();
        sink.tx
            .send(CacheUpdate::Delta(vec![
                CacheEvent::Stored(3),
                CacheEvent::Removed(1),
                CacheEvent::Stored(4),
                CacheEvent::Removed(4),
            ]))
            .await
            .unwrap();
        let first = rx.recv().await.unwrap();
        assert_eq!(first.seq, 0);
        assert!(
            matches!(first.body, KvEventBody::Snapshot { ref hashes, .. } if hashes == &[1, 2])
        );
        let second = rx.recv().await.unwrap();
        assert_eq!(second.seq, 1);
        let KvEventBody::Delta {
            mut stored,
            mut removed,
        } = second.body
        else {
            panic!("a delta");
        };
        stored.sort();
        removed.sort();
        assert_eq!((stored, removed), (vec![3], vec![1, 4]));
        cancel.cancel();
        task.await.unwrap();
    }
}
