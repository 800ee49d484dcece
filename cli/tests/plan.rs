//! `tandem plan` end to end: the built binary, the reference deployment's flag sets (its figures
//! are listed in `cli/src/plan/mod.rs`'s doc), every figure asserted through `--format json`,
//! and a non-zero exit with a clear message for each bad combination.

use std::process::{Command, Output};

use serde_json::Value;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;
const KIB: u64 = 1 << 10;

/// The served model, SmolLM2-135M-Instruct Q4_1, where `tandem model fetch` puts it.
const SMOLLM2_GGUF: &str = "/root/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The reference deployment's model (70B-class, GQA): 80 layers, 8 KV heads, head dim 128, BF16.
const LLAMA70B: &str = "--layers 80 --kv-heads 8 --head-dim 128 --dtype bf16";

/// The reference TP-4 unit: 4 × 80 GB, 140 GB weights, 5 GB reserve, 2048 tokens, batch 16.
const TP4_UNIT: &str =
    "--weights-gb 140 --gpu-mem-gb 80 --tp 4 --reserve-gb 5 --seq-len 2048 --batch 16";

fn tandem_plan(flags: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tandem"))
        .arg("plan")
        .args(flags.split_whitespace())
        .env_clear()
        .output()
        .expect("run the tandem binary")
}

/// Runs `tandem plan FLAGS --format json`, asserts success, and parses the single JSON object.
fn plan_json(flags: &str) -> Value {
    let out = tandem_plan(&format!("{flags} --format json"));
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "{flags}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let value: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    assert!(value.is_object(), "{stdout}");
    value
}

/// Runs `tandem plan FLAGS`, asserts failure, and returns stderr.
fn plan_fails(flags: &str) -> String {
    let out = tandem_plan(flags);
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        !out.status.success(),
        "{flags} should fail, printed {}",
        String::from_utf8_lossy(&out.stdout)
    );
    stderr
}

fn assert_figures(v: &Value, expected: [(&str, u64); 7]) {
    for (key, want) in expected {
        assert_eq!(v[key].as_u64(), Some(want), "{key} in {v:#}");
    }
}

#[test]
fn tp4_with_full_kv_per_gpu_reproduces_the_seeds_64_requests_and_4_batches() {
    let v = plan_json(&format!("{LLAMA70B} {TP4_UNIT} --kv-per-gpu full"));
    assert_figures(
        &v,
        [
            ("kv_bytes_per_token", 327_680),
            ("kv_bytes_at_batch", 16 * 640 * MIB),
            ("weight_bytes_per_gpu", 35 * GIB),
            ("kv_budget_bytes", 40 * GIB),
            ("max_batch_at_seq_len", 64),
            ("max_concurrent_requests", 64),
            ("batches_in_flight", 4),
        ],
    );
    assert_eq!(v["kv_per_gpu"], "full");
    assert_eq!(v["kv_bytes_per_request_per_gpu"].as_u64(), Some(640 * MIB));
}

#[test]
fn tp4_with_split_kv_heads_holds_256_requests_and_16_batches() {
    let v = plan_json(&format!("{LLAMA70B} {TP4_UNIT}"));
    assert_figures(
        &v,
        [
            ("kv_bytes_per_token", 327_680),
            ("kv_bytes_at_batch", 16 * 640 * MIB),
            ("weight_bytes_per_gpu", 35 * GIB),
            ("kv_budget_bytes", 40 * GIB),
            ("max_batch_at_seq_len", 256),
            ("max_concurrent_requests", 256),
            ("batches_in_flight", 16),
        ],
    );
    assert_eq!(v["kv_per_gpu"], "split");
    assert_eq!(v["kv_heads_per_gpu"], 2);
    assert_eq!(v["kv_bytes_per_token_per_gpu"].as_u64(), Some(80 * KIB));
    assert_eq!(v["alternative"]["max_concurrent_requests"], 64);
}

#[test]
fn batch_32_of_4096_tokens_is_40_gib_of_kv() {
    let v = plan_json(&format!(
        "{LLAMA70B} --weights-gb 40 --gpu-mem-gb 80 --reserve-gb 8 --seq-len 4096 --batch 32"
    ));
    assert_figures(
        &v,
        [
            ("kv_bytes_per_token", 320 * KIB),
            ("kv_bytes_at_batch", 40 * GIB),
            ("weight_bytes_per_gpu", 40 * GIB),
            ("kv_budget_bytes", 32 * GIB),
            ("max_batch_at_seq_len", 25),
            ("max_concurrent_requests", 25),
            ("batches_in_flight", 0),
        ],
    );
}

