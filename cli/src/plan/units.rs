//! Units of the planner's flags and output, and the checks every number passes on the way in.
//!
//! As in the seed's arithmetic, "GB" in a flag means 2^30 bytes (a GiB) and "KB" means 2^10
//! bytes. Conversions to bytes round in the conservative direction for the plan: memory the GPU
//! *has* rounds down, memory something *needs* (weights, reserve) rounds up. All byte counts are
//! `u64`; conversions refuse values at or beyond 2^63 bytes rather than saturating.

use super::error::PlanError;

/// Bytes in one "KB" of a flag or of the output (2^10).
pub const KIB_BYTES: u64 = 1 << 10;
/// Bytes in one "MB" of the output (2^20).
pub const MIB_BYTES: u64 = 1 << 20;
/// Bytes in one "GB" of a flag (2^30), as in the seed's arithmetic.
pub const GIB_BYTES: u64 = 1 << 30;
/// Bytes in one TiB of the output (2^40).
pub const TIB_BYTES: u64 = 1 << 40;

/// Largest byte count a conversion accepts (exclusive): far above any real deployment, and
/// exactly representable as an f64.
const MAX_BYTES_F64: f64 = 9_223_372_036_854_775_808.0; // 2^63

/// Which way a conversion to whole bytes rounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rounding {
    /// Toward zero: for capacity the hardware has.
    Down,
    /// Away from zero: for memory something needs.
    Up,
}

/// Checks that `value` is a finite number `>= 0`, naming `field` in the error.
pub fn non_negative(field: &'static str, value: f64) -> Result<f64, PlanError> {
    if value.is_nan() {
        return Err(invalid(field, value, "must be a number, not NaN"));
    }
    if value.is_infinite() {
        return Err(invalid(field, value, "must be finite"));
    }
    if value < 0.0 {
        return Err(invalid(field, value, "must not be negative"));
    }
    Ok(value)
}

/// Checks that an integer flag is at least 1.
pub fn at_least_one(field: &'static str, value: u64) -> Result<u64, PlanError> {
    if value == 0 {
        return Err(PlanError::InvalidValue {
            field,
            value: "0".into(),
            reason: "must be at least 1",
        });
    }
    Ok(value)
}

/// Converts `amount` units of `unit_bytes` (e.g. GB = 2^30) to whole bytes.
pub fn to_bytes(
    field: &'static str,
    amount: f64,
    unit_bytes: u64,
    rounding: Rounding,
) -> Result<u64, PlanError> {
    let amount = non_negative(field, amount)?;
    let exact = amount * unit_bytes as f64;
    let rounded = match rounding {
        Rounding::Down => exact.floor(),
        Rounding::Up => exact.ceil(),
    };
    if rounded >= MAX_BYTES_F64 {
        return Err(invalid(
            field,
            amount,
            "is too large (at or above 2^63 bytes)",
        ));
    }
    Ok(rounded as u64)
}

/// `a × b`, refusing results at or beyond 2^63 so later sums cannot overflow.
pub fn checked_product(field: &'static str, a: u64, b: u64) -> Result<u64, PlanError> {
    match a.checked_mul(b) {
        Some(p) if p < (1 << 63) => Ok(p),
        _ => Err(PlanError::InvalidValue {
            field,
            value: format!("{a} × {b}"),
            reason: "is too large (at or above 2^63 bytes)",
        }),
    }
}

/// Parses a parameter count: a plain or scientific number (`70000000000`, `7e10`) or one with a
/// decimal suffix `K`, `M`, `B`/`G` or `T` (`70B`, `134.5M`). Rounds to the nearest parameter.
pub fn parse_param_count(field: &'static str, text: &str) -> Result<u64, PlanError> {
    let t = text.trim();
    let (number, scale) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() && !t.ends_with("inf") && !t.ends_with("NaN") => {
            let scale = match c.to_ascii_uppercase() {
                'K' => 1e3,
                'M' => 1e6,
                'B' | 'G' => 1e9,
                'T' => 1e12,
                _ => {
                    return Err(PlanError::InvalidValue {
                        field,
                        value: text.into(),
                        reason: "unknown suffix (use K, M, B or T, or a plain number)",
                    });
                }
            };
            (&t[..i], scale)
        }
        _ => (t, 1.0),
    };
    let value: f64 = number.parse().map_err(|_| PlanError::InvalidValue {
        field,
        value: text.into(),
        reason: "is not a number (e.g. 70B, 134.5M, 7e10)",
    })?;
    let count = non_negative(field, value)? * scale;
    if count >= MAX_BYTES_F64 {
        return Err(PlanError::InvalidValue {
            field,
            value: text.into(),
            reason: "is too large",
        });
    }
    Ok(count.round() as u64)
}

