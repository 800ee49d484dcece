//! Every metric family the router exports (declared here once; call sites hold
//! [`RouterMetrics`] handles). Rendered at `GET /metrics` on the HTTP port.
//!
//! | family | type | labels | what |
//! |---|---|---|---|
//! | `tandem_router_requests_total` | counter | outcome | admitted, completed, failed, cancelled, overloaded |
//! | `tandem_router_request_failures_total` | counter | reason | failed requests by [`RouterError::kind`](crate::RouterError::kind) |
//! | `tandem_router_time_to_first_token_seconds` | histogram | model, priority | admission start to the first token sent to the client |
//! | `tandem_router_inter_token_latency_seconds` | histogram | model, priority | gap between tokens sent (a batch of n tokens counts n gaps of gap/n) |
//! | `tandem_router_request_duration_seconds` | histogram | model, priority | admission start to the final message |
//! | `tandem_router_queue_wait_seconds` | histogram | model, priority | time in the admission queue |
//! | `tandem_router_input_tokens_total` | counter | model, priority | prompt tokens of completed requests |
//! | `tandem_router_cached_input_tokens_total` | counter | model, priority | of those, served from a prefix cache |
//! | `tandem_router_output_tokens_total` | counter | model, priority | tokens sent to clients |
//! | `tandem_router_recoveries_total` | counter | kind | retry, reprefill, migration, reserve_refused, release |
//! | `tandem_router_routing_picks_total` | counter | role, source | node choices from load reports or the fallback |
//! | `tandem_router_prefill_placements_total` | counter | site, reason | where attempts' prompts were computed: `prefill_node` or `decode_node` (conditional disaggregation), and why |
//! | `tandem_router_load_fallback_entered_total` | counter | role | switches to in-flight routing |
//! | `tandem_router_nodes` | gauge | role | nodes accepting work |
//! | `tandem_router_in_flight` | gauge | role, node | this router's requests per node |
//! | `tandem_router_admission_in_flight` / `_queued` | gauge | – | admitted and waiting requests |
//! | `tandem_router_load_signals_connected` | gauge | – | 1 while NATS is connected |
//! | `tandem_router_load_report_age_seconds` | gauge | role, node | age of the newest load report per node |
//! | `tandem_router_key_requests_total` | counter | key | completed requests per API key id (at most 100 ids, then `other`) |
//! | `tandem_router_key_tokens_total` | counter | key, kind | input, cached_input, output tokens per key id |
//! | `tandem_router_key_node_seconds_total` | counter | key, pool | engine time per key id and pool |
//! | `tandem_router_canary_pairs` / `_pairs_passing` | gauge | – | pairs probed / passing their last probe |
//! | `tandem_router_canary_pool_all_failing` | gauge | role | 1 while every node of the pool fails the canary (routed to anyway: a canary never empties a pool) |
//! | `tandem_router_canary_probes_total` | counter | result | canary probes: ok, failed, or inconclusive (timed out behind real work the nodes are making progress on) |
//! | `tandem_router_canary_duration_seconds` | histogram | – | one canary probe |
//! | `tandem_trace_*` | counter | – | span export (see `tandem_telemetry`) |

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tandem_cluster::Role;
use tandem_telemetry::metrics::{self as tm, FnCollector, buckets};

use crate::pipeline::Router;
use crate::request::Priority;

mod labels;
pub use labels::*;

fn ttft() -> Histogram {
    tm::histogram(buckets::TTFT_SECONDS)
}
fn itl() -> Histogram {
    tm::histogram(buckets::ITL_SECONDS)
}
fn e2e() -> Histogram {
    tm::histogram(buckets::E2E_SECONDS)
}
fn queue() -> Histogram {
    tm::histogram(buckets::QUEUE_SECONDS)
}