#[test]
fn one_80_gb_card_with_40_gb_weights_and_8_gb_reserve_fits_batch_12_at_8192_tokens() {
    for mode in ["split", "full"] {
        let v = plan_json(&format!(
            "{LLAMA70B} --weights-gb 40 --gpu-mem-gb 80 --reserve-gb 8 --seq-len 8192 --batch 4 --kv-per-gpu {mode}"
        ));
        assert_figures(
            &v,
            [
                ("kv_bytes_per_token", 327_680),
                ("kv_bytes_at_batch", 4 * 2560 * MIB),
                ("weight_bytes_per_gpu", 40 * GIB),
                ("kv_budget_bytes", 32 * GIB),
                ("max_batch_at_seq_len", 12),
                ("max_concurrent_requests", 12),
                ("batches_in_flight", 3),
            ],
        );
    }
}

#[test]
fn served_smollm2_gguf_is_23040_bytes_per_token_in_bf16_and_f16_and_46080_in_f32() {
    let base =
        format!("--model {SMOLLM2_GGUF} --gpu-mem-gb 24 --reserve-gb 2 --seq-len 2048 --batch 8");
    for (dtype, per_token) in [
        ("bf16", 23_040u64),
        ("f16", 23_040),
        ("f32", 46_080),
        ("fp8", 11_520),
    ] {
        let v = plan_json(&format!("{base} --dtype {dtype}"));
        assert_eq!(v["kv_bytes_per_token"].as_u64(), Some(per_token), "{dtype}");
        assert_eq!(
            v["kv_bytes_at_batch"].as_u64(),
            Some(per_token * 2048 * 8),
            "{dtype}"
        );
        assert_eq!(
            (
                v["layers"].as_u64(),
                v["kv_heads"].as_u64(),
                v["head_dim"].as_u64()
            ),
            (Some(30), Some(3), Some(64))
        );
        let params = v["param_count"].as_u64().unwrap();
        let weights = v["weight_bytes_per_gpu"].as_u64().unwrap();
        assert_eq!(
            weights,
            2 * params,
            "bf16 weights: 2 bytes per counted parameter"
        );
        let budget = 22 * GIB - weights;
        assert_eq!(v["kv_budget_bytes"].as_u64(), Some(budget));
        assert_eq!(
            v["max_concurrent_requests"].as_u64(),
            Some(budget / (per_token * 2048)),
            "{dtype}"
        );
    }
    // int8: 30 layers × (2 × 3 heads × 16 tokens × 64 dims + 3 × 64 f16 K scales + 3 × 16 f16 V
    // scales) per 16-token block.
    let v = plan_json(&format!("{base} --dtype int8"));
    assert_eq!(
        v["kv_bytes_per_token"].as_u64(),
        Some(30 * (6144 + 384 + 96) / 16)
    );
    assert_eq!(v["kv_bytes_per_token"].as_u64(), Some(12_420));
}

#[test]
fn table_has_units_names_the_mode_and_explains_the_other() {
    let out = tandem_plan(&format!("{LLAMA70B} {TP4_UNIT} --kv-per-gpu full"));
    assert!(out.status.success());
    let table = String::from_utf8(out.stdout).unwrap();
    for needle in [
        "327680  320.00 KiB",
        "35.00 GiB",
        "40.00 GiB",
        "KV per GPU: full (the seed's arithmetic)",
        "256 concurrent requests, 16 batches in flight",
    ] {
        assert!(table.contains(needle), "missing `{needle}` in\n{table}");
    }
    let row = |label: &str| {
        let line = table
            .lines()
            .find(|l| l.starts_with(label))
            .unwrap_or_else(|| panic!("{label}\n{table}"));
        line.split_whitespace().last().unwrap().to_string()
    };
    assert_eq!(row("max concurrent requests per unit"), "64");
    assert_eq!(row("batches in flight"), "4");
}

#[test]
fn a_budget_that_fits_no_request_prints_max_batch_zero_and_says_so() {
    let out = tandem_plan(&format!(
        "{LLAMA70B} --weights-gb 40 --gpu-mem-gb 49 --reserve-gb 8 --seq-len 8192"
    ));
    assert!(out.status.success());
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(table.contains("no request of 8192 tokens fits"), "{table}");
    let v = plan_json(&format!(
        "{LLAMA70B} --weights-gb 40 --gpu-mem-gb 49 --reserve-gb 8 --seq-len 8192"
    ));
    assert_eq!(v["max_batch_at_seq_len"], 0);
    assert!(
        v["notes"][0]
            .as_str()
            .unwrap()
            .contains("no request of 8192 tokens fits")
    );
}

