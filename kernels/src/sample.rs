//! Sampling one token from a row of logits: temperature, top-k, top-p and one uniform draw,
//! defined so that a GPU computes **the same token, bit for bit**, without sorting the row.
//!
//! # The definition
//! For a row `l[0..vocab)` and a [`SampleSpec`]:
//! 1. Greedy (`temperature` not above 0, or `top_k == 1`): [`argmax`](crate::argmax).
//! 2. Candidates are the finite logits (none: [`argmax`](crate::argmax)), in the *order*
//!    "larger logit first, lower index first among equals" (`f32::total_cmp`, so `-0.0` comes
//!    after `+0.0`). With `0 < top_k < candidates`, only the first `top_k` stay.
//! 3. Each candidate's weight is an integer: `w = ⌊e · 2^shift + ½⌋` with
//!    `e = exp((l − max) / temperature)` computed by [`weight`] (f64 operations in one fixed
//!    sequence: `fma`, no library `exp`) and `shift = ` [`weight_shift`]`(vocab)`, so a sum of
//!    weights never exceeds 2^62. The most likely token weighs `2^shift`; a token whose `e` is
//!    below `2^-(shift+1)` weighs 0 and is never picked.
//! 4. Top-p (`top_p < 1`): with `W` the candidates' total weight and
//!    `P = ⌈top_p · 2^32⌉`, the candidates kept are the shortest prefix (in order) whose weight
//!    reaches `⌈W · P / 2^32⌉`.
//! 5. The draw `d` (53 bits, `u = d / 2^53`) picks the first kept token at which the running
//!    weight exceeds `⌊d · W_kept / 2^53⌋`: token `i` with probability `w_i / W_kept`. A token
//!    of weight 0 is never picked, whatever the rounding.
//!
//! After the weights everything is integer arithmetic, whose sums do not depend on their order;
//! the weights are a fixed sequence of correctly rounded operations. So a GPU kernel that
//! finds the same tokens by radix selection over `(logit, index)` (tandem-kernels-cuda
//! `sample.cu`) returns exactly [`sample`]'s token, and the distribution differs from exact
//! softmax sampling only by the quantisation (relative `2^-shift` of the largest weight).

use std::cmp::Ordering;

/// Bits of a draw: `u = draw / 2^DRAW_BITS` is uniform in `[0, 1)`.
pub const DRAW_BITS: u32 = 53;

/// One row's sampling parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleSpec {
    /// 0 = greedy; otherwise logits are divided by this.
    pub temperature: f32,
    /// Keep only the `top_k` first tokens (0 = no limit; 1 = greedy).
    pub top_k: u32,
    /// Keep the shortest prefix holding this share of the weight (1 = no limit). In `(0, 1]`.
    pub top_p: f32,
    /// The uniform draw, `< 2^DRAW_BITS` (higher bits are ignored).
    pub draw: u64,
}

impl SampleSpec {
    /// True when the row's pick is its argmax (no draw is used): `temperature` 0 (or not a
    /// positive number, which request validation refuses before it gets here), or `top_k` 1.
    pub fn is_greedy(&self) -> bool {
        self.temperature.partial_cmp(&0.0) != Some(Ordering::Greater) || self.top_k == 1
    }
}

/// `log2` of the weight of the most likely token: `62 − ⌈log2 vocab⌉`, so `vocab` weights sum
/// below 2^62 (at least 32: up to the kernels' largest vocabulary, 2^31, they sum below 2^63).
pub fn weight_shift(vocab: usize) -> u32 {
    let bits = usize::BITS - vocab.max(2).saturating_sub(1).leading_zeros();
    62u32.saturating_sub(bits).max(32)
}

