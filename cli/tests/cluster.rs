//! End to end against real processes: etcd, NATS, `tandem decode`, `tandem prefill` and
//! `tandem router` serving the real model. Each test runs its own cluster; they run one at a
//! time (2-core CI machines: two clusters at once would only measure contention).
//!
//! - same output any path: gRPC (token ids) and HTTP (streamed and not) equal the in-process
//!   engine for 48 tokens; the official `openai` Python client streams a chat and a completion
//!   and reads usage; bad input gets 4xx / INVALID_ARGUMENT naming the field and the cluster keeps
//!   serving; NATS stopped: serving continues on the router's own counts (log line + metric) and
//!   load-report routing resumes when NATS returns;
//! - 64 concurrent streams of mixed lengths through 1 prefill + 2 decode nodes, each equal to the
//!   engine's output, then every node's free blocks equal its total;
//! - membership: a decode node that joins gets traffic within a second of registering; `kill -9`
//!   of a decode node removes it within the lease TTL and requests keep succeeding; a node with a
//!   different KV layout is refused at registration.

use crate::e2e;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use e2e::harness::{Cluster, WAIT, http, model};
use tandem_cluster::Role;
use tandem_engine::tokenizer::{ChatMessage, Tokenizer};
use tandem_engine::{
    Completion, Engine, EngineConfig, Model, ModelSource, Priority, Request, SamplingParams,
    WeightDtype, loader,
};
use tandem_proto::v1::inference_client::InferenceClient;
use tandem_proto::v1::{GenerateRequest, generate_request, generate_response};

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const PROMPTS: &[&str] = &[
    "The history of the printing press begins",
    "def quicksort(items):\n    ",
    "Ten facts about octopuses:\n1.",
];

/// The in-process engine's answers (the reference every path must equal).
fn engine_outputs(reqs: Vec<Request>) -> (Vec<Completion>, Arc<Tokenizer>) {
    let loaded = loader::load(&ModelSource::Path(model()), WeightDtype::F32).unwrap();
    let mut e = Engine::new(
        Model::new(loaded.weights),
        loaded.tokenizer,
        EngineConfig::default(),
    )
    .unwrap();
    let tok = e.tokenizer().unwrap().clone();
    (e.generate(reqs, |_| {}).unwrap(), tok)
}

fn greedy(id: u64, prompt: Vec<u32>, max: usize) -> Request {
    Request {
        id,
        prompt,
        params: SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(max)
        },
        priority: Priority::Interactive,
    }
}

