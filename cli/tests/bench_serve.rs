//! `tandem bench-serve` end to end: a real local 1P+1D cluster (etcd, NATS, router, nodes) and
//! the colocated engine each serve every request of every level (closed loop and Poisson open
//! loop), the JSON report says so, and the throughput–latency plots are written.

use crate::common;

use common::model;

use std::process::Command;

#[test]
fn both_sides_report_every_level_with_real_timings() {
    let plots = std::env::temp_dir().join(format!("tandem-bench-serve-plots-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args([
            "bench-serve",
            "--concurrency",
            "1,2",
            "--rates",
            "4",
            "--plot-dir",
            plots.to_str().unwrap(),
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
    assert_eq!(v["slo"]["ttft_ms"], 2000.0, "the default SLO is reported: {v}");
    for side in ["disaggregated", "colocated"] {
        let levels = v[side]
            .as_array()
            .unwrap_or_else(|| panic!("{side} missing: {v}"));
        let loads: Vec<String> = levels
            .iter()
            .map(|l| match (l["concurrency"].as_u64(), l["rate_req_s"].as_f64()) {
                (Some(c), None) => format!("c{c}"),
                (None, Some(r)) => format!("r{r}"),
                _ => panic!("a level has exactly one of concurrency and rate: {l}"),
            })
            .collect();
        assert_eq!(loads, ["c1", "c2", "r4"], "{side}");
        for l in levels {
            let f = |k: &str| l[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {l}"));
            assert!(f("ttft_p50_ms") > 0.0 && f("e2e_p50_ms") >= f("ttft_p50_ms"), "{side}: {l}");
            for m in ["ttft", "itl", "e2e"] {
                let (p50, p90, p99) = (f(&format!("{m}_p50_ms")), f(&format!("{m}_p90_ms")), f(&format!("{m}_p99_ms")));
                assert!(p50 <= p90 && p90 <= p99, "{side} {m} percentiles out of order: {l}");
            }
            // 4 tokens per request: the first at TTFT, three more after it.
            assert!(f("itl_p50_ms") > 0.0, "{side}: {l}");
            assert!(f("output_tok_s") > 0.0, "{side}: {l}");
            assert!(f("goodput_req_s") <= f("throughput_req_s") + 1e-9, "{side}: {l}");
            let met = f("slo_attainment");
            assert!((0.0..=1.0).contains(&met), "{side}: {l}");
            assert_eq!(l["requests"], 2, "{side}: every request finished: {l}");
            assert_eq!(l["output_tokens"], 2 * 4, "{side}: nothing lost: {l}");
        }
    }
    // How the KV moved, read from the nodes' /metrics: every pushed prompt counted, none by
    // CUDA IPC on the CPU.
    let kv = &v["kv"];
    let n = |k: &str| kv[k].as_u64().unwrap_or_else(|| panic!("kv.{k} missing: {v}"));
    assert!(n("transfers_received") >= 1 && n("transfers_received") <= 7, "{kv}");
    assert!(n("bytes_sent") > 0, "{kv}");
    assert_eq!(n("ipc_bytes_sent"), 0, "no GPU here: {kv}");
    assert!(kv["transfer_seconds"].as_f64().unwrap() > 0.0, "{kv}");
    for png in ["bench-serve-concurrency.png", "bench-serve-rate.png"] {
        let bytes = std::fs::read(plots.join(png)).unwrap_or_else(|e| panic!("{png}: {e}; stderr: {err}"));
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{png} is not a PNG");
    }
    std::fs::remove_dir_all(&plots).unwrap();
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

#[test]
fn a_rate_that_is_not_positive_is_refused_and_named() {
    for bad in ["0", "-1", "nan"] {
        let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(["bench-serve", &format!("--rates={bad}"), "--mode", "colocated"])
            .env("TANDEM_MODEL", model())
            .output()
            .expect("run tandem bench-serve");
        assert!(!out.status.success(), "--rates {bad} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--rates must be finite and > 0"), "--rates {bad}: {err}");
    }
}