const LOG2_E: f64 = std::f64::consts::LOG2_E;
const LN2: f64 = std::f64::consts::LN_2;
/// Cody–Waite split of ln 2 (fdlibm's): `k · LN2_HI` is exact for the `k` used here.
const LN2_HI: f64 = 6.931_471_803_691_238e-1;
const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
/// `1/n!` for n = 13 down to 0: Taylor series of `exp(r)` for `|r| ≤ ln2 / 2`.
const EXP_TAYLOR: [f64; 14] = [
    1.6059043836821613e-10,
    2.08767569878681e-09,
    2.505210838544172e-08,
    2.755731922398589e-07,
    2.7557319223985893e-06,
    2.48015873015873e-05,
    0.0001984126984126984,
    0.001388888888888889,
    0.008333333333333333,
    0.041666666666666664,
    0.16666666666666666,
    0.5,
    1.0,
    1.0,
];

/// The integer weight of a logit `d = (l − max) · (1 / temperature)` below the row's maximum
/// (`d ≤ 0`): `⌊exp(d) · 2^shift + ½⌋`, 0 where `exp(d) < 2^-(shift+2)`. The sequence of
/// operations is part of the definition (`sample.cu` repeats it): `k = round(d · log2 e)`,
/// `r = d − k·ln2` (two `fma`s), a degree-13 Horner polynomial in `fma`, times `2^k`.
pub fn weight(d: f64, shift: u32) -> u64 {
    weight_inline(d, shift)
}

/// [`weight`], inlined into its callers (so a caller compiled for FMA gets hardware `fma`).
#[inline(always)]
fn weight_inline(d: f64, shift: u32) -> u64 {
    if d.is_nan() || d < -((shift + 2) as f64) * LN2 {
        return 0;
    }
    let k = (d * LOG2_E).round();
    let r = (-k).mul_add(LN2_HI, d);
    let r = (-k).mul_add(LN2_LO, r);
    let mut p = EXP_TAYLOR[0];
    for &c in &EXP_TAYLOR[1..] {
        p = p.mul_add(r, c);
    }
    // k ∈ [-(shift + 3), 1]: 2^k is a normal number, built from its bits.
    let scale = f64::from_bits(((1023 + k as i64) as u64) << 52);
    let e = p * scale;
    (e * (1u64 << shift) as f64 + 0.5) as u64
}

/// `f32::total_cmp`'s order as an unsigned key (larger key = larger value).
fn order_key(v: f32) -> u32 {
    let b = v.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// `⌈W · P / 2^32⌉` with `P = ⌈top_p · 2^32⌉`: the weight the top-p prefix must reach.
fn top_p_target(total: u64, top_p: f32) -> u64 {
    let p = ((top_p as f64) * 4_294_967_296.0).ceil() as u128;
    ((total as u128 * p).div_ceil(1u128 << 32)) as u64
}

/// `⌊draw · W / 2^53⌋`: the running weight the picked token's must exceed.
fn draw_target(draw: u64, total: u64) -> u64 {
    let d = (draw & ((1u64 << DRAW_BITS) - 1)) as u128;
    ((d * total as u128) >> DRAW_BITS) as u64
}

/// The token [`SampleSpec`] picks from `logits` (module docs). `O(n)`: one pass for the
/// weights (hardware `fma` where the CPU has it: the same correctly rounded operation), then
/// selection by weight histograms over the order key ([`select_by_weight`]), as `sample.cu`
/// does on the GPU; only the few candidates in the last bucket are sorted.
pub fn sample(logits: &[f32], spec: &SampleSpec) -> usize {
    let Some(cand) = candidates(logits, spec) else {
        return crate::argmax(logits);
    };
    let max = cand
        .iter()
        .map(|&i| logits[i as usize])
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let inv_t = 1.0 / spec.temperature as f64;
    let mut items = weigh(logits, &cand, max, inv_t, weight_shift(logits.len()));
    let total: u64 = items.iter().map(|&(_, w)| w).sum();
    let kept_total = if spec.top_p < 1.0 {
        // The first candidate at which the running weight reaches the target, and those before.
        let need = top_p_target(total, spec.top_p).max(1);
        let (cut, before, own) = select_by_weight(&mut items, need - 1);
        items.retain(|&(key, _)| key >= cut);
        before + own
    } else {
        total
    };
    let (key, _, _) = select_by_weight(&mut items, draw_target(spec.draw, kept_total));
    !(key as u32) as usize
}

/// The candidates of a sampled row (steps 1–2 of the definition): its finite logits' indices,
/// cut to the first `top_k` in order; `None` when the pick is the argmax (greedy, or no finite
/// logit).
fn candidates(logits: &[f32], spec: &SampleSpec) -> Option<Vec<u32>> {
    if spec.is_greedy() {
        return None;
    }
    let mut cand: Vec<u32> = (0..logits.len() as u32)
        .filter(|&i| logits[i as usize].is_finite())
        .collect();
    if cand.is_empty() {
        return None;
    }
    let k = spec.top_k as usize;
    if k > 0 && k < cand.len() {
        cand.select_nth_unstable_by(k - 1, |a, b| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        });
        cand.truncate(k);
    }
    Some(cand)
}

