//! A key's lease at one router: the requests, tokens and slots it was granted from the shared
//! record and has not spent, and the asks that top it up or give it back.
//!
//! Invariant: what the lease holds was granted by the record (or, while the store cannot be
//! reached, by this router's own buckets); spending never takes it below zero except for
//! output tokens, a debt the next ask pays back first.

use std::time::Instant;

use tandem_cluster::{Ask, Grant, KeyLimits, LimitRecord};

use super::{LEASE_DIVISOR, RateLimitStatus};

/// A key's lease at this router.
#[derive(Debug)]
pub(super) struct Lease {
    pub(super) limits: KeyLimits,
    /// Requests granted and not spent.
    pub(super) requests: u32,
    /// Tokens granted and not spent (below zero: output spent beyond the lease).
    pub(super) tokens: f64,
    /// Slots this router holds, and how many run.
    pub(super) slots_held: u32,
    pub(super) running: u32,
    /// When the slots were last renewed.
    pub(super) renewed: Instant,
    pub(super) last_used: Instant,
    /// The shared buckets as last seen.
    pub(super) seen: RateLimitStatus,
    /// This router's own buckets while the store cannot be reached.
    pub(super) fallback: Option<LimitRecord>,
}

impl Lease {
    pub(super) fn new(limits: KeyLimits) -> Self {
        let now = Instant::now();
        Lease {
            limits,
            requests: 0,
            tokens: 0.0,
            slots_held: 0,
            running: 0,
            renewed: now,
            last_used: now,
            seen: RateLimitStatus {
                limits,
                ..RateLimitStatus::default()
            },
            fallback: None,
        }
    }

    /// Spends one request, `prompt` tokens and a slot if the lease has them.
    pub(super) fn try_spend(&mut self, prompt: u32) -> bool {
        let l = &self.limits;
        let ok = (l.requests_per_second.is_none() || self.requests >= 1)
            && (l.tokens_per_minute.is_none() || self.tokens >= f64::from(prompt))
            && (l.max_concurrent_requests.is_none() || self.running < self.slots_held);
        if ok {
            if l.requests_per_second.is_some() {
                self.requests -= 1;
            }
            if l.tokens_per_minute.is_some() {
                self.tokens -= f64::from(prompt);
            }
            self.running += 1;
            self.last_used = Instant::now();
        }
        ok
    }

    pub(super) fn request_chunk(&self) -> u32 {
        (self.limits.request_capacity() / LEASE_DIVISOR)
            .floor()
            .max(1.0) as u32
    }

    pub(super) fn token_chunk(&self) -> f64 {
        (self.limits.token_capacity() / LEASE_DIVISOR).floor()
    }

    /// Spare slots a router may keep beyond its running requests (a tenth of the limit).
    pub(super) fn slot_spare(&self) -> u32 {
        self.limits.max_concurrent_requests.unwrap_or(0) / LEASE_DIVISOR as u32
    }

    /// Whether it holds more slots than it runs and may keep: none spare for small limits
    /// (a slot goes back when its request ends), else up to twice the spare allowance before
    /// the surplus goes back (so a steady key does not visit the record per request).
    pub(super) fn slots_spare(&self) -> bool {
        match self.slot_spare() {
            0 => self.slots_held > self.running,
            spare => self.slots_held > self.running + 2 * spare,
        }
    }

    /// Whether a background refill should top the lease up (leases of more than one request
    /// only: a key that slow visits the record per request).
    pub(super) fn runs_low(&self) -> bool {
        let chunk = self.request_chunk();
        chunk > 1
            && ((self.limits.requests_per_second.is_some() && self.requests < chunk / 2)
                || (self.limits.tokens_per_minute.is_some()
                    && self.tokens < self.token_chunk() / 2.0))
    }

    /// The ask that admits one request of `prompt` tokens (and refills the lease), or with
    /// `None` tops up a lease that runs low and gives back spare slots.
    pub(super) fn ask(&self, admitting: Option<u32>) -> Ask {
        let refill = admitting.is_some() || self.runs_low();
        let prompt = admitting.map_or(0.0, f64::from);
        let admit = u32::from(admitting.is_some());
        Ask {
            admitting: admitting.is_some(),
            requests: if refill {
                self.request_chunk()
                    .saturating_sub(self.requests)
                    .max(admit)
            } else {
                0
            },
            // A debt (tokens below zero) is always paid back.
            tokens_needed: (prompt - self.tokens).max(0.0),
            tokens_extra: if refill && self.limits.tokens_per_minute.is_some() {
                self.token_chunk()
            } else {
                0.0
            },
            slots_running: self.running,
            slots_wanted: self.running + admit + self.slot_spare(),
            ..Ask::default()
        }
    }

    /// The ask that gives back everything unspent, keeping slots for the running requests;
    /// the lease is emptied now, so nothing is spent twice while the visit is under way.
    pub(super) fn give_back(&mut self) -> Ask {
        let ask = Ask {
            return_requests: f64::from(self.requests),
            return_tokens: self.tokens,
            slots_running: self.running,
            slots_wanted: self.running,
            ..Ask::default()
        };
        self.requests = 0;
        self.tokens = 0.0;
        ask
    }

    /// Takes `grant` into the lease; `record` is the shared record after it.
    pub(super) fn take(&mut self, grant: &Grant, record: &LimitRecord) {
        if grant.denied.is_none() {
            self.requests += grant.requests;
            self.tokens += grant.tokens;
        }
        self.slots_held = grant.slots_held;
        self.renewed = Instant::now();
        self.seen = RateLimitStatus {
            limits: self.limits,
            remaining_requests: grant.remaining_requests as u64,
            remaining_tokens: grant.remaining_tokens as u64,
            reset_requests: record.requests_reset(&self.limits),
            reset_tokens: record.tokens_reset(&self.limits),
        };
    }

    pub(super) fn status(&self) -> RateLimitStatus {
        let mut s = self.seen;
        s.remaining_requests += u64::from(self.requests);
        s.remaining_tokens += self.tokens.max(0.0) as u64;
        s
    }
}
