//! Proto ⇄ engine conversions shared by both nodes: sampling parameters (with the seed rule
//! that keeps seeded sampling identical across nodes), priority, finish reason and usage.
//!
//! **Seeds.** The engine seeds a request's sampler from `seed`, or else from its *engine*
//! request id, which differs between the prefill and the decode node. So an unseeded request
//! with temperature > 0 gets a seed derived here from the caller's request id string (XXH3),
//! the same on every node: the first token (drawn on the prefill node) and the rest (decode
//! node) come from one generator stream, exactly as on one engine.

use tandem_engine::grammar::{GrammarError, ResponseFormat};
use tandem_engine::{FinishReason, Priority, SamplingParams, TokenLogprob, Usage};
use tandem_proto::v1;

/// The engine's sampling parameters for a request. `max_tokens == 0` takes `default_max_tokens`.
/// A malformed `response_format` is [`GrammarError::Invalid`] naming the part (the caller's
/// INVALID_ARGUMENT); the engine compiles it.
pub fn sampling_params(
    p: Option<&v1::SamplingParams>,
    request_id: &str,
    default_max_tokens: usize,
) -> Result<SamplingParams, GrammarError> {
    let Some(p) = p else {
        return Ok(SamplingParams {
            max_new_tokens: default_max_tokens,
            ..SamplingParams::default()
        });
    };
    let response_format = match &p.response_format {
        Some(f) => ResponseFormat::from_proto(f)?,
        None => None,
    };
    let seed = match p.seed {
        Some(s) => Some(s),
        None if p.temperature > 0.0 => Some(seed_for(request_id)),
        None => None,
    };
    Ok(SamplingParams {
        temperature: p.temperature,
        top_k: p.top_k as usize,
        top_p: if p.top_p == 0.0 { 1.0 } else { p.top_p },
        seed,
        max_new_tokens: if p.max_tokens == 0 {
            default_max_tokens
        } else {
            p.max_tokens as usize
        },
        stop: p.stop.clone(),
        ignore_eos: p.ignore_eos,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        repetition_penalty: if p.repetition_penalty == 0.0 {
            1.0
        } else {
            p.repetition_penalty
        },
        logprobs: p.logprobs,
        top_logprobs: p.top_logprobs as usize,
        resumed_output_tokens: p.resumed_output_tokens as usize,
        response_format,
    })
}

/// The proto form of a token's log probability.
pub fn logprob(l: &TokenLogprob) -> v1::TokenLogprob {
    v1::TokenLogprob {
        token_id: l.token,
        logprob: l.logprob,
        top: l
            .top
            .iter()
            .map(|&(token_id, logprob)| v1::TopLogprob { token_id, logprob })
            .collect(),
    }
}

/// The engine form of a proto token log probability.
pub fn logprob_from(l: &v1::TokenLogprob) -> TokenLogprob {
    TokenLogprob {
        token: l.token_id,
        logprob: l.logprob,
        top: l.top.iter().map(|t| (t.token_id, t.logprob)).collect(),
    }
}

/// The sampler seed of an unseeded request: XXH3 of its request id.
pub fn seed_for(request_id: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(request_id.as_bytes())
}

/// The engine priority of a proto priority value (unknown values are interactive).
pub fn priority(p: i32) -> Priority {
    match v1::Priority::try_from(p) {
        Ok(v1::Priority::Batch) => Priority::Batch,
        _ => Priority::Interactive,
    }
}

/// The proto finish reason of an engine one.
pub fn finish_reason(r: FinishReason) -> v1::FinishReason {
    match r {
        FinishReason::Eos | FinishReason::StopString => v1::FinishReason::Stop,
        FinishReason::Length => v1::FinishReason::Length,
        FinishReason::Aborted => v1::FinishReason::Cancelled,
    }
}

/// The proto usage of an engine one.
pub fn usage(u: Usage) -> v1::Usage {
    v1::Usage {
        prompt_tokens: u.prompt_tokens as u32,
        cached_prompt_tokens: u.cached_tokens as u32,
        completion_tokens: u.completion_tokens as u32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unseeded_sampling_gets_the_same_seed_on_every_node_and_greedy_stays_unseeded() {
        let sampled = v1::SamplingParams {
            temperature: 0.7,
            max_tokens: 5,
            ..Default::default()
        };
        let a = sampling_params(Some(&sampled), "req-1", 16).unwrap();
        let b = sampling_params(Some(&sampled), "req-1", 16).unwrap();
        assert_eq!(a.seed, b.seed);
        assert!(a.seed.is_some());
        assert_ne!(a.seed, sampling_params(Some(&sampled), "req-2", 16).unwrap().seed);
        let greedy = sampling_params(Some(&v1::SamplingParams::default()), "req-1", 16).unwrap();
        assert_eq!(greedy.seed, None);
        assert_eq!(greedy.max_new_tokens, 16, "0 takes the default");
        assert_eq!(greedy.top_p, 1.0, "0 means off");
        assert_eq!(greedy.repetition_penalty, 1.0, "0 means off");
        let penalised = v1::SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: -0.5,
            repetition_penalty: 1.2,
            logprobs: true,
            top_logprobs: 3,
            resumed_output_tokens: 7,
            ..Default::default()
        };
        let p = sampling_params(Some(&penalised), "x", 1).unwrap();
        assert_eq!(
            (
                p.presence_penalty,
                p.frequency_penalty,
                p.repetition_penalty
            ),
            (0.5, -0.5, 1.2)
        );
        assert_eq!(
            (p.logprobs, p.top_logprobs, p.resumed_output_tokens),
            (true, 3, 7)
        );
        let seeded = v1::SamplingParams {
            temperature: 0.7,
            seed: Some(3),
            ..Default::default()
        };
        assert_eq!(sampling_params(Some(&seeded), "x", 1).unwrap().seed, Some(3));
        let structured = v1::SamplingParams {
            response_format: Some(ResponseFormat::JsonObject.to_proto()),
            ..Default::default()
        };
        assert_eq!(
            sampling_params(Some(&structured), "x", 1).unwrap().response_format,
            Some(ResponseFormat::JsonObject)
        );
        let broken = v1::SamplingParams {
            response_format: Some(v1::ResponseFormat {
                format: Some(v1::response_format::Format::JsonSchema(
                    v1::response_format::JsonSchema {
                        name: "n".into(),
                        schema: "{".into(),
                        strict: true,
                    },
                )),
            }),
            ..Default::default()
        };
        assert!(matches!(
            sampling_params(Some(&broken), "x", 1),
            Err(GrammarError::Invalid { part, .. }) if part == "response_format.json_schema.schema"
        ));
    }

    #[test]
    fn logprobs_round_trip_through_the_proto() {
        let l = TokenLogprob {
            token: 5,
            logprob: -0.25,
            top: vec![(5, -0.25), (9, -1.5)],
        };
        assert_eq!(logprob_from(&logprob(&l)), l);
    }

    #[test]
    fn finish_reasons_and_priorities_map_to_their_proto_names() {
        assert_eq!(finish_reason(FinishReason::Eos), v1::FinishReason::Stop);
        assert_eq!(
            finish_reason(FinishReason::StopString),
            v1::FinishReason::Stop
        );
        assert_eq!(
            finish_reason(FinishReason::Length),
            v1::FinishReason::Length
        );
        assert_eq!(
            finish_reason(FinishReason::Aborted),
            v1::FinishReason::Cancelled
        );
        assert_eq!(priority(v1::Priority::Batch as i32), Priority::Batch);
        assert_eq!(priority(99), Priority::Interactive);
    }
}
