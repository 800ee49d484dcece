//! End to end, over gRPC, against real etcd and NATS: a prefill node and a decode node (in this
//! process, port 0), a tiny client in the router's role, and real node processes for startup,
//! TCP transfer, expiry, drain and layout refusal.
//!
//! One cluster is shared by every scenario (the model loads once per node), so this test has
//! its own `main` (`harness = false`): scenarios run in order, each named after the behaviour it
//! checks; a failing one is reported and the rest still run; the exit status is non-zero if any
//! failed. Every scenario that moves KV ends by checking that both nodes hold nothing.

mod common;
#[path = "common/processes.rs"]
mod processes;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use tandem_cluster::{
    Discovery, EtcdConfig, EtcdDiscovery, LoadSignals, NatsConfig, NatsLoadSignals, Role,
};
use tandem_kv_transfer::Fault;
use tandem_node::status;
use tandem_proto::v1 as pb;
use tandem_proto::v1::decode_client::DecodeClient;
use tonic::Code;
use tonic::transport::Channel;

type Scenario = fn(Arc<Cluster>) -> Pin<Box<dyn Future<Output = ()> + Send>>;

macro_rules! scenarios {
    ($($f:path),* $(,)?) => { [$((stringify!($f), (|c| Box::pin($f(c))) as Scenario)),*] };
}

fn main() {
    // A runner that lists tests first (cargo nextest) finds none here: the scenarios share one
    // cluster, so they run as this one binary (scripts/test.sh runs it beside nextest).
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let only = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let t0 = Instant::now();
    let cluster = Arc::new(rt.block_on(Cluster::start()));
    eprintln!("cluster up in {:.1} s", t0.elapsed().as_secs_f64());
    let all = scenarios![
        greedy_and_seeded_output_equals_the_colocated_engine_token_for_token,
        nodes_register_in_etcd_and_report_load_on_nats,
        health_and_reflection_answer_on_both_nodes,
        cancelling_mid_stream_frees_every_block_on_both_nodes,
        a_corrupted_transfer_is_data_loss_and_nothing_is_decoded,
        prefill_refuses_a_target_with_another_layout_fingerprint,
        release_returns_a_reservation_once_and_bad_decode_calls_name_the_field,
        a_decode_node_asked_to_prefill_here_computes_the_prompt_itself_exactly,
        a_prompt_computed_on_the_decode_node_reports_progress_until_its_first_token,
        reserve_calls_cancelled_while_the_engine_is_busy_strand_no_blocks,
        processes::a_decode_node_process_serves_over_tcp_expires_reservations_and_drains_on_sigterm,
        processes::a_node_whose_layout_the_cluster_refuses_exits_non_zero_saying_so,
    ];
    let mut failed = Vec::new();
    for (name, f) in all {
        if only.as_deref().is_some_and(|o| !name.contains(o)) {
            continue;
        }
        let t = Instant::now();
        let r = rt.block_on(rt.spawn(f(Arc::clone(&cluster))));
        match r {
            Ok(()) => eprintln!("test {name} ... ok ({:.1} s)", t.elapsed().as_secs_f64()),
            Err(e) => {
                eprintln!("test {name} ... FAILED: {e}");
                failed.push(name);
            }
        }
    }
    let cluster = Arc::try_unwrap(cluster)
        .ok()
        .expect("scenarios hold no cluster reference at the end");
    rt.block_on(async {
        cluster.prefill.shutdown().await;
        cluster.decode.shutdown().await;
    });
    drop(cluster.etcd);
    drop(cluster.nats);
    if !failed.is_empty() {
        eprintln!("{} failed: {failed:?}", failed.len());
        std::process::exit(1);
    }
    eprintln!("all passed in {:.1} s", t0.elapsed().as_secs_f64());
}

const CHAT: &[&str] = &[
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
];
const PLAIN: &[&str] = &[
    "The quick brown fox",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "In 1969, the first humans landed on",
];