/// `bytes` with the largest binary unit that keeps the number at least 1 (`320.00 KiB`).
pub fn human_bytes(bytes: u64) -> String {
    let units = [
        (TIB_BYTES, "TiB"),
        (GIB_BYTES, "GiB"),
        (MIB_BYTES, "MiB"),
        (KIB_BYTES, "KiB"),
    ];
    for (size, name) in units {
        if bytes >= size {
            return format!("{:.2} {name}", bytes as f64 / size as f64);
        }
    }
    format!("{bytes} B")
}

fn invalid(field: &'static str, value: f64, reason: &'static str) -> PlanError {
    PlanError::InvalidValue {
        field,
        value: value.to_string(),
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gb_means_two_to_the_thirty_bytes() {
        assert_eq!(
            to_bytes("--gpu-mem-gb", 80.0, GIB_BYTES, Rounding::Down).unwrap(),
            80 << 30
        );
        assert_eq!(
            to_bytes("--weights-gb", 0.5, GIB_BYTES, Rounding::Up).unwrap(),
            1 << 29
        );
    }

    #[test]
    fn fractional_bytes_round_down_for_capacity_and_up_for_needs() {
        // 1e-9 GB is 1.07 bytes.
        assert_eq!(to_bytes("x", 1e-9, GIB_BYTES, Rounding::Down).unwrap(), 1);
        assert_eq!(to_bytes("x", 1e-9, GIB_BYTES, Rounding::Up).unwrap(), 2);
    }

    #[test]
    fn negative_nan_infinite_and_huge_values_are_rejected_naming_the_flag() {
        for (v, reason) in [
            (-5.0, "must not be negative"),
            (f64::NAN, "must be a number, not NaN"),
            (f64::INFINITY, "must be finite"),
            (1e12, "is too large (at or above 2^63 bytes)"),
        ] {
            match to_bytes("--reserve-gb", v, GIB_BYTES, Rounding::Up) {
                Err(PlanError::InvalidValue {
                    field: "--reserve-gb",
                    reason: r,
                    ..
                }) => {
                    assert_eq!(r, reason, "value {v}")
                }
                other => panic!("value {v}: {other:?}"),
            }
        }
    }

    #[test]
    fn param_counts_accept_suffixes_and_scientific_notation() {
        assert_eq!(parse_param_count("p", "70B").unwrap(), 70_000_000_000);
        assert_eq!(parse_param_count("p", "134.5m").unwrap(), 134_500_000);
        assert_eq!(parse_param_count("p", "7e10").unwrap(), 70_000_000_000);
        assert_eq!(parse_param_count("p", "1.5T").unwrap(), 1_500_000_000_000);
        assert_eq!(parse_param_count("p", "12345").unwrap(), 12_345);
        assert!(parse_param_count("p", "-7B").is_err());
        assert!(parse_param_count("p", "7X").is_err());
        assert!(parse_param_count("p", "NaN").is_err());
        assert!(parse_param_count("p", "seven").is_err());
    }

    #[test]
    fn human_bytes_picks_the_largest_unit_at_least_one() {
        assert_eq!(human_bytes(327_680), "320.00 KiB");
        assert_eq!(human_bytes(640 << 20), "640.00 MiB");
        assert_eq!(human_bytes(35 << 30), "35.00 GiB");
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 << 40), "3.00 TiB");
    }

    #[test]
    fn zero_is_rejected_where_at_least_one_is_needed() {
        assert_eq!(at_least_one("--tp", 4).unwrap(), 4);
        assert!(matches!(
            at_least_one("--tp", 0),
            Err(PlanError::InvalidValue {
                field: "--tp",
                reason: "must be at least 1",
                ..
            })
        ));
    }
}
