//! Per-key rate limits at the router: requests per second, tokens per minute and concurrent
//! requests, held across every router by leases from the shared buckets in
//! [`tandem_cluster::ratelimit`] (etcd in production).
//!
//! ```text
//! admit(key, prompt) ──▶ lease covers it? ──yes──▶ spend locally (µs) ──▶ KeyPermit
//!                           │ no                      └─ lease low: refill in background
//!                           ▼
//!                 one visit to the shared record (CAS) ──▶ grant: add to lease, spend
//!                                                     └──▶ denied: RateLimited (429)
//! KeyPermit::finish(output) ──▶ output tokens spent from the lease (below zero: a debt
//!                               paid back at the next visit)
//! drop(KeyPermit) ──▶ slot freed; a spare slot goes back to the record in the background
//! every LEASE_IDLE without use ──▶ unspent requests and tokens go back
//! ```
//!
//! Invariants: a request is admitted only against requests, tokens and a slot this router
//! was granted (or, while the store cannot be reached, against this router's own buckets at
//! the key's full limits: logged once per outage, counted in
//! `tandem_router_rate_limit_store_errors`, marked on the request's span); one visit to a
//! key's record is in flight per router at a time; a [`KeyPermit`] frees its slot when
//! dropped, whatever ended the request.
//!
//! Leases are a tenth of a bucket (at least one request): keys with a rate of 20 requests per
//! second or more are admitted locally almost always; slower keys visit the record per
//! request, which their rate allows. Tokens are checked against the prompt at admission and
//! the output is spent when it is known (as the OpenAI API counts them).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tandem_cluster::{Grant, KeyLimits, LimitKind, LimitRecord, RateLimitStore};
use tokio_util::sync::CancellationToken;

use crate::error::RouterError;

mod lease;

use self::lease::Lease;

/// A lease is this fraction of a bucket.
const LEASE_DIVISOR: f64 = 10.0;
/// Unspent leases of a key unused this long go back to the shared record.
pub const LEASE_IDLE: Duration = Duration::from_secs(1);
/// Slots are held this long unless renewed (a router that dies frees them after it).
pub const SLOT_HOLD: Duration = Duration::from_secs(10);
/// The longest an admission waits for the shared record before it limits alone.
pub const STORE_TIMEOUT: Duration = Duration::from_millis(500);
/// After a failed visit, the store is tried again no sooner than this (admissions meanwhile
/// use this router's own buckets at once instead of waiting on a dead store).
pub const STORE_RETRY: Duration = Duration::from_secs(2);
/// Visits one admission may make before it gives up (requests admitted locally meanwhile
/// kept spending what it was granted).
const MAX_ADMIT_VISITS: u32 = 3;
/// How often idle leases are returned and held slots renewed.
const MAINTENANCE_PERIOD: Duration = Duration::from_millis(250);

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// What a response tells its client about the key's limits (the `x-ratelimit-*` headers).
/// `remaining` is this router's last view of the shared buckets plus its unspent lease.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RateLimitStatus {
    /// The key's limits.
    pub limits: KeyLimits,
    /// Requests left.
    pub remaining_requests: u64,
    /// Tokens left.
    pub remaining_tokens: u64,
    /// Until the requests bucket is full.
    pub reset_requests: Duration,
    /// Until the tokens bucket is full.
    pub reset_tokens: Duration,
}