async fn greedy_and_seeded_output_equals_the_colocated_engine_token_for_token(c: Arc<Cluster>) {
    let mut cases: Vec<(String, Vec<u32>, pb::SamplingParams)> = Vec::new();
    for (i, p) in CHAT.iter().chain(PLAIN).enumerate() {
        cases.push((
            format!("greedy-{i}"),
            c.tokenize(p, i < CHAT.len()),
            greedy(MAX_TOKENS),
        ));
    }
    let sampled = |seed| pb::SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        seed,
        ..greedy(MAX_TOKENS)
    };
    cases.push(("seeded".into(), c.tokenize(CHAT[0], true), sampled(Some(7))));
    cases.push((
        "unseeded-sampled".into(),
        c.tokenize(PLAIN[2], false),
        sampled(None),
    ));
    let reqs = cases
        .iter()
        .enumerate()
        .map(|(i, (id, p, s))| reference_request(i as u64, id, p.clone(), s))
        .collect();
    let cc = Arc::clone(&c);
    let want = tokio::task::spawn_blocking(move || cc.colocated(reqs))
        .await
        .unwrap();
    // All at once: the decode node batches them, the prefill node chunks them together.
    let router = c.router().await;
    let runs = cases.iter().map(|(id, p, s)| {
        let (r, id, p, s) = (router.clone(), id.clone(), p.clone(), s.clone());
        tokio::spawn(async move { r.generate(&id, &p, s).await })
    });
    let mut got = Vec::new();
    for r in runs {
        got.push(r.await.unwrap().expect("generation succeeds"));
    }
    for ((id, prompt, _), g) in cases.iter().zip(&got) {
        eprintln!(
            "  {id}: {} prompt tokens, {} KV blocks ({} KiB) pushed in {} us",
            prompt.len(),
            g.pushed.blocks,
            g.pushed.bytes >> 10,
            g.pushed.transfer_us
        );
    }
    for ((id, prompt, _), (g, (tokens, text))) in cases.iter().zip(got.iter().zip(&want)) {
        assert_eq!(
            &g.tokens, tokens,
            "{id}: disaggregated tokens differ from colocated"
        );
        assert_eq!(&g.text, text, "{id}: text differs");
        assert_eq!(g.finish.finish_reason(), pb::FinishReason::Length, "{id}");
        let u = g.finish.usage.unwrap();
        assert_eq!(
            (u.prompt_tokens as usize, u.completion_tokens),
            (prompt.len(), MAX_TOKENS),
            "{id}: usage"
        );
        assert_eq!(
            g.pushed.blocks as usize,
            prompt.len().div_ceil(16),
            "{id}: every prompt block pushed"
        );
        assert!(g.pushed.bytes > 0, "{id}");
    }
    c.wait_quiescent("after the equality run").await;
}

async fn nodes_register_in_etcd_and_report_load_on_nats(c: Arc<Cluster>) {
    let etcd = EtcdDiscovery::connect(EtcdConfig::new(vec![c.etcd.endpoint()], CLUSTER))
        .await
        .unwrap();
    let decoders = etcd.list(Role::Decode).await.unwrap();
    let d = decoders
        .get(c.decode.node_id())
        .expect("the decode node is registered");
    assert_eq!(d.grpc_addr, format!("http://{}", c.decode.grpc_addr()));
    assert_eq!(d.kv_transfer_addrs, [c.decode.kv_address().to_string()]);
    assert_eq!(d.layout_fingerprint, c.decode.layout().fingerprint());
    assert_eq!(d.capacity_blocks, 256);
    assert!(!d.draining);
    let p = etcd.list(Role::Prefill).await.unwrap();
    assert_eq!(
        p.get(c.prefill.node_id())
            .expect("the prefill node is registered")
            .layout_fingerprint,
        c.prefill.layout().fingerprint()
    );
    let nats = NatsLoadSignals::connect(NatsConfig::new(c.nats.url(), CLUSTER))
        .await
        .unwrap();
    for (role, id) in [
        (Role::Decode, c.decode.node_id()),
        (Role::Prefill, c.prefill.node_id()),
    ] {
        let mut view = nats.subscribe(role).await.unwrap();
        let seen = tokio::time::timeout(
            Duration::from_secs(5),
            view.wait_for(|v| v.get(id).is_some_and(|r| r.report.seq > 0)),
        )
        .await
        .is_ok();
        assert!(seen, "no load report from {id} within 5 s");
        let report = view.borrow().get(id).unwrap().report.clone();
        assert_eq!(
            (report.total_blocks, report.free_blocks),
            (256, 256),
            "{id}: an idle node reports every block free"
        );
        assert_eq!(report.role, role);
    }
}

