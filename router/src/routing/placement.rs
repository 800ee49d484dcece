//! Conditional disaggregation: whether a request's prompt is computed on a prefill node (and
//! its KV shipped to the decode node) or by the decode node itself, with no transfer.
//!
//! Shipping KV costs a second node call, the transfer, and the prefill pool's queue; computing
//! the prompt on the decode node costs the other sequences in its batch one longer step. For a
//! short prompt the first is the larger cost, for a long one the second, and a prefill pool
//! with a long queue tips it further:
//!
//! | decision | reason | when |
//! |---|---|---|
//! | decode node | `short_prompt` | prompt ≤ `max_local_tokens` |
//! | decode node | `prefill_unavailable` | prompt ≤ `busy_max_local_tokens` and no prefill node accepts work (the pool is down or empty: the decode pool keeps serving what it can) |
//! | decode node | `prefill_busy` | prompt ≤ `busy_max_local_tokens`, and the chosen prefill node has ≥ `busy_ratio` × the prompt tokens the decode node would compute (its pending prompt tokens plus this prompt) |
//! | prefill node | `long_prompt` | otherwise |
//! | prefill node | `always` | `--disaggregation always` |
//! | prefill node | `pinned` | the canary, which probes a named prefill→decode pair |
//!
//! Prompt lengths count the tokens the decode node would compute: it publishes no KV events,
//! so the router assumes its cache holds none of the prompt (the node's own prefix cache may
//! still serve some). [`decide`] is a pure function of what the router knows at the decision:
//! the prompt's length, the chosen prefill node's queue and the decode node's, both as the
//! load policies estimated them.

/// `--disaggregation`: whether the decode pool may compute prompts itself.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DisaggregationMode {
    /// Short prompts, and prompts a busy prefill pool would delay, are computed by the decode
    /// node (no KV transfer).
    #[default]
    Conditional,
    /// Every prompt goes through a prefill node.
    Always,
}

/// The thresholds of conditional disaggregation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PlacementSettings {
    /// Always, or conditional.
    pub mode: DisaggregationMode,
    /// Prompts of at most this many tokens are computed by the decode node.
    pub max_local_tokens: u32,
    /// The longest prompt a busy prefill pool sends to the decode node.
    pub busy_max_local_tokens: u32,
    /// How much more prompt work the chosen prefill node must have than the decode node for
    /// the pool to count as busy.
    pub busy_ratio: f64,
}

impl PlacementSettings {
    /// Default `--local-prefill-max-tokens`: measured with `tandem bench-serve --mode
    /// placement` (bench/RESULTS.md, "Conditional disaggregation").
    pub const DEFAULT_MAX_LOCAL_TOKENS: u32 = 64;
    /// Default `--local-prefill-busy-max-tokens`.
    pub const DEFAULT_BUSY_MAX_LOCAL_TOKENS: u32 = 512;
    /// Default `--local-prefill-busy-ratio`.
    pub const DEFAULT_BUSY_RATIO: f64 = 4.0;

    /// The settings the router's flags give (`None`: the default), checked: the ratio is a
    /// number ≥ 1, and the busy cap is not below the short-prompt threshold (unset, it rises to
    /// meet it).
    pub fn from_flags(
        mode: Option<DisaggregationMode>,
        max_local_tokens: Option<u32>,
        busy_max_local_tokens: Option<u32>,
        busy_ratio: Option<f64>,
    ) -> Result<Self, crate::RouterError> {
        let max_local_tokens = max_local_tokens.unwrap_or(Self::DEFAULT_MAX_LOCAL_TOKENS);
        let settings = PlacementSettings {
            mode: mode.unwrap_or_default(),
            max_local_tokens,
            busy_max_local_tokens: busy_max_local_tokens
                .unwrap_or(Self::DEFAULT_BUSY_MAX_LOCAL_TOKENS.max(max_local_tokens)),
            busy_ratio: busy_ratio.unwrap_or(Self::DEFAULT_BUSY_RATIO),
        };
        if !(settings.busy_ratio.is_finite() && settings.busy_ratio >= 1.0) {
            return Err(crate::RouterError::Config {
                field: "local-prefill-busy-ratio",
                value: settings.busy_ratio.to_string(),
                reason: "must be a number of at least 1".into(),
            });
        }
        if settings.busy_max_local_tokens < settings.max_local_tokens {
            return Err(crate::RouterError::Config {
                field: "local-prefill-busy-max-tokens",
                value: settings.busy_max_local_tokens.to_string(),
                reason: format!(
                    "is below --local-prefill-max-tokens ({})",
                    settings.max_local_tokens
                ),
            });
        }
        Ok(settings)
    }