#[test]
fn every_flag_reads_its_tandem_plan_environment_variable() {
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["plan", "--format", "json"])
        .env_clear()
        .envs([
            ("TANDEM_PLAN_LAYERS", "80"),
            ("TANDEM_PLAN_KV_HEADS", "8"),
            ("TANDEM_PLAN_HEAD_DIM", "128"),
            ("TANDEM_PLAN_WEIGHTS_GB", "140"),
            ("TANDEM_PLAN_GPU_MEM_GB", "80"),
            ("TANDEM_PLAN_TP", "4"),
            ("TANDEM_PLAN_RESERVE_GB", "5"),
            ("TANDEM_PLAN_SEQ_LEN", "2048"),
            ("TANDEM_PLAN_BATCH", "16"),
            ("TANDEM_PLAN_KV_PER_GPU", "full"),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (
            v["max_concurrent_requests"].as_u64(),
            v["batches_in_flight"].as_u64()
        ),
        (Some(64), Some(4))
    );
}

#[test]
fn help_says_gb_is_2_to_the_30_and_kb_2_to_the_10() {
    let out = tandem_plan("--help");
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    assert!(
        help.contains("GB in a flag means 2^30 bytes") && help.contains("KB means 2^10 bytes"),
        "{help}"
    );
    assert!(help.contains("TANDEM_PLAN_GPU_MEM_GB"), "{help}");
}

#[test]
fn weights_larger_than_the_cards_fail_with_a_clear_message() {
    let err = plan_fails(&format!(
        "{LLAMA70B} --weights-gb 400 --gpu-mem-gb 80 --tp 4 --reserve-gb 5 --seq-len 2048"
    ));
    assert!(
        err.contains("weights do not fit: 100.00 GiB of weights per GPU"),
        "{err}"
    );
    let err = plan_fails(&format!(
        "{LLAMA70B} --weights-gb 140 --gpu-mem-gb 80 --seq-len 2048"
    ));
    assert!(err.contains("weights do not fit"), "{err}");
}

#[test]
fn zero_tp_seq_len_or_batch_fails_naming_the_flag() {
    for (flag, args) in [
        ("--tp", "--tp 0 --seq-len 2048"),
        ("--seq-len", "--tp 4 --seq-len 0"),
        ("--batch", "--tp 4 --seq-len 2048 --batch 0"),
    ] {
        let err = plan_fails(&format!(
            "{LLAMA70B} --weights-gb 140 --gpu-mem-gb 80 {args}"
        ));
        assert!(
            err.contains(&format!("invalid {flag} `0`: must be at least 1")),
            "{err}"
        );
    }
}

#[test]
fn negative_or_nan_values_fail_with_a_clear_message() {
    let base = format!("{LLAMA70B} --weights-gb 140 --gpu-mem-gb 80 --tp 4 --seq-len 2048");
    for (extra, message) in [
        ("--reserve-gb -5", "must not be negative"),
        ("--reserve-frac -0.1", "must not be negative"),
        ("--reserve-gb NaN", "must be a number, not NaN"),
        ("--reserve-frac 1.5", "must be below 1"),
    ] {
        let err = plan_fails(&format!("{base} {extra}"));
        let flag = extra.split_whitespace().next().unwrap();
        assert!(
            err.contains(flag) && err.contains(message),
            "{extra}: {err}"
        );
    }
}

#[test]
fn conflicting_flags_fail_with_clap_naming_both() {
    let base = format!("{LLAMA70B} --gpu-mem-gb 80 --seq-len 2048");
    for (extra, a, b) in [
        (
            "--weights-gb 140 --reserve-gb 5 --reserve-frac 0.1",
            "--reserve-gb",
            "--reserve-frac",
        ),
        ("--weights-gb 140 --params 70B", "--weights-gb", "--params"),
        ("--weights-gb 140 --model x.gguf", "--model", "--layers"),
    ] {
        let err = plan_fails(&format!("{base} {extra}"));
        assert!(
            err.contains("cannot be used with") && err.contains(a) && err.contains(b),
            "{extra}: {err}"
        );
    }
}

#[test]
fn an_unreadable_model_path_fails_naming_the_path() {
    let err = plan_fails("--model /nonexistent/tandem/model.gguf --gpu-mem-gb 80 --seq-len 2048");
    assert!(
        err.contains("cannot read model at /nonexistent/tandem/model.gguf"),
        "{err}"
    );
}

#[test]
fn missing_weights_fail_listing_the_flags_that_supply_them() {
    let err = plan_fails(&format!("{LLAMA70B} --gpu-mem-gb 80 --seq-len 2048"));
    assert!(
        err.contains("no weights given: pass --params, --weights-gb or --model"),
        "{err}"
    );
}
