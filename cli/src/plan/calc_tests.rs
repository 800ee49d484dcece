//! Unit tests of the capacity arithmetic, one per reference-deployment figure (listed in
//! `plan/mod.rs`'s doc) plus the edge cases.

use super::*;
use crate::plan::units::{GIB_BYTES, KIB_BYTES, MIB_BYTES};

const LLAMA70B: ModelShape = ModelShape {
    num_layers: 80,
    num_kv_heads: 8,
    head_dim: 128,
};
const SMOLLM2: ModelShape = ModelShape {
    num_layers: 30,
    num_kv_heads: 3,
    head_dim: 64,
};

/// The reference TP-4 unit: 4 × 80 GB, 140 GB weights, 5 GB reserve, 2048 tokens, batch 16.
fn tp4_reference(kv_per_gpu: KvPerGpu) -> PlanInput {
    PlanInput {
        shape: LLAMA70B,
        kv_dtype: PlanKvDtype::Bf16,
        block_size_tokens: 16,
        weight_bytes: 140 * GIB_BYTES,
        gpu_mem_bytes: 80 * GIB_BYTES,
        tp: 4,
        reserve_bytes: 5 * GIB_BYTES,
        seq_len_tokens: 2048,
        batch: 16,
        kv_per_gpu,
    }
}

/// The reference deployment's single card: 80 GB, 40 GB weights, 8 GB reserve.
fn tp1_reference(seq_len_tokens: u64, batch: u64) -> PlanInput {
    PlanInput {
        weight_bytes: 40 * GIB_BYTES,
        tp: 1,
        reserve_bytes: 8 * GIB_BYTES,
        seq_len_tokens,
        batch,
        ..tp4_reference(KvPerGpu::Split)
    }
}

#[test]
fn reference_model_needs_320_kib_per_token_in_bf16() {
    let cost = KvCost::of(LLAMA70B, 8, PlanKvDtype::Bf16, 16).unwrap();
    assert_eq!(
        cost,
        KvCost {
            bytes: 327_680,
            tokens: 1
        }
    );
    assert_eq!(cost.bytes_per_token_ceil(), 320 * KIB_BYTES);
}

#[test]
fn batch_32_of_4096_tokens_needs_40_gib() {
    let plan = compute(&tp1_reference(4096, 32)).unwrap();
    assert_eq!(plan.kv_bytes_per_token, 327_680);
    assert_eq!(plan.kv_bytes_at_batch, 40 * GIB_BYTES);
    assert_eq!(
        plan.chosen.kv_bytes_at_batch_per_gpu,
        40 * GIB_BYTES,
        "TP 1: one GPU holds it all"
    );
}

#[test]
fn single_80_gb_card_with_40_gb_weights_and_8_gb_reserve_fits_batch_12_at_8192() {
    for mode in [KvPerGpu::Split, KvPerGpu::Full] {
        let plan = compute(&PlanInput {
            kv_per_gpu: mode,
            ..tp1_reference(8192, 1)
        })
        .unwrap();
        assert_eq!(plan.weight_bytes_per_gpu, 40 * GIB_BYTES);
        assert_eq!(plan.kv_budget_bytes, 32 * GIB_BYTES);
        assert_eq!(plan.chosen.kv_bytes_per_request_per_gpu, 2560 * MIB_BYTES);
        assert_eq!(plan.max_batch_at_seq_len(), 12, "{mode:?}");
        assert_eq!(
            plan.chosen,
            Capacity {
                mode,
                ..plan.alternative
            },
            "TP 1: modes agree"
        );
    }
}

#[test]
fn tp4_unit_charged_full_heads_holds_64_requests_and_4_batches_like_the_seed() {
    let plan = compute(&tp4_reference(KvPerGpu::Full)).unwrap();
    assert_eq!(plan.kv_bytes_per_token, 327_680);
    assert_eq!(plan.weight_bytes_per_gpu, 35 * GIB_BYTES);
    assert_eq!(plan.kv_budget_bytes, 40 * GIB_BYTES);
    assert_eq!(plan.chosen.kv_heads_per_gpu, 8);
    assert_eq!(plan.chosen.kv_bytes_per_token_per_gpu, 320 * KIB_BYTES);
    assert_eq!(plan.chosen.kv_bytes_per_request_per_gpu, 640 * MIB_BYTES);
    assert_eq!(plan.chosen.max_concurrent_requests, 64);
    assert_eq!(plan.max_batch_at_seq_len(), 64);
    assert_eq!(plan.chosen.batches_in_flight, 4);
    assert_eq!(plan.alternative.mode, KvPerGpu::Split);
    assert_eq!(plan.alternative.max_concurrent_requests, 256);
}

