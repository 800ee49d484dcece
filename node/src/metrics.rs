//! Every metric family a node exports, both roles (declared here once; the
//! services and drivers hold [`NodeMetrics`] handles). Served at `GET /metrics` on
//! `--metrics-addr`, whose URL the node advertises in its etcd record (`metrics_url`), so
//! Prometheus service discovery (`tandem up --prometheus`) finds every node.
//!
//! Every series carries `role` and `node` labels.
//!
//! | family | type | labels | what |
//! |---|---|---|---|
//! | `tandem_node_requests_total` | counter | outcome | Prefill / Decode calls: ok, failed, cancelled, refused |
//! | `tandem_node_time_to_first_token_seconds` | histogram | – | call received → first token sent (prefill: sampled; decode: KV verified and first token streamed) |
//! | `tandem_node_step_duration_seconds` | histogram | – | one engine step (forward pass) |
//! | `tandem_node_prompt_tokens_total` | counter | – | prompt tokens of requests this node served |
//! | `tandem_node_cached_prompt_tokens_total` | counter | – | of those, served from a prefix cache (prefix-cache hits, in tokens) |
//! | `tandem_node_prefills_here_total` | counter | – | decode: Decode calls whose prompt this node computed itself (conditional disaggregation) |
//! | `tandem_node_running_sequences` / `_waiting_sequences` | gauge | – | the scheduler's queues |
//! | `tandem_node_batch_size` | gauge | – | outputs of the last step |
//! | `tandem_node_kv_blocks` | gauge | state | free, used, reserved (decode reservations, prefill blocks awaiting a push) |
//! | `tandem_node_kv_blocks_capacity` | gauge | – | blocks in the pool |
//! | `tandem_node_engine_steps_total`, `_computed_prompt_tokens_total`, `_generated_tokens_total`, `_preemptions_total` | counter | – | the engine's own counts |
//! | `tandem_node_kv_staged_bytes_total` | counter | direction | `--device cuda`: KV bytes copied device → host pool (out, prefill) and host pool → device (in, decode) |
//! | `tandem_node_tokens_picked_on_device_total` | counter | – | `--device cuda`: tokens sampled on the GPU (only ids came back); the rest were sampled by the host from logits (penalties, grammar, logprobs) |
//! | `tandem_node_cuda_graph_replays_total`, `_cuda_graph_fallbacks_total` | counter | – | `--device cuda`: decode steps replayed from graphs; failed captures (each logged) |
//! | `tandem_node_grammar_failures_total` | counter | – | structured outputs ended early because llguidance failed (its limits); each also logged |
//! | `tandem_node_tokens_per_second` | gauge | – | prompt + generated tokens/s over the last 0.5 s |
//! | `tandem_node_prompt_tokens_per_step` | gauge | – | prompt tokens one engine step may compute now (decode: sized from measured steps to `--max-step-ms`) |
//! | `tandem_kv_transfer_bytes_total` | counter | transport, direction | KV bytes sent (prefill) / received and verified (decode) |
//! | `tandem_kv_ipc_bytes_total` | counter | transport, direction | `--kv-cuda-ipc`: of those, bytes copied device to device into a peer's GPU pool (sent) / verified in this GPU's pool (received) |
//! | `tandem_kv_ipc_declined_total` | counter | transport | `--kv-cuda-ipc`: connections from senders on this GPU that got no IPC offer and stream their bytes (export failed, or the pool is not the device pool's mirror; each logged) |
//! | `tandem_kv_transfers_total` | counter | transport, result | started, confirmed (outbound), received (inbound, verified) |
//! | `tandem_kv_transfer_duration_seconds` | histogram | transport | outbound transfer, start to confirmation |
//! | `tandem_kv_transfer_failures_total` | counter | transport, reason | transfers that did not complete, by kind |
//! | `tandem_kv_transfer_checksum_mismatches_total` | counter | transport | transfers refused on receipt (fail closed: re-prefilled) |
//! | `tandem_kv_transfer_live` | gauge | transport, what | registrations, reservations, transfers, connections held |
//! | `tandem_node_registration_live` | gauge | state | 1 for the etcd registration's current state |
//! | `tandem_node_lease_renewal_failures_total` | counter | – | times the lease keep-alive lost etcd or the lease |
//! | `tandem_node_load_signals_connected` | gauge | – | 1 while NATS is connected |
//! | `tandem_node_load_reports_total` | counter | result | load reports published / failed |
//! | `tandem_trace_*` | counter | – | span export (see `tandem_telemetry`) |

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tandem_cluster::{LoadSignalsStatus, RegistrationState};
use tandem_telemetry::metrics::{self as tm, FnCollector, buckets};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::sync::watch;

