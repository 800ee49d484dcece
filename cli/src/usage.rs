//! `tandem usage` and `tandem cost`: what each API key used, and what it cost, from a
//! router's `/v1/usage` (the ledger every router adds to; see the router's `usage` module).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use serde_json::Value;

/// Flags of `tandem usage` and `tandem cost`.
#[derive(Args, Debug, Clone)]
pub struct UsageArgs {
    /// The router's HTTP address.
    #[arg(long, env = "TANDEM_ROUTER_HTTP", default_value = "127.0.0.1:8000")]
    pub router: String,
    /// An admin API key (or the key whose own usage to read).
    #[arg(long, env = "TANDEM_API_KEY")]
    pub api_key: Option<String>,
    /// One key id (default: every key; needs an admin key).
    pub key_id: Option<String>,
    /// Print the router's JSON as is.
    #[arg(long)]
    pub json: bool,
}

fn get(args: &UsageArgs) -> anyhow::Result<Value> {
    let host = args
        .router
        .trim_start_matches("http://")
        .trim_end_matches('/');
    let path = match &args.key_id {
        Some(id) => format!("/v1/usage/{id}"),
        None => "/v1/usage".to_string(),
    };
    let mut s = TcpStream::connect(host).with_context(|| format!("connecting to the router at {host}"))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let auth = args
        .api_key
        .as_ref()
        .map(|k| format!("Authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Connection: close\r\n\r\n")?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let json: Value = serde_json::from_str(body.trim())
        .with_context(|| format!("the router answered {status} with: {body}"))?;
    if status != 200 {
        bail!(
            "{} {path} answered {status}: {}",
            args.router,
            json["error"]["message"].as_str().unwrap_or(body)
        );
    }
    Ok(json)
}

fn rows(v: &Value, key_id: &Option<String>) -> Vec<(String, Value)> {
    match key_id {
        Some(id) => vec![(id.clone(), v.clone())],
        None => v["keys"]
            .as_object()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default(),
    }
}

/// Runs `tandem usage`: a table of tokens and node-seconds per key.
pub fn usage(args: &UsageArgs) -> anyhow::Result<String> {
    let v = get(args)?;
    if args.json {
        return Ok(serde_json::to_string_pretty(&v)?);
    }
    let mut out = format!(
        "{:<20} {:>9} {:>12} {:>12} {:>12} {:>12} {:>12}\n",
        "key", "requests", "input", "cached", "output", "prefill s", "decode s"
    );
    for (k, t) in rows(&v, &args.key_id) {
        out.push_str(&format!(
            "{:<20} {:>9} {:>12} {:>12} {:>12} {:>12.3} {:>12.3}\n",
            k,
            t["requests"],
            t["input_tokens"],
            t["cached_input_tokens"],
            t["output_tokens"],
            t["prefill_node_seconds"].as_f64().unwrap_or(0.0),
            t["decode_node_seconds"].as_f64().unwrap_or(0.0),
        ));
    }
    Ok(out.trim_end().to_string())
}

fn money(v: &Value) -> String {
    v.as_f64().map_or("-".into(), |x| format!("{x:.4}"))
}

/// Runs `tandem cost`: dollars per key and per pool, per million tokens of each kind.
pub fn cost(args: &UsageArgs) -> anyhow::Result<String> {
    let v = get(args)?;
    if args.json {
        return Ok(serde_json::to_string_pretty(&v)?);
    }
    let mut out = format!(
        "{:<20} {:>10} {:>14} {:>14} {:>14}\n",
        "key", "$ total", "$/1M input", "$/1M cached", "$/1M output"
    );
    for (k, t) in rows(&v, &args.key_id) {
        let c = &t["cost"];
        out.push_str(&format!(
            "{:<20} {:>10} {:>14} {:>14} {:>14}\n",
            k,
            money(&c["usd_total"]),
            money(&c["usd_per_million_input"]),
            money(&c["usd_per_million_cached_input"]),
            money(&c["usd_per_million_output"]),
        ));
    }
    if let Some(p) = v.get("pools") {
        out.push_str(&format!(
            "\npool      node-seconds         $    $/1M tokens\nprefill   {:>12.3} {:>9} {:>14}  (input)\ndecode    {:>12.3} {:>9} {:>14}  (output)\n",
            p["prefill"]["node_seconds"].as_f64().unwrap_or(0.0),
            money(&p["prefill"]["usd"]),
            money(&p["prefill"]["usd_per_million_input"]),
            p["decode"]["node_seconds"].as_f64().unwrap_or(0.0),
            money(&p["decode"]["usd"]),
            money(&p["decode"]["usd_per_million_output"]),
        ));
    }
    Ok(out.trim_end().to_string())
}
