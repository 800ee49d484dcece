//! `tandem sim` checked against reality: the engine's step times measured by `tandem
//! bench-engine`, plus the per-request time outside the engines measured on the cluster with
//! a prompt of a few tokens, drive a simulation of 1 prefill + 1 decode node; its TTFT and ITL
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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[test]
fn the_simulation_of_1p1d_with_measured_steps_is_within_20_percent_of_the_real_cluster() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
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
        let prompt = format!(
            "{}: {}",
            ["Sailor", "Keeper", "Pilot", "Fisher", "Diver", "Rower", "Captain", "Stoker", "Cook"][i],
            "Write about the tides, the moon and the harbour at night. ".repeat(12)
        );
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

    // The engine's step times at this prompt length, measured alone.
    let model = common::model();
    let bench = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["bench-engine", "--format", "json", "--batch", "1,2", "--decode-tokens", "32", "--runs", "3"])
        .args(["--prompt-len", &prompt_tokens.to_string(), "--model"])
        .arg(&model)
        .output()
        .unwrap();
    assert!(bench.status.success(), "{}", String::from_utf8_lossy(&bench.stderr));
    let profile = up.run_dir.with_extension("profile.json");
    std::fs::write(&profile, &bench.stdout).unwrap();
    let prefill_tok_s = serde_json::from_slice::<serde_json::Value>(&bench.stdout).unwrap()["prefill_tok_s"]
        .as_f64()
        .unwrap();
    let overhead_ms = ((tiny_ttft - tiny_tokens as f64 / prefill_tok_s) * 1e3).max(0.0);

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