impl RateLimitStatus {
    /// The `x-ratelimit-*` headers (HTTP) and metadata (gRPC): the key's limits, what is left
    /// of them, and when each bucket is full again. Requests count per second
    /// (`limit-requests` is the key's `requests_per_second`), tokens per minute.
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::with_capacity(7);
        if let Some(rps) = self.limits.requests_per_second {
            out.push(("x-ratelimit-limit-requests", format!("{rps}")));
            out.push((
                "x-ratelimit-remaining-requests",
                self.remaining_requests.to_string(),
            ));
            out.push(("x-ratelimit-reset-requests", reset(self.reset_requests)));
        }
        if let Some(tpm) = self.limits.tokens_per_minute {
            out.push(("x-ratelimit-limit-tokens", tpm.to_string()));
            out.push((
                "x-ratelimit-remaining-tokens",
                self.remaining_tokens.to_string(),
            ));
            out.push(("x-ratelimit-reset-tokens", reset(self.reset_tokens)));
        }
        if let Some(n) = self.limits.max_concurrent_requests {
            out.push(("x-ratelimit-limit-concurrent-requests", n.to_string()));
        }
        out
    }
}

/// A duration as OpenAI writes its reset headers: `20ms`, `1.5s`, `6m0s`.
fn reset(d: Duration) -> String {
    let ms = d.as_millis();
    match ms {
        0..1000 => format!("{ms}ms"),
        1000..60_000 => format!("{}s", (d.as_secs_f64() * 1000.0).round() / 1000.0),
        _ => format!("{}m{}s", ms / 60_000, (ms % 60_000) / 1000),
    }
}

#[derive(Debug)]
struct KeyState {
    id: Arc<str>,
    lease: Mutex<Lease>,
    /// One visit to the shared record at a time.
    visit: tokio::sync::Mutex<()>,
    refilling: AtomicBool,
}

impl KeyState {
    fn lease(&self) -> std::sync::MutexGuard<'_, Lease> {
        self.lease.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Counters the limiter keeps (read by `/metrics`).
#[derive(Debug, Default)]
pub struct LimiterCounts {
    /// Visits to the shared records.
    pub store_visits: AtomicU64,
    /// Visits that failed (the router limited alone meanwhile).
    pub store_errors: AtomicU64,
    /// Decisions made on this router's own buckets because the store was down.
    pub local_decisions: AtomicU64,
}

/// The per-key limiter of one router.
#[derive(Debug)]
pub struct RateLimiter {
    store: Arc<dyn RateLimitStore>,
    holder: String,
    keys: Mutex<HashMap<Arc<str>, Arc<KeyState>>>,
    counts: LimiterCounts,
    /// Whether the last visit failed (a warning is logged once per outage).
    store_down: AtomicBool,
    /// While the store is down: when to try it again.
    retry_store_at: Mutex<Option<Instant>>,
}

/// A request admitted under a limited key: its slot, and where its output tokens are spent.
#[derive(Debug)]
pub struct KeyPermit {
    state: Option<(Arc<RateLimiter>, Arc<KeyState>)>,
    status: Option<RateLimitStatus>,
    /// Whether it was admitted against this router's own buckets (the store was down).
    pub fallback: bool,
}

impl KeyPermit {
    /// A permit of a key without limits.
    pub fn unlimited() -> Self {
        KeyPermit {
            state: None,
            status: None,
            fallback: false,
        }
    }

    /// What the response's `x-ratelimit-*` headers say (none: the key has no limits).
    pub fn status(&self) -> Option<RateLimitStatus> {
        self.status
    }

    /// Spends the request's output tokens from the key's lease.
    pub fn spend_output(&self, tokens: u32) {
        if let Some((_, key)) = &self.state {
            let mut lease = key.lease();
            if lease.limits.tokens_per_minute.is_some() {
                lease.tokens -= f64::from(tokens);
            }
        }
    }
}

impl Drop for KeyPermit {
    fn drop(&mut self) {
        let Some((limiter, key)) = self.state.take() else {
            return;
        };
        let spare = {
            let mut lease = key.lease();
            lease.running = lease.running.saturating_sub(1);
            lease.slots_spare()
        };
        // A spare slot goes back at once, so another router's request need not wait for it.
        if spare && tokio::runtime::Handle::try_current().is_ok() {
            tokio::spawn(async move { limiter.visit(&key, None).await });
        }
    }
}

impl RateLimiter {
    /// A limiter whose leases come from `store`; `holder` names this router in the records.
    pub fn new(store: Arc<dyn RateLimitStore>, holder: String) -> Arc<Self> {
        Arc::new(RateLimiter {
            store,
            holder,
            keys: Mutex::default(),
            counts: LimiterCounts::default(),
            store_down: AtomicBool::new(false),
            retry_store_at: Mutex::new(None),
        })
    }

