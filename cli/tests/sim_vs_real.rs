//! `tandem bench-sim` runs end to end: a real 1P+1D cluster with every prompt through the prefill
//! node, the engine profiled, the levels served and simulated, a report per round and level.
//!
//! Only what does not depend on this machine's speed is asserted: the benchmark's shape, that
//! each figure was measured (finite, positive), that the calibration saw the predicted path (KV
//! pushes), and that bad flags are refused before anything starts. How close the simulation
//! comes is the benchmark's figure (`tandem bench-sim`, bench/RESULTS.md), never a pass/fail
//! here: a timing ratio failed a clean-clone run of the suite once on a busy machine.

use std::process::Command;

use crate::common;
use common::up::SERIAL;

fn bench_sim(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tandem"))
        .arg("bench-sim")
        .args(args)
        .env("TANDEM_MODEL", common::model())
        .output()
        .unwrap()
}

#[test]
fn bench_sim_measures_every_level_on_the_predicted_path_and_reports_the_ratios() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let out = bench_sim(&[
        "--rounds", "1", "--concurrency", "1,2", "--requests-per-client", "1", "--max-tokens", "8",
        "--prompt-len", "40", "--json",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {stderr}"));
    let positive = |v: &serde_json::Value, what: &str| {
        let x = v.as_f64().unwrap_or_else(|| panic!("{what} missing in {r}"));
        assert!(x.is_finite() && x > 0.0, "{what} = {x}: {r}");
    };
    let rounds = r["rounds"].as_array().unwrap();
    assert_eq!(rounds.len(), 1, "{r}");
    let (cal, points) = (&rounds[0][0], rounds[0][1].as_array().unwrap());
    // The calibration went through the prefill node: its two-token prompts were pushed.
    positive(&cal["transfer_ms"], "the calibration's KV push");
    positive(&cal["prefill_tok_s"], "the engine's prefill rate");
    positive(&cal["decode_tok_s_batch1"], "the engine's decode rate");
    assert!(cal["overhead_ms"].as_f64().is_some_and(|o| o >= 0.0), "{r}");
    let levels: Vec<u64> = points.iter().map(|p| p["concurrency"].as_u64().unwrap()).collect();
    assert_eq!(levels, [1, 2], "{r}");
    for p in points {
        for f in ["real_ttft_ms", "sim_ttft_ms", "real_itl_ms", "sim_itl_ms"] {
            positive(&p[f], f);
        }
    }
    let summary = r["summary"].as_array().unwrap();
    assert_eq!(summary.len(), 2, "{r}");
    for s in summary {
        positive(&s["ttft_ratio"], "ttft_ratio");
        positive(&s["itl_ratio"], "itl_ratio");
        assert!(s["within_tolerance"].is_boolean(), "{r}");
    }
    assert!(stderr.contains("stopping etcd"), "the cluster was stopped: {stderr}");
}

#[test]
fn bench_sim_refuses_bad_flags_before_starting_anything() {
    for (args, says) in [
        (&["--concurrency", "0"][..], "--concurrency"),
        (&["--rounds", "0"][..], "--rounds"),
        (&["--prompt-len", "2"][..], "--prompt-len"),
        (&["--tolerance=0"][..], "--tolerance"),
    ] {
        let out = bench_sim(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} passed");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(!stderr.contains("starting the 1P+1D cluster"), "{args:?} started a cluster: {stderr}");
    }
}
