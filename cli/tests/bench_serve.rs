//! `tandem bench-serve` end to end: a real local 1P+1D cluster (etcd, NATS, router, nodes) and
//! the colocated engine each serve every request of every level, and the JSON report says so.

mod common;

use common::model;

use std::process::Command;

#[test]
fn both_sides_report_every_level_with_real_timings() {
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args([
            "bench-serve",
            "--concurrency",
            "1,2",
            "--requests",
            "2",
            "--prompt-len",
            "16",
            "--max-tokens",
            "4",
            "--json",
        ])
        .env("TANDEM_MODEL", model())
        .output()
        .expect("run tandem bench-serve");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench-serve failed: {err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not one JSON object ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    assert_eq!(v["max_tokens"], 4);
    for side in ["disaggregated", "colocated"] {
        let levels = v[side]
            .as_array()
            .unwrap_or_else(|| panic!("{side} missing: {v}"));
        let conc: Vec<u64> = levels
            .iter()
            .map(|l| l["concurrency"].as_u64().unwrap())
            .collect();
        assert_eq!(conc, [1, 2], "{side}");
        for l in levels {
            let ttft = l["ttft_p50_ms"].as_f64().unwrap();
            let e2e = l["e2e_p50_ms"].as_f64().unwrap();
            assert!(ttft > 0.0 && e2e >= ttft, "{side}: {l}");
            // 4 tokens per request: the first at TTFT, three more after it.
            assert!(l["itl_p50_ms"].as_f64().unwrap() > 0.0, "{side}: {l}");
            assert!(l["output_tok_s"].as_f64().unwrap() > 0.0, "{side}: {l}");
            assert_eq!(l["requests"], 2, "{side}: every request finished: {l}");
            assert_eq!(l["output_tokens"], 2 * 4, "{side}: nothing lost: {l}");
        }
    }
    assert!(
        err.contains("bench-serve: disaggregated concurrency 2 done"),
        "{err}"
    );
}

#[test]
fn zero_concurrency_is_refused_before_anything_starts() {
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["bench-serve", "--concurrency", "0", "--mode", "colocated"])
        .env("TANDEM_MODEL", model())
        .output()
        .expect("run tandem bench-serve");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("concurrency levels must be > 0"), "{err}");
}
