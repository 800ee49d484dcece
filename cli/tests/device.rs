//! `--device cpu|cuda[:N]` end to end through the `tandem` binary. Meaningful with or without a
//! GPU: without a CUDA driver, `generate` and `bench-engine` on `--device cuda` must exit
//! non-zero with kernels-cuda's no-driver message (naming libcuda and what was searched) and no
//! panic, and this prints one line saying what was not run; with a driver, `generate` on
//! `--device cuda` must give the CPU's greedy tokens on the same dummy weights (f32). Bad device
//! names are clap errors; disaggregated serving on CUDA is refused as not built yet.

use std::path::PathBuf;
use std::process::{Command, Output};

fn tandem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(args)
        .env("RUST_LOG", "warn")
        .env_remove("TANDEM_DEVICE")
        .env_remove("TANDEM_MODEL")
        .output()
        .expect("run tandem")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A small dummy shape (GQA 9:3, head_dim 64), written once per test process.
fn dummy_config() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tandem-device-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("config.json");
    std::fs::write(
        &p,
        r#"{"hidden_size": 192, "intermediate_size": 512, "num_hidden_layers": 3,
            "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 1024,
            "max_position_embeddings": 1024, "rope_theta": 100000.0, "tie_word_embeddings": true}"#,
    )
    .unwrap();
    p
}

/// The greedy token ids `generate` prints with `--print-token-ids` on `device`.
fn generate_ids(device: &str, cfg: &str, prompt_ids: &str) -> Result<String, Output> {
    let out = tandem(&[
        "generate", "--device", device, "--dummy-weights", cfg, "--dtype", "f32", "--prompt-ids", prompt_ids,
        "--max-tokens", "32", "--print-token-ids", "--kv-blocks", "64",
    ]);
    if !out.status.success() {
        return Err(out);
    }
    let err = stderr(&out);
    let line = err.lines().find(|l| l.starts_with("token_ids:")).expect("--print-token-ids prints a line");
    Ok(line.to_string())
}

fn assert_no_driver(out: &Output, what: &str) {
    let err = stderr(out);
    assert!(!out.status.success(), "{what}: expected failure without a driver; stderr: {err}");
    assert!(err.contains("no CUDA driver"), "{what}: the no-driver error: {err}");
    assert!(err.contains("libcuda"), "{what}: names libcuda: {err}");
    assert!(err.contains("tried"), "{what}: names what was searched: {err}");
    assert!(!err.contains("panicked"), "{what}: no panic: {err}");
    assert!(out.stdout.is_empty(), "{what}: nothing on stdout");
}

#[test]
fn generate_on_cuda_is_the_no_driver_error_without_a_driver_and_the_cpus_tokens_with_one() {
    let cfg = dummy_config();
    let cfg = cfg.to_str().unwrap();
    let prompt = "5,17,99,300,42,7,810,23,64,1000,3";
    let cpu = generate_ids("cpu", cfg, prompt).unwrap_or_else(|o| panic!("cpu generate failed: {}", stderr(&o)));
    match generate_ids("cuda", cfg, prompt) {
        Ok(gpu) => assert_eq!(gpu, cpu, "greedy tokens on cuda:0 (f32) equal the CPU's"),
        Err(out) => {
            assert_no_driver(&out, "generate --device cuda --dummy-weights");
            // The same error before any model is resolved or fetched (no --model, no dummy).
            assert_no_driver(&tandem(&["generate", "--device", "cuda", "--prompt", "hi"]), "generate --prompt hi");
            assert_no_driver(
                &tandem(&["bench-engine", "--device", "cuda", "--dummy-weights", cfg, "--runs", "1"]),
                "bench-engine --device cuda",
            );
            eprintln!("tandem --device cuda: GPU comparison not run (no CUDA driver); checked the no-driver error instead");
        }
    }
}

#[test]
fn bad_device_names_are_clap_errors_naming_the_accepted_forms() {
    for bad in ["gpu", "cuda:x", "cuda:", "cuda:-1"] {
        let out = tandem(&["generate", "--device", bad, "--prompt", "hi"]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{bad}: a usage error: {err}");
        assert!(err.contains("invalid device") && err.contains("cuda:N"), "{bad}: {err}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["generate", "--prompt", "hi"])
        .env("TANDEM_DEVICE", "gpu")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "TANDEM_DEVICE is parsed like the flag: {}", stderr(&out));
}

#[test]
fn disaggregated_serving_on_cuda_checks_the_device_before_anything_starts() {
    // With a GPU these would start serving; the GPU check script runs `up --device cuda`.
    if tandem_kernels_cuda::device_count().is_ok() {
        eprintln!("tandem --device cuda nodes: a CUDA driver is present; `scripts/gpu-check.sh` serves on it");
        return;
    }
    for args in [
        &["prefill", "--device", "cuda", "--cluster", "c1", "--kv-transport", "tcp"][..],
        &["decode", "--device", "cuda:0", "--cluster", "c1", "--kv-transport", "tcp"][..],
        &["up", "--device", "cuda", "--no-sample"][..],
    ] {
        let out = tandem(args);
        assert_no_driver(&out, &format!("{args:?}"));
        let err = stderr(&out);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(!err.contains("run directory"), "{args:?}: nothing started: {err}");
    }
}