async fn health_and_reflection_answer_on_both_nodes(c: Arc<Cluster>) {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::{
        ServerReflectionRequest, server_reflection_request, server_reflection_response,
    };
    for (addr, service) in [
        (c.prefill.grpc_addr(), "tandem.v1.Prefill"),
        (c.decode.grpc_addr(), "tandem.v1.Decode"),
    ] {
        let ch = tonic::transport::Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let health = HealthClient::new(ch.clone())
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            health.status(),
            tonic_health::pb::health_check_response::ServingStatus::Serving,
            "{service}"
        );
        let req = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(server_reflection_request::MessageRequest::ListServices(
                String::new(),
            )),
        };
        let mut stream = ServerReflectionClient::new(ch)
            .server_reflection_info(tokio_stream::once(req))
            .await
            .unwrap()
            .into_inner();
        let Some(server_reflection_response::MessageResponse::ListServicesResponse(list)) =
            stream.message().await.unwrap().unwrap().message_response
        else {
            panic!("reflection did not list services");
        };
        let names: Vec<_> = list.service.iter().map(|s| s.name.as_str()).collect();
        assert!(
            names.contains(&service) && names.contains(&"grpc.health.v1.Health"),
            "{names:?}"
        );
    }
}

async fn cancelling_mid_stream_frees_every_block_on_both_nodes(c: Arc<Cluster>) {
    let router = c.router().await;
    let prompt = c.tokenize(CHAT[2], true);
    let mut f = router
        .start("cancel-me", &prompt, greedy(1000))
        .await
        .unwrap();
    let mut batches = 0;
    while batches < 3 {
        match f.stream.message().await.unwrap() {
            Some(pb::DecodeResponse {
                event: Some(pb::decode_response::Event::Tokens(_)),
            }) => batches += 1,
            other => panic!("expected tokens, got {other:?}"),
        }
    }
    assert!(
        c.decode.snapshot().borrow().running >= 1,
        "the request is running"
    );
    drop(f.stream); // the client goes away mid-stream
    c.wait_quiescent("after a mid-stream cancel").await;
    // And a cancel between the first token and the Decode call: the reservation is released.
    let f = router
        .start("cancel-early", &prompt, greedy(8))
        .await
        .unwrap();
    drop(f.stream);
    let _ = f.prefill.await;
    c.wait_quiescent("after an early cancel").await;
}

async fn a_corrupted_transfer_is_data_loss_and_nothing_is_decoded(c: Arc<Cluster>) {
    let router = c.router().await;
    let prompt = c.tokenize(CHAT[1], true);
    c.prefill
        .set_fault(Some(Fault::CorruptByte { offset: 1000 }));
    let started = router.start("corrupt", &prompt, greedy(16)).await;
    c.prefill.set_fault(None);
    let mut f = started.expect("reserve, prefill and the decode call are accepted");
    let first = f.stream.message().await;
    let err = first.expect_err("a corrupt transfer must not produce tokens");
    assert_eq!(err.code(), Code::DataLoss, "{err:?}");
    assert!(
        status::is_retry_safe(&err),
        "re-prefilling is safe: {err:?}"
    );
    assert_eq!(status::error_kind(&err), Some("checksum_mismatch"));
    let pushed = f.prefill.await.unwrap();
    assert!(
        pushed.is_err(),
        "the prefill node reports the failed push, not KvPushed: {pushed:?}"
    );
    c.wait_quiescent("after a corrupt transfer").await;
    // The cluster keeps serving.
    let g = router
        .generate("after-corrupt", &prompt, greedy(4))
        .await
        .unwrap();
    assert_eq!(g.tokens.len(), 4);
    c.wait_quiescent("after the follow-up request").await;
}