/// The router's metric handles. Cheap to clone.
#[derive(Clone)]
pub struct RouterMetrics {
    registry: Arc<std::sync::OnceLock<Registry>>,
    model: String,
    ttft: Family<RequestLabels, Histogram, tm::HistogramCtor>,
    itl: Family<RequestLabels, Histogram, tm::HistogramCtor>,
    e2e: Family<RequestLabels, Histogram, tm::HistogramCtor>,
    queue_wait: Family<RequestLabels, Histogram, tm::HistogramCtor>,
    input_tokens: Family<RequestLabels, Counter>,
    cached_input_tokens: Family<RequestLabels, Counter>,
    output_tokens: Family<RequestLabels, Counter>,
    failures: Family<ReasonLabels, Counter>,
    placements: Family<PlacementLabels, Counter>,
    canary_seconds: Histogram,
    canary_probes: Family<ResultLabels, Counter>,
    key_requests: Family<KeyLabels, Counter>,
    key_tokens: Family<KeyTokenLabels, Counter>,
    key_node_seconds: Family<KeyPoolLabels, Counter<f64, std::sync::atomic::AtomicU64>>,
    rate_limited: Family<KeyLimitLabels, Counter>,
    key_file_reloads: Family<ResultLabels, Counter>,
    /// Key ids given their own series so far (at most `max_key_ids`; the rest are `other`).
    key_ids: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    max_key_ids: usize,
}

impl std::fmt::Debug for RouterMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterMetrics")
            .field("model", &self.model)
            .finish()
    }
}

impl RouterMetrics {
    /// Handles for a router serving `model` (the registry is completed by [`Self::install`]).
    pub fn new(model: &str) -> Self {
        RouterMetrics {
            registry: Arc::new(std::sync::OnceLock::new()),
            model: model.to_string(),
            ttft: Family::new_with_constructor(ttft),
            itl: Family::new_with_constructor(itl),
            e2e: Family::new_with_constructor(e2e),
            queue_wait: Family::new_with_constructor(queue),
            input_tokens: Family::default(),
            cached_input_tokens: Family::default(),
            output_tokens: Family::default(),
            failures: Family::default(),
            placements: Family::default(),
            key_requests: Family::default(),
            key_tokens: Family::default(),
            key_node_seconds: Family::default(),
            rate_limited: Family::default(),
            key_file_reloads: Family::default(),
            key_ids: Arc::default(),
            max_key_ids: DEFAULT_MAX_KEY_IDS,
            canary_seconds: tm::histogram(buckets::CANARY_SECONDS),
            canary_probes: {
                // Both series exist from the start (an alert on failures needs the 0).
                let f = Family::<ResultLabels, Counter>::default();
                let _ = f.get_or_create(&ResultLabels { result: "ok" });
                let _ = f.get_or_create(&ResultLabels { result: "failed" });
                f
            },
        }
    }

    /// Builds the registry: these handles plus the families read from `router` at scrape time.
    /// Called once, when the router starts.
    pub(crate) fn install(&self, router: &Router) {
        let mut r = Registry::default();
        r.register(
            "tandem_router_time_to_first_token_seconds",
            "Admission start to the first token sent to the client",
            self.ttft.clone(),
        );
        r.register(
            "tandem_router_inter_token_latency_seconds",
            "Gap between tokens sent to the client",
            self.itl.clone(),
        );
        r.register(
            "tandem_router_request_duration_seconds",
            "Admission start to the final message",
            self.e2e.clone(),
        );
        r.register(
            "tandem_router_queue_wait_seconds",
            "Time in the router's admission queue",
            self.queue_wait.clone(),
        );
        r.register(
            "tandem_router_input_tokens",
            "Prompt tokens of completed requests",
            self.input_tokens.clone(),
        );
        r.register(
            "tandem_router_cached_input_tokens",
            "Prompt tokens of completed requests served from a prefix cache",
            self.cached_input_tokens.clone(),
        );
        r.register(
            "tandem_router_output_tokens",
            "Tokens sent to clients",
            self.output_tokens.clone(),
        );
        r.register(
            "tandem_router_request_failures",
            "Admitted requests that failed, by reason",
            self.failures.clone(),
        );
        r.register(
            "tandem_router_prefill_placements",
            "Where attempts' prompts were computed (prefill node or decode node), and why",
            self.placements.clone(),
        );
        r.register(
            "tandem_router_canary_duration_seconds",
            "One canary probe (a two-token generation through one pair)",
            self.canary_seconds.clone(),
        );
        r.register(
            "tandem_router_key_requests",
            "Completed requests by API key id",
            self.key_requests.clone(),
        );
        r.register(
            "tandem_router_key_tokens",
            "Tokens of completed requests by API key id and kind (input, cached_input, output)",
            self.key_tokens.clone(),
        );
        r.register(
            "tandem_router_key_node_seconds",
            "Engine time of completed requests by API key id and pool",
            self.key_node_seconds.clone(),
        );
        r.register(
            "tandem_router_rate_limited",
            "Requests refused by their API key's limits, by key id and limit",
            self.rate_limited.clone(),
        );
        r.register(
            "tandem_router_key_file_reloads",
            "Reloads of the API key file by result (ok; failed: the keys before stay loaded)",
            self.key_file_reloads.clone(),
        );
        r.register(
            "tandem_router_canary_probes",
            "Canary probes by result",
            self.canary_probes.clone(),
        );
        let weak = router.downgrade();
        r.register_collector(Box::new(FnCollector::new(move || match weak.upgrade() {
            Some(router) => live_families(&router),
            None => Vec::new(),
        })));
        r.register_collector(Box::new(FnCollector::new(
            tandem_telemetry::trace_export_families,
        )));
        let _ = self.registry.set(r);
    }

