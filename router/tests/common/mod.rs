//! Shared harness of the router's integration tests: fake nodes (`fakes`), a scripted load
//! bus, a router served on port-0 listeners, a minimal HTTP/1.1 client and bounded waits.
#![allow(dead_code)] // each test binary uses a different subset

pub mod fakes;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tandem_cluster::{
    ClusterError, Discovery, LoadReport, LoadSignals, LoadSignalsStatus, LoadView, MemoryDiscovery,
    ReceivedReport, Role,
};
use tandem_proto::v1::inference_client::InferenceClient;
use tandem_router::{AdmissionLimits, ApiKeys, Router, RouterOptions, ServedModel, TokenLimits};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

/// Every wait in these tests is bounded by this.
pub const WAIT: Duration = Duration::from_secs(10);

/// Test logs (`RUST_LOG=tandem_router=debug` for more).
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("tandem_router=info")),
        )
        .try_init();
}

/// The served model's tokenizer and context (the real default GGUF; `tandem model fetch`).
pub fn model() -> ServedModel {
    static MODEL: OnceLock<ServedModel> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            let path = tandem_router::model::default_model_path();
            ServedModel::from_gguf(&path, Some("smollm2"))
                .unwrap_or_else(|e| panic!("the router tests need the default model: {e}"))
        })
        .clone()
}

/// Router settings for tests (generous limits, short timeouts).
pub fn options() -> RouterOptions {
    RouterOptions {
        tokens: TokenLimits {
            max_tokens_limit: 64,
            default_max_tokens: 8,
        },
        admission: AdmissionLimits {
            max_in_flight: 64,
            max_queued: 64,
            queue_timeout: Duration::from_secs(10),
            batch_queue_timeout: Duration::from_secs(10),
            batch_aging: Duration::from_secs(5),
        },
        api_keys: ApiKeys::default(),
        max_attempts: 3,
        rpc_timeout: Duration::from_secs(5),
        connect_timeout: Duration::from_secs(2),
        max_report_age: Duration::from_secs(1),
        stream_idle_timeout: Duration::from_secs(10),
        canary: tandem_router::canary::CanarySettings::disabled(),
        cost: Default::default(),
        prefill_policy: Default::default(),
        placement: tandem_router::routing::PlacementSettings::always(),
    }
}

/// A load bus whose views the test writes directly, with any report age: staleness without
/// waiting for time to pass.
#[derive(Clone, Debug)]
pub struct ScriptedLoads {
    views: Arc<[watch::Sender<LoadView>; 2]>,
    status: watch::Sender<LoadSignalsStatus>,
    /// KV events travel on an in-process bus (the test publishes them as a node would).
    pub kv: tandem_cluster::MemoryLoadSignals,
}

impl ScriptedLoads {
    /// Empty views.
    pub fn new() -> Self {
        Self {
            views: Arc::new([
                watch::Sender::new(HashMap::new()),
                watch::Sender::new(HashMap::new()),
            ]),
            status: watch::Sender::new(LoadSignalsStatus::default()),
            kv: tandem_cluster::MemoryLoadSignals::new("test").expect("a bus"),
        }
    }

    fn view(&self, role: Role) -> &watch::Sender<LoadView> {
        &self.views[match role {
            Role::Prefill => 0,
            Role::Decode => 1,
        }]
    }

    /// Sets `node`'s report, received `age` ago.
    pub fn set(&self, role: Role, node: &str, age: Duration, edit: impl FnOnce(&mut LoadReport)) {
        let mut report = LoadReport::idle(node, role, 1024);
        edit(&mut report);
        let received_at = Instant::now() - age;
        self.view(role).send_modify(|view| {
            view.insert(
                node.to_string(),
                ReceivedReport {
                    report,
                    received_at,
                },
            );
        });
    }
}

#[async_trait]
impl LoadSignals for ScriptedLoads {
    fn cluster(&self) -> &str {
        "test"
    }

    async fn publish(&self, report: &LoadReport) -> Result<(), ClusterError> {
        self.set(report.role, &report.node_id.clone(), Duration::ZERO, |r| {
            *r = report.clone()
        });
        Ok(())
    }

    async fn subscribe(&self, role: Role) -> Result<watch::Receiver<LoadView>, ClusterError> {
        Ok(self.view(role).subscribe())
    }