use tandem_kv_transfer::metrics::TransferMetrics;

use crate::engine_thread::EngineSnapshot;

/// How a node call ended.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Outcome {
    /// Its final message was sent.
    Ok,
    /// It ended with an error status.
    Failed,
    /// The caller went away.
    Cancelled,
    /// Refused at admission (draining, out of blocks, invalid).
    Refused,
}

impl Outcome {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Failed => "failed",
            Outcome::Cancelled => "cancelled",
            Outcome::Refused => "refused",
        }
    }
}

/// Labels of the request counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}




fn ttft() -> Histogram {
    tm::histogram(buckets::TTFT_SECONDS)
}

/// The control-plane views a node's collector reads at scrape time (set once it has joined).
#[derive(Default)]
struct ControlPlaneViews {
    registration: Option<watch::Receiver<RegistrationState>>,
    signals: Option<watch::Receiver<LoadSignalsStatus>>,
    lease_failures: Option<Arc<AtomicU64>>,
    transfers: Vec<(&'static str, Arc<TransferMetrics>)>,
}

struct Inner {
    registry: Registry,
    requests: Family<OutcomeLabels, Counter>,
    ttft: Histogram,
    step: Histogram,
    prompt_tokens: Counter,
    cached_prompt_tokens: Counter,
    prefills_here: Counter,
    views: Arc<Mutex<ControlPlaneViews>>,
    snapshot: Arc<OnceLock<watch::Receiver<EngineSnapshot>>>,
}

/// A node's metric handles and registry. Cheap to clone.
#[derive(Clone)]
pub struct NodeMetrics {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for NodeMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NodeMetrics")
    }
}

impl NodeMetrics {
    /// The families of node `node_id` in `role` (`prefill` or `decode`).
    pub fn new(role: &'static str, node_id: &str) -> Self {
        let mut registry = Registry::with_labels(
            [
                ("role".into(), role.into()),
                ("node".into(), node_id.to_string().into()),
            ]
            .into_iter(),
        );
        let requests = Family::<OutcomeLabels, Counter>::default();
        let ttft = ttft();
        let step = tm::histogram(buckets::STEP_SECONDS);
        let prompt_tokens = Counter::default();
        let cached_prompt_tokens = Counter::default();
        let prefills_here = Counter::default();
        registry.register(
            "tandem_node_requests",
            "Prefill or Decode calls by outcome",
            requests.clone(),
        );
        registry.register(
            "tandem_node_time_to_first_token_seconds",
            "Call received to first token sent",
            ttft.clone(),
        );
        registry.register(
            "tandem_node_step_duration_seconds",
            "One engine step (forward pass)",
            step.clone(),
        );
        registry.register(
            "tandem_node_prompt_tokens",
            "Prompt tokens of requests served",
            prompt_tokens.clone(),
        );
        registry.register(
            "tandem_node_cached_prompt_tokens",
            "Prompt tokens served from a prefix cache",
            cached_prompt_tokens.clone(),
        );
        registry.register(
            "tandem_node_prefills_here",
            "Decode calls whose prompt this node computed itself (no prefill node, no KV transfer)",
            prefills_here.clone(),
        );
        let views = Arc::new(Mutex::new(ControlPlaneViews::default()));
        let snapshot: Arc<OnceLock<watch::Receiver<EngineSnapshot>>> = Arc::new(OnceLock::new());
        {
            let (views, snapshot) = (Arc::clone(&views), Arc::clone(&snapshot));
            registry.register_collector(Box::new(FnCollector::new(move || {
                let mut out = match snapshot.get() {
                    Some(rx) => engine_families(&rx.borrow()),
                    None => Vec::new(),
                };
                out.extend(control_plane_families(
                    &views.lock().unwrap_or_else(|p| p.into_inner()),
                ));
                out
            })));
        }
        registry.register_collector(Box::new(FnCollector::new(
            tandem_telemetry::trace_export_families,
        )));
        NodeMetrics {
            inner: Arc::new(Inner {
                registry,
                requests,
                ttft,
                step,
                prompt_tokens,
                cached_prompt_tokens,
                prefills_here,
                views,
                snapshot,
            }),
        }
    }