    /// The Prometheus text of every family.
    pub fn render(&self) -> String {
        match self.registry.get() {
            Some(r) => tm::render(r),
            None => String::new(),
        }
    }

    fn labels(&self, priority: Priority) -> RequestLabels {
        RequestLabels {
            model: self.model.clone(),
            priority: priority.as_str(),
        }
    }

    /// The first token of a request reached its client.
    pub fn first_token(&self, priority: Priority, since_admission: Duration) {
        self.ttft
            .get_or_create(&self.labels(priority))
            .observe(since_admission.as_secs_f64());
    }

    /// `tokens` more tokens reached the client `gap` after the previous ones.
    pub fn tokens_after(&self, priority: Priority, gap: Duration, tokens: u32) {
        if tokens == 0 {
            return;
        }
        let h = self.itl.get_or_create(&self.labels(priority));
        let each = gap.as_secs_f64() / f64::from(tokens);
        for _ in 0..tokens {
            h.observe(each);
        }
    }

    /// Tokens sent to a client (every delta).
    pub fn output(&self, priority: Priority, tokens: u32) {
        self.output_tokens
            .get_or_create(&self.labels(priority))
            .inc_by(u64::from(tokens));
    }

    /// A request finished with its final message.
    pub fn completed(&self, priority: Priority, total: Duration, usage: crate::Usage) {
        let l = self.labels(priority);
        self.e2e.get_or_create(&l).observe(total.as_secs_f64());
        self.input_tokens
            .get_or_create(&l)
            .inc_by(u64::from(usage.prompt_tokens));
        self.cached_input_tokens
            .get_or_create(&l)
            .inc_by(u64::from(usage.cached_prompt_tokens));
    }

    /// A request left the admission queue after `wait`.
    pub fn admitted(&self, priority: Priority, wait: Duration) {
        self.queue_wait
            .get_or_create(&self.labels(priority))
            .observe(wait.as_secs_f64());
    }

    /// A completed request's usage under `key` (ids beyond the first `max_key_ids` share the
    /// label `other`: bounded cardinality).
    pub fn key_usage(&self, key: &str, u: &tandem_cluster::UsageTotals) {
        let key = self.key_label(key);
        self.key_requests
            .get_or_create(&KeyLabels { key: key.clone() })
            .inc_by(u.requests);
        for (kind, n) in [
            ("input", u.input_tokens),
            ("cached_input", u.cached_input_tokens),
            ("output", u.output_tokens),
        ] {
            self.key_tokens
                .get_or_create(&KeyTokenLabels {
                    key: key.clone(),
                    kind,
                })
                .inc_by(n);
        }
        for (pool, s) in [
            ("prefill", u.prefill_node_seconds),
            ("decode", u.decode_node_seconds),
        ] {
            self.key_node_seconds
                .get_or_create(&KeyPoolLabels {
                    key: key.clone(),
                    pool,
                })
                .inc_by(s);
        }
    }

