//! A minimal HTTP/1.1 client over a blocking socket, enough for the router's JSON and SSE
//! answers: extra request headers, the response headers, the body, and when each `data:` line
//! of a stream arrived (the longest stall a client saw).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// A response.
#[derive(Debug)]
pub struct Reply {
    /// The status code.
    pub status: u16,
    /// Headers, names lowercased.
    pub headers: Vec<(String, String)>,
    /// The body as text (chunked framing left in: search it, do not parse it whole).
    pub body: String,
    /// The `data:` payloads of an SSE stream, in order.
    pub events: Vec<String>,
    /// The longest time between two reads that carried stream data.
    pub longest_stall: Duration,
    /// When each `data:` event arrived, since the request was sent.
    pub event_at: Vec<Duration>,
}

impl Reply {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The JSON object of a non-streamed answer (between the first `{` and the last `}`).
    pub fn json(&self) -> serde_json::Value {
        let (a, b) = (
            self.body.find('{').expect("a JSON body"),
            self.body.rfind('}').expect("a JSON body"),
        );
        serde_json::from_str(&self.body[a..=b]).expect("a JSON body")
    }
}

/// Sends one request and reads the whole answer. `on_event(n)` is called after the n-th
/// stream event arrives (to inject faults mid-stream).
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
    mut on_event: impl FnMut(usize),
) -> Reply {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let body = body.unwrap_or("");
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body.as_bytes()).unwrap();
    let sent = Instant::now();
    let mut event_at = Vec::new();
    let mut raw = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    let mut last_data: Option<Instant> = None;
    let mut longest = Duration::ZERO;
    let mut seen_events = 0;
    loop {
        let n = match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) => panic!("reading the answer: {e}"),
        };
        raw.extend_from_slice(&buf[..n]);
        let chunk = String::from_utf8_lossy(&buf[..n]);
        if chunk.contains("data:") {
            let now = Instant::now();
            if let Some(t) = last_data {
                longest = longest.max(now - t);
            }
            last_data = Some(now);
            let total = String::from_utf8_lossy(&raw).matches("\ndata:").count();
            while seen_events < total {
                seen_events += 1;
                event_at.push(sent.elapsed());
                on_event(seen_events);
            }
        }
    }
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let events = body
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.trim().to_string())
        .collect();
    Reply {
        status,
        headers,
        body: body.to_string(),
        events,
        longest_stall: longest,
        event_at,
    }
}