/// `(order key << 32 | !index, weight)` of every candidate of nonzero weight: a larger key64
/// comes first in the sampling order.
fn weigh(logits: &[f32], cand: &[u32], max: f64, inv_t: f64, shift: u32) -> Vec<(u64, u64)> {
    // A plain loop: iterator adapters and closures are compiled apart from the caller and
    // would not get its target features.
    #[inline(always)]
    fn body(logits: &[f32], cand: &[u32], max: f64, inv_t: f64, shift: u32) -> Vec<(u64, u64)> {
        let mut out = Vec::with_capacity(cand.len());
        for &i in cand {
            let l = logits[i as usize];
            let w = weight_inline((l as f64 - max) * inv_t, shift);
            if w > 0 {
                out.push((((order_key(l) as u64) << 32) | (!i) as u64, w));
            }
        }
        out
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "fma,sse4.1")]
        fn with_fma(
            logits: &[f32],
            cand: &[u32],
            max: f64,
            inv_t: f64,
            shift: u32,
        ) -> Vec<(u64, u64)> {
            body(logits, cand, max, inv_t, shift)
        }
        if std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("sse4.1")
        {
            // SAFETY: the CPU has FMA and SSE4.1 (checked just above).
            return unsafe { with_fma(logits, cand, max, inv_t, shift) };
        }
    }
    body(logits, cand, max, inv_t, shift)
}

/// Among `items` (distinct keys), the one at which the running weight, in descending key order,
/// first exceeds `x` (`x` below their total): `(its key, the weight before it, its weight)`.
/// Radix selection, 11 bits of the key a round: a weight histogram, the bucket the running
/// weight crosses in, then only that bucket's items; a bucket of at most 64 is sorted. Reorders
/// `items`.
fn select_by_weight(items: &mut [(u64, u64)], mut x: u64) -> (u64, u64, u64) {
    const BITS: u32 = 11;
    let mut before = 0u64;
    let mut rest: &mut [(u64, u64)] = items;
    let mut shift = 64 - BITS;
    loop {
        if rest.len() <= 64 {
            rest.sort_unstable_by_key(|&(key, _)| std::cmp::Reverse(key));
            let mut acc = 0u64;
            for &(key, w) in rest.iter() {
                if acc + w > x {
                    return (key, before + acc, w);
                }
                acc += w;
            }
            unreachable!("the target {x} is below the items' weight {acc}");
        }
        let digit = |key: u64| ((key >> shift) & ((1 << BITS) - 1)) as usize;
        let mut hist = [0u64; 1 << BITS];
        for &(key, w) in rest.iter() {
            hist[digit(key)] += w;
        }
        let mut d = (1 << BITS) - 1;
        let mut acc = 0u64;
        while d > 0 && acc + hist[d] <= x {
            acc += hist[d];
            d -= 1;
        }
        x -= acc;
        before += acc;
        // The crossing bucket's items to the front, the rest dropped.
        let mut n = 0;
        for j in 0..rest.len() {
            if digit(rest[j].0) == d {
                rest.swap(n, j);
                n += 1;
            }
        }
        rest = &mut rest[..n];
        shift = shift.saturating_sub(BITS);
    }
}