    /// `key`, or `other` once `max_key_ids` ids have their own series (bounded cardinality).
    fn key_label(&self, key: &str) -> String {
        let mut ids = self.key_ids.lock().unwrap_or_else(|p| p.into_inner());
        if ids.contains(key) || ids.len() < self.max_key_ids {
            ids.insert(key.to_string());
            key.to_string()
        } else {
            OTHER_KEYS.to_string()
        }
    }

    /// A request was refused by its key's `limit`.
    pub fn rate_limited(&self, key: &str, limit: tandem_cluster::LimitKind) {
        let key = self.key_label(key);
        self.rate_limited
            .get_or_create(&KeyLimitLabels {
                key,
                limit: limit.as_str(),
            })
            .inc();
    }

    /// The key file was read again.
    pub fn key_file_reload(&self, ok: bool) {
        let result = if ok { "ok" } else { "failed" };
        self.key_file_reloads
            .get_or_create(&ResultLabels { result })
            .inc();
    }

    /// A canary probe ended.
    pub fn canary_probe(&self, ok: bool, took: Duration) {
        self.canary_seconds.observe(took.as_secs_f64());
        let result = if ok { "ok" } else { "failed" };
        self.canary_probes
            .get_or_create(&ResultLabels { result })
            .inc();
    }

    /// An attempt's prompt was placed (conditional disaggregation).
    pub fn placement(&self, placement: crate::routing::Placement) {
        self.placements
            .get_or_create(&PlacementLabels {
                site: placement.site(),
                reason: placement.reason().as_str(),
            })
            .inc();
    }

    /// A canary probe timed out behind real work (no verdict on its pair).
    pub fn canary_inconclusive(&self) {
        self.canary_probes
            .get_or_create(&ResultLabels { result: "inconclusive" })
            .inc();
    }

    /// An admitted request failed.
    pub fn failed(&self, reason: &'static str) {
        self.failures.get_or_create(&ReasonLabels { reason }).inc();
    }
}