    /// The Prometheus text of every family.
    pub fn render(&self) -> String {
        tm::render(&self.inner.registry)
    }

    /// Reads engine figures from `snapshots` at every scrape (set once the engine runs).
    pub fn watch_engine(&self, snapshots: watch::Receiver<EngineSnapshot>) {
        let _ = self.inner.snapshot.set(snapshots);
    }

    /// Reads the registration state, lease failures and NATS status at every scrape.
    pub fn watch_control_plane(
        &self,
        registration: watch::Receiver<RegistrationState>,
        signals: watch::Receiver<LoadSignalsStatus>,
        lease_failures: Arc<AtomicU64>,
    ) {
        let mut v = self.inner.views.lock().unwrap_or_else(|p| p.into_inner());
        v.registration = Some(registration);
        v.signals = Some(signals);
        v.lease_failures = Some(lease_failures);
    }

    /// The step-duration histogram (the engine thread observes it).
    pub fn step_histogram(&self) -> Histogram {
        self.inner.step.clone()
    }

    /// A call ended.
    pub fn request(&self, outcome: Outcome) {
        self.inner
            .requests
            .get_or_create(&OutcomeLabels {
                outcome: outcome.as_str(),
            })
            .inc();
    }

    /// The first token went out `elapsed` after the call arrived.
    pub fn first_token(&self, elapsed: Duration) {
        self.inner.ttft.observe(elapsed.as_secs_f64());
    }

    /// A Decode call asked this node to compute its prompt itself.
    pub fn prefill_here(&self) {
        self.inner.prefills_here.inc();
    }

    /// A request's prompt: `total` tokens, `cached` of them from the prefix cache.
    pub fn prompt(&self, total: u64, cached: u64) {
        self.inner.prompt_tokens.inc_by(total);
        self.inner.cached_prompt_tokens.inc_by(cached);
    }

    /// Exports the counters of the `transport` (`ucx`, `tcp`) KV transport: bytes, transfers,
    /// failures by kind (checksum mismatches among them), durations, live gauges.
    pub fn watch_transfers(&self, transport: &'static str, metrics: Arc<TransferMetrics>) {
        self.inner
            .views
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .transfers
            .push((transport, metrics));
    }
}