    /// The counters.
    pub fn counts(&self) -> &LimiterCounts {
        &self.counts
    }

    /// Whether the limits hold across routers (false: each router limits alone).
    pub fn is_shared(&self) -> bool {
        self.store.is_shared()
    }

    fn key(&self, id: &Arc<str>, limits: KeyLimits) -> Arc<KeyState> {
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        let state = keys.entry(Arc::clone(id)).or_insert_with(|| {
            Arc::new(KeyState {
                id: Arc::clone(id),
                lease: Mutex::new(Lease::new(limits)),
                visit: tokio::sync::Mutex::new(()),
                refilling: AtomicBool::new(false),
            })
        });
        let mut lease = state.lease();
        if lease.limits != limits {
            // The key file was reloaded: new limits apply from the next visit.
            lease.limits = limits;
            lease.seen.limits = limits;
        }
        drop(lease);
        Arc::clone(state)
    }

    /// Admits one request of `prompt_tokens` under key `id` with `limits`, or says which
    /// limit refuses it and when to come back.
    pub async fn admit(
        self: &Arc<Self>,
        id: &Arc<str>,
        limits: KeyLimits,
        prompt_tokens: u32,
    ) -> Result<KeyPermit, RouterError> {
        if limits.is_unlimited() {
            return Ok(KeyPermit::unlimited());
        }
        let key = self.key(id, limits);
        let permit = |limiter: &Arc<Self>, status, fallback| KeyPermit {
            state: Some((Arc::clone(limiter), Arc::clone(&key))),
            status: Some(status),
            fallback,
        };
        {
            let mut lease = key.lease();
            if lease.try_spend(prompt_tokens) {
                let status = lease.status();
                if lease.runs_low() && !key.refilling.swap(true, Ordering::AcqRel) {
                    let (limiter, key) = (Arc::clone(self), Arc::clone(&key));
                    tokio::spawn(async move {
                        limiter.visit(&key, None).await;
                        key.refilling.store(false, Ordering::Release);
                    });
                }
                return Ok(permit(self, status, false));
            }
        }
        let _visit = key.visit.lock().await;
        // Another request's visit may have refilled the lease meanwhile.
        {
            let mut lease = key.lease();
            if lease.try_spend(prompt_tokens) {
                let status = lease.status();
                return Ok(permit(self, status, false));
            }
        }
        // A grant covers the request it was asked for, unless requests admitted locally
        // meanwhile spent part of it: then visit again.
        for _ in 0..MAX_ADMIT_VISITS {
            let (grant, fallback) = self.visit_locked(&key, Some(prompt_tokens)).await;
            let mut lease = key.lease();
            if let Some((limit, retry_after)) = grant.denied {
                return Err(RouterError::RateLimited {
                    key_id: id.to_string(),
                    limit,
                    retry_after,
                    status: lease.status(),
                });
            }
            if lease.try_spend(prompt_tokens) {
                return Ok(permit(self, lease.status(), fallback));
            }
        }
        let status = key.lease().status();
        Err(RouterError::RateLimited {
            key_id: id.to_string(),
            limit: LimitKind::Requests,
            retry_after: Some(Duration::from_secs(1)),
            status,
        })
    }

    /// One visit to `key`'s record (refilling, or returning spare slots when `admitting` is
    /// `None`).
    async fn visit(&self, key: &KeyState, admitting: Option<u32>) {
        let _visit = key.visit.lock().await;
        self.visit_locked(key, admitting).await;
    }

