//! Tests of the flags: parsing, conflicts, resolution into bytes, and `run`'s output.

use super::*;
use clap::Parser;

#[derive(Parser, Debug)]
struct TestCli {
    #[command(flatten)]
    plan: PlanArgs,
}

fn parse(flags: &str) -> Result<PlanArgs, clap::Error> {
    let argv = std::iter::once("plan").chain(flags.split_whitespace());
    TestCli::try_parse_from(argv).map(|c| c.plan)
}

const TP4: &str = "--layers 80 --kv-heads 8 --head-dim 128 --dtype bf16 --weights-gb 140 \
                   --gpu-mem-gb 80 --tp 4 --reserve-gb 5 --seq-len 2048 --batch 16";

fn json(flags: &str) -> serde_json::Value {
    let out = run(&parse(&format!("{flags} --format json")).unwrap()).unwrap();
    serde_json::from_str(&out).unwrap()
}

#[test]
fn design_tp4_example_gives_seed_figures_with_full_and_4x_with_split() {
    let full = json(&format!("{TP4} --kv-per-gpu full"));
    assert_eq!(full["kv_bytes_per_token"], 327_680);
    assert_eq!(full["weight_bytes_per_gpu"], 35u64 << 30);
    assert_eq!(full["kv_budget_bytes"], 40u64 << 30);
    assert_eq!(full["max_concurrent_requests"], 64);
    assert_eq!(full["batches_in_flight"], 4);
    assert_eq!(full["kv_per_gpu"], "full");
    let split = json(TP4);
    assert_eq!(split["max_concurrent_requests"], 256);
    assert_eq!(split["max_batch_at_seq_len"], 256);
    assert_eq!(split["batches_in_flight"], 16);
    assert_eq!(split["kv_heads_per_gpu"], 2);
    assert_eq!(split["kv_bytes_per_token_per_gpu"], 81_920);
    assert_eq!(split["alternative"]["max_concurrent_requests"], 64);
}

#[test]
fn reserve_frac_is_a_fraction_of_gpu_memory() {
    let flags = TP4.replace("--reserve-gb 5", "--reserve-frac 0.0625");
    let r = resolve(&parse(&flags).unwrap()).unwrap();
    assert_eq!(r.input.reserve_bytes, 5 << 30);
    assert!(resolve(&parse(&TP4.replace("--reserve-gb 5", "--reserve-frac 1")).unwrap()).is_err());
}

#[test]
fn params_times_weight_dtype_gives_weight_bytes() {
    let flags = TP4.replace("--weights-gb 140", "--params 70B");
    assert_eq!(
        resolve(&parse(&flags).unwrap()).unwrap().input.weight_bytes,
        140_000_000_000
    );
    let int4 = format!("{flags} --weight-dtype int4");
    assert_eq!(
        resolve(&parse(&int4).unwrap()).unwrap().input.weight_bytes,
        35_000_000_000
    );
}

#[test]
fn conflicting_flag_pairs_are_rejected_by_clap() {
    for extra in [
        "--reserve-frac 0.1",
        "--params 70B",
        "--weight-dtype f32",
        "--model x.gguf",
    ] {
        let err = parse(&format!("{TP4} {extra}")).expect_err(extra);
        assert_eq!(
            err.kind(),
            clap::error::ErrorKind::ArgumentConflict,
            "{extra}"
        );
    }
}

/// TP4's flags without `flag` and its value.
fn tp4_without(flag: &str) -> String {
    let words: Vec<&str> = TP4.split_whitespace().collect();
    let at = words.iter().position(|w| *w == flag).expect(flag);
    [&words[..at], &words[at + 2..]].concat().join(" ")
}

#[test]
fn negative_and_nan_values_are_rejected_by_clap_naming_the_flag() {
    let cases = [
        ("--reserve-gb", "-5", "must not be negative"),
        ("--gpu-mem-gb", "-80", "must not be negative"),
        ("--weights-gb", "-1", "must not be negative"),
        ("--tp", "-4", "must not be negative"),
        ("--seq-len", "-2048", "must not be negative"),
        ("--weights-gb", "NaN", "must be a number, not NaN"),
    ];
    for (flag, value, reason) in cases {
        let err = parse(&format!("{} {flag} {value}", tp4_without(flag)))
            .expect_err(flag)
            .to_string();
        assert!(
            err.contains(flag) && err.contains(reason),
            "{flag} {value}: {err}"
        );
    }
    let err =
        parse(&format!("{TP4} --reserve-frac=-0.1").replace("--reserve-gb 5 ", "")).unwrap_err();
    assert!(err.to_string().contains("must not be negative"), "{err}");
}

#[test]
fn shape_flags_are_required_without_a_model() {
    let err = parse("--gpu-mem-gb 80 --seq-len 2048 --weights-gb 10").unwrap_err();
    assert_eq!(err.kind(), clap::error::ErrorKind::MissingRequiredArgument);
    let no_weights =
        parse("--layers 2 --kv-heads 2 --head-dim 64 --gpu-mem-gb 80 --seq-len 2048").unwrap();
    assert!(matches!(
        resolve(&no_weights),
        Err(PlanError::Missing {
            what: "weights",
            ..
        })
    ));
}

#[test]
fn served_smollm2_from_model_is_23040_bytes_per_token_in_bf16_and_46080_in_f32() {
    let model = "/root/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf";
    let base = format!("--model {model} --gpu-mem-gb 24 --seq-len 2048 --reserve-gb 1");
    let bf16 = json(&base);
    assert_eq!(bf16["kv_bytes_per_token"], 23_040);
    assert_eq!(bf16["layers"], 30);
    let params = bf16["param_count"].as_u64().unwrap();
    assert_eq!(
        bf16["weight_bytes"].as_u64().unwrap(),
        2 * params,
        "bf16 weights by default"
    );
    assert_eq!(
        json(&format!("{base} --dtype f32"))["kv_bytes_per_token"],
        46_080
    );
    assert_eq!(
        json(&format!("{base} --weights-gb 1"))["weight_bytes"],
        1u64 << 30
    );
}

#[test]
fn table_names_the_mode_and_how_the_other_mode_differs() {
    let split = run(&parse(TP4).unwrap()).unwrap();
    assert!(split.contains("KV per GPU: split (default)"), "{split}");
    assert!(split.contains("2 of 8 KV heads"), "{split}");
    assert!(
        split.contains("64 concurrent requests, 4 batches in flight"),
        "{split}"
    );
    assert!(split.contains("327680  320.00 KiB"), "{split}");
    let full = run(&parse(&format!("{TP4} --kv-per-gpu full")).unwrap()).unwrap();
    assert!(
        full.contains("KV per GPU: full (the seed's arithmetic)"),
        "{full}"
    );
    assert!(
        full.contains("256 concurrent requests, 16 batches in flight"),
        "{full}"
    );
}