async fn prefill_refuses_a_target_with_another_layout_fingerprint(c: Arc<Cluster>) {
    let router = c.router().await;
    let prompt = c.tokenize(PLAIN[0], false);
    let mut decode = router.decode.clone();
    let reserve = pb::ReserveRequest {
        request_id: "fp".into(),
        prompt_tokens: prompt.len() as u32,
        max_new_tokens: 4,
    };
    let mut target = decode
        .reserve(reserve)
        .await
        .unwrap()
        .into_inner()
        .target
        .unwrap();
    let good = target.clone();
    target.layout_fingerprint ^= 1;
    let req = pb::PrefillRequest {
        request_id: "fp".into(),
        prompt_token_ids: prompt,
        sampling: Some(greedy(4)),
        target: Some(target),
        priority: 0,
    };
    let err = router
        .prefill
        .clone()
        .prefill(req)
        .await
        .expect_err("a foreign layout is refused");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(!status::is_retry_safe(&err));
    let released = decode
        .release(pb::ReleaseRequest {
            reservation_id: good.reservation_id,
            epoch: good.epoch,
        })
        .await
        .unwrap();
    assert!(released.into_inner().released);
    c.wait_quiescent("after a refused prefill").await;
}

async fn release_returns_a_reservation_once_and_bad_decode_calls_name_the_field(c: Arc<Cluster>) {
    let mut decode = c.router().await.decode;
    let too_big = pb::ReserveRequest {
        request_id: "big".into(),
        prompt_tokens: 100,
        max_new_tokens: 256 * 16,
    };
    let err = decode
        .reserve(too_big)
        .await
        .expect_err("more blocks than the pool holds");
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    let empty = pb::ReserveRequest {
        request_id: "empty".into(),
        prompt_tokens: 0,
        max_new_tokens: 4,
    };
    let err = decode
        .reserve(empty)
        .await
        .expect_err("an empty prompt is refused");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("prompt_tokens"), "{err:?}");
    let r = pb::ReserveRequest {
        request_id: "rel".into(),
        prompt_tokens: 20,
        max_new_tokens: 8,
    };
    let t = decode
        .reserve(r)
        .await
        .unwrap()
        .into_inner()
        .target
        .unwrap();
    assert_eq!(t.block_ids.len(), 2, "one block per 16 prompt tokens");
    assert!(c.decode.snapshot().borrow().reserved_or_held_blocks >= 2);
    let wrong_len = pb::DecodeRequest {
        reservation_id: t.reservation_id,
        epoch: t.epoch ^ 1,
        prompt_token_ids: vec![1; 20],
        ..Default::default()
    };
    let err = decode
        .decode(wrong_len)
        .await
        .expect_err("a stale epoch is refused");
    assert_eq!(err.code(), Code::FailedPrecondition);
    let rel = |id, epoch| pb::ReleaseRequest {
        reservation_id: id,
        epoch,
    };
    assert!(
        decode
            .release(rel(t.reservation_id, t.epoch))
            .await
            .unwrap()
            .into_inner()
            .released
    );
    assert!(
        !decode
            .release(rel(t.reservation_id, t.epoch))
            .await
            .unwrap()
            .into_inner()
            .released,
        "idempotent"
    );
    let gone = pb::DecodeRequest {
        reservation_id: t.reservation_id,
        epoch: t.epoch,
        prompt_token_ids: vec![1; 20],
        ..Default::default()
    };
    assert_eq!(
        decode.decode(gone).await.expect_err("released").code(),
        Code::NotFound
    );
    c.wait_quiescent("after release").await;
}

