//! The drills' clients: real OpenAI-API requests to the router, paced in an open loop, each
//! outcome recorded whole (the text, when it ended, the longest silence, retries).
//!
//! The client behaves like the OpenAI SDKs: a request whose connection fails, or whose answer is
//! cut off before its end, or that gets a 429/503, is sent again (at most [`MAX_ATTEMPTS`]
//! times, backing off); every retry is counted, so a drill that passes only thanks to retries
//! shows it. Any other error status is a failure at once.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Attempts per request (the first and the retries).
pub const MAX_ATTEMPTS: u32 = 6;
/// No request may take longer than this, retries included.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(180);

/// One distinct request of a workload.
#[derive(Clone, Debug)]
pub struct RequestSpec {
    /// The prompt.
    pub prompt: String,
    /// Streamed (SSE) or one JSON answer.
    pub stream: bool,
    /// Tokens to generate (`ignore_eos`: always exactly this many).
    pub max_tokens: u32,
}

/// What happened to one request.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// Which distinct request ([`Workload::distinct`]) this was.
    pub spec: usize,
    /// When it was sent, since the drill's load started.
    pub sent_at: Duration,
    /// When it ended (answered, failed or hung up), since the load started.
    pub done_at: Duration,
    /// The generated text, or the error that ended the request.
    pub result: Result<String, String>,
    /// The client hung up on purpose (the text is what arrived before).
    pub cancelled: bool,
    /// The longest time the client waited for the next bytes (the first included).
    pub longest_stall: Duration,
    /// Retries after a lost connection, a cut answer or a 429/503.
    pub retries: u32,
    /// Why the first retries were needed (at most two kept).
    pub retry_reasons: Vec<String>,
}

/// Shared counters the drill's trigger watches while the load runs.
#[derive(Debug, Default)]
pub struct Progress {
    /// Streamed events received, all requests together.
    pub events: AtomicU64,
    /// Requests in flight.
    pub in_flight: AtomicUsize,
}

/// A drill's load: `total` requests cycling through `distinct`, started `rate_per_s` apart.
#[derive(Clone, Debug)]
pub struct Workload {
    /// The distinct requests (the reference run answers each once).
    pub distinct: Vec<RequestSpec>,
    /// Requests sent in the drill.
    pub total: usize,
    /// Requests started per second.
    pub rate_per_s: f64,
    /// Requests (by index) whose client hangs up after this many streamed events.
    pub hang_up: Option<HangUp>,
}

/// Which requests hang up (by index), and after how many streamed events.
pub type HangUp = (fn(usize) -> bool, u64);

impl Workload {
    /// Short and long prompts, streamed and not, `max_tokens` each: eight distinct requests.
    pub fn mixed(total: usize, rate_per_s: f64, max_tokens: u32) -> Workload {
        let long = "The harbour at night: lamps on the water, ropes creaking, the tide coming in \
                    over the stones while the fishing boats wait for morning. "
            .repeat(5);
        let mut distinct = Vec::new();
        for (i, topic) in ["rivers", "lighthouses", "bridges", "glaciers"]
            .iter()
            .enumerate()
        {
            let prompt = if i % 2 == 0 {
                format!("Write three sentences about {topic}.")
            } else {
                format!("{long}Now write about {topic}.")
            };
            for stream in [true, false] {
                distinct.push(RequestSpec {
                    prompt: prompt.clone(),
                    stream,
                    max_tokens,
                });
            }
        }
        Workload {
            distinct,
            total,
            rate_per_s,
            hang_up: None,
        }
    }

    /// The spec index of request `i`.
    pub fn spec_of(&self, i: usize) -> usize {
        i % self.distinct.len()
    }

    /// Runs every distinct request once, two at a time: the fault-free answers.
    pub async fn reference(&self, addr: SocketAddr) -> Result<Vec<String>, (usize, String)> {
        let client = client();
        let progress = Arc::new(Progress::default());
        let mut out = vec![String::new(); self.distinct.len()];
        for pair in (0..self.distinct.len()).collect::<Vec<_>>().chunks(2) {
            let mut tasks = Vec::new();
            for &i in pair {
                let (client, spec, progress) =
                    (client.clone(), self.distinct[i].clone(), progress.clone());
                tasks.push(tokio::spawn(async move {
                    send(&client, addr, &spec, &progress, None, Instant::now()).await
                }));
            }
            for (task, &i) in tasks.into_iter().zip(pair) {
                let o = task.await.map_err(|e| (i, e.to_string()))?;
                if o.retries > 0 {
                    return Err((
                        i,
                        format!("needed {} retries on a healthy cluster", o.retries),
                    ));
                }
                out[i] = o.result.map_err(|e| (i, e))?;
            }
        }
        Ok(out)
    }

    /// Sends the whole load, request `i` at `i / rate_per_s` seconds, and waits for every answer.
    pub async fn run(&self, addr: SocketAddr, progress: Arc<Progress>) -> Vec<Outcome> {
        let client = client();
        let t0 = Instant::now();
        let mut tasks = Vec::with_capacity(self.total);
        for i in 0..self.total {
            let at = t0 + Duration::from_secs_f64(i as f64 / self.rate_per_s);
            tokio::time::sleep_until(at.into()).await;
            let spec_i = self.spec_of(i);
            let spec = self.distinct[spec_i].clone();
            let hang_up = self
                .hang_up
                .and_then(|(pick, after)| (spec.stream && pick(i)).then_some(after));
            let (client, progress) = (client.clone(), progress.clone());
            tasks.push(tokio::spawn(async move {
                let mut o = send(&client, addr, &spec, &progress, hang_up, t0).await;
                o.spec = spec_i;
                o
            }));
        }
        let mut out = Vec::with_capacity(tasks.len());
        for (i, t) in tasks.into_iter().enumerate() {
            out.push(t.await.unwrap_or_else(|e| Outcome {
                spec: self.spec_of(i),
                sent_at: Duration::ZERO,
                done_at: t0.elapsed(),
                result: Err(format!("client task failed: {e}")),
                cancelled: false,
                longest_stall: Duration::ZERO,
                retries: 0,
                retry_reasons: Vec::new(),
            }));
        }
        out
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(5))
        .pool_max_idle_per_host(0)
        .build()
        .expect("an HTTP client without TLS always builds")
}

