//! `tandem sim` checked against reality: the engine's step times measured by `tandem
//! bench-engine` (alone, before and after the cluster runs: their mean), plus the per-request
//! time outside the engines measured on the cluster with a prompt of a few tokens, drive a simulation of 1 prefill + 1 decode node; its TTFT and ITL
//! for ~160-token prompts are within 20 % of the real `tandem up` cluster serving them (one
//! client at a time, the same prompt and output lengths).

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

/// `tandem bench-engine` at `prompt_len`, as JSON.
fn bench_engine(prompt_len: usize) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["bench-engine", "--format", "json", "--batch", "1,2", "--decode-tokens", "32", "--runs", "3"])
        .args(["--prompt-len", &prompt_len.to_string(), "--model"])
        .arg(common::model())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The mean of two bench-engine runs, figure by figure (this machine's speed drifts: one run
/// before the cluster and one after bracket the cluster's measurement).
fn mean_profile(a: &serde_json::Value, b: &serde_json::Value) -> serde_json::Value {
    let mean = |x: &serde_json::Value, y: &serde_json::Value| (x.as_f64().unwrap() + y.as_f64().unwrap()) / 2.0;
    let mut decode = serde_json::Map::new();
    for (k, v) in a["decode_tok_s"].as_object().unwrap() {
        decode.insert(k.clone(), mean(v, &b["decode_tok_s"][k]).into());
    }
    serde_json::json!({
        "prefill_tok_s": mean(&a["prefill_tok_s"], &b["prefill_tok_s"]),
        "decode_tok_s": decode,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[test]
fn the_simulation_of_1p1d_with_measured_steps_is_within_20_percent_of_the_real_cluster() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let text = "Write about the tides, the moon and the harbour at night. ".repeat(12);
    let words = ["Sailor", "Keeper", "Pilot", "Fisher", "Diver", "Rower", "Captain", "Stoker", "Cook"];
    // The engine alone at this prompt length, before the cluster starts.
    let tok = tandem_engine::tokenizer::Tokenizer::from_gguf(
        &tandem_engine::loader::gguf::open(&common::model()).unwrap().0,
    )
    .unwrap();
    let before = bench_engine(tok.encode(&format!("{}: {text}", words[1])).len());
    let (grpc, http) = (free_addr(), free_addr());
    let mut up = Up::start_with(&grpc, &http, &["--no-sample"]);
    up.wait_for_line("Ctrl-C or SIGTERM stops the cluster", Duration::from_secs(240));

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
    let (mut ttft, mut itl, mut prompt_tokens) = (Vec::new(), Vec::new(), 0u64);
    for i in 0..9 {
        // A different first word each time: no prefix-cache hits (bench-engine has none).
        let prompt = format!("{}: {text}", words[i]);
        let body = serde_json::json!({
            "prompt": prompt, "max_tokens": OUTPUT, "ignore_eos": true, "stream": true,
            "stream_options": {"include_usage": true}
        })
        .to_string();
        let r = request(addr, "POST", "/v1/completions", &[], Some(&body), |_| {});
        assert_eq!(r.status, 200, "{}", r.body);
        prompt_tokens = usage_prompt_tokens(&r.events);
        let tokens = &r.event_at[..OUTPUT as usize];
        if i == 0 {
            continue; // warm-up
        }
        ttft.push(tokens[0].as_secs_f64());
        let gaps: Vec<f64> = tokens.windows(2).map(|w| (w[1] - w[0]).as_secs_f64()).collect();
        itl.push(median(gaps));
    }
    let (real_ttft, real_itl) = (median(ttft), median(itl));
    up.signal(libc::SIGTERM);
    let (code, _) = up.wait_exit(Duration::from_secs(120));
    assert_eq!(code, Some(0));

    // The engine's step times at this prompt length, measured alone, after the cluster too.
    let after = bench_engine(prompt_tokens as usize);
    let bench = mean_profile(&before, &after);
    let profile = up.run_dir.with_extension("profile.json");
    std::fs::write(&profile, bench.to_string()).unwrap();
    // A prompt of a token or two is one bandwidth-bound forward pass, as long as a decode step
    // at batch 1 (the weights are read once either way); the rest of its TTFT is overhead.
    let one_pass_s = 1.0 / bench["decode_tok_s"]["1"].as_f64().unwrap();
    assert!(tiny_tokens <= 2, "the overhead probe's prompts are {tiny_tokens} tokens");
    let overhead_ms = ((tiny_ttft - one_pass_s) * 1e3).max(0.0);

    // The simulation of the same workload: one request at a time (a low Poisson rate).
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["sim", "--format", "json", "--gpus", "2", "--tp", "1", "--prefill-instances", "1"])
        .args(["--rate", "0.05", "--duration-secs", "3600", "--spread", "0", "--profile"])
        .arg(&profile)
        .args(["--prompt-tokens", &prompt_tokens.to_string(), "--output-tokens", &OUTPUT.to_string()])
        .args(["--overhead-ms", &format!("{overhead_ms:.1}")])
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&profile);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let sim: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let d = &sim["disaggregated"];
    let (sim_ttft, sim_itl) = (d["ttft_s"]["p50"].as_f64().unwrap(), d["itl_s"]["p50"].as_f64().unwrap());
    eprintln!(
        "overhead {overhead_ms:.1} ms (TTFT of {tiny_tokens}-token prompts {:.1} ms); prompt {prompt_tokens} tokens, output {OUTPUT}: TTFT real {:.1} ms, simulated {:.1} ms; ITL real {:.1} ms, simulated {:.1} ms",
        tiny_ttft * 1e3,
        real_ttft * 1e3,
        sim_ttft * 1e3,
        real_itl * 1e3,
        sim_itl * 1e3
    );
    let off = |sim: f64, real: f64| (sim - real).abs() / real;
    assert!(off(sim_ttft, real_ttft) <= 0.20, "TTFT: simulated {sim_ttft} vs real {real_ttft}");
    assert!(off(sim_itl, real_itl) <= 0.20, "ITL: simulated {sim_itl} vs real {real_itl}");
}
