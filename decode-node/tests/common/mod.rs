//! The end-to-end harness: real etcd and NATS (`tandem_cluster::testing`), a prefill node and a
//! decode node in this process on port 0 (joined through the real etcd/NATS from their flags),
//! a colocated engine for the expected output, and [`Router`], a tiny client that plays the
//! router's part of the flow: Reserve → Prefill (FirstToken, KvPushed) → Decode.
#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

use tandem_cluster::testing::{TestEtcd, TestNats};
use tandem_decode_node::{DecodeArgs, DecodeNode};
use tandem_engine::{Engine, Model, Priority, Request, SamplingParams, loader};
use tandem_node::Coordination;
use tandem_node::engine_thread::EngineSnapshot;
use tandem_prefill_node::{PrefillArgs, PrefillNode};
use tandem_proto::v1::decode_client::DecodeClient;
use tandem_proto::v1::prefill_client::PrefillClient;
use tandem_proto::v1::{self as pb, decode_response, prefill_response};
use tokio::sync::watch;
use tonic::Status;
use tonic::transport::Channel;

/// Cluster name of the tests (isolates them from anything else in the same etcd).
pub const CLUSTER: &str = "node-e2e";
/// KV blocks of each node (small: block accounting is checked exactly).
pub const KV_BLOCKS: &str = "256";
/// Greedy tokens compared against the colocated engine.
pub const MAX_TOKENS: u32 = 48;