    /// Every prompt through a prefill node (tests, and `--disaggregation always`).
    pub fn always() -> Self {
        PlacementSettings {
            mode: DisaggregationMode::Always,
            ..Self::default()
        }
    }
}

impl Default for PlacementSettings {
    fn default() -> Self {
        PlacementSettings {
            mode: DisaggregationMode::Conditional,
            max_local_tokens: Self::DEFAULT_MAX_LOCAL_TOKENS,
            busy_max_local_tokens: Self::DEFAULT_BUSY_MAX_LOCAL_TOKENS,
            busy_ratio: Self::DEFAULT_BUSY_RATIO,
        }
    }
}

/// Where the prompt is computed, and why.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// On a prefill node; its KV is pushed to the decode node.
    PrefillNode(PlacementReason),
    /// On the decode node itself (`DecodeRequest.prefill_here`).
    DecodeNode(PlacementReason),
}

impl Placement {
    /// The `where` label: `prefill_node` or `decode_node`.
    pub fn site(self) -> &'static str {
        match self {
            Placement::PrefillNode(_) => "prefill_node",
            Placement::DecodeNode(_) => "decode_node",
        }
    }

    /// Why.
    pub fn reason(self) -> PlacementReason {
        match self {
            Placement::PrefillNode(r) | Placement::DecodeNode(r) => r,
        }
    }

    /// True when the decode node computes the prompt.
    pub fn is_local(self) -> bool {
        matches!(self, Placement::DecodeNode(_))
    }
}

/// Why a prompt went where it went (the `reason` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlacementReason {
    /// Short enough that the transfer would cost more than computing it in place.
    ShortPrompt,
    /// The chosen prefill node had much more prompt work queued than the decode node.
    PrefillBusy,
    /// No prefill node accepts work.
    PrefillUnavailable,
    /// Too long to compute on the decode node.
    LongPrompt,
    /// `--disaggregation always`.
    Always,
    /// A named prefill→decode pair (the canary).
    Pinned,
}

impl PlacementReason {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            PlacementReason::ShortPrompt => "short_prompt",
            PlacementReason::PrefillBusy => "prefill_busy",
            PlacementReason::PrefillUnavailable => "prefill_unavailable",
            PlacementReason::LongPrompt => "long_prompt",
            PlacementReason::Always => "always",
            PlacementReason::Pinned => "pinned",
        }
    }
}

/// What the router knows when it decides.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlacementInput {
    /// The prompt (the attempt's: a migration's includes the output so far), in tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens the chosen prefill node would compute before this prompt is done (its
    /// pending prompt tokens plus this prompt's uncached part); `None` when unknown (no
    /// prefill node chosen, or no fresh load report).
    pub prefill_work_tokens: Option<u64>,
    /// Prompt tokens pending on the decode node (fresh load report; `None` when unknown).
    pub decode_pending_tokens: Option<u64>,
    /// A named pair (the canary).
    pub pinned: bool,
    /// No prefill node accepts work.
    pub prefill_unavailable: bool,
}

