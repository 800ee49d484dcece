//! The planner's settings: SLO targets and each pool's bounds, from a TOML file (`--slo-file`)
//! over built-in defaults, checked once at start (errors name the field).
//!
//! ```toml
//! ttft_p90_slo_ms = 2000      # prefill is sized so its backlog drains within half of this
//! interval_ms = 2000          # one observe → decide → act round
//! prefill_tokens_per_s = 0    # one prefill node's throughput; 0: measured from its reports
//! decode_kv_high = 0.85       # scale decode up above this occupancy (KV or batch use) ...
//! decode_kv_low = 0.30        # ... and down below this one (hysteresis between)
//! prefill_util_low = 0.20     # scale prefill down when busy less than this
//!
//! [prefill]
//! min = 1
//! max = 4
//! scale_up_cooldown_secs = 10
//! scale_down_cooldown_secs = 60
//!
//! [decode]
//! min = 1
//! max = 4
//! ```

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::PlannerError;

/// Bounds and cooldowns of one pool.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PoolLimits {
    /// Fewest nodes.
    pub min: usize,
    /// Most nodes.
    pub max: usize,
    /// After a change, no scale-up of this pool for this long.
    pub scale_up_cooldown_secs: u64,
    /// After a change, no scale-down of this pool for this long; a scale-down also needs the
    /// pool to have been under its low watermark this long.
    pub scale_down_cooldown_secs: u64,
}

impl Default for PoolLimits {
    fn default() -> Self {
        PoolLimits {
            min: 1,
            max: 4,
            scale_up_cooldown_secs: 10,
            scale_down_cooldown_secs: 60,
        }
    }
}

/// Everything the planner decides with.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PlannerConfig {
    /// TTFT p90 target, ms.
    pub ttft_p90_slo_ms: u64,
    /// ITL p90 target, ms (reported beside decisions; decode is sized by KV use).
    pub itl_p90_slo_ms: u64,
    /// Time between rounds, ms.
    pub interval_ms: u64,
    /// One prefill node's prompt throughput, tokens/s (0: the best its reports have shown).
    pub prefill_tokens_per_s: f64,
    /// Decode occupancy (the larger of KV use and batch use) above which the pool grows.
    pub decode_kv_high: f64,
    /// Decode occupancy below which the pool may shrink.
    pub decode_kv_low: f64,
    /// Prefill busy fraction below which the pool may shrink.
    pub prefill_util_low: f64,
    /// The prefill pool's bounds.
    pub prefill: PoolLimits,
    /// The decode pool's bounds.
    pub decode: PoolLimits,
}

impl Default for PlannerConfig {
    fn default() -> Self {
        PlannerConfig {
            ttft_p90_slo_ms: 2000,
            itl_p90_slo_ms: 100,
            interval_ms: 2000,
            prefill_tokens_per_s: 0.0,
            decode_kv_high: 0.85,
            decode_kv_low: 0.30,
            prefill_util_low: 0.20,
            prefill: PoolLimits::default(),
            decode: PoolLimits::default(),
        }
    }
}

impl PlannerConfig {
    /// Reads `path` over the defaults and validates.
    pub fn from_file(path: &Path) -> Result<Self, PlannerError> {
        let text = std::fs::read_to_string(path).map_err(|e| PlannerError::Config {
            field: "slo-file",
            value: path.display().to_string(),
            reason: e.to_string(),
        })?;
        let c: PlannerConfig = toml::from_str(&text).map_err(|e| PlannerError::Config {
            field: "slo-file",
            value: path.display().to_string(),
            reason: e.to_string(),
        })?;
        c.validate()?;
        Ok(c)
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), PlannerError> {
        let bad = |field: &'static str, value: String, reason: &str| {
            Err(PlannerError::Config {
                field,
                value,
                reason: reason.to_string(),
            })
        };
        if self.ttft_p90_slo_ms == 0 {
            return bad("ttft_p90_slo_ms", "0".into(), "must be positive");
        }
        if self.itl_p90_slo_ms == 0 {
            return bad("itl_p90_slo_ms", "0".into(), "must be positive");
        }
        if self.interval_ms == 0 {
            return bad("interval_ms", "0".into(), "must be positive");
        }
        if !self.prefill_tokens_per_s.is_finite() || self.prefill_tokens_per_s < 0.0 {
            return bad(
                "prefill_tokens_per_s",
                self.prefill_tokens_per_s.to_string(),
                "must be ≥ 0 (0: measured)",
            );
        }
        for (field, v) in [
            ("decode_kv_high", self.decode_kv_high),
            ("decode_kv_low", self.decode_kv_low),
            ("prefill_util_low", self.prefill_util_low),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return bad(field, v.to_string(), "must be between 0 and 1");
            }
        }
        if self.decode_kv_low >= self.decode_kv_high {
            return bad(
                "decode_kv_low",
                self.decode_kv_low.to_string(),
                "must be below decode_kv_high (the gap is the hysteresis)",
            );
        }
        for (pool, l) in [("prefill", &self.prefill), ("decode", &self.decode)] {
            if l.max == 0 {
                return bad(
                    if pool == "prefill" { "prefill.max" } else { "decode.max" },
                    "0".into(),
                    "must be at least 1",
                );
            }
            if l.min > l.max {
                return bad(
                    if pool == "prefill" { "prefill.min" } else { "decode.min" },
                    l.min.to_string(),
                    &format!("is above {pool}.max ({})", l.max),
                );
            }
        }
        Ok(())
    }

    /// The round period.
    pub fn interval(&self) -> Duration {
        Duration::from_millis(self.interval_ms)
    }

    /// A pool's limits.
    pub fn limits(&self, pool: tandem_cluster::Role) -> &PoolLimits {
        match pool {
            tandem_cluster::Role::Prefill => &self.prefill,
            tandem_cluster::Role::Decode => &self.decode,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!(
            "tandem-slo-{}-{}.toml",
            std::process::id(),
            text.len()
        ));
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn a_file_overrides_defaults_and_bad_values_name_their_field() {
        let c = PlannerConfig::from_file(&file("ttft_p90_slo_ms = 900\n[prefill]\nmax = 6\n")).unwrap();
        assert_eq!((c.ttft_p90_slo_ms, c.prefill.max, c.decode.max), (900, 6, 4));
        for (text, field) in [
            ("[prefill]\nmin = 5\nmax = 2\n", "prefill.min"),
            ("decode_kv_low = 0.9\n", "decode_kv_low"),
            ("prefill_tokens_per_s = -3.0\n", "prefill_tokens_per_s"),
            ("ttft_p90_slo_ms = 0\n", "ttft_p90_slo_ms"),
            ("tffs = 3\n", "slo-file"),
            ("[decode]\nmax = 0\n", "decode.max"),
        ] {
            match PlannerConfig::from_file(&file(text)) {
                Err(PlannerError::Config { field: f, .. }) => assert_eq!(f, field, "{text}"),
                other => panic!("{text}: {other:?}"),
            }
        }
    }
}