fn engine_families(s: &EngineSnapshot) -> Vec<tm::Family> {
    let used = s
        .total_blocks
        .saturating_sub(s.free_blocks)
        .saturating_sub(s.reserved_or_held_blocks);
    vec![
        tm::Family::gauge("tandem_node_running_sequences", "Sequences running.")
            .value(s.running as f64),
        tm::Family::gauge("tandem_node_waiting_sequences", "Requests waiting for admission.")
            .value(s.waiting as f64),
        tm::Family::gauge("tandem_node_batch_size", "Outputs of the last engine step.")
            .value(s.batch_size as f64),
        tm::Family::gauge(
            "tandem_node_pending_prompt_tokens",
            "Prompt tokens queued and not computed yet (what the planner sizes prefill by).",
        )
        .value(s.pending_prompt_tokens as f64),
        tm::Family::gauge(
            "tandem_node_kv_blocks",
            "KV blocks by state (reserved: decode reservations and prefill blocks awaiting a push).",
        )
        .with(vec![("state", "free".into())], s.free_blocks as f64)
        .with(vec![("state", "used".into())], used as f64)
        .with(
            vec![("state", "reserved".into())],
            s.reserved_or_held_blocks as f64,
        ),
        tm::Family::gauge("tandem_node_kv_blocks_capacity", "KV blocks in the pool.")
            .value(s.total_blocks as f64),
        tm::Family::gauge(
            "tandem_node_tokens_per_second",
            "Prompt + generated tokens per second over the last window.",
        )
        .value(s.tokens_per_s),
        tm::Family::counter("tandem_node_engine_steps", "Engine steps (forward passes).")
            .value(s.steps as f64),
        tm::Family::counter(
            "tandem_node_computed_prompt_tokens",
            "Prompt tokens the engine computed (cache hits excluded).",
        )
        .value(s.prefill_tokens as f64),
        tm::Family::counter("tandem_node_generated_tokens", "Tokens the engine sampled.")
            .value(s.decode_tokens as f64),
        tm::Family::counter(
            "tandem_node_preemptions",
            "Sequences preempted (recomputed later) for lack of KV blocks.",
        )
        .value(s.preemptions as f64),
        tm::Family::counter(
            "tandem_node_kv_staged_bytes",
            "--device cuda: KV bytes copied between device memory and the transport's host pool.",
        )
        .with(vec![("direction", "out".into())], s.kv_staged_out_bytes as f64)
        .with(vec![("direction", "in".into())], s.kv_staged_in_bytes as f64),
        tm::Family::counter(
            "tandem_node_tokens_picked_on_device",
            "--device cuda: tokens sampled on the GPU (only their ids came back); the rest of tandem_node_decode_tokens were sampled by the host from logits.",
        )
        .value(s.tokens_picked_on_device as f64),
        tm::Family::counter(
            "tandem_node_cuda_graph_replays",
            "--device cuda: decode steps replayed from a captured CUDA graph.",
        )
        .value(s.cuda_graph_replays as f64),
        tm::Family::counter(
            "tandem_node_cuda_graph_fallbacks",
            "--device cuda: graph captures that failed (decode then runs without graphs; logged).",
        )
        .value(s.cuda_graph_fallbacks as f64),
        tm::Family::counter(
            "tandem_node_grammar_failures",
            "Structured outputs ended early because their grammar failed (llguidance's limits).",
        )
        .value(s.grammar_failures as f64),
        tm::Family::gauge(
            "tandem_node_prompt_tokens_per_step",
            "Prompt tokens one engine step may compute now (a decode node sizes it from its step time).",
        )
        .value(s.prefill_token_cap as f64),
    ]
}

fn control_plane_families(v: &ControlPlaneViews) -> Vec<tm::Family> {
    let mut out = Vec::new();
    if let Some(r) = &v.registration {
        let state = match &*r.borrow() {
            RegistrationState::Live { .. } => "live",
            RegistrationState::Reconnecting => "reconnecting",
            RegistrationState::Reregistering => "reregistering",
            RegistrationState::Refused { .. } => "refused",
            RegistrationState::Closed => "closed",
        };
        let mut f = tm::Family::gauge(
            "tandem_node_registration_live",
            "1 for the current state of the node's etcd registration.",
        );
        for s in ["live", "reconnecting", "reregistering", "refused", "closed"] {
            f = f.with(vec![("state", s.into())], f64::from(u8::from(s == state)));
        }
        out.push(f);
    }
    if let Some(n) = &v.lease_failures {
        out.push(
            tm::Family::counter(
                "tandem_node_lease_renewal_failures",
                "Times the lease keep-alive lost etcd or the lease itself.",
            )
            .value(n.load(Ordering::Relaxed) as f64),
        );
    }
    out.extend(transfer_families(&v.transfers));
    if let Some(s) = &v.signals {
        let s = s.borrow();
        out.push(
            tm::Family::gauge(
                "tandem_node_load_signals_connected",
                "1 while the NATS load bus is connected.",
            )
            .value(f64::from(u8::from(s.connected))),
        );
        out.push(
            tm::Family::counter("tandem_node_load_reports", "Load reports by result.")
                .with(vec![("result", "published".into())], s.published as f64)
                .with(vec![("result", "failed".into())], s.publish_failures as f64),
        );
    }
    out
}