#[test]
fn tp4_unit_with_split_heads_holds_256_requests_and_16_batches() {
    let plan = compute(&tp4_reference(KvPerGpu::Split)).unwrap();
    assert_eq!(
        plan.kv_bytes_per_token, 327_680,
        "the model's figure does not depend on TP"
    );
    assert_eq!(plan.kv_bytes_at_batch, 16 * 640 * MIB_BYTES);
    assert_eq!(plan.chosen.kv_heads_per_gpu, 2);
    assert_eq!(plan.chosen.kv_bytes_per_token_per_gpu, 80 * KIB_BYTES);
    assert_eq!(plan.chosen.kv_bytes_per_request_per_gpu, 160 * MIB_BYTES);
    assert_eq!(plan.chosen.kv_bytes_at_batch_per_gpu, 16 * 160 * MIB_BYTES);
    assert_eq!(plan.chosen.max_concurrent_requests, 256);
    assert_eq!(plan.max_batch_at_seq_len(), 256);
    assert_eq!(plan.chosen.batches_in_flight, 16);
    assert_eq!(plan.alternative.max_concurrent_requests, 64);
    assert_eq!(plan.alternative.batches_in_flight, 4);
}

#[test]
fn smollm2_kv_bytes_per_token_for_each_dtype() {
    let per_token = |d| {
        KvCost::of(SMOLLM2, 3, d, 16)
            .unwrap()
            .bytes_per_token_ceil()
    };
    assert_eq!(per_token(PlanKvDtype::Bf16), 23_040);
    assert_eq!(per_token(PlanKvDtype::F16), 23_040);
    assert_eq!(per_token(PlanKvDtype::F32), 46_080);
    assert_eq!(per_token(PlanKvDtype::Fp8), 11_520);
    // int8: 30 layers × (2 × 3 heads × 16 tokens × 64 dims of data + 3 heads × 64 f16 K scales
    // + 3 heads × 16 f16 V scales) per 16 tokens.
    let int8 = KvCost::of(SMOLLM2, 3, PlanKvDtype::Int8, 16).unwrap();
    assert_eq!(
        int8,
        KvCost {
            bytes: 30 * (6144 + 384 + 96),
            tokens: 16
        }
    );
    assert_eq!(int8.bytes_per_token_ceil(), 12_420);
}

#[test]
fn int8_scales_amortise_over_the_block_size() {
    let at = |block| KvCost::of(LLAMA70B, 8, PlanKvDtype::Int8, block).unwrap();
    // 80 × (2 × 8 × 16 × 128 data + 8 × 128 × 2 K-scale + 8 × 16 × 2 V-scale) bytes per 16 tokens.
    assert_eq!(
        at(16).bytes_per_token_ceil(),
        80 * (32_768 + 2_048 + 256) / 16
    );
    assert_eq!(at(16).bytes_per_token_ceil(), 175_360);
    // Bigger blocks spread the same 2048 bytes of K scales per layer over more tokens; the V
    // scales stay 2 bytes per token and head.
    assert_eq!(
        at(64).bytes_per_token_ceil(),
        80 * (2 * 8 * 128 + 2048 / 64 + 8 * 2)
    );
    // A fractional per-token size is rounded up per request, not per token.
    let tiny = KvCost::of(
        ModelShape {
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: 1,
        },
        1,
        PlanKvDtype::Int8,
        16,
    )
    .unwrap();
    assert_eq!(
        tiny,
        KvCost {
            bytes: 68,
            tokens: 16
        }
    ); // 32 data + 2 K-scale + 32 V-scale bytes, padded to a multiple of 4: 4.25 B/token
    assert_eq!(tiny.bytes_for("x", 3).unwrap(), 13); // ceil(68 × 3 / 16)
    assert_eq!(tiny.bytes_per_token_ceil(), 5);
}

#[test]
fn split_heads_round_up_and_replicate_when_tp_exceeds_kv_heads() {
    assert_eq!(kv_heads_per_gpu(8, 4, KvPerGpu::Split), 2);
    assert_eq!(
        kv_heads_per_gpu(3, 2, KvPerGpu::Split),
        2,
        "uneven: the fuller GPU bounds the unit"
    );
    assert_eq!(kv_heads_per_gpu(3, 4, KvPerGpu::Split), 1);
    assert_eq!(kv_heads_per_gpu(8, 16, KvPerGpu::Split), 1, "replicated");
    assert_eq!(kv_heads_per_gpu(8, 16, KvPerGpu::Full), 8);
}

