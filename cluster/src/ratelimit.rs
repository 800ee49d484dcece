//! Per-API-key rate limits shared by every router: the record each key's buckets live in, the
//! arithmetic on it, and where it is stored.
//!
//! A key may limit requests per second, tokens per minute (prompt + output) and concurrent
//! requests. Its record holds two token buckets and the concurrency slots each router holds:
//!
//! - `requests` fills at `requests_per_second` up to one second's worth (at least 1);
//! - `tokens` fills at `tokens_per_minute / 60` per second up to a minute's worth;
//! - `slots` names, per router, how many concurrent requests it may run and until when
//!   (a router that dies stops renewing and its slots come back when they expire).
//!
//! Routers do not visit the record per request: they *lease* a share of each bucket (a
//! [`Ask`] applied with [`LimitRecord::apply`]) and spend it locally, asking again when it
//! runs low and giving back what they did not spend. Invariants, whatever the routers do:
//! a bucket never holds more than its capacity; requests and tokens leave a bucket only as
//! grants, so what all routers admit in any window is at most what the buckets dispensed
//! (tokens go below zero only by paying back output tokens spent beyond a lease, which
//! then delays the next grant); the slots held by unexpired routers never sum past
//! `max_concurrent_requests` once a grant is made.
//!
//! Where it lives, and why: etcd (`/tandem/{cluster}/ratelimit/{key_id}`, JSON, updated by
//! compare-and-swap like the usage ledger). etcd is the store every router already shares,
//! and JetStream KV is not usable with Debian's nats-server 2.9. An etcd write is a raft commit
//! (a millisecond or more), which is why requests spend leases instead of writing per request.
//! [`MemoryRateLimitStore`] is the in-process twin (one router, tests).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::Client;
use serde::{Deserialize, Serialize};

use crate::cas::update_json;
use crate::error::ClusterError;
use crate::keys::ClusterKeys;

/// One key's limits; `None` is unlimited.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct KeyLimits {
    /// Requests admitted per second (bursts of up to one second's worth, at least 1).
    pub requests_per_second: Option<f64>,
    /// Prompt plus output tokens per minute.
    pub tokens_per_minute: Option<u64>,
    /// Requests running at once.
    pub max_concurrent_requests: Option<u32>,
}

impl KeyLimits {
    /// No limit set.
    pub fn is_unlimited(&self) -> bool {
        *self == KeyLimits::default()
    }

    /// The requests bucket's capacity.
    pub fn request_capacity(&self) -> f64 {
        self.requests_per_second.map_or(0.0, |r| r.max(1.0))
    }

    /// The tokens bucket's capacity.
    pub fn token_capacity(&self) -> f64 {
        self.tokens_per_minute.map_or(0.0, |t| t as f64)
    }

    fn tokens_per_ms(&self) -> f64 {
        self.token_capacity() / 60_000.0
    }

    fn requests_per_ms(&self) -> f64 {
        self.requests_per_second.unwrap_or(0.0) / 1000.0
    }
}

/// Which limit a request met.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitKind {
    /// Requests per second.
    Requests,
    /// Tokens per minute.
    Tokens,
    /// Concurrent requests.
    Concurrency,
}

impl LimitKind {
    /// A stable lowercase name for metric labels and error codes.
    pub const fn as_str(self) -> &'static str {
        match self {
            LimitKind::Requests => "requests",
            LimitKind::Tokens => "tokens",
            LimitKind::Concurrency => "concurrency",
        }
    }
}

/// Concurrency slots one router holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SlotHold {
    /// Slots held.
    pub held: u32,
    /// Wall time (ms since the Unix epoch) after which they are free again unless renewed.
    pub expires_ms: u64,
}

/// The shared record of one key.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LimitRecord {
    /// Requests left in the bucket.
    pub requests: f64,
    /// Tokens left in the bucket (below zero while output beyond a lease is paid back).
    pub tokens: f64,
    /// Wall time (ms since the Unix epoch) the buckets were last filled to.
    pub at_ms: u64,
    /// Concurrency slots per router id.
    #[serde(default)]
    pub slots: BTreeMap<String, SlotHold>,
}

/// What one router asks of a key's record.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Ask {
    /// A request is being admitted: one request, `tokens_needed` and one slot beyond
    /// `slots_running` must be granted, or nothing is.
    pub admitting: bool,
    /// Requests wanted, granted as far as the bucket has them (at least one when admitting).
    pub requests: u32,
    /// Tokens that must be granted (a prompt, plus any debt the lease carries).
    pub tokens_needed: f64,
    /// Tokens wanted beyond those, granted as far as the bucket has them.
    pub tokens_extra: f64,
    /// Unspent requests given back.
    pub return_requests: f64,
    /// Unspent tokens given back (negative: output spent beyond the lease, paid back).
    pub return_tokens: f64,
    /// Requests the router runs now under this key: it keeps that many slots, whatever else.
    pub slots_running: u32,
    /// Slots it would like to hold from now on (more than running: spare for the next ones).
    pub slots_wanted: u32,
}

