//! What arrives: request times (Poisson, or bursty: a Poisson process whose rate alternates
//! between high and low phases, or a closed loop of clients that each send their next request
//! when the last one finished) and prompt/output lengths (fixed, or uniform within ±spread).
//! Seeded and deterministic (the engine's xoshiro256** [`Rng`]): the same flags give the same
//! requests.

use serde::Serialize;
pub use tandem_engine::rng::Rng;

/// Exponential with the given mean.
fn exponential(rng: &mut Rng, mean: f64) -> f64 {
    -mean * (1.0 - rng.next_f64()).ln()
}

/// How requests arrive.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Arrivals {
    /// A Poisson process at `rate` requests/s.
    Poisson {
        /// Requests per second.
        rate: f64,
    },
    /// Poisson at `rate × high` for `period_s × duty`, then at the rate that keeps the mean at
    /// `rate` for the rest of each period.
    Bursty {
        /// Mean requests per second.
        rate: f64,
        /// The burst's rate over the mean.
        high: f64,
        /// Length of one high + low cycle, s.
        period_s: f64,
        /// Fraction of the period spent high.
        duty: f64,
    },
    /// A closed loop: `clients` clients, each sending its next request the moment its last one
    /// finished (as `tandem bench-serve --concurrency` drives a real cluster). The rate is
    /// whatever the cluster sustains.
    Closed {
        /// Clients at once.
        clients: u32,
    },
}

impl Arrivals {
    /// The mean rate (`None` for a closed loop: the cluster sets it).
    pub fn mean_rate(&self) -> Option<f64> {
        match *self {
            Arrivals::Poisson { rate } | Arrivals::Bursty { rate, .. } => Some(rate),
            Arrivals::Closed { .. } => None,
        }
    }

    /// The rate at time `t` (0 for a closed loop, whose arrivals follow completions).
    pub fn rate_at(&self, t: f64) -> f64 {
        match *self {
            Arrivals::Poisson { rate } => rate,
            Arrivals::Closed { .. } => 0.0,
            Arrivals::Bursty {
                rate,
                high,
                period_s,
                duty,
            } => {
                let low = (rate * (1.0 - high * duty) / (1.0 - duty)).max(0.0);
                if (t % period_s) < period_s * duty {
                    rate * high
                } else {
                    low
                }
            }
        }
    }

    /// The next arrival after `t` (thinning of the piecewise-constant rate); `None` for a
    /// closed loop, whose next arrival is a completion's.
    pub fn next_after(&self, t: f64, rng: &mut Rng) -> Option<f64> {
        let max = match *self {
            Arrivals::Poisson { rate } => rate,
            Arrivals::Bursty { rate, high, .. } => rate * high.max(1.0),
            Arrivals::Closed { .. } => return None,
        };
        let mut t = t;
        loop {
            t += exponential(rng, 1.0 / max);
            if rng.next_f64() * max <= self.rate_at(t) {
                return Some(t);
            }
        }
    }
}

/// Prompt and output lengths.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Lengths {
    /// Mean prompt tokens.
    pub prompt: u32,
    /// Mean output tokens.
    pub output: u32,
    /// Each is drawn uniformly within ± this fraction of its mean (0: fixed).
    pub spread: f64,
}

impl Lengths {
    /// One request's `(prompt, output)`.
    pub fn draw(&self, rng: &mut Rng) -> (u32, u32) {
        let mut one = |mean: u32| {
            let f = 1.0 + self.spread * (2.0 * rng.next_f64() - 1.0);
            ((mean as f64 * f).round() as u32).max(1)
        };
        (one(self.prompt), one(self.output))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_and_bursty_keep_their_mean_rate_and_bursts_are_bursty() {
        for a in [
            Arrivals::Poisson { rate: 50.0 },
            Arrivals::Bursty {
                rate: 50.0,
                high: 3.0,
                period_s: 60.0,
                duty: 0.25,
            },
        ] {
            let mut rng = Rng::new(7);
            let (mut t, mut n, mut in_burst) = (0.0, 0u32, 0u32);
            while t < 3600.0 {
                t = a.next_after(t, &mut rng).expect("an open loop");
                n += 1;
                if t % 60.0 < 15.0 {
                    in_burst += 1;
                }
            }
            let rate = n as f64 / 3600.0;
            assert!((rate - 50.0).abs() < 1.5, "{a:?}: {rate}");
            let share = in_burst as f64 / n as f64;
            match a {
                Arrivals::Poisson { .. } => assert!((share - 0.25).abs() < 0.02, "{share}"),
                _ => assert!((share - 0.75).abs() < 0.02, "{share}"),
            }
        }
        let closed = Arrivals::Closed { clients: 4 };
        assert_eq!(closed.next_after(1.0, &mut Rng::new(7)), None, "a completion's, not a clock's");
        assert_eq!(closed.mean_rate(), None);
    }
}