#[test]
fn weights_shard_rounds_up_to_the_largest_gpu_share() {
    let plan = compute(&PlanInput {
        weight_bytes: 140 * GIB_BYTES + 1,
        ..tp4_reference(KvPerGpu::Split)
    })
    .unwrap();
    assert_eq!(plan.weight_bytes_per_gpu, 35 * GIB_BYTES + 1);
    assert_eq!(plan.kv_budget_bytes, 40 * GIB_BYTES - 1);
    assert_eq!(plan.chosen.max_concurrent_requests, 255);
}

#[test]
fn weights_plus_reserve_filling_the_card_is_refused() {
    for weight_bytes in [300 * GIB_BYTES + 1, 400 * GIB_BYTES] {
        let input = PlanInput {
            weight_bytes,
            ..tp4_reference(KvPerGpu::Split)
        };
        match compute(&input) {
            Err(PlanError::WeightsDoNotFit {
                weight_bytes_per_gpu,
                tp: 4,
                ..
            }) => {
                assert!(
                    weight_bytes_per_gpu > 75 * GIB_BYTES,
                    "{weight_bytes_per_gpu}"
                )
            }
            other => panic!("{other:?}"),
        }
    }
    // Exactly full: a zero budget is an error too (nothing fits, whatever the length).
    let exact = PlanInput {
        weight_bytes: 300 * GIB_BYTES,
        ..tp4_reference(KvPerGpu::Split)
    };
    assert!(matches!(
        compute(&exact),
        Err(PlanError::WeightsDoNotFit { .. })
    ));
}

#[test]
fn zero_tp_seq_len_batch_or_shape_is_refused_naming_the_flag() {
    let base = tp4_reference(KvPerGpu::Split);
    let cases = [
        ("--tp", PlanInput { tp: 0, ..base }),
        (
            "--seq-len",
            PlanInput {
                seq_len_tokens: 0,
                ..base
            },
        ),
        ("--batch", PlanInput { batch: 0, ..base }),
        (
            "--kv-heads",
            PlanInput {
                shape: ModelShape {
                    num_kv_heads: 0,
                    ..LLAMA70B
                },
                ..base
            },
        ),
        (
            "--block-size",
            PlanInput {
                block_size_tokens: 0,
                ..base
            },
        ),
    ];
    for (flag, input) in cases {
        match compute(&input) {
            Err(PlanError::InvalidValue {
                field,
                reason: "must be at least 1",
                ..
            }) => {
                assert_eq!(field, flag)
            }
            other => panic!("{flag}: {other:?}"),
        }
    }
}

#[test]
fn a_budget_smaller_than_one_request_gives_max_batch_zero_not_an_error() {
    // 1 GiB of budget; one 8192-token request needs 2.5 GiB.
    let input = PlanInput {
        gpu_mem_bytes: 49 * GIB_BYTES,
        ..tp1_reference(8192, 4)
    };
    let plan = compute(&input).unwrap();
    assert_eq!(plan.kv_budget_bytes, GIB_BYTES);
    assert_eq!(plan.max_batch_at_seq_len(), 0);
    assert_eq!(plan.chosen.batches_in_flight, 0);
}

#[test]
fn batch_larger_than_the_unit_holds_gives_zero_batches_in_flight() {
    let plan = compute(&PlanInput {
        batch: 65,
        ..tp4_reference(KvPerGpu::Full)
    })
    .unwrap();
    assert_eq!(plan.chosen.max_concurrent_requests, 64);
    assert_eq!(plan.chosen.batches_in_flight, 0);
}

#[test]
fn absurd_lengths_are_refused_instead_of_overflowing() {
    let input = PlanInput {
        seq_len_tokens: u64::MAX / 2,
        ..tp4_reference(KvPerGpu::Split)
    };
    assert!(matches!(
        compute(&input),
        Err(PlanError::InvalidValue {
            field: "--seq-len",
            ..
        })
    ));
    let input = PlanInput {
        batch: u64::MAX / 2,
        ..tp4_reference(KvPerGpu::Split)
    };
    assert!(matches!(
        compute(&input),
        Err(PlanError::InvalidValue {
            field: "--batch",
            ..
        })
    ));
}