/// [`sample`] the plain way: every candidate of nonzero weight sorted, then the walks. The
/// reference the unit tests hold the selection path to.
#[cfg(test)]
fn sample_sorted(logits: &[f32], spec: &SampleSpec) -> usize {
    let Some(cand) = candidates(logits, spec) else {
        return crate::argmax(logits);
    };
    let first = |a: &u32, b: &u32| -> Ordering {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    let max = cand
        .iter()
        .map(|&i| logits[i as usize])
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let inv_t = 1.0 / spec.temperature as f64;
    let shift = weight_shift(logits.len());
    let mut weighted: Vec<(u32, u64)> = cand
        .into_iter()
        .map(|i| (i, weight((logits[i as usize] as f64 - max) * inv_t, shift)))
        .filter(|&(_, w)| w > 0)
        .collect();
    weighted.sort_unstable_by(|a, b| first(&a.0, &b.0));
    let total: u64 = weighted.iter().map(|&(_, w)| w).sum();
    let kept_total = if spec.top_p < 1.0 {
        let need = top_p_target(total, spec.top_p);
        let mut acc = 0u64;
        let mut keep = weighted.len();
        for (n, &(_, w)) in weighted.iter().enumerate() {
            acc += w;
            if acc >= need {
                keep = n + 1;
                break;
            }
        }
        weighted.truncate(keep);
        acc
    } else {
        total
    };
    let target = draw_target(spec.draw, kept_total);
    let mut acc = 0u64;
    for &(i, w) in &weighted {
        acc += w;
        if acc > target {
            return i as usize;
        }
    }
    unreachable!("the draw's target {target} is below the kept weight {kept_total}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(temperature: f32, top_k: u32, top_p: f32, u: f64) -> SampleSpec {
        SampleSpec {
            temperature,
            top_k,
            top_p,
            draw: (u * (1u64 << DRAW_BITS) as f64) as u64,
        }
    }

    #[test]
    fn the_weight_is_exp_to_the_quantum_and_exactly_the_shift_at_the_maximum() {
        let shift = weight_shift(49_152);
        assert_eq!(shift, 46);
        assert_eq!(weight(0.0, shift), 1 << shift);
        for d in [-1e-9f64, -0.1, -0.5, -1.0, -2.5, -7.0, -13.3, -20.0, -31.0] {
            let exact = d.exp() * (1u64 << shift) as f64;
            let got = weight(d, shift) as f64;
            assert!(
                (got - exact).abs() <= 1.0 + exact * 1e-14,
                "d {d}: {got} vs {exact}"
            );
        }
        assert_eq!(weight(-40.0, shift), 0);
        assert_eq!(weight(f64::NAN, shift), 0);
        assert_eq!(weight_shift(2), 61);
        assert_eq!(weight_shift(128_256), 45);
        assert_eq!(weight_shift(1 << 17), 45);
        assert_eq!(weight_shift((1 << 17) + 1), 44);
    }

    #[test]
    fn the_order_key_is_total_cmp() {
        let vals = [
            f32::NEG_INFINITY,
            -3.5,
            -0.0,
            0.0,
            1e-30,
            2.0,
            f32::INFINITY,
        ];
        for w in vals.windows(2) {
            assert!(order_key(w[0]) < order_key(w[1]), "{w:?}");
        }
    }

    #[test]
    fn the_draw_walks_the_cumulative_weight_in_logit_order() {
        // Weights ∝ e^0, e^-ln2 ... at T = 1: tokens 2 (½), 0 (¼), 1 (⅛ + rounding) ...
        let l = [-(2f32.ln()), -(8f32.ln()), 0.0, -(4f32.ln())];
        let pick = |u| sample(&l, &spec(1.0, 0, 1.0, u));
        // Total weight is 1 + ½ + ¼ + ⅛ of 2^shift: token 2 takes the first 8/15.
        assert_eq!(pick(0.0), 2);
        assert_eq!(pick(0.53), 2);
        assert_eq!(pick(0.54), 0);
        assert_eq!(pick(0.79), 0);
        assert_eq!(pick(0.81), 3);
        assert_eq!(pick(0.999_999), 1);
    }

    #[test]
    fn top_k_and_top_p_cut_the_order_and_equal_logits_go_by_index() {
        let l = [0.1f32, 2.0, 1.5, -1.0, 2.0, 0.3];
        for u in [0.0, 0.3, 0.6, 0.99] {
            assert!(matches!(sample(&l, &spec(5.0, 2, 1.0, u)), 1 | 4));
            assert!(matches!(sample(&l, &spec(1.0, 0, 0.5, u)), 1 | 4));
        }
        // top_k = 1 is greedy, top_k past the candidates is no limit.
        assert_eq!(sample(&l, &spec(1.0, 1, 1.0, 0.99)), 1);
        assert_eq!(sample(&l, &spec(1e6, 99, 1.0, 0.99)), 3);
        // The two maxima, at u just below ½ and just above, in index order.
        assert_eq!(sample(&l, &spec(1.0, 2, 1.0, 0.499)), 1);
        assert_eq!(sample(&l, &spec(1.0, 2, 1.0, 0.501)), 4);
        // A tiny top_p keeps the first in order alone.
        assert_eq!(sample(&l, &spec(1.0, 0, 1e-6, 0.99)), 1);
    }

    #[test]
    fn non_finite_logits_are_never_sampled_and_a_row_without_finite_ones_is_its_argmax() {
        let l = [f32::NAN, f32::INFINITY, 1.0, f32::NEG_INFINITY, 1.0];
        for u in [0.0, 0.4, 0.6, 0.999] {
            assert!(matches!(sample(&l, &spec(1.0, 0, 1.0, u)), 2 | 4));
        }
        assert_eq!(
            sample(
                &[f32::NAN, f32::NEG_INFINITY, f32::INFINITY],
                &spec(1.0, 0, 1.0, 0.5)
            ),
            2
        );
        assert_eq!(sample(&[f32::NAN, f32::NAN], &spec(1.0, 0, 1.0, 0.5)), 0);
    }

    #[test]
    fn a_token_too_unlikely_for_the_quantum_is_never_picked() {
        // exp(-50) is far below 2^-61 of the maximum: weight 0, even at the top of the draw.
        let l = [0.0f32, -50.0];
        assert_eq!(sample(&l, &spec(1.0, 0, 1.0, 1.0 - f64::EPSILON)), 0);
    }

    #[test]
    fn the_selection_path_picks_what_sorting_every_candidate_picks() {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for case in 0..400 {
            let vocab = [5usize, 70, 1000, 49_152][case % 4];
            let sd = [0.3f32, 3.0, 12.0][case % 3];
            let grid = case % 5 == 0; // many equal logits
            let row: Vec<f32> = (0..vocab)
                .map(|_| {
                    let v = ((next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * sd * 3.4;
                    if grid { v.round() } else { v }
                })
                .collect();
            let spec = SampleSpec {
                temperature: [0.05f32, 0.7, 1.0, 2.5, 1e3][case % 5],
                top_k: [0u32, 0, 3, 50][(case % 4) ^ ((case / 4) % 4)],
                top_p: [1.0f32, 0.9, 0.3, 1e-3][(case / 3) % 4],
                draw: next() >> 11,
            };
            assert_eq!(
                sample(&row, &spec),
                sample_sorted(&row, &spec),
                "case {case}: {spec:?}"
            );
        }
    }

    #[test]
    fn frequencies_follow_the_softmax() {
        let l = [1.0f32, 0.5, -0.25, 0.0, 2.0];
        let t = 0.8f64;
        let z: f64 = l.iter().map(|&x| ((x as f64 - 2.0) / t).exp()).sum();
        let mut counts = [0usize; 5];
        let n = 20_000;
        for j in 0..n {
            let u = (j as f64 + 0.5) / n as f64;
            counts[sample(&l, &spec(t as f32, 0, 1.0, u))] += 1;
        }
        for (i, &c) in counts.iter().enumerate() {
            let p = ((l[i] as f64 - 2.0) / t).exp() / z;
            assert!(
                (c as f64 / n as f64 - p).abs() < 1e-3,
                "token {i}: {c} of {n}, p {p}"
            );
        }
    }
}