    /// A visit, with `key.visit` held by the caller: returns the grant and whether it came
    /// from this router's own buckets because the store failed.
    async fn visit_locked(&self, key: &KeyState, admitting: Option<u32>) -> (Grant, bool) {
        let (ask, limits) = {
            let mut lease = key.lease();
            let ask = match admitting {
                Some(_) => lease.ask(admitting),
                None if lease.last_used.elapsed() >= LEASE_IDLE => lease.give_back(),
                None => lease.ask(None),
            };
            (ask, lease.limits)
        };
        let hold_ms = SLOT_HOLD.as_millis() as u64;
        let mut grant = Grant::default();
        let mut record = LimitRecord::default();
        let skip_store = {
            let retry_at = self
                .retry_store_at
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            retry_at.is_some_and(|at| Instant::now() < at)
        };
        let result = if skip_store {
            Err(None)
        } else {
            self.counts.store_visits.fetch_add(1, Ordering::Relaxed);
            self.store
                .update(&key.id, &mut |current| {
                    let now = now_ms();
                    let mut r = current.unwrap_or_else(|| LimitRecord::full(&limits, now));
                    grant = r.apply(&limits, &self.holder, &ask, now, hold_ms);
                    record = r.clone();
                    r
                })
                .await
                .map_err(Some)
        };
        let fallback = match result {
            Ok(_) => {
                if self.store_down.swap(false, Ordering::AcqRel) {
                    *self
                        .retry_store_at
                        .lock()
                        .unwrap_or_else(|p| p.into_inner()) = None;
                    tracing::info!("rate-limit store reachable again; limits are shared again");
                }
                false
            }
            Err(error) => {
                if let Some(error) = error {
                    self.counts.store_errors.fetch_add(1, Ordering::Relaxed);
                    *self
                        .retry_store_at
                        .lock()
                        .unwrap_or_else(|p| p.into_inner()) = Some(Instant::now() + STORE_RETRY);
                    if !self.store_down.swap(true, Ordering::AcqRel) {
                        tracing::warn!(%error, "rate-limit store unreachable: each key is limited by this router alone (at its full limits) until it is back");
                    }
                }
                self.counts.local_decisions.fetch_add(1, Ordering::Relaxed);
                let mut lease = key.lease();
                let now = now_ms();
                let local = lease
                    .fallback
                    .get_or_insert_with(|| LimitRecord::full(&limits, now));
                grant = local.apply(&limits, &self.holder, &ask, now, hold_ms);
                record = local.clone();
                true
            }
        };
        key.lease().take(&grant, &record);
        if fallback {
            tracing::Span::current().record("tandem.rate_limit", "local");
        }
        (grant, fallback)
    }

    /// Returns idle leases and renews held slots until `shutdown`; then gives everything back.
    pub async fn maintain(self: Arc<Self>, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(MAINTENANCE_PERIOD);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tick.tick() => {}
            }
            for key in self.due() {
                self.visit(&key, None).await;
            }
        }
        let keys: Vec<_> = {
            let keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
            keys.values().cloned().collect()
        };
        for key in keys {
            let idle = {
                let mut lease = key.lease();
                lease.last_used = Instant::now() - LEASE_IDLE;
                lease.requests > 0 || lease.tokens != 0.0 || lease.slots_held > 0
            };
            if idle {
                self.visit(&key, None).await;
            }
        }
    }

    /// Keys whose lease should go back (idle) or whose slots need renewing.
    fn due(&self) -> Vec<Arc<KeyState>> {
        let keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        keys.values()
            .filter(|k| {
                let l = k.lease();
                let idle = l.last_used.elapsed() >= LEASE_IDLE
                    && (l.requests > 0 || l.tokens != 0.0 || l.slots_held > l.running);
                let spare = l.slots_spare();
                let renew = l.slots_held > 0 && l.renewed.elapsed() >= SLOT_HOLD / 3;
                idle || renew || spare
            })
            .cloned()
            .collect()
    }
}
