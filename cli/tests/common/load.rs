//! Steady client load for tests: `clients` threads sending completions back to back until
//! stopped, counting every answer (a request that fails, panics or is cut short counts as
//! failed, with why) and recording when each finished and how long it took.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::client::request;

/// One finished request.
#[derive(Clone, Debug)]
pub struct Sample {
    /// When it finished, since the load started.
    pub at: Duration,
    /// How long it took.
    pub latency: Duration,
    /// Whether it completed with every token asked for.
    pub ok: bool,
}

pub struct Load {
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<Sample>>>,
    errors: Arc<Mutex<Vec<String>>>,
    threads: Vec<JoinHandle<()>>,
}

impl Load {
    /// Starts `clients` clients sending `prompt(client)` for `max_tokens` tokens
    /// (`ignore_eos`, so a complete answer has exactly that many).
    pub fn start(
        addr: SocketAddr,
        clients: usize,
        prompt: impl Fn(usize) -> String,
        max_tokens: u32,
    ) -> Load {
        let (stop, samples, errors) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(Mutex::new(Vec::new())),
            Arc::new(Mutex::new(Vec::new())),
        );
        let t0 = Instant::now();
        let threads = (0..clients)
            .map(|k| {
                let body = serde_json::json!({
                    "prompt": prompt(k), "max_tokens": max_tokens, "ignore_eos": true
                })
                .to_string();
                let (stop, samples, errors) = (stop.clone(), samples.clone(), errors.clone());
                let want = format!("\"completion_tokens\":{max_tokens}");
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let t = Instant::now();
                        let reply = std::panic::catch_unwind(|| {
                            request(addr, "POST", "/v1/completions", &[], Some(&body), |_| {})
                        });
                        let ok = match &reply {
                            Ok(r) if r.status == 200 && r.body.contains(&want) => true,
                            Ok(r) => {
                                errors.lock().unwrap().push(format!("{} {}", r.status, r.body));
                                false
                            }
                            Err(_) => {
                                errors.lock().unwrap().push("the request panicked".into());
                                false
                            }
                        };
                        samples.lock().unwrap().push(Sample {
                            at: t0.elapsed(),
                            latency: t.elapsed(),
                            ok,
                        });
                        if !ok {
                            std::thread::sleep(Duration::from_millis(100));
                        }
                    }
                })
            })
            .collect();
        Load {
            stop,
            samples,
            errors,
            threads,
        }
    }

    /// Requests that completed so far.
    pub fn ok(&self) -> usize {
        self.samples.lock().unwrap().iter().filter(|s| s.ok).count()
    }

    /// Stops the clients (each finishes its request) and returns every sample and error.
    pub fn stop(self) -> (Vec<Sample>, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            let _ = t.join();
        }
        let samples = self.samples.lock().unwrap().clone();
        let errors = self.errors.lock().unwrap().clone();
        (samples, errors)
    }
}