/// What a router got.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Grant {
    /// Requests granted.
    pub requests: u32,
    /// Tokens granted.
    pub tokens: f64,
    /// Slots the router now holds.
    pub slots_held: u32,
    /// The limit that refused the ask, and when to try again (`None`: never, the ask is over
    /// the limit's capacity). Nothing but returns and slot renewals took effect.
    pub denied: Option<(LimitKind, Option<Duration>)>,
    /// Requests left in the bucket after the grant.
    pub remaining_requests: f64,
    /// Tokens left in the bucket after the grant.
    pub remaining_tokens: f64,
}

fn ms(d: f64) -> Duration {
    Duration::from_secs_f64((d / 1000.0).max(0.0))
}

impl LimitRecord {
    /// Full buckets, no slots held.
    pub fn full(limits: &KeyLimits, now_ms: u64) -> Self {
        LimitRecord {
            requests: limits.request_capacity(),
            tokens: limits.token_capacity(),
            at_ms: now_ms,
            slots: BTreeMap::new(),
        }
    }

    /// Fills the buckets for the time since `at_ms` (a clock behind `at_ms` adds nothing).
    pub fn refill(&mut self, limits: &KeyLimits, now_ms: u64) {
        let dt = now_ms.saturating_sub(self.at_ms) as f64;
        self.requests =
            (self.requests + dt * limits.requests_per_ms()).min(limits.request_capacity());
        self.tokens = (self.tokens + dt * limits.tokens_per_ms()).min(limits.token_capacity());
        self.at_ms = self.at_ms.max(now_ms);
        self.slots
            .retain(|_, h| h.expires_ms > now_ms && h.held > 0);
    }

    /// Time until the requests bucket is full again.
    pub fn requests_reset(&self, limits: &KeyLimits) -> Duration {
        match limits.requests_per_ms() {
            r if r > 0.0 => ms((limits.request_capacity() - self.requests) / r),
            _ => Duration::ZERO,
        }
    }

    /// Time until the tokens bucket is full again.
    pub fn tokens_reset(&self, limits: &KeyLimits) -> Duration {
        match limits.tokens_per_ms() {
            r if r > 0.0 => ms((limits.token_capacity() - self.tokens) / r),
            _ => Duration::ZERO,
        }
    }

    /// Applies `holder`'s ask at `now_ms`: returns first, then all of the grant or none of it.
    /// Slots are held until `now_ms + hold_ms`.
    pub fn apply(
        &mut self,
        limits: &KeyLimits,
        holder: &str,
        ask: &Ask,
        now_ms: u64,
        hold_ms: u64,
    ) -> Grant {
        self.refill(limits, now_ms);
        self.requests = (self.requests + ask.return_requests).min(limits.request_capacity());
        self.tokens = (self.tokens + ask.return_tokens).min(limits.token_capacity());
        let denied = self.check(limits, holder, ask);
        let mut grant = Grant {
            denied,
            ..Grant::default()
        };
        let slots = match (limits.max_concurrent_requests, denied) {
            (None, _) => 0,
            (Some(_), Some(_)) => ask.slots_running,
            (Some(_), None) => {
                let wanted = ask
                    .slots_wanted
                    .max(ask.slots_running + u32::from(ask.admitting));
                wanted
                    .min(self.slots_free(limits, holder))
                    .max(ask.slots_running)
            }
        };
        if denied.is_none() {
            if limits.requests_per_second.is_some() {
                let wanted = ask.requests.max(u32::from(ask.admitting));
                grant.requests = wanted.min(self.requests.floor().max(0.0) as u32);
                self.requests -= f64::from(grant.requests);
            }
            if limits.tokens_per_minute.is_some() {
                let wanted = ask.tokens_needed.max(0.0) + ask.tokens_extra.max(0.0);
                grant.tokens = wanted
                    .min(self.tokens.max(0.0))
                    .max(ask.tokens_needed.max(0.0));
                self.tokens -= grant.tokens;
            }
        }
        if slots > 0 {
            let hold = SlotHold {
                held: slots,
                expires_ms: now_ms + hold_ms,
            };
            self.slots.insert(holder.to_string(), hold);
        } else {
            self.slots.remove(holder);
        }
        grant.slots_held = slots;
        grant.remaining_requests = self.requests.max(0.0);
        grant.remaining_tokens = self.tokens.max(0.0);
        grant
    }