    fn status(&self) -> watch::Receiver<LoadSignalsStatus> {
        self.status.subscribe()
    }

    async fn publish_kv_events(
        &self,
        batch: &tandem_cluster::KvEventBatch,
    ) -> Result<(), ClusterError> {
        self.kv.publish_kv_events(batch).await
    }

    async fn subscribe_kv_events(
        &self,
    ) -> Result<tokio::sync::mpsc::Receiver<tandem_cluster::KvEventBatch>, ClusterError> {
        self.kv.subscribe_kv_events().await
    }
}

/// A router served on port-0 listeners.
pub struct RunningRouter {
    /// The core.
    pub router: Router,
    /// gRPC ingress.
    pub grpc_addr: SocketAddr,
    /// HTTP ingress.
    pub http_addr: SocketAddr,
    stop: CancellationToken,
}

impl Drop for RunningRouter {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl RunningRouter {
    /// A gRPC client of the ingress.
    pub async fn grpc(&self) -> InferenceClient<tonic::transport::Channel> {
        InferenceClient::connect(format!("http://{}", self.grpc_addr))
            .await
            .expect("connect to the router's gRPC ingress")
    }
}

/// Starts a router over `discovery` and `signals` and serves both ingresses.
pub async fn start_router(
    discovery: Arc<dyn Discovery>,
    signals: Arc<dyn LoadSignals>,
    options: RouterOptions,
) -> RunningRouter {
    start_router_with(discovery, signals, options, tandem_router::Stores::memory()).await
}

/// [`start_router`] keeping usage and rate limits in `stores`.
pub async fn start_router_with(
    discovery: Arc<dyn Discovery>,
    signals: Arc<dyn LoadSignals>,
    options: RouterOptions,
    stores: tandem_router::Stores,
) -> RunningRouter {
    let router = Router::start(model(), options, discovery, signals, stores)
        .await
        .expect("router starts");
    let grpc = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (grpc_addr, http_addr) = (grpc.local_addr().unwrap(), http.local_addr().unwrap());
    let stop = CancellationToken::new();
    tokio::spawn(tandem_router::serve(
        router.clone(),
        grpc,
        http,
        stop.clone().cancelled_owned(),
    ));
    RunningRouter {
        router,
        grpc_addr,
        http_addr,
        stop,
    }
}

/// A cluster in memory: one discovery, a scripted load bus, fake nodes registered in it.
pub struct MemoryCluster {
    /// Membership.
    pub discovery: MemoryDiscovery,
    /// Load reports.
    pub loads: ScriptedLoads,
    /// Registrations by node id (drop or deregister to remove a node).
    pub registrations: HashMap<String, tandem_cluster::Registration>,
}

impl MemoryCluster {
    /// An empty cluster.
    pub fn new() -> Self {
        Self {
            discovery: MemoryDiscovery::new("test").unwrap(),
            loads: ScriptedLoads::new(),
            registrations: HashMap::new(),
        }
    }

    /// Registers a node record.
    pub async fn register(&mut self, info: tandem_cluster::NodeInfo) {
        let id = info.node_id.clone();
        let registration = self.discovery.register(info).await.expect("register");
        self.registrations.insert(id, registration);
    }

    /// Removes a node at once.
    pub async fn deregister(&mut self, node_id: &str) {
        let registration = self.registrations.remove(node_id).expect("registered");
        registration.deregister().await.expect("deregister");
    }

    /// Starts a router over this cluster.
    pub async fn router(&self, options: RouterOptions) -> RunningRouter {
        start_router(
            Arc::new(self.discovery.clone()),
            Arc::new(self.loads.clone()),
            options,
        )
        .await
    }
}

/// Waits (bounded) until `condition` holds, re-checking whenever `notify` fires.
pub async fn wait_until(what: &str, notify: &Notify, condition: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let notified = notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if condition() {
            return;
        }
        if tokio::time::timeout_at(deadline, notified).await.is_err() {
            assert!(condition(), "timed out waiting for: {what}");
            return;
        }
    }
}

/// An HTTP response.
#[derive(Debug)]
pub struct HttpResponse {
    /// Status code.
    pub status: u16,
    /// Header lines, lower-cased names.
    pub headers: Vec<(String, String)>,
    /// Body (de-chunked).
    pub body: String,
}

impl HttpResponse {
    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", self.body))
    }

    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The `data:` payloads of a server-sent-event body.
    pub fn sse_data(&self) -> Vec<String> {
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
            .map(str::to_string)
            .collect()
    }
}