/// Conditional disaggregation, the decode node's side: Reserve, then Decode with
/// `prefill_here` and no prefill node at all. The output equals the colocated engine's, greedy
/// and seeded; the prefill node computes nothing; every block comes back.
async fn a_decode_node_asked_to_prefill_here_computes_the_prompt_itself_exactly(c: Arc<Cluster>) {
    let sampled = pb::SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        seed: Some(11),
        ..greedy(MAX_TOKENS)
    };
    let cases = [
        ("here-greedy", c.tokenize(CHAT[1], true), greedy(MAX_TOKENS)),
        ("here-seeded", c.tokenize(PLAIN[0], false), sampled),
    ];
    let reqs = cases
        .iter()
        .enumerate()
        .map(|(i, (id, p, s))| reference_request(i as u64, id, p.clone(), s))
        .collect();
    let cc = Arc::clone(&c);
    let want = tokio::task::spawn_blocking(move || cc.colocated(reqs))
        .await
        .unwrap();
    let prefill_steps = c.prefill.snapshot().borrow().steps;
    let mut decode = c.router().await.decode;
    for ((id, prompt, sampling), (tokens, text)) in cases.iter().zip(&want) {
        let target = decode
            .reserve(pb::ReserveRequest {
                request_id: id.to_string(),
                prompt_tokens: prompt.len() as u32,
                max_new_tokens: sampling.max_tokens,
            })
            .await
            .unwrap()
            .into_inner()
            .target
            .unwrap();
        let mut stream = decode
            .decode(pb::DecodeRequest {
                request_id: id.to_string(),
                reservation_id: target.reservation_id,
                epoch: target.epoch,
                prompt_token_ids: prompt.clone(),
                sampling: Some(sampling.clone()),
                prefill_here: true,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let (mut got, mut got_text, mut usage) = (Vec::new(), String::new(), None);
        while let Some(m) = stream.message().await.unwrap() {
            match m.event {
                Some(pb::decode_response::Event::Tokens(b)) => {
                    got.extend(b.token_ids);
                    got_text.push_str(&b.text);
                }
                Some(pb::decode_response::Event::Final(f)) => usage = f.usage,
                Some(pb::decode_response::Event::Progress(p)) => {
                    assert!(
                        got.is_empty(),
                        "{id}: progress comes only before the first token"
                    );
                    assert!(
                        p.prompt_tokens_computed as usize <= prompt.len(),
                        "{id}: {p:?}"
                    );
                }
                None => panic!("{id}: an empty event"),
            }
        }
        assert_eq!(&got, tokens, "{id}: computed on the decode node");
        assert_eq!(&got_text, text, "{id}: text");
        let u = usage.expect("a final message with usage");
        assert_eq!(
            (u.prompt_tokens as usize, u.completion_tokens),
            (prompt.len(), MAX_TOKENS),
            "{id}"
        );
    }
    assert_eq!(
        c.prefill.snapshot().borrow().steps,
        prefill_steps,
        "the prefill node took no part"
    );
    c.wait_quiescent("after prefilling on the decode node")
        .await;
}

/// 1,200 prompt tokens: several seconds of multi-millisecond steps when the decode node
/// computes them. Each `variant` is another prompt (no prefix shared with the others, so a
/// scenario after another does not find its KV cached).
fn long_prompt(variant: u32) -> Vec<u32> {
    (0..1200u32)
        .map(|i| 100 + variant * 7 + i * 37 % 40_000)
        .collect()
}

/// Reserves for `prompt` and 2 output tokens, and asks the decode node to compute the prompt
/// itself (`prefill_here`): the reservation and the answer's stream.
async fn compute_on_the_decode_node(
    decode: &mut DecodeClient<Channel>,
    id: &str,
    prompt: &[u32],
) -> (pb::KvTarget, tonic::Streaming<pb::DecodeResponse>) {
    let target = decode
        .reserve(pb::ReserveRequest {
            request_id: id.into(),
            prompt_tokens: prompt.len() as u32,
            max_new_tokens: 2,
        })
        .await
        .unwrap()
        .into_inner()
        .target
        .unwrap();
    let stream = decode
        .decode(pb::DecodeRequest {
            request_id: id.into(),
            reservation_id: target.reservation_id,
            epoch: target.epoch,
            prompt_token_ids: prompt.to_vec(),
            sampling: Some(greedy(2)),
            prefill_here: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    (target, stream)
}

/// A long prompt computed on the decode node (several seconds here) is reported on: a
/// `DecodeProgress` between steps once a second has passed, until the first token, its
/// computed count growing and never past the prompt, so the router's stall clock sees a busy
/// node, not a hung one.
async fn a_prompt_computed_on_the_decode_node_reports_progress_until_its_first_token(
    c: Arc<Cluster>,
) {
    let prompt = long_prompt(0);
    let mut decode = c.router().await.decode;
    let (_, mut stream) = compute_on_the_decode_node(&mut decode, "long-here", &prompt).await;
    let t0 = Instant::now();
    let (mut progress, mut tokens, mut first_at) = (Vec::new(), 0, None);
    while let Some(m) = stream.message().await.unwrap() {
        match m.event {
            Some(pb::decode_response::Event::Progress(p)) => {
                assert_eq!(tokens, 0, "progress only before the first token");
                progress.push(p.prompt_tokens_computed);
            }
            Some(pb::decode_response::Event::Tokens(b)) => {
                first_at.get_or_insert(t0.elapsed());
                tokens += b.token_ids.len();
            }
            Some(pb::decode_response::Event::Final(_)) => {}
            None => panic!("an empty event"),
        }
    }
    let first_at = first_at.expect("tokens came");
    assert_eq!(tokens, 2);
    // A report at the first loop iteration a second or more after the last message (between
    // steps: the prompt runs in chunks sized to the node's `--max-step-ms`).
    assert!(!progress.is_empty(), "no progress in {first_at:?}");
    assert!(progress.windows(2).all(|w| w[0] <= w[1]), "{progress:?}");
    assert!(
        progress.iter().all(|&n| n as usize <= prompt.len()),
        "{progress:?}"
    );
    c.wait_quiescent("after a long prompt on the decode node")
        .await;
}

/// Reserve calls whose caller gives up while the engine is busy (the router timing out on a
/// frozen or loaded node) strand nothing: the engine may run the Reserve after the call is
/// gone, and the node gives those blocks back at once. A long prompt on the decode node keeps
/// its engine in multi-millisecond steps while calls with timeouts of 1–24 ms are made.
async fn reserve_calls_cancelled_while_the_engine_is_busy_strand_no_blocks(c: Arc<Cluster>) {
    let mut decode = c.router().await.decode;
    let (target, mut stream) =
        compute_on_the_decode_node(&mut decode, "busy", &long_prompt(1)).await;
    let busy = tokio::spawn(async move {
        let mut tokens = 0;
        while let Some(m) = stream.message().await.unwrap() {
            if let Some(pb::decode_response::Event::Tokens(b)) = m.event {
                tokens += b.token_ids.len();
            }
        }
        tokens
    });
    let (mut cancelled, mut answered) = (0, Vec::new());
    for i in 0..24u64 {
        let call = decode.reserve(pb::ReserveRequest {
            request_id: format!("impatient-{i}"),
            prompt_tokens: 20,
            max_new_tokens: 4,
        });
        match tokio::time::timeout(Duration::from_millis(1 + i), call).await {
            Err(_) => cancelled += 1,
            Ok(r) => answered.push(r.unwrap().into_inner().target.unwrap()),
        }
    }
    assert_eq!(busy.await.unwrap(), 2, "the long prompt's answer");
    assert!(
        cancelled >= 8,
        "only {cancelled} of 24 calls were cancelled: the engine was not busy, nothing was tested"
    );
    for t in answered {
        let released = decode
            .release(pb::ReleaseRequest {
                reservation_id: t.reservation_id,
                epoch: t.epoch,
            })
            .await
            .unwrap()
            .into_inner()
            .released;
        assert!(released, "an answered reservation is held until released");
    }
    // A call cancelled after the node answered leaves its reservation in the table, unknown to
    // the caller: it expires at the TTL (30 s here). Nothing may be held outside the table.
    let blocks_each = 2; // 24 tokens, 16 per block
    let deadline = Instant::now() + Duration::from_secs(10);
    let in_table = loop {
        let in_table = c.decode.unclaimed_reservations();
        let held = c.decode.snapshot().borrow().reserved_or_held_blocks;
        if held == blocks_each * in_table {
            break in_table;
        }
        assert!(
            Instant::now() < deadline,
            "{held} blocks held but {in_table} reservations in the table: blocks stranded by {cancelled} cancelled calls"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // Give those back as a client that knew their ids would (ids are sequential per node), so
    // the scenarios after this one start from an empty node.
    let mut swept = 0;
    for id in target.reservation_id + 1..=target.reservation_id + 24 {
        let r = pb::ReleaseRequest {
            reservation_id: id,
            epoch: target.epoch,
        };
        swept += decode.release(r).await.unwrap().into_inner().released as usize;
    }
    assert_eq!(
        swept, in_table,
        "the table's reservations were this scenario's"
    );
    c.wait_quiescent(&format!("after {cancelled} cancelled Reserve calls"))
        .await;
}