    fn slots_free(&self, limits: &KeyLimits, holder: &str) -> u32 {
        let others: u32 = self
            .slots
            .iter()
            .filter(|(h, _)| h.as_str() != holder)
            .map(|(_, s)| s.held)
            .sum();
        limits
            .max_concurrent_requests
            .unwrap_or(0)
            .saturating_sub(others)
    }

    /// Which limit refuses `ask` now, if any.
    fn check(
        &self,
        limits: &KeyLimits,
        holder: &str,
        ask: &Ask,
    ) -> Option<(LimitKind, Option<Duration>)> {
        if !ask.admitting {
            return None;
        }
        if let Some(max) = limits.max_concurrent_requests {
            if max == 0 {
                return Some((LimitKind::Concurrency, None));
            }
            if ask.slots_running + 1 > self.slots_free(limits, holder) {
                // Slots come back when a request ends; no rate to predict it from.
                return Some((LimitKind::Concurrency, Some(Duration::from_secs(1))));
            }
        }
        if limits.requests_per_second.is_some() && self.requests < 1.0 {
            let wait = (1.0 - self.requests) / limits.requests_per_ms();
            return Some((LimitKind::Requests, Some(ms(wait))));
        }
        if limits.tokens_per_minute.is_some() && ask.tokens_needed > self.tokens {
            if ask.tokens_needed > limits.token_capacity() {
                return Some((LimitKind::Tokens, None));
            }
            let wait = (ask.tokens_needed - self.tokens) / limits.tokens_per_ms();
            return Some((LimitKind::Tokens, Some(ms(wait))));
        }
        None
    }
}

/// Where the records live (etcd in production, memory for one router and tests).
#[async_trait]
pub trait RateLimitStore: Send + Sync + std::fmt::Debug {
    /// Replaces `key_id`'s record with `update(current)` atomically (`update` may run more
    /// than once; only its last result is written) and returns what was written.
    async fn update(
        &self,
        key_id: &str,
        update: &mut (dyn FnMut(Option<LimitRecord>) -> LimitRecord + Send),
    ) -> Result<LimitRecord, ClusterError>;

    /// Whether routers share the records (false: each router limits alone).
    fn is_shared(&self) -> bool;
}

/// The records in etcd (see the module docs).
#[derive(Clone)]
pub struct EtcdRateLimitStore {
    client: Client,
    keys: ClusterKeys,
    timeout: Duration,
}

impl std::fmt::Debug for EtcdRateLimitStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdRateLimitStore")
            .field("cluster", &self.keys.cluster())
            .finish()
    }
}

impl EtcdRateLimitStore {
    pub(crate) fn new(client: Client, keys: ClusterKeys, timeout: Duration) -> Self {
        EtcdRateLimitStore {
            client,
            keys,
            timeout,
        }
    }

    /// The same store with every etcd call bounded by `timeout` (an admission waits for it
    /// when its lease does not cover it, so it is kept short).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

#[async_trait]
impl RateLimitStore for EtcdRateLimitStore {
    async fn update(
        &self,
        key_id: &str,
        update: &mut (dyn FnMut(Option<LimitRecord>) -> LimitRecord + Send),
    ) -> Result<LimitRecord, ClusterError> {
        let key = self.keys.rate_limit_key(key_id)?;
        update_json(&self.client, &key, self.timeout, "rate limit txn", update).await
    }

    fn is_shared(&self) -> bool {
        true
    }
}

/// The in-process twin of [`EtcdRateLimitStore`].
#[derive(Debug, Default)]
pub struct MemoryRateLimitStore {
    records: Mutex<BTreeMap<String, LimitRecord>>,
}

#[async_trait]
impl RateLimitStore for MemoryRateLimitStore {
    async fn update(
        &self,
        key_id: &str,
        update: &mut (dyn FnMut(Option<LimitRecord>) -> LimitRecord + Send),
    ) -> Result<LimitRecord, ClusterError> {
        let mut records = self.records.lock().unwrap_or_else(|p| p.into_inner());
        let next = update(records.get(key_id).cloned());
        records.insert(key_id.to_string(), next.clone());
        Ok(next)
    }

