//! `tandem sim` checked against reality: the engine's step times measured by `tandem
//! bench-engine`, plus the per-request time outside the engines (measured on the cluster with
//! prompts of a token or two), drive a simulation of 1 prefill + 1 decode node; its TTFT and
//! ITL for ~160-token prompts are within 20 % of the real `tandem up` cluster serving them (one
//! client at a time, the same prompt and output lengths).
//!
//! This shared machine's speed drifts by more than the tolerance within a minute, so the
//! comparison is paired: in each round the engine is measured alone (the cluster idle) and then
//! two requests are served; each round's simulation is compared with that round's requests, and
//! the median of the rounds' ratios is asserted.

mod common;

use std::process::Command;
use std::time::Duration;

use common::client::request;
use common::up::{SERIAL, Up, free_addr};

const OUTPUT: u32 = 24;

fn usage_prompt_tokens(events: &[String]) -> u64 {
    events
        .iter()
        .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
        .find_map(|v| v["usage"]["prompt_tokens"].as_u64())
        .expect("a usage event")
}

/// `tandem bench-engine` at `prompt_len` (prefill) and batch-1 decode from a prompt that long
/// for `OUTPUT` tokens (the cluster's requests' shape), as JSON.
fn bench_engine(prompt_len: usize) -> serde_json::Value {
    let len = prompt_len.to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args([
            "bench-engine",
            "--format",
            "json",
            "--batch",
            "1",
            "--runs",
            "3",
        ])
        .args([
            "--decode-tokens",
            &OUTPUT.to_string(),
            "--decode-prompt-len",
            &len,
        ])
        .args(["--prompt-len", &len, "--model"])
        .arg(common::model())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One round: the engine alone, then the cluster's requests (TTFT and median ITL of each, s).
struct Round {
    profile: serde_json::Value,
    ttft: Vec<f64>,
    itl: Vec<f64>,
}

/// `tandem sim` of one request at a time (a low Poisson rate) on 1 prefill + 1 decode node with
/// the measured `profile`: its (TTFT, ITL) medians, s.
fn simulate(
    profile: &serde_json::Value,
    dir: &std::path::Path,
    prompt_tokens: u64,
    overhead_ms: f64,
) -> (f64, f64) {
    let path = dir.with_extension("profile.json");
    std::fs::write(&path, profile.to_string()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args([
            "sim",
            "--format",
            "json",
            "--gpus",
            "2",
            "--tp",
            "1",
            "--prefill-instances",
            "1",
        ])
        .args([
            "--rate",
            "0.05",
            "--duration-secs",
            "3600",
            "--spread",
            "0",
            "--profile",
        ])
        .arg(&path)
        .args([
            "--prompt-tokens",
            &prompt_tokens.to_string(),
            "--output-tokens",
            &OUTPUT.to_string(),
        ])
        .args(["--overhead-ms", &format!("{overhead_ms:.1}")])
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&path);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let sim: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let d = &sim["disaggregated"];
    (
        d["ttft_s"]["p50"].as_f64().unwrap(),
        d["itl_s"]["p50"].as_f64().unwrap(),
    )
}

#[test]
fn the_simulation_of_1p1d_with_measured_steps_is_within_20_percent_of_the_real_cluster() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let text = "Write about the tides, the moon and the harbour at night. ".repeat(12);
    // The warm-up request's word, then two per round (five rounds).
    let words = [
        "Sailor", "Keeper", "Pilot", "Fisher", "Diver", "Rower", "Captain", "Stoker", "Cook",
        "Miller", "Weaver",
    ];
    let tok = tandem_engine::loader::gguf::tokenizer_of(&common::model()).unwrap();
    let prompt_len = tok.encode(&format!("{}: {text}", words[1])).len();
    let (grpc, http) = (free_addr(), free_addr());
    let mut up = Up::start_with(&grpc, &http, &["--no-sample"]);
    up.wait_for_line(
        "Ctrl-C or SIGTERM stops the cluster",
        Duration::from_secs(240),
    );

    // The real cluster: sequential streamed requests.
    let addr = http.parse().unwrap();
    // The overhead: TTFT of prompts of a few tokens (ingress, tokenization, routing, hops).
    let (mut tiny_ttft, mut tiny_tokens) = (Vec::new(), 0u64);
    for (i, w) in ["Hi", "Hey", "Yo", "Ho", "Ha", "He"].iter().enumerate() {
        let body = serde_json::json!({
            "prompt": w, "max_tokens": 2, "ignore_eos": true, "stream": true,
            "stream_options": {"include_usage": true}
        })
        .to_string();
        let r = request(addr, "POST", "/v1/completions", &[], Some(&body), |_| {});
        assert_eq!(r.status, 200, "{}", r.body);
        tiny_tokens = usage_prompt_tokens(&r.events);
        if i > 0 {
            tiny_ttft.push(r.event_at[0].as_secs_f64());
        }
    }
    let tiny_ttft = median(tiny_ttft);
    // The warm-up request, then rounds: the engine measured alone (the cluster idle), then two
    // requests on the cluster.
    let (mut rounds, mut prompt_tokens) = (Vec::<Round>::new(), 0u64);
    for (i, word) in words.iter().enumerate() {
        if i % 2 == 1 {
            rounds.push(Round {
                profile: bench_engine(prompt_len),
                ttft: Vec::new(),
                itl: Vec::new(),
            });
        }
        // A different first word each time: no prefix-cache hits (bench-engine has none).
        let prompt = format!("{word}: {text}");
        let body = serde_json::json!({
            "prompt": prompt, "max_tokens": OUTPUT, "ignore_eos": true, "stream": true,
            "stream_options": {"include_usage": true}
        })
        .to_string();
        let r = request(addr, "POST", "/v1/completions", &[], Some(&body), |_| {});
        assert_eq!(r.status, 200, "{}", r.body);
        prompt_tokens = usage_prompt_tokens(&r.events);
        let tokens = &r.event_at[..OUTPUT as usize];
        let Some(round) = rounds.last_mut() else {
            continue; // warm-up
        };
        round.ttft.push(tokens[0].as_secs_f64());
        let gaps: Vec<f64> = tokens
            .windows(2)
            .map(|w| (w[1] - w[0]).as_secs_f64())
            .collect();
        round.itl.push(median(gaps));
    }
    up.signal(libc::SIGTERM);
    let (code, _) = up.wait_exit(Duration::from_secs(120));
    assert_eq!(code, Some(0));

    // A prompt of a token or two is one bandwidth-bound forward pass, as long as a decode step
    // at batch 1 (the weights are read once either way); the rest of its TTFT is overhead.
    let batch1 = |r: &Round| r.profile["decode_tok_s"]["1"].as_f64().unwrap();
    let one_pass_s = 1.0 / median(rounds.iter().map(batch1).collect());
    assert!(
        tiny_tokens <= 2,
        "the overhead probe's prompts are {tiny_tokens} tokens"
    );
    let overhead_ms = ((tiny_ttft - one_pass_s) * 1e3).max(0.0);
    eprintln!(
        "overhead {overhead_ms:.1} ms (TTFT of {tiny_tokens}-token prompts {:.1} ms)",
        tiny_ttft * 1e3
    );

    let (mut ttft_ratio, mut itl_ratio) = (Vec::new(), Vec::new());
    for r in &rounds {
        let (sim_ttft, sim_itl) = simulate(&r.profile, &up.run_dir, prompt_tokens, overhead_ms);
        let real_ttft = r.ttft.iter().sum::<f64>() / r.ttft.len() as f64;
        let real_itl = r.itl.iter().sum::<f64>() / r.itl.len() as f64;
        eprintln!(
            "round: engine prefill {:.0} tok/s, decode {:.1} tok/s; prompt {prompt_tokens} tokens, output {OUTPUT}: TTFT real {:.1} ms, simulated {:.1} ms; ITL real {:.1} ms, simulated {:.1} ms",
            r.profile["prefill_tok_s"].as_f64().unwrap(),
            batch1(r),
            real_ttft * 1e3,
            sim_ttft * 1e3,
            real_itl * 1e3,
            sim_itl * 1e3
        );
        ttft_ratio.push(sim_ttft / real_ttft);
        itl_ratio.push(sim_itl / real_itl);
    }
    let (ttft_ratio, itl_ratio) = (median(ttft_ratio), median(itl_ratio));
    eprintln!("median simulated/real: TTFT {ttft_ratio:.3}, ITL {itl_ratio:.3}");
    assert!(
        (ttft_ratio - 1.0).abs() <= 0.20,
        "TTFT: simulated/real {ttft_ratio:.3}"
    );
    assert!(
        (itl_ratio - 1.0).abs() <= 0.20,
        "ITL: simulated/real {itl_ratio:.3}"
    );
}