/// How one attempt ended.
enum Attempt {
    Done(String),
    HungUp(String),
    /// Worth sending again (connection lost, answer cut, 429/503).
    Retry(String),
    Failed(String),
}

/// Sends `spec` (retrying as the module says) and records its outcome.
async fn send(
    client: &reqwest::Client,
    addr: SocketAddr,
    spec: &RequestSpec,
    progress: &Progress,
    hang_up_after: Option<u64>,
    t0: Instant,
) -> Outcome {
    progress.in_flight.fetch_add(1, Ordering::Relaxed);
    let sent_at = t0.elapsed();
    let deadline = Instant::now() + REQUEST_DEADLINE;
    let mut stall = Duration::ZERO;
    let mut retries = 0;
    let mut retry_reasons = Vec::new();
    let mut backoff = Duration::from_millis(250);
    let (result, cancelled) = loop {
        let attempt = tokio::time::timeout_at(
            deadline.into(),
            attempt(client, addr, spec, progress, hang_up_after, &mut stall),
        )
        .await
        .unwrap_or_else(|_| Attempt::Failed(format!("no answer within {REQUEST_DEADLINE:?}")));
        match attempt {
            Attempt::Done(text) => break (Ok(text), false),
            Attempt::HungUp(text) => break (Ok(text), true),
            Attempt::Failed(e) => break (Err(e), false),
            Attempt::Retry(e)
                if retries + 1 >= MAX_ATTEMPTS || Instant::now() + backoff > deadline =>
            {
                break (Err(format!("{e} (after {retries} retries)")), false);
            }
            Attempt::Retry(e) => {
                retries += 1;
                if retry_reasons.len() < 2 {
                    retry_reasons.push(e);
                }
                // The wait between attempts is the client's choice, not a stall of the service.
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(4));
            }
        }
    };
    progress.in_flight.fetch_sub(1, Ordering::Relaxed);
    Outcome {
        spec: 0,
        sent_at,
        done_at: t0.elapsed(),
        result,
        cancelled,
        longest_stall: stall,
        retries,
        retry_reasons,
    }
}

async fn attempt(
    client: &reqwest::Client,
    addr: SocketAddr,
    spec: &RequestSpec,
    progress: &Progress,
    hang_up_after: Option<u64>,
    stall: &mut Duration,
) -> Attempt {
    let body = serde_json::json!({
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "ignore_eos": true,
        "stream": spec.stream,
    });
    let mut last = Instant::now();
    let resp = match client
        .post(format!("http://{addr}/v1/completions"))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
    {
        Ok(r) => r,
        Err(e) => return Attempt::Retry(format!("sending: {e}")),
    };
    let status = resp.status().as_u16();
    let mut resp = resp;
    let mut buf = Vec::new();
    let mut text = String::new();
    let mut events = 0u64;
    loop {
        let chunk = match resp.chunk().await {
            Ok(Some(c)) => c,
            Ok(None) => break,
            Err(e) if status == 200 => return Attempt::Retry(format!("answer cut off: {e}")),
            Err(e) => return Attempt::Failed(format!("HTTP {status}, body unreadable: {e}")),
        };
        *stall = (*stall).max(last.elapsed());
        last = Instant::now();
        buf.extend_from_slice(&chunk);
        if status != 200 || !spec.stream {
            continue;
        }
        // Server-sent events: `data: {...}\n\n` each.
        while let Some(end) = find(&buf, b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let event = String::from_utf8_lossy(&event);
            let Some(data) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                return Attempt::Done(text);
            }
            let v: serde_json::Value = match serde_json::from_str(data) {
                Ok(v) => v,
                Err(e) => return Attempt::Failed(format!("unparsable event {data:?}: {e}")),
            };
            if let Some(err) = v.get("error") {
                return Attempt::Failed(format!("error event: {err}"));
            }
            if let Some(t) = v["choices"][0]["text"].as_str() {
                text.push_str(t);
                events += 1;
                progress.events.fetch_add(1, Ordering::Relaxed);
                if hang_up_after.is_some_and(|n| events >= n) {
                    return Attempt::HungUp(text);
                }
            }
        }
    }
    let body = String::from_utf8_lossy(&buf).into_owned();
    match status {
        200 if spec.stream => {
            Attempt::Retry(format!("stream ended without [DONE] after {events} events"))
        }
        200 => match serde_json::from_str::<serde_json::Value>(&body) {
            Ok(v) => match v["choices"][0]["text"].as_str() {
                Some(t) => Attempt::Done(t.to_string()),
                None => Attempt::Failed(format!("answer without choices[0].text: {body}")),
            },
            Err(e) => Attempt::Failed(format!("unparsable answer ({e}): {body}")),
        },
        429 | 503 => Attempt::Retry(format!("HTTP {status}: {body}")),
        _ => Attempt::Failed(format!("HTTP {status}: {body}")),
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}