/// Where the prompt goes. Called twice per attempt: first with no prefill node chosen (a short
/// prompt is settled without one), then, for longer prompts, with the chosen node's work.
pub fn decide(settings: &PlacementSettings, input: PlacementInput) -> Placement {
    if input.pinned {
        return Placement::PrefillNode(PlacementReason::Pinned);
    }
    if settings.mode == DisaggregationMode::Always {
        return Placement::PrefillNode(PlacementReason::Always);
    }
    if input.prompt_tokens <= u64::from(settings.max_local_tokens) {
        return Placement::DecodeNode(PlacementReason::ShortPrompt);
    }
    if input.prefill_unavailable && input.prompt_tokens <= u64::from(settings.busy_max_local_tokens)
    {
        return Placement::DecodeNode(PlacementReason::PrefillUnavailable);
    }
    if input.prompt_tokens <= u64::from(settings.busy_max_local_tokens)
        && let (Some(prefill), Some(decode)) =
            (input.prefill_work_tokens, input.decode_pending_tokens)
    {
        let local = (decode + input.prompt_tokens) as f64;
        if prefill as f64 >= settings.busy_ratio * local {
            return Placement::DecodeNode(PlacementReason::PrefillBusy);
        }
    }
    Placement::PrefillNode(PlacementReason::LongPrompt)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(prompt: u64, prefill: Option<u64>, decode: Option<u64>) -> PlacementInput {
        PlacementInput {
            prompt_tokens: prompt,
            prefill_work_tokens: prefill,
            decode_pending_tokens: decode,
            pinned: false,
            prefill_unavailable: false,
        }
    }

    #[test]
    fn short_prompts_stay_on_the_decode_node_up_to_the_threshold() {
        let s = PlacementSettings::default();
        let max = u64::from(s.max_local_tokens);
        assert_eq!(
            decide(&s, input(max, None, None)),
            Placement::DecodeNode(PlacementReason::ShortPrompt)
        );
        assert_eq!(
            decide(&s, input(max + 1, Some(max + 1), Some(0))),
            Placement::PrefillNode(PlacementReason::LongPrompt)
        );
    }

    #[test]
    fn a_busy_prefill_node_sends_medium_prompts_to_the_decode_node() {
        let s = PlacementSettings::default();
        // 200 tokens here (decode idle) against 4 × 200 queued on the prefill node: busy.
        assert_eq!(
            decide(&s, input(200, Some(800), Some(0))),
            Placement::DecodeNode(PlacementReason::PrefillBusy)
        );
        // Just under the ratio: the prefill node.
        assert_eq!(
            decide(&s, input(200, Some(799), Some(0))),
            Placement::PrefillNode(PlacementReason::LongPrompt)
        );
        // The decode node's own queue counts against it.
        assert_eq!(
            decide(&s, input(200, Some(800), Some(100))),
            Placement::PrefillNode(PlacementReason::LongPrompt)
        );
        // Above the busy cap, however long the queue.
        let long = u64::from(s.busy_max_local_tokens) + 1;
        assert_eq!(
            decide(&s, input(long, Some(1_000_000), Some(0))),
            Placement::PrefillNode(PlacementReason::LongPrompt)
        );
        // Unknown loads (stale reports) never count as busy.
        assert_eq!(
            decide(&s, input(200, None, Some(0))),
            Placement::PrefillNode(PlacementReason::LongPrompt)
        );
        assert_eq!(
            decide(&s, input(200, Some(1_000_000), None)),
            Placement::PrefillNode(PlacementReason::LongPrompt)
        );
    }

    #[test]
    fn without_prefill_nodes_the_decode_node_computes_what_it_may() {
        let s = PlacementSettings::default();
        let down = |prompt| PlacementInput {
            prefill_unavailable: true,
            ..input(prompt, None, None)
        };
        assert_eq!(
            decide(&s, down(300)),
            Placement::DecodeNode(PlacementReason::PrefillUnavailable)
        );
        let long = u64::from(s.busy_max_local_tokens) + 1;
        assert_eq!(
            decide(&s, down(long)),
            Placement::PrefillNode(PlacementReason::LongPrompt),
            "too long for the decode node: the caller answers that no prefill node is available"
        );
        assert_eq!(
            decide(&PlacementSettings::always(), down(10)),
            Placement::PrefillNode(PlacementReason::Always)
        );
    }

    #[test]
    fn flags_fill_defaults_and_refuse_what_cannot_work() {
        let p = PlacementSettings::from_flags(None, Some(300), None, None).unwrap();
        assert_eq!((p.max_local_tokens, p.busy_max_local_tokens), (300, 512));
        let p = PlacementSettings::from_flags(None, Some(1000), None, None).unwrap();
        assert_eq!(
            p.busy_max_local_tokens, 1000,
            "the busy cap rises to the threshold"
        );
        let e = PlacementSettings::from_flags(None, Some(100), Some(50), None).unwrap_err();
        assert!(
            e.to_string().contains("local-prefill-busy-max-tokens"),
            "{e}"
        );
        for bad in [0.5, f64::NAN] {
            let e = PlacementSettings::from_flags(None, None, None, Some(bad)).unwrap_err();
            assert!(e.to_string().contains("local-prefill-busy-ratio"), "{e}");
        }
    }

    #[test]
    fn always_and_pinned_go_through_a_prefill_node_whatever_the_prompt() {
        assert_eq!(
            decide(&PlacementSettings::always(), input(1, None, None)),
            Placement::PrefillNode(PlacementReason::Always)
        );
        let pinned = PlacementInput {
            pinned: true,
            ..input(1, None, None)
        };
        assert_eq!(
            decide(&PlacementSettings::default(), pinned),
            Placement::PrefillNode(PlacementReason::Pinned)
        );
    }
}