/// The request bytes of one HTTP/1.1 call (`Connection: close`).
pub fn http_request_bytes(
    method: &str,
    path: &str,
    body: Option<&str>,
    auth: Option<&str>,
) -> Vec<u8> {
    let mut request = format!("{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n");
    if let Some(key) = auth {
        request.push_str(&format!("Authorization: Bearer {key}\r\n"));
    }
    if let Some(body) = body {
        request.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ));
    } else {
        request.push_str("\r\n");
    }
    request.into_bytes()
}

/// One HTTP/1.1 call over a fresh connection (bounded by [`WAIT`]).
pub async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
    auth: Option<&str>,
) -> HttpResponse {
    let call = async {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream
            .write_all(&http_request_bytes(method, path, body, auth))
            .await
            .expect("send");
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.expect("read");
        parse_response(&raw)
    };
    tokio::time::timeout(WAIT, call)
        .await
        .unwrap_or_else(|_| panic!("{method} {path}: no answer within {WAIT:?}"))
}

fn parse_response(raw: &[u8]) -> HttpResponse {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n").expect("a header block");
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .expect("a status line");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_string()
    };
    HttpResponse {
        status,
        headers,
        body,
    }
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].strip_prefix("\r\n").unwrap_or(&rest[size..]);
    }
    out
}

/// What a gRPC generation returned.
#[derive(Debug, Default)]
pub struct Collected {
    /// Token ids of all deltas.
    pub ids: Vec<u32>,
    /// Text of all deltas.
    pub text: String,
    /// The final message.
    pub last: Option<tandem_proto::v1::GenerateFinal>,
}

/// A gRPC Generate request for `prompt` with greedy sampling.
pub fn grpc_request(prompt: &str, max_tokens: u32) -> tandem_proto::v1::GenerateRequest {
    tandem_proto::v1::GenerateRequest {
        input: Some(tandem_proto::v1::generate_request::Input::Prompt(
            prompt.to_string(),
        )),
        sampling: Some(tandem_proto::v1::SamplingParams {
            max_tokens,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Reads a Generate stream to its end (bounded by [`WAIT`]).
pub async fn collect(
    mut stream: tonic::Streaming<tandem_proto::v1::GenerateResponse>,
) -> Result<Collected, tonic::Status> {
    use tandem_proto::v1::generate_response::Event;
    let mut out = Collected::default();
    loop {
        let message = tokio::time::timeout(WAIT, stream.message())
            .await
            .expect("the stream went quiet")?;
        match message.and_then(|m| m.event) {
            Some(Event::Delta(delta)) => {
                out.ids.extend(delta.token_ids);
                out.text.push_str(&delta.text);
            }
            Some(Event::Final(last)) => out.last = Some(last),
            None => return Ok(out),
        }
    }
}

/// Runs one greedy gRPC generation to its end.
pub async fn generate(
    router: &RunningRouter,
    prompt: &str,
    max_tokens: u32,
) -> Result<Collected, tonic::Status> {
    let mut client = router.grpc().await;
    let stream = client
        .generate(grpc_request(prompt, max_tokens))
        .await?
        .into_inner();
    collect(stream).await
}

/// Token count of `prompt` (plain text).
pub fn prompt_tokens(prompt: &str) -> usize {
    model().tokenizer.encode(prompt).len()
}

/// Token count of a one-message chat of `content` from the user, in the model's template.
pub fn chat_prompt_len(content: &str) -> usize {
    let tokenizer = &model().tokenizer;
    let text = tokenizer
        .apply_chat_template(&[tandem_tokenizer::ChatMessage::new("user", content)], true)
        .unwrap();
    tokenizer.encode(&text).len()
}

/// splitmix64: the test's only randomness (fuzz mutations, simulation plans), reproducible from
/// one seed.
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`0` when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    /// A duration between `lo_ms` and `hi_ms` milliseconds, both included.
    pub fn ms(&mut self, lo_ms: u64, hi_ms: u64) -> Duration {
        Duration::from_millis(lo_ms + self.below((hi_ms - lo_ms + 1) as usize) as u64)
    }

    /// One of `of`.
    pub fn pick<'a>(&mut self, of: &[&'a str]) -> &'a str {
        of[self.below(of.len())]
    }
}