/// The real model (`$TANDEM_MODEL` or the cache); a missing model fails with the fix.
pub fn model_path() -> PathBuf {
    let p = std::env::var_os("TANDEM_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(tandem_node::fetch::default_model_path);
    assert!(
        p.exists(),
        "the model is missing at {}: run `cargo run -p tandem-cli -- model fetch`",
        p.display()
    );
    p
}

/// Flags shared by every node of the test cluster.
pub fn common_flags(etcd: &TestEtcd, nats: &TestNats) -> Vec<String> {
    [
        "--cluster",
        CLUSTER,
        "--etcd-endpoints",
        &etcd.endpoint(),
        "--nats-url",
        &nats.url(),
        "--lease-ttl-secs",
        "2",
        "--load-report-ms",
        "100",
        "--kv-blocks",
        KV_BLOCKS,
        "--model",
        model_path().to_str().expect("UTF-8 model path"),
    ]
    .map(String::from)
    .to_vec()
}

/// The cluster the scenarios share.
pub struct Cluster {
    pub etcd: TestEtcd,
    pub nats: TestNats,
    pub prefill: PrefillNode,
    pub decode: DecodeNode,
    pub colocated: std::sync::Mutex<Engine>,
}

impl Cluster {
    /// Starts etcd, NATS, a prefill node and a decode node (UCX where it starts), and loads the
    /// colocated reference engine with the same engine flags.
    pub async fn start() -> Self {
        let etcd = TestEtcd::start().await;
        let nats = TestNats::start().await;
        let flags = common_flags(&etcd, &nats);
        let pargs = PrefillArgs::try_parse_from_flags(&flags);
        let dargs = DecodeArgs::try_parse_from_flags(&flags);
        let engine_args = pargs.node.engine.clone();
        let colocated = tokio::task::spawn_blocking(move || {
            let source = tandem_node::model::resolve_source(&engine_args).unwrap();
            let loaded = loader::load(&source, engine_args.dtype).unwrap();
            Engine::new(
                Model::new(loaded.weights),
                loaded.tokenizer,
                engine_args.engine_config().unwrap(),
            )
            .unwrap()
        });
        let prefill = PrefillNode::start(pargs, Coordination::FromArgs)
            .await
            .expect("prefill node starts");
        let decode = DecodeNode::start(dargs, Coordination::FromArgs)
            .await
            .expect("decode node starts");
        let colocated = std::sync::Mutex::new(colocated.await.unwrap());
        Cluster {
            etcd,
            nats,
            prefill,
            decode,
            colocated,
        }
    }

    /// A client playing the router between the two nodes.
    pub async fn router(&self) -> Router {
        Router::connect(self.prefill.grpc_addr(), self.decode.grpc_addr()).await
    }

    /// Token ids of a chat prompt (templated) or a plain one.
    pub fn tokenize(&self, text: &str, chat: bool) -> Vec<u32> {
        let engine = self.colocated.lock().unwrap();
        let tok = engine.tokenizer().expect("the model has a tokenizer");
        if chat {
            let msgs = [tandem_engine::tokenizer::ChatMessage {
                role: "user".into(),
                content: text.into(),
            }];
            tok.encode(&tok.apply_chat_template(&msgs, true).unwrap())
        } else {
            tok.encode(text)
        }
    }

    /// What the colocated engine generates for these requests (output token ids and text).
    pub fn colocated(&self, requests: Vec<Request>) -> Vec<(Vec<u32>, String)> {
        let mut engine = self.colocated.lock().unwrap();
        engine
            .generate(requests, |_| {})
            .unwrap()
            .into_iter()
            .map(|c| (c.tokens, c.text))
            .collect()
    }

    /// Waits until both nodes hold nothing: every block free, no reservation, nothing running.
    pub async fn wait_quiescent(&self, what: &str) {
        wait_quiescent(self.prefill.snapshot(), &format!("prefill node: {what}")).await;
        wait_quiescent(self.decode.snapshot(), &format!("decode node: {what}")).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while self.decode.unclaimed_reservations() + self.decode.inbound_reservations() > 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what}: reservations left on the decode node"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Waits (up to 10 s) until a node's snapshot shows every block free and nothing held.
pub async fn wait_quiescent(mut snap: watch::Receiver<EngineSnapshot>, what: &str) {
    let ok = matches!(
        tokio::time::timeout(Duration::from_secs(10), snap.wait_for(|s| s.is_quiescent())).await,
        Ok(Ok(_))
    );
    let last = snap.borrow().clone();
    assert!(ok, "{what}: blocks still held after 10 s: {last:?}");
}

/// Parsing node flags in tests.
pub trait FromFlags: Sized {
    /// Parses `flags` (no program name); panics on a bad flag.
    fn try_parse_from_flags(flags: &[String]) -> Self;
}

impl FromFlags for PrefillArgs {
    fn try_parse_from_flags(flags: &[String]) -> Self {
        clap::Parser::try_parse_from(
            std::iter::once("prefill").chain(flags.iter().map(String::as_str)),
        )
        .unwrap()
    }
}

impl FromFlags for DecodeArgs {
    fn try_parse_from_flags(flags: &[String]) -> Self {
        clap::Parser::try_parse_from(
            std::iter::once("decode").chain(flags.iter().map(String::as_str)),
        )
        .unwrap()
    }
}

/// Greedy sampling of `max_tokens`, EOS ignored (so lengths are exact).
pub fn greedy(max_tokens: u32) -> pb::SamplingParams {
    pb::SamplingParams {
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

/// The engine request the colocated reference runs for `sampling` (same seed rule as the nodes).
pub fn reference_request(
    id: u64,
    request_id: &str,
    prompt: Vec<u32>,
    sampling: &pb::SamplingParams,
) -> Request {
    let params: SamplingParams =
        tandem_node::convert::sampling_params(Some(sampling), request_id, 1).unwrap();
    Request {
        id,
        prompt,
        params,
        priority: Priority::Interactive,
    }
}

/// One finished generation as the router saw it.
#[derive(Debug)]
pub struct Generation {
    /// Every generated token, the first (from the prefill node) included.
    pub tokens: Vec<u32>,
    /// Their text.
    pub text: String,
    /// The final message.
    pub finish: pb::DecodeFinal,
    /// The prefill node's KvPushed.
    pub pushed: pb::KvPushed,
}

/// A decode call in progress (for cancellation scenarios).
pub struct InFlight {
    pub stream: tonic::Streaming<pb::DecodeResponse>,
    pub prefill: tokio::task::JoinHandle<Result<Option<pb::PrefillResponse>, Status>>,
    pub first_token: u32,
    pub target: pb::KvTarget,
}

/// The router's part of the flow, over gRPC.
#[derive(Clone)]
pub struct Router {
    pub prefill: PrefillClient<Channel>,
    pub decode: DecodeClient<Channel>,
}

impl Router {
    /// Connects to both nodes.
    pub async fn connect(prefill: std::net::SocketAddr, decode: std::net::SocketAddr) -> Self {
        let ch = |a: std::net::SocketAddr| async move {
            Channel::from_shared(format!("http://{a}"))
                .unwrap()
                .connect()
                .await
                .unwrap()
        };
        Router {
            prefill: PrefillClient::new(ch(prefill).await),
            decode: DecodeClient::new(ch(decode).await),
        }
    }

    /// Reserve + Prefill (until the first token) + Decode call; returns the open decode stream.
    pub async fn start(
        &self,
        request_id: &str,
        prompt: &[u32],
        sampling: pb::SamplingParams,
    ) -> Result<InFlight, Status> {
        let mut decode = self.decode.clone();
        let reserve = pb::ReserveRequest {
            request_id: request_id.into(),
            prompt_tokens: prompt.len() as u32,
            max_new_tokens: sampling.max_tokens,
        };
        let target = decode
            .reserve(reserve)
            .await?
            .into_inner()
            .target
            .expect("Reserve returns a target");
        let mut pstream = self
            .prefill
            .clone()
            .prefill(pb::PrefillRequest {
                request_id: request_id.into(),
                prompt_token_ids: prompt.to_vec(),
                sampling: Some(sampling.clone()),
                target: Some(target.clone()),
                priority: 0,
            })
            .await?
            .into_inner();
        let first = match pstream.message().await? {
            Some(pb::PrefillResponse {
                event: Some(prefill_response::Event::FirstToken(f)),
            }) => f,
            other => panic!("prefill stream began with {other:?}, not FirstToken"),
        };
        let prefill = tokio::spawn(async move { pstream.message().await });
        let stream = decode
            .decode(pb::DecodeRequest {
                request_id: request_id.into(),
                reservation_id: target.reservation_id,
                epoch: target.epoch,
                prompt_token_ids: prompt.to_vec(),
                first_token_id: first.token_id,
                sampling: Some(sampling),
                priority: 0,
                cached_prompt_tokens: first.cached_prompt_tokens,
                first_token_logprob: first.logprob.clone(),
                prefill_here: false,
            })
            .await?
            .into_inner();
        Ok(InFlight {
            stream,
            prefill,
            first_token: first.token_id,
            target,
        })
    }

    /// A whole generation.
    pub async fn generate(
        &self,
        request_id: &str,
        prompt: &[u32],
        sampling: pb::SamplingParams,
    ) -> Result<Generation, Status> {
        let mut f = self.start(request_id, prompt, sampling).await?;
        let (mut tokens, mut text) = (Vec::new(), String::new());
        let finish = loop {
            match f.stream.message().await? {
                Some(pb::DecodeResponse {
                    event: Some(decode_response::Event::Tokens(b)),
                }) => {
                    tokens.extend(b.token_ids);
                    text.push_str(&b.text);
                }
                Some(pb::DecodeResponse {
                    event: Some(decode_response::Event::Final(fin)),
                }) => break fin,
                other => panic!(
                    "decode stream for {request_id} ended without a final message: {other:?}"
                ),
            }
        };
        assert_eq!(
            tokens.first(),
            Some(&f.first_token),
            "{request_id}: the stream starts with the prefill node's first token"
        );
        let pushed = match f.prefill.await.unwrap()? {
            Some(pb::PrefillResponse {
                event: Some(prefill_response::Event::KvPushed(p)),
            }) => p,
            other => panic!("{request_id}: prefill stream ended with {other:?}, not KvPushed"),
        };
        Ok(Generation {
            tokens,
            text,
            finish,
            pushed,
        })
    }
}