/// Families read from the router's live state at scrape time.
fn live_families(router: &Router) -> Vec<tm::Family> {
    let s = router.stats();
    let label = |k: &'static str, v: &str| vec![(k, v.to_string())];
    let mut out = vec![
        tm::Family::counter("tandem_router_requests", "Requests by outcome.")
            .with(label("outcome", "admitted"), s.admitted as f64)
            .with(label("outcome", "completed"), s.completed as f64)
            .with(label("outcome", "failed"), s.failed as f64)
            .with(label("outcome", "cancelled"), s.cancelled as f64)
            .with(label("outcome", "overloaded"), s.overloaded as f64),
        tm::Family::counter(
            "tandem_router_recoveries",
            "Attempts repeated after a retry-safe failure, by kind.",
        )
        .with(label("kind", "retry"), s.retries as f64)
        .with(label("kind", "reprefill"), s.reprefills as f64)
        .with(label("kind", "migration"), s.migrations as f64)
        .with(label("kind", "reserve_refused"), s.reserve_refusals as f64)
        .with(label("kind", "release"), s.releases as f64)
        .with(label("kind", "reserve_unanswered"), s.reserve_unanswered as f64),
    ];
    if let Some(index) = router.prefix_index() {
        let c = index.counts();
        out.push(
            tm::Family::gauge(
                "tandem_router_prefix_index_nodes",
                "Prefill nodes whose prefix cache the router trusts now (KV events in order since a snapshot).",
            )
            .with(Vec::new(), c.synced_nodes as f64),
        );
        out.push(
            tm::Family::gauge(
                "tandem_router_prefix_index_blocks",
                "Cached KV blocks the router knows of, over every prefill node.",
            )
            .with(Vec::new(), c.hashes as f64),
        );
        out.push(
            tm::Family::counter(
                "tandem_router_kv_event_batches",
                "KV event batches received from prefill nodes.",
            )
            .with(Vec::new(), c.batches as f64),
        );
        out.push(
            tm::Family::counter(
                "tandem_router_kv_event_gaps",
                "Gaps in a node's KV events (its cache counted as empty until its next snapshot).",
            )
            .with(Vec::new(), c.gaps as f64),
        );
    }
    let limiter = router.rate_limiter().counts();
    out.push(
        tm::Family::counter(
            "tandem_router_rate_limit_store_visits",
            "Visits to the shared rate-limit records (etcd): lease refills, returns, admissions a lease did not cover.",
        )
        .with(Vec::new(), limiter.store_visits.load(std::sync::atomic::Ordering::Relaxed) as f64),
    );
    out.push(
        tm::Family::counter(
            "tandem_router_rate_limit_store_errors",
            "Visits to the shared rate-limit records that failed; meanwhile this router limited each key alone.",
        )
        .with(Vec::new(), limiter.store_errors.load(std::sync::atomic::Ordering::Relaxed) as f64),
    );
    out.push(
        tm::Family::counter(
            "tandem_router_rate_limit_local_decisions",
            "Lease visits decided on this router's own buckets because the shared store was down.",
        )
        .with(
            Vec::new(),
            limiter
                .local_decisions
                .load(std::sync::atomic::Ordering::Relaxed) as f64,
        ),
    );
    let mut picks = tm::Family::counter(
        "tandem_router_routing_picks",
        "Node choices, by role and by source (NATS load reports or the router's own in-flight counts).",
    );
    let mut entered = tm::Family::counter(
        "tandem_router_load_fallback_entered",
        "Times routing switched to in-flight counts because load reports were stale or absent.",
    );
    let mut nodes = tm::Family::gauge("tandem_router_nodes", "Nodes accepting work, by role.");
    let mut all_failing = tm::Family::gauge(
        "tandem_router_canary_pool_all_failing",
        "1 while every node of the role's pool fails the canary (none is taken out of routing then).",
    );
    let mut in_flight =
        tm::Family::gauge("tandem_router_in_flight", "Requests in flight per node.");
    let mut ages = tm::Family::gauge(
        "tandem_router_load_report_age_seconds",
        "Age of the newest load report per node (absent: no report yet).",
    );
    let (np, nd) = router.available_nodes();
    for (role, rs, available) in [(Role::Prefill, s.prefill, np), (Role::Decode, s.decode, nd)] {
        let r = role.as_str();
        picks = picks
            .with(
                vec![("role", r.into()), ("source", "load_report".into())],
                rs.load_picks as f64,
            )
            .with(
                vec![("role", r.into()), ("source", "fallback".into())],
                rs.fallback_picks as f64,
            );
        entered = entered.with(label("role", r), rs.fallback_entered as f64);
        nodes = nodes.with(label("role", r), available as f64);
        all_failing = all_failing.with(
            label("role", r),
            f64::from(u8::from(router.canary_all_failing(role))),
        );
        for (node, n) in router.in_flight_by_node(role) {
            in_flight = in_flight.with(vec![("role", r.into()), ("node", node)], f64::from(n));
        }
        for (node, age) in router.load_report_ages(role) {
            ages = ages.with(vec![("role", r.into()), ("node", node)], age.as_secs_f64());
        }
    }
    let (pairs, passing) = router.canary_counts();
    out.push(
        tm::Family::gauge(
            "tandem_router_canary_pairs",
            "Prefill→decode pairs the canary has probed (current nodes).",
        )
        .value(pairs as f64),
    );
    out.push(
        tm::Family::gauge(
            "tandem_router_canary_pairs_passing",
            "Of those, pairs whose last probe passed (0 with pairs > 0: NOT_SERVING).",
        )
        .value(passing as f64),
    );
    let admission = router.admission();
    out.extend([
        picks,
        entered,
        nodes,
        all_failing,
        in_flight,
        ages,
        tm::Family::gauge(
            "tandem_router_admission_in_flight",
            "Requests admitted and not finished.",
        )
        .value(admission.in_flight() as f64),
        tm::Family::gauge(
            "tandem_router_admission_queued",
            "Requests waiting in the admission queue.",
        )
        .value(admission.queued() as f64),
        tm::Family::gauge(
            "tandem_router_load_signals_connected",
            "1 while the NATS load bus is connected.",
        )
        .value(f64::from(u8::from(router.load_signals_connected()))),
    ]);
    out
}