fn transfer_families(transports: &[(&'static str, Arc<TransferMetrics>)]) -> Vec<tm::Family> {
    if transports.is_empty() {
        return Vec::new();
    }
    let mut bytes = tm::Family::counter(
        "tandem_kv_transfer_bytes",
        "KV payload bytes pushed (sent) or verified on receipt (received).",
    );
    let mut ipc_bytes = tm::Family::counter(
        "tandem_kv_ipc_bytes",
        "KV payload bytes moved device to device by CUDA IPC (sent: copied into a peer's GPU pool; received: verified in this GPU's pool). Part of tandem_kv_transfer_bytes.",
    );
    let mut ipc_declined = tm::Family::counter(
        "tandem_kv_ipc_declined",
        "Connections from senders on this GPU that got no CUDA IPC offer and stream KV bytes instead (the pool could not be exported, or is not the device pool's mirror).",
    );
    let mut transfers = tm::Family::counter(
        "tandem_kv_transfers",
        "KV transfers: outbound started and confirmed, inbound (reservations) filled and verified.",
    );
    let mut failures = tm::Family::counter(
        "tandem_kv_transfer_failures",
        "KV transfers that failed, by reason (checksum_mismatch: refused on receipt, re-prefilled).",
    );
    let mut mismatches = tm::Family::counter(
        "tandem_kv_transfer_checksum_mismatches",
        "KV transfers refused on receipt because a block's checksum did not match.",
    );
    let mut seconds = tm::Family::histogram(
        "tandem_kv_transfer_duration_seconds",
        "Outbound KV transfer time, push start to the receiver's confirmation.",
    );
    let mut live = tm::Family::gauge(
        "tandem_kv_transfer_live",
        "Transport resources held now (registrations, reservations, transfers, connections).",
    );
    for (t, m) in transports {
        let s = m.snapshot();
        let l = |k: &'static str, v: &str| vec![("transport", t.to_string()), (k, v.to_string())];
        bytes = bytes
            .with(l("direction", "sent"), s.bytes_sent as f64)
            .with(l("direction", "received"), s.bytes_received as f64);
        ipc_bytes = ipc_bytes
            .with(l("direction", "sent"), s.ipc_bytes_sent as f64)
            .with(l("direction", "received"), s.ipc_bytes_received as f64);
        ipc_declined = ipc_declined.with(vec![("transport", t.to_string())], s.ipc_declined as f64);
        transfers = transfers
            .with(l("result", "started"), s.transfers_started as f64)
            .with(l("result", "confirmed"), s.transfers_succeeded as f64)
            .with(l("result", "received"), s.inbound_succeeded as f64);
        for (kind, n) in &s.failures {
            failures = failures.with(l("reason", kind), *n as f64);
        }
        mismatches = mismatches.with(
            vec![("transport", t.to_string())],
            s.failures_of(tandem_kv_transfer::error::FailureKind::ChecksumMismatch) as f64,
        );
        let bounds = tandem_kv_transfer::metrics::SECONDS_BUCKETS
            .iter()
            .copied()
            .chain([f64::INFINITY]);
        seconds = seconds.with_histogram(
            vec![("transport", t.to_string())],
            bounds.zip(s.seconds_bucket_counts.iter().copied()).collect(),
            s.seconds_sum,
        );
        live = live
            .with(l("what", "registrations"), s.live_registrations as f64)
            .with(l("what", "reservations"), s.live_reservations as f64)
            .with(l("what", "transfers"), s.live_transfers as f64)
            .with(l("what", "connections"), s.live_connections as f64);
    }
    vec![bytes, ipc_bytes, ipc_declined, transfers, failures, mismatches, seconds, live]
}

/// Binds `--metrics-addr` and serves `GET /metrics` from `metrics`; returns the server and the
/// URL to advertise in the node's etcd record.
pub async fn serve(
    listen: &crate::config::ListenArgs,
    metrics: &NodeMetrics,
) -> Result<(tm::MetricsServer, String), crate::NodeError> {
    let addr = listen.metrics_addr;
    let listener = crate::lifecycle::bind("metrics", addr).await?;
    let bound = listener
        .local_addr()
        .map_err(|source| crate::NodeError::Bind {
            what: "metrics",
            addr,
            source,
        })?;
    let this = metrics.clone();
    let server = tm::MetricsServer::spawn(listener, Arc::new(move || this.render())).map_err(
        |source| crate::NodeError::Bind {
            what: "metrics",
            addr,
            source,
        },
    )?;
    let url = format!("http://{}/metrics", listen.advertised(bound));
    Ok((server, url))
}