    fn is_shared(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RPS2: KeyLimits = KeyLimits {
        requests_per_second: Some(2.0),
        tokens_per_minute: Some(600),
        max_concurrent_requests: Some(2),
    };

    fn admit(tokens: f64) -> Ask {
        Ask {
            admitting: true,
            requests: 1,
            tokens_needed: tokens,
            ..Ask::default()
        }
    }

    #[test]
    fn buckets_grant_up_to_capacity_then_refill_at_their_rate() {
        let mut r = LimitRecord::full(&RPS2, 0);
        let a = r.apply(&RPS2, "a", &admit(100.0), 0, 10_000);
        assert_eq!((a.requests, a.tokens, a.denied), (1, 100.0, None));
        let second = Ask {
            slots_running: 1,
            ..admit(100.0)
        };
        assert_eq!(r.apply(&RPS2, "a", &second, 0, 10_000).slots_held, 2);
        // Both slots are a's: b is refused for concurrency.
        let refused = r.apply(&RPS2, "b", &admit(1.0), 0, 10_000);
        assert_eq!(refused.denied.map(|d| d.0), Some(LimitKind::Concurrency));
        // One of a's requests ended and it gave its slot back; the bucket (2) is empty now.
        let release = Ask {
            slots_running: 1,
            slots_wanted: 1,
            ..Ask::default()
        };
        assert_eq!(r.apply(&RPS2, "a", &release, 0, 10_000).slots_held, 1);
        let refused = r.apply(&RPS2, "b", &admit(1.0), 0, 10_000);
        assert_eq!(
            refused.denied,
            Some((LimitKind::Requests, Some(Duration::from_millis(500))))
        );
        // Half a second later one request came back; tokens refilled by 5 (600/min).
        let ok = r.apply(&RPS2, "b", &admit(1.0), 500, 10_000);
        assert_eq!((ok.requests, ok.denied), (1, None));
        assert!((ok.remaining_tokens - (400.0 + 5.0 - 1.0)).abs() < 1e-9);
        // Never past capacity, however long it rests.
        r.refill(&RPS2, 10_000_000);
        assert_eq!((r.requests, r.tokens), (2.0, 600.0));
    }

    #[test]
    fn a_denied_ask_takes_nothing_and_says_when_to_come_back() {
        let mut r = LimitRecord::full(&RPS2, 0);
        let big = r.apply(&RPS2, "a", &admit(590.0), 0, 10_000);
        assert_eq!(big.denied, None);
        let no = r.apply(&RPS2, "b", &admit(70.0), 0, 10_000);
        // 60 tokens short at 10 tokens/s: 6 s.
        assert_eq!(
            no.denied,
            Some((LimitKind::Tokens, Some(Duration::from_secs(6))))
        );
        assert_eq!((r.requests, r.tokens), (1.0, 10.0), "nothing taken");
        assert!(!r.slots.contains_key("b"), "no slot kept by a refused ask");
        // More than a minute's worth can never pass.
        let never = r.apply(&RPS2, "b", &admit(601.0), 0, 10_000);
        assert_eq!(never.denied, Some((LimitKind::Tokens, None)));
    }

    #[test]
    fn output_beyond_a_lease_is_paid_back_and_delays_the_next_grant() {
        let mut r = LimitRecord::full(&RPS2, 0);
        r.apply(&RPS2, "a", &admit(600.0), 0, 10_000);
        let payback = Ask {
            return_tokens: -60.0,
            ..Ask::default()
        };
        r.apply(&RPS2, "a", &payback, 0, 10_000);
        assert_eq!(r.tokens, -60.0);
        let no = r.apply(&RPS2, "b", &admit(10.0), 0, 10_000);
        assert_eq!(
            no.denied,
            Some((LimitKind::Tokens, Some(Duration::from_secs(7))))
        );
    }

    #[test]
    fn slots_of_a_router_that_stops_renewing_come_back_when_they_expire() {
        let one = KeyLimits {
            max_concurrent_requests: Some(1),
            ..KeyLimits::default()
        };
        let mut r = LimitRecord::full(&one, 0);
        assert_eq!(r.apply(&one, "a", &admit(0.0), 0, 1_000).slots_held, 1);
        assert_eq!(
            r.apply(
                &one,
                "a",
                &Ask {
                    slots_running: 1,
                    ..admit(0.0)
                },
                0,
                1_000
            )
            .denied,
            Some((LimitKind::Concurrency, Some(Duration::from_secs(1)))),
            "a's own second request finds no slot either"
        );
        let held = r.apply(&one, "b", &admit(0.0), 500, 1_000);
        assert_eq!(held.denied.map(|d| d.0), Some(LimitKind::Concurrency));
        let after = r.apply(&one, "b", &admit(0.0), 1_001, 1_000);
        assert_eq!((after.denied, after.slots_held), (None, 1));
        assert_eq!(r.slots.keys().collect::<Vec<_>>(), ["b"]);
    }
}

/// The store over a membership client's etcd connection (defined here, beside the store, so the
/// etcd client names no store).
impl crate::discovery::EtcdDiscovery {
    /// The per-key rate limits' shared records in this cluster's etcd, over the same client.
    pub fn rate_limit_store(&self) -> EtcdRateLimitStore {
        EtcdRateLimitStore::new(
            self.etcd().client.clone(),
            self.etcd().keys.clone(),
            self.etcd().config.request_timeout,
        )
    }
}
