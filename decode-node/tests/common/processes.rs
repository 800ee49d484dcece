//! Scenarios with a real `tandem-decode-node` process joining the shared cluster: startup with
//! printed bound addresses, KV over TCP from a UCX prefill node, reservation expiry, the phased
//! shutdown on SIGTERM, and refusal of a foreign KV layout.

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use tandem_cluster::{Discovery, EtcdConfig, EtcdDiscovery, Role};
use tandem_proto::v1 as pb;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tonic::Code;

use crate::common::*;

/// A decode node process and what it printed.
struct DecodeProcess {
    child: Child,
    grpc: std::net::SocketAddr,
    kv: String,
    node_id: String,
}

async fn spawn_decode(c: &Cluster, extra: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tandem-decode-node"));
    cmd.args(common_flags(&c.etcd, &c.nats))
        .args(extra)
        .stdin(Stdio::null())
        .kill_on_drop(true);
    cmd
}

/// Starts a decode node process and reads its `listening` line (up to 60 s: it loads the model).
async fn start_decode(c: &Cluster, extra: &[&str]) -> DecodeProcess {
    let mut child = spawn_decode(c, extra)
        .await
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn tandem-decode-node");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
        .await
        .expect("the decode node prints its addresses within 60 s")
        .unwrap()
        .expect("stdout line");
    let field = |k: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .unwrap_or_else(|| panic!("no {k} in {line:?}"))
            .to_string()
    };
    DecodeProcess {
        grpc: field("grpc=").parse().unwrap(),
        kv: field("kv="),
        node_id: field("node_id="),
        child,
    }
}

pub async fn a_decode_node_process_serves_over_tcp_expires_reservations_and_drains_on_sigterm(
    c: Arc<Cluster>,
) {
    let mut p = start_decode(
        &c,
        &[
            "--kv-transport",
            "tcp",
            "--reservation-ttl-ms",
            "1500",
            "--node-id",
            "decode-proc",
        ],
    )
    .await;
    assert!(p.kv.starts_with("tcp://127.0.0.1:"), "{}", p.kv);
    assert_eq!(p.node_id, "decode-proc");
    let router = Router::connect(c.prefill.grpc_addr(), p.grpc).await;

    // Same output over TCP from a UCX prefill node.
    let prompt = c.tokenize("Write a haiku about the sea.", true);
    let want = c
        .colocated(vec![reference_request(
            0,
            "tcp",
            prompt.clone(),
            &greedy(MAX_TOKENS),
        )])
        .remove(0)
        .0;
    let g = router
        .generate("tcp", &prompt, greedy(MAX_TOKENS))
        .await
        .unwrap();
    assert_eq!(
        g.tokens, want,
        "over TCP the output equals the colocated engine's"
    );

    // An unclaimed reservation expires; a late Decode call finds it gone.
    let mut decode = router.decode.clone();
    let r = pb::ReserveRequest {
        request_id: "abandoned".into(),
        prompt_tokens: 40,
        max_new_tokens: 8,
    };
    let t = decode
        .reserve(r)
        .await
        .unwrap()
        .into_inner()
        .target
        .unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let late = pb::DecodeRequest {
        reservation_id: t.reservation_id,
        epoch: t.epoch,
        prompt_token_ids: vec![1; 40],
        ..Default::default()
    };
    assert_eq!(
        decode.decode(late).await.expect_err("expired").code(),
        Code::NotFound
    );
    let etcd = EtcdDiscovery::connect(EtcdConfig::new(vec![c.etcd.endpoint()], CLUSTER))
        .await
        .unwrap();
    let mut view = etcd.watch(Role::Decode).await.unwrap();

    // SIGTERM during a request: the request finishes, new work is refused, the node deregisters
    // and exits 0.
    let mut f = router
        .start("in-flight", &prompt, greedy(64))
        .await
        .unwrap();
    let first = f.stream.message().await.unwrap();
    assert!(first.is_some());
    let pid = p.child.id().expect("running").to_string();
    let kill = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(kill.success());
    let draining = tokio::time::timeout(
        Duration::from_secs(10),
        view.wait_for(|v| v.get("decode-proc").is_some_and(|n| n.draining)),
    )
    .await
    .is_ok();
    assert!(draining, "the record is marked draining");
    let refused = decode
        .reserve(pb::ReserveRequest {
            request_id: "late".into(),
            prompt_tokens: 4,
            max_new_tokens: 4,
        })
        .await
        .expect_err("a draining node takes no new work");
    assert_eq!(refused.code(), Code::Unavailable);
    let mut tokens = 1;
    loop {
        match f
            .stream
            .message()
            .await
            .expect("the in-flight request completes")
        {
            Some(pb::DecodeResponse {
                event: Some(pb::decode_response::Event::Tokens(b)),
            }) => tokens += b.token_ids.len(),
            Some(pb::DecodeResponse {
                event: Some(pb::decode_response::Event::Final(fin)),
            }) => {
                assert_eq!(fin.usage.unwrap().completion_tokens, 64);
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(tokens >= 64);
    let status = tokio::time::timeout(Duration::from_secs(30), p.child.wait())
        .await
        .expect("exits after the drain")
        .unwrap();
    assert!(status.success(), "graceful shutdown exits 0: {status:?}");
    // Deregistered before it exited, not left to its lease: etcd, asked at once, no longer has
    // the record (the lease's 2 s TTL would keep it there for a while yet).
    let listed = etcd.list(Role::Decode).await.unwrap();
    assert!(
        !listed.contains_key("decode-proc"),
        "deregistered before exit, not left to the lease: {listed:?}"
    );
    c.wait_quiescent("after the process scenario").await;
}

pub async fn a_node_whose_layout_the_cluster_refuses_exits_non_zero_saying_so(c: Arc<Cluster>) {
    let out = spawn_decode(&c, &["--kv-dtype", "f16", "--node-id", "decode-f16"])
        .await
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output();
    let out = tokio::time::timeout(Duration::from_secs(90), out)
        .await
        .expect("exits within 90 s")
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a refused node must not serve: {:?}",
        out.status
    );
    assert!(
        stderr.contains("refused") && stderr.contains("layout"),
        "stderr names the refusal:\n{stderr}"
    );
    let etcd = EtcdDiscovery::connect(EtcdConfig::new(vec![c.etcd.endpoint()], CLUSTER))
        .await
        .unwrap();
    assert!(
        !etcd
            .list(Role::Decode)
            .await
            .unwrap()
            .contains_key("decode-f16")
    );
}
