//! Offering load: the same requests, closed loop (`c` clients) or open loop (Poisson arrivals),
//! to the disaggregated cluster over the router's gRPC ingress, or to a colocated engine in this
//! process. Every request runs to its `max_tokens` (EOS ignored); one that fails fails the level.
//!
//! Open loop sends each request at its arrival instant whether or not earlier ones finished, so
//! in-flight requests are bounded only by the level's request count (`--requests`), which is the
//! point: an overloaded server shows it in TTFT, not in a throttled client.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use tandem_engine::{Priority, Request, SamplingParams};
use tandem_proto::v1::inference_client::InferenceClient;
use tandem_proto::v1::{GenerateRequest, TokenIds, generate_request, generate_response};
use tonic::transport::Channel;

use super::stats::{Load, Sample, poisson_arrivals};

/// Seed of a level's Poisson arrivals (distinct per rate, the same every run).
fn arrival_seed(rate_req_s: f64) -> u64 {
    0xA221_7A15 ^ rate_req_s.to_bits()
}

/// A benchmark's request over the gRPC ingress: the prompt as token ids, exactly `max_tokens`
/// generated (EOS ignored), default (greedy) sampling otherwise.
pub(crate) fn fixed_length_request(ids: Vec<u32>, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        input: Some(generate_request::Input::TokenIds(TokenIds { ids })),
        sampling: Some(tandem_proto::v1::SamplingParams { max_tokens, ignore_eos: true, ..Default::default() }),
        ..Default::default()
    }
}

/// One streamed request through the router; times from `arrival`.
async fn one_request(
    client: &mut InferenceClient<Channel>,
    ids: Vec<u32>,
    max_tokens: u32,
    arrival: Instant,
) -> anyhow::Result<Sample> {
    let req = fixed_length_request(ids, max_tokens);
    let mut stream = client.generate(req).await?.into_inner();
    let (mut ttft, mut tokens) = (None, 0);
    while let Some(m) = stream.message().await? {
        if let Some(generate_response::Event::Delta(d)) = m.event
            && !d.token_ids.is_empty()
        {
            ttft.get_or_insert(arrival.elapsed());
            tokens += d.token_ids.len();
        }
    }
    Ok(Sample { ttft: ttft.unwrap_or_default(), e2e: arrival.elapsed(), tokens })
}

/// Runs `prompts` through the cluster at `grpc` under `load`; returns every request's sample and
/// the level's wall time. `bar` (if any) advances once per finished request.
pub async fn disaggregated(
    grpc: SocketAddr,
    load: Load,
    prompts: Vec<Vec<u32>>,
    max_tokens: u32,
    bar: Option<&ProgressBar>,
) -> anyhow::Result<(Vec<Sample>, Duration)> {
    let channel = Channel::from_shared(format!("http://{grpc}"))?.connect().await?;
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    match load {
        Load::Concurrency(c) => {
            let queue = Arc::new(Mutex::new(prompts));
            for _ in 0..c {
                let (queue, bar) = (queue.clone(), bar.cloned());
                let mut client = InferenceClient::new(channel.clone());
                tasks.push(tokio::spawn(async move {
                    let mut out = Vec::new();
                    loop {
                        let next = queue.lock().expect("queue lock").pop();
                        let Some(ids) = next else { break };
                        out.push(one_request(&mut client, ids, max_tokens, Instant::now()).await?);
                        bar.as_ref().inspect(|b| b.inc(1));
                    }
                    anyhow::Ok(out)
                }));
            }
        }
        Load::Rate(r) => {
            let arrivals = poisson_arrivals(prompts.len(), r, arrival_seed(r));
            for (ids, at) in prompts.into_iter().zip(arrivals) {
                let bar = bar.cloned();
                let mut client = InferenceClient::new(channel.clone());
                tasks.push(tokio::spawn(async move {
                    let arrival = t0 + at;
                    tokio::time::sleep_until(arrival.into()).await;
                    let s = one_request(&mut client, ids, max_tokens, arrival).await?;
                    bar.as_ref().inspect(|b| b.inc(1));
                    anyhow::Ok(vec![s])
                }));
            }
        }
    }
    let mut samples = Vec::new();
    for t in tasks {
        samples.extend(t.await??);
    }
    Ok((samples, t0.elapsed()))
}

/// Runs `prompts` through `engine` in this thread under `load`; request ids start at `id0`.
pub fn colocated(
    engine: &mut tandem_engine::Engine,
    load: Load,
    mut prompts: Vec<Vec<u32>>,
    max_tokens: usize,
    id0: u64,
    bar: Option<&ProgressBar>,
) -> anyhow::Result<(Vec<Sample>, Duration)> {
    // Arrival offsets in pop order (prompts are taken from the back).
    let mut arrivals: Vec<Duration> = match load {
        Load::Concurrency(_) => Vec::new(),
        Load::Rate(r) => {
            let mut a = poisson_arrivals(prompts.len(), r, arrival_seed(r));
            a.reverse();
            a
        }
    };
    // id -> (arrival, ttft, tokens)
    let mut live: HashMap<u64, (Instant, Option<Duration>, usize)> = HashMap::new();
    let mut samples = Vec::new();
    let mut next_id = id0;
    let t0 = Instant::now();
    loop {
        loop {
            let arrival = match load {
                Load::Concurrency(c) if live.len() < c => Instant::now(),
                Load::Concurrency(_) => break,
                Load::Rate(_) => match arrivals.last() {
                    Some(&at) if t0 + at <= Instant::now() => t0 + at,
                    _ => break,
                },
            };
            let Some(p) = prompts.pop() else { break };
            arrivals.pop();
            let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) };
            engine.add_request(
                Request { id: next_id, prompt: p, params, priority: Priority::Interactive },
                arrival,
            )?;
            live.insert(next_id, (arrival, None, 0));
            next_id += 1;
        }
        if live.is_empty() {
            match arrivals.last() {
                // Idle until the next Poisson arrival.
                Some(&at) => {
                    std::thread::sleep((t0 + at).saturating_duration_since(Instant::now()));
                    continue;
                }
                None => break,
            }
        }
        for o in engine.step()? {
            let e = live.get_mut(&o.request_id).expect("live request");
            e.1.get_or_insert(e.0.elapsed());
            e.2 += 1;
            if o.finished.is_some() {
                let (start, ttft, tokens) = live.remove(&o.request_id).expect("live request");
                samples.push(Sample { ttft: ttft.unwrap_or_default(), e2e: start.elapsed(), tokens });
                bar.inspect(|b| b.inc(1));
            }
        }
    }
    Ok((samples, t0.elapsed()))
}