fn grpc_request(input: generate_request::Input, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        input: Some(input),
        sampling: Some(tandem_proto::v1::SamplingParams {
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Streams one gRPC generation: (token ids, text).
async fn grpc_generate(
    client: &mut InferenceClient<tonic::transport::Channel>,
    req: GenerateRequest,
) -> Result<(Vec<u32>, String), tonic::Status> {
    let mut stream = client.generate(req).await?.into_inner();
    let (mut ids, mut text) = (Vec::new(), String::new());
    while let Some(m) = stream.message().await? {
        if let Some(generate_response::Event::Delta(d)) = m.event {
            ids.extend(d.token_ids);
            text.push_str(&d.text);
        }
    }
    Ok((ids, text))
}

/// Concatenated `choices[0].text` of an SSE body.
fn sse_text(body: &str) -> String {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_string))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_prefill_one_decode_cluster_serves_exactly_the_engine_output_and_degrades_without_nats()
{
    let _serial = SERIAL.lock().await;
    let mut c = Cluster::start("e2e-same").await;
    c.node("decode", "d0", &[]);
    c.node("prefill", "p0", &[]);
    // Every prompt through the prefill node, however short (conditional disaggregation is
    // checked at the end, through a second router on its defaults).
    c.router(&["--disaggregation", "always"]);

    // The reference, computed while the nodes load.
    let tok =
        tandem_engine::loader::gguf::tokenizer_of(&model()).unwrap();
    let chat = tok
        .apply_chat_template(
            &[ChatMessage {
                role: "user".into(),
                content: "Name three rivers in Europe.".into(),
            }],
            true,
        )
        .unwrap();
    let mut reqs: Vec<Request> = PROMPTS
        .iter()
        .enumerate()
        .map(|(i, p)| greedy(i as u64, tok.encode(p), 48))
        .collect();
    reqs.push(greedy(99, tok.encode(&chat), 48));
    // Over the router's default --local-prefill-max-tokens (64): always through a prefill node.
    let long_prompt = "Disaggregated serving splits prefill from decode. ".repeat(10);
    let long_ids = tok.encode(&long_prompt);
    assert!(long_ids.len() > 64, "{} tokens", long_ids.len());
    reqs.push(greedy(100, long_ids, 16));
    let (want, _) = engine_outputs(reqs);
    c.wait_ready(1, 1).await;
    // The decode node's own count of prompt tokens it computed, before any request (its
    // warm-up forward pass computed a few).
    let decode_prompt_before = c
        .node_metric(Role::Decode, "d0", "tandem_node_computed_prompt_tokens_total")
        .await
        .expect("the decode node's computed-prompt counter");

    // gRPC: token ids and text, plain and chat.
    let mut client = InferenceClient::connect(format!("http://{}", c.grpc))
        .await
        .unwrap();
    for (i, p) in PROMPTS.iter().enumerate() {
        let (ids, text) = grpc_generate(
            &mut client,
            grpc_request(generate_request::Input::Prompt(p.to_string()), 48),
        )
        .await
        .unwrap();
        assert_eq!(ids, want[i].tokens, "gRPC tokens for {p:?}");
        assert_eq!(ids.len(), 48);
        assert_eq!(text, want[i].text);
    }
    let chat_input = generate_request::Input::Chat(tandem_proto::v1::ChatMessages {
        messages: vec![tandem_proto::v1::ChatMessage {
            role: "user".into(),
            content: "Name three rivers in Europe.".into(),
        }],
    });
    let (ids, _) = grpc_generate(&mut client, grpc_request(chat_input, 48))
        .await
        .unwrap();
    assert_eq!(ids, want[3].tokens, "gRPC chat tokens");
    // Structured output over gRPC: the schema as JSON text in sampling.response_format.
    let mut structured = grpc_request(
        generate_request::Input::Prompt("Is the sky blue? Answer in JSON.".into()),
        32,
    );
    let sampling = structured.sampling.as_mut().unwrap();
    sampling.ignore_eos = false;
    sampling.response_format = Some(tandem_proto::v1::ResponseFormat {
        format: Some(tandem_proto::v1::response_format::Format::JsonSchema(
            tandem_proto::v1::response_format::JsonSchema {
                name: "answer".into(),
                schema: r#"{"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"], "additionalProperties": false}"#.into(),
                strict: true,
            },
        )),
    });
    let (_, text) = grpc_generate(&mut client, structured).await.unwrap();
    let v: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("gRPC structured output {text:?}: {e}"));
    assert!(v["answer"].is_boolean() && v.as_object().unwrap().len() == 1, "{text}");

    // HTTP: streamed and not, same text.
    let (_, models) = http(c.http, "GET", "/v1/models", None).await.unwrap();
    let model_id = serde_json::from_str::<serde_json::Value>(&models).unwrap()["data"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    for (i, p) in PROMPTS.iter().enumerate() {
        for stream in [false, true] {
            let body = serde_json::json!({"model": model_id, "prompt": p, "max_tokens": 48, "temperature": 0,
                "ignore_eos": true, "stream": stream}).to_string();
            let (status, resp) = http(c.http, "POST", "/v1/completions", Some(&body))
                .await
                .unwrap();
            assert_eq!(status, 200, "{resp}");
            let text = if stream {
                sse_text(&resp)
            } else {
                let v: serde_json::Value = serde_json::from_str(&resp).unwrap();
                assert_eq!(v["usage"]["completion_tokens"], 48);
                assert_eq!(v["usage"]["prompt_tokens"], want[i].usage.prompt_tokens);
                v["choices"][0]["text"].as_str().unwrap().to_string()
            };
            assert_eq!(text, want[i].text, "HTTP stream={stream} for {p:?}");
        }
    }

    // Disaggregated for real: the prefill node computed every prompt and the decode node none
    // (a decode node that recomputed prompts would produce the same tokens and pass the
    // equality checks above; its own counter would not stay at zero).
    let decode_prompt = c
        .node_metric(Role::Decode, "d0", "tandem_node_computed_prompt_tokens_total")
        .await
        .expect("the decode node's computed-prompt counter");
    let prefill_prompt = c
        .node_metric(Role::Prefill, "p0", "tandem_node_computed_prompt_tokens_total")
        .await
        .expect("the prefill node's computed-prompt counter");
    let generated = c
        .node_metric(Role::Decode, "d0", "tandem_node_generated_tokens_total")
        .await
        .expect("the decode node's generated-token counter");
    assert_eq!(
        decode_prompt, decode_prompt_before,
        "the decode node computed prompt tokens while serving\n{}",
        c.logs()
    );
    assert!(prefill_prompt > 0.0 && generated > 0.0, "prefill {prefill_prompt}, decode generated {generated}");
    // CPU nodes keep their KV in the transport's memory: nothing is staged, no graph is used,
    // nothing moves by CUDA IPC, no token is picked on a device, and the series are exported (a
    // GPU node's show there).
    for (role, id) in [(Role::Prefill, "p0"), (Role::Decode, "d0")] {
        for series in [
            "tandem_node_kv_staged_bytes_total",
            "tandem_node_cuda_graph_fallbacks_total",
            "tandem_kv_ipc_bytes_total",
            "tandem_kv_ipc_declined_total",
            "tandem_node_tokens_picked_on_device_total",
        ] {
            let v = c.node_metric(role, id, series).await;
            assert_eq!(v, Some(0.0), "{id}: {series}");
        }
    }

    // The official openai client, streaming a chat and a completion with usage.
    let python = std::env::var("TANDEM_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/e2e/openai_client.py");
    let out = tokio::process::Command::new(&python)
        .args([
            script,
            &format!("http://{}/v1", c.http),
            "--max-tokens",
            "24",
        ])
        .output()
        .await
        .unwrap_or_else(|e| panic!("running {python}: {e}; run scripts/setup.sh"));
    assert!(
        out.status.success(),
        "openai client failed (pip install -r tests/reference/requirements.txt?): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["chat"]["text"].as_str().unwrap().contains("Paris"), "{v}");
    for kind in ["chat", "completion"] {
        assert!(
            v[kind]["usage"]["prompt_tokens"].as_u64().unwrap() > 0,
            "{kind} usage: {v}"
        );
        assert!(
            v[kind]["usage"]["completion_tokens"].as_u64().unwrap() > 0,
            "{kind} usage: {v}"
        );
        assert!(
            v[kind]["chunks"].as_u64().unwrap() > 2,
            "{kind} was streamed: {v}"
        );
    }

    // The rest of the surface through the client's own types (tests/e2e/openai_client.py).
    let s = &v["surface"];
    let chat = &s["chat"];
    assert_eq!(chat["indices"], serde_json::json!([0, 1]), "{s}");
    assert_eq!(chat["texts"], chat["again"], "the same seed, the same choices: {s}");
    for (i, text) in chat["texts"].as_array().unwrap().iter().enumerate() {
        let text = text.as_str().unwrap();
        assert!(!text.contains('.') && !text.contains("\n\n"), "stop strings cut choice {i}: {text:?}");
        let lps = chat["logprobs"][i].as_array().unwrap();
        assert!(!lps.is_empty() && lps.len() <= 12, "choice {i}: {s}");
        for t in lps {
            assert!(t[1].as_f64().unwrap() <= 0.0 && t[2] == 2, "choice {i}: {t}");
        }
    }
    let total: u64 = (0..2).map(|i| chat["logprobs"][i].as_array().unwrap().len() as u64).sum();
    assert_eq!(chat["usage"]["completion_tokens"], total, "one logprob per generated token: {s}");
    assert_eq!(s["completion"]["tokens"], serde_json::json!({"0": 6, "1": 6}), "{s}");
    assert_ne!(s["greedy"], s["greedy_penalised"], "frequency_penalty is honoured: {s}");
    // Structured output, prefill node and decode node both following the grammar.
    let st = &s["structured"];
    let obj = &st["json_object"];
    let text = obj["text"].as_str().unwrap();
    if obj["finish_reason"] == "stop" {
        let v: serde_json::Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("json_object {text:?}: {e}"));
        assert!(v.is_object(), "{st}");
    } else {
        assert!(text.starts_with('{'), "json_object: {st}");
    }
    let schema = &st["json_schema"];
    assert_eq!(schema["finish_reason"], "stop", "a bounded schema ends: {st}");
    let city: serde_json::Value = serde_json::from_str(schema["text"].as_str().unwrap())
        .unwrap_or_else(|e| panic!("json_schema: {st}: {e}"));
    let fields: Vec<&str> = city.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(fields, ["city", "population_millions", "landmarks"], "{st}");
    assert!(city["population_millions"].as_u64().is_some_and(|p| p <= 40), "{st}");
    assert!(city["landmarks"].as_array().is_some_and(|l| l.len() <= 2), "{st}");
    assert_eq!(st["refused"]["status"], 400, "{st}");
    assert!(
        st["refused"]["body"]["message"].as_str().is_some_and(|m| m.contains("response_format.json_schema.schema")),
        "an unsupported schema is refused naming its part: {st}"
    );

    // Bad input: 4xx naming the field (HTTP), INVALID_ARGUMENT (gRPC); the cluster keeps serving.
    let long = "word ".repeat(9000);
    let cases = [
        ("{not json", 400, None),
        (
            &*serde_json::json!({"model": "no-such-model", "prompt": "hi"}).to_string(),
            404,
            Some("model"),
        ),
        (
            &*serde_json::json!({"model": model_id, "prompt": "hi", "max_tokens": 1_000_000})
                .to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            &*serde_json::json!({"model": model_id, "prompt": ""}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            &*serde_json::json!({"model": model_id, "prompt": long, "max_tokens": 8}).to_string(),
            400,
            Some("prompt"),
        ),
    ];
    for (body, status, param) in cases {
        let (got, resp) = http(c.http, "POST", "/v1/completions", Some(body))
            .await
            .unwrap();
        assert_eq!(got, status, "{resp}");
        let v: serde_json::Value =
            serde_json::from_str(&resp).unwrap_or_else(|_| panic!("OpenAI error body: {resp}"));
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{resp}"
        );
        if let Some(param) = param {
            assert!(
                v["error"]["param"] == param
                    || v["error"]["message"].as_str().unwrap().contains(param),
                "{resp}"
            );
        }
    }
    for (input, field) in [
        (generate_request::Input::Prompt(String::new()), "prompt"),
        (generate_request::Input::Prompt(long.clone()), "prompt"),
    ] {
        let err = grpc_generate(&mut client, grpc_request(input, 8))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
        assert!(err.message().contains(field), "{err:?}");
    }
    let err = grpc_generate(
        &mut client,
        grpc_request(generate_request::Input::Prompt("hi".into()), 1_000_000),
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("max_tokens"), "{err:?}");
    let (ids, _) = grpc_generate(
        &mut client,
        grpc_request(generate_request::Input::Prompt(PROMPTS[0].into()), 48),
    )
    .await
    .unwrap();
    assert_eq!(ids, want[0].tokens, "still serving after bad input");

    // NATS goes away: serving continues on the router's own counts, said in a log line and a
    // metric; when NATS returns, load reports drive routing again.
    let fallback = "tandem_router_load_fallback_entered_total{role=\"decode\"}";
    let before = c.metric(fallback).await.unwrap_or(0);
    c.nats.stop();
    c.wait_for(
        "the router to fall back to its own counts",
        Duration::from_secs(30),
        async |c| {
            let mut client = InferenceClient::connect(format!("http://{}", c.grpc))
                .await
                .unwrap();
            let (ids, _) = grpc_generate(
                &mut client,
                grpc_request(generate_request::Input::Prompt(PROMPTS[1].into()), 8),
            )
            .await
            .unwrap();
            assert_eq!(ids, want[1].tokens[..8], "served while NATS is down");
            c.metric(fallback).await.unwrap_or(0) > before
        },
    )
    .await;
    assert!(c.metric("tandem_router_load_signals_connected").await == Some(0));
    let router_log = c.proc("router").log_text().to_lowercase();
    assert!(
        router_log.contains("fallback") || router_log.contains("stale"),
        "a log line says so:\n{router_log}"
    );
    c.nats.restart().await;
    let picks = "tandem_router_routing_picks_total{role=\"decode\",source=\"load_report\"}";
    let picks_before = c.metric(picks).await.unwrap_or(0);
    c.wait_for(
        "load-report routing to resume",
        Duration::from_secs(30),
        async |c| {
            let mut client = InferenceClient::connect(format!("http://{}", c.grpc))
                .await
                .unwrap();
            grpc_generate(
                &mut client,
                grpc_request(generate_request::Input::Prompt(PROMPTS[2].into()), 4),
            )
            .await
            .unwrap();
            c.metric("tandem_router_load_signals_connected").await == Some(1)
                && c.metric(picks).await.unwrap_or(0) > picks_before
        },
    )
    .await;
    c.wait_all_blocks_free(&["d0", "p0"]).await;

    // Conditional disaggregation, through a second router on its defaults: the short prompts
    // are computed by the decode node itself (no prefill call, no KV transfer) with the same
    // tokens; the long one still goes through the prefill node.
    c.router_named("router-conditional", &["--canary-interval-secs", "0"]);
    let here = "tandem_node_prefills_here_total";
    let here_before = c.node_metric(Role::Decode, "d0", here).await.unwrap_or(0.0);
    let mut client = InferenceClient::connect(format!("http://{}", c.grpc))
        .await
        .unwrap();
    for (i, p) in PROMPTS.iter().enumerate() {
        let (ids, _) = grpc_generate(
            &mut client,
            grpc_request(generate_request::Input::Prompt(p.to_string()), 48),
        )
        .await
        .unwrap();
        assert_eq!(ids, want[i].tokens, "prefilled on the decode node: {p:?}");
    }
    assert_eq!(
        c.node_metric(Role::Decode, "d0", here).await,
        Some(here_before + PROMPTS.len() as f64),
        "the decode node computed each short prompt\n{}",
        c.logs()
    );
    let placed = |site: &str, reason: &str| {
        format!("tandem_router_prefill_placements_total{{site=\"{site}\",reason=\"{reason}\"}}")
    };
    assert_eq!(
        c.metric(&placed("decode_node", "short_prompt")).await,
        Some(PROMPTS.len() as u64)
    );
    let (ids, _) = grpc_generate(
        &mut client,
        grpc_request(generate_request::Input::Prompt(long_prompt.clone()), 16),
    )
    .await
    .unwrap();
    assert_eq!(ids, want[4].tokens, "the long prompt, disaggregated");
    assert_eq!(c.metric(&placed("prefill_node", "long_prompt")).await, Some(1));
    assert_eq!(
        c.node_metric(Role::Decode, "d0", here).await,
        Some(here_before + PROMPTS.len() as f64),
        "not computed on the decode node"
    );
    c.wait_all_blocks_free(&["d0", "p0"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_concurrent_streams_through_one_prefill_and_two_decode_nodes_all_complete_exactly()
 {
    let _serial = SERIAL.lock().await;
    let mut c = Cluster::start("e2e-conc").await;
    c.node("decode", "d0", &[]);
    c.node("decode", "d1", &[]);
    c.node("prefill", "p0", &[]);
    c.router(&["--max-in-flight", "64"]);
    let tok =
        tandem_engine::loader::gguf::tokenizer_of(&model()).unwrap();
    let texts: Vec<String> = (0..64)
        .map(|i| {
            format!(
                "Request {i}: {}",
                "Disaggregated serving splits prefill from decode. ".repeat(1 + i % 9)
            )
        })
        .collect();
    let max_tokens = |i: usize| 8 + (i % 5) * 6;
    let reqs = texts
        .iter()
        .enumerate()
        .map(|(i, t)| greedy(i as u64, tok.encode(t), max_tokens(i)))
        .collect();
    let (want, _) = engine_outputs(reqs);
    c.wait_ready(1, 2).await;

    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for (i, t) in texts.iter().enumerate() {
        let (addr, t) = (c.grpc, t.clone());
        tasks.push(tokio::spawn(async move {
            let mut client = InferenceClient::connect(format!("http://{addr}"))
                .await
                .unwrap();
            grpc_generate(
                &mut client,
                grpc_request(generate_request::Input::Prompt(t), max_tokens(i) as u32),
            )
            .await
        }));
    }
    for (i, task) in tasks.into_iter().enumerate() {
        let (ids, _) = tokio::time::timeout(WAIT, task)
            .await
            .expect("stream finished")
            .unwrap()
            .unwrap_or_else(|e| panic!("request {i}: {e:?}\n{}", c.logs()));
        assert_eq!(ids, want[i].tokens, "request {i}");
    }
    eprintln!("64 streams in {:?}", t0.elapsed());
    c.wait_all_blocks_free(&["d0", "d1", "p0"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_nodes_join_under_load_leave_when_their_lease_lapses_and_a_foreign_layout_is_refused()
{
    let _serial = SERIAL.lock().await;
    let mut c = Cluster::start("e2e-members").await;
    c.node("decode", "d0", &[]);
    c.node("prefill", "p0", &[]);
    c.router(&[]);
    c.wait_ready(1, 1).await;

    // Steady background traffic, four streams at a time.
    let stop = Arc::new(AtomicBool::new(false));
    let mut load = Vec::new();
    for k in 0..4 {
        let (addr, stop) = (c.grpc, stop.clone());
        load.push(tokio::spawn(async move {
            let mut client = InferenceClient::connect(format!("http://{addr}"))
                .await
                .unwrap();
            // Every request counted: a failure or a short answer is kept with why (the first
            // few; a dead router must not grow this without bound while the test unwinds).
            let (mut ok, mut failed) = (0u32, Vec::new());
            let mut failures = 0u32;
            while !stop.load(Ordering::Relaxed) {
                let prompt = format!("Background request {k}: tell me about rivers.");
                let why = match grpc_generate(
                    &mut client,
                    grpc_request(generate_request::Input::Prompt(prompt), 24),
                )
                .await
                {
                    Ok((ids, _)) if ids.len() == 24 => {
                        ok += 1;
                        continue;
                    }
                    Ok((ids, _)) => format!("{} tokens instead of 24", ids.len()),
                    Err(e) => format!("{e:?}"),
                };
                failures += 1;
                if failed.len() < 16 {
                    failed.push(why);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            if failures as usize > failed.len() {
                failed.push(format!("... {} failures in all", failures));
            }
            (ok, failed)
        }));
    }

    // A new decode node gets traffic once registered, with no restart of the router (the
    // router's per-node in-flight gauge on /metrics counts it from the moment a request is
    // dispatched there). How soon is printed, not asserted: on a loaded machine a watch event
    // can take longer than on a quiet one; the wait bounds it at ten lease TTLs.
    c.node("decode", "d1", &[]);
    c.wait_for("d1 to register", WAIT, async |c| {
        c.registered(Role::Decode).await.contains(&"d1".to_string())
    })
    .await;
    let registered_at = Instant::now();
    c.wait_for("d1 to get traffic", Duration::from_secs(20), async |c| {
        c.metric("tandem_router_in_flight{role=\"decode\",node=\"d1\"}")
            .await
            .unwrap_or(0)
            > 0
    })
    .await;
    let joined_after = registered_at.elapsed();
    eprintln!("d1 received traffic {joined_after:?} after registering");

    // kill -9 of d0: gone from membership once its lease (TTL 2 s) lapses, with nobody
    // deregistering it, and requests still succeed. How soon is printed; the wait bounds it.
    let killed_at = Instant::now();
    let d0 = c.proc("d0");
    d0.child.kill().unwrap(); // SIGKILL
    d0.name = "killed-d0".into();
    c.wait_for(
        "d0 to leave membership",
        Duration::from_secs(20),
        async |c| !c.registered(Role::Decode).await.contains(&"d0".to_string()),
    )
    .await;
    let gone_after = killed_at.elapsed();
    eprintln!("d0 left membership {gone_after:?} after kill -9");
    let mut client = InferenceClient::connect(format!("http://{}", c.grpc))
        .await
        .unwrap();
    for p in PROMPTS {
        let (ids, _) = grpc_generate(
            &mut client,
            grpc_request(generate_request::Input::Prompt(p.to_string()), 16),
        )
        .await
        .unwrap_or_else(|e| panic!("{e:?}\n{}", c.logs()));
        assert_eq!(ids.len(), 16);
    }
    stop.store(true, Ordering::Relaxed);
    let (mut ok, mut failed) = (0, Vec::new());
    for t in load {
        let (o, f) = tokio::time::timeout(WAIT, t).await.unwrap().unwrap();
        ok += o;
        failed.extend(f);
    }
    eprintln!("background load around the kill -9: {ok} ok, {} failed", failed.len());
    assert!(ok >= 8, "only {ok} background requests completed");
    // Streams on d0 when it died migrate to d1 (re-prefill of prompt + tokens so far).
    assert!(failed.is_empty(), "requests lost around the kill -9 of d0: {failed:#?}\n{}", c.logs());

    // A decode node whose KV layout differs (f16 KV in an f32 cluster) is refused.
    c.node("decode", "expect-exit-f16", &["--kv-dtype", "f16"]);
    c.wait_for("the foreign-layout node to exit", WAIT, async |c| {
        c.proc("expect-exit-f16")
            .child
            .try_wait()
            .unwrap()
            .is_some()
    })
    .await;
    let p = c.proc("expect-exit-f16");
    let status = p.child.wait().unwrap();
    assert!(!status.success(), "refused node exits non-zero");
    let log = p.log_text().to_lowercase();
    assert!(
        log.contains("layout"),
        "a clear log line names the layout:\n{log}"
    );
    assert!(
        !c.registered(Role::Decode)
            .await
            .contains(&"expect-exit-f16".to_string())
    );
    c.wait_all_blocks_free(&["d1", "p0"]).await;
}
