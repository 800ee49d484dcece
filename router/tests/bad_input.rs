//! Every bad input gets the right status and an error naming the field, over HTTP (OpenAI
//! error body) and gRPC (INVALID_ARGUMENT / NOT_FOUND with the field in the message), and the
//! router keeps serving afterwards.

use crate::common;

use common::fakes::{start_decode, start_prefill};
use common::{MemoryCluster, RunningRouter, http, init_tracing, model, options};
use tandem_proto::v1 as pb;

async fn serving_router() -> (RunningRouter, Vec<Box<dyn std::any::Any>>) {
    let mut cluster = MemoryCluster::new();
    let p = start_prefill("p0").await;
    let d = start_decode("d0").await;
    cluster.register(p.info()).await;
    cluster.register(d.info()).await;
    let router = cluster.router(options()).await;
    (router, vec![Box::new(p), Box::new(d), Box::new(cluster)])
}

/// A prompt of more tokens than the model's context.
fn overlong_prompt() -> String {
    let context = model().context_tokens as usize;
    "hello ".repeat(context + 10)
}

async fn assert_still_serving(router: &RunningRouter) {
    let ok = http(
        router.http_addr,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt": "still there?", "max_tokens": 2}"#),
        None,
    )
    .await;
    assert_eq!(ok.status, 200, "router stopped serving: {}", ok.body);
}

#[tokio::test]
async fn every_bad_http_input_gets_an_openai_error_naming_the_field() {
    init_tracing();
    let (router, _keep) = serving_router().await;
    let long = overlong_prompt();
    let long_body = format!(r#"{{"prompt": "{long}", "max_tokens": 8}}"#);
    let long_chat = format!(r#"{{"messages": [{{"role": "user", "content": "{long}"}}]}}"#);
    // (endpoint, body, status, param, what the message must mention)
    let cases: Vec<(&str, String, u16, Option<&str>, &str)> = vec![
        (
            "/v1/completions",
            "{not json".into(),
            400,
            None,
            "key must be a string",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "hi", "max_tokens": "ten"}"#.into(),
            400,
            Some("max_tokens"),
            "invalid type",
        ),
        (
            "/v1/completions",
            r#"{"max_tokens": 3}"#.into(),
            400,
            Some("prompt"),
            "missing field `prompt`",
        ),
        (
            "/v1/chat/completions",
            r#"{"prompt": "x"}"#.into(),
            400,
            Some("messages"),
            "missing field `messages`",
        ),
        (
            "/v1/completions",
            r#"{"prompt": ""}"#.into(),
            400,
            Some("prompt"),
            "must not be empty",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": []}"#.into(),
            400,
            Some("messages"),
            "at least one message",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"role": "wizard", "content": "x"}]}"#.into(),
            400,
            Some("messages"),
            "wizard",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "hi", "model": "gpt-9"}"#.into(),
            404,
            Some("model"),
            "gpt-9",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "hi", "max_tokens": 65}"#.into(),
            400,
            Some("max_tokens"),
            "limit of 64",
        ),
        (
            "/v1/completions",
            long_body,
            400,
            Some("prompt"),
            "context length",
        ),
        (
            "/v1/chat/completions",
            long_chat,
            400,
            Some("messages"),
            "context length",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "hi", "temperature": 3.5}"#.into(),
            400,
            Some("temperature"),
            "[0, 2]",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "hi", "top_p": 1.5}"#.into(),
            400,
            Some("top_p"),
            "(0, 1]",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "hi", "top_k": -5}"#.into(),
            400,
            Some("top_k"),
            "-5",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "hi", "stop": ["a","b","c","d","e"]}"#.into(),
            400,
            Some("stop"),
            "at most 4",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "hi", "n": 17}"#.into(),
            400,
            Some("n"),
            "expected 1 to 16",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "hi", "priority": "urgent"}"#.into(),
            400,
            Some("priority"),
            "urgent",
        ),
        (
            "/v1/completions",
            r#"{"prompt": [1, 99999999]}"#.into(),
            400,
            Some("prompt"),
            "outside the vocabulary",
        ),
        (
            "/v1/completions",
            r#"{"prompt": "hi", "logprobs": 9}"#.into(),
            400,
            Some("logprobs"),
            "from 0 to 5",
        ),
    ];
    for (path, body, status, param, mention) in cases {
        let response = http(router.http_addr, "POST", path, Some(&body), None).await;
        let shown: String = body.chars().take(80).collect();
        assert_eq!(response.status, status, "{path} {shown}: {}", response.body);
        let json = response.json();
        let error = &json["error"];
        for key in ["message", "type", "param", "code"] {
            assert!(
                error.get(key).is_some(),
                "{shown}: error body lacks `{key}`: {json}"
            );
        }
        assert_eq!(error["param"].as_str(), param, "{shown}: {json}");
        let message = error["message"].as_str().unwrap();
        assert!(
            message.contains(mention),
            "{shown}: `{message}` should mention `{mention}`"
        );
        if let Some(param) = param {
            assert!(
                message.contains(param),
                "{shown}: `{message}` should name `{param}`"
            );
        }
    }
    assert_still_serving(&router).await;
}

#[tokio::test]
async fn every_bad_grpc_input_gets_invalid_argument_or_not_found_naming_the_field() {
    init_tracing();
    let (router, _keep) = serving_router().await;
    let mut client = router.grpc().await;
    let text = |prompt: &str| Some(pb::generate_request::Input::Prompt(prompt.to_string()));
    let sampling = |max_tokens: u32, temperature: f32| {
        Some(pb::SamplingParams {
            max_tokens,
            temperature,
            ..Default::default()
        })
    };
    let base = pb::GenerateRequest {
        input: text("hi"),
        sampling: sampling(2, 0.0),
        ..Default::default()
    };
    let cases: Vec<(pb::GenerateRequest, tonic::Code, &str)> = vec![
        (
            pb::GenerateRequest {
                input: None,
                ..base.clone()
            },
            tonic::Code::InvalidArgument,
            "prompt",
        ),
        (
            pb::GenerateRequest {
                input: text(""),
                ..base.clone()
            },
            tonic::Code::InvalidArgument,
            "prompt",
        ),
        (
            pb::GenerateRequest {
                input: Some(pb::generate_request::Input::Chat(pb::ChatMessages {
                    messages: vec![],
                })),
                ..base.clone()
            },
            tonic::Code::InvalidArgument,
            "chat.messages",
        ),
        (
            pb::GenerateRequest {
                input: Some(pb::generate_request::Input::TokenIds(pb::TokenIds {
                    ids: vec![],
                })),
                ..base.clone()
            },
            tonic::Code::InvalidArgument,
            "token_ids.ids",
        ),
        (
            pb::GenerateRequest {
                model: "gpt-9".into(),
                ..base.clone()
            },
            tonic::Code::NotFound,
            "gpt-9",
        ),
        (
            pb::GenerateRequest {
                sampling: sampling(65, 0.0),
                ..base.clone()
            },
            tonic::Code::InvalidArgument,
            "sampling.max_tokens",
        ),
        (
            pb::GenerateRequest {
                input: text(&overlong_prompt()),
                ..base.clone()
            },
            tonic::Code::InvalidArgument,
            "prompt",
        ),
        (
            pb::GenerateRequest {
                sampling: sampling(2, -1.0),
                ..base.clone()
            },
            tonic::Code::InvalidArgument,
            "sampling.temperature",
        ),
        (
            pb::GenerateRequest {
                priority: 7,
                ..base.clone()
            },
            tonic::Code::InvalidArgument,
            "priority",
        ),
    ];
    for (request, code, field) in cases {
        let status = match client.generate(request.clone()).await {
            Ok(_) => panic!("{request:?} was accepted"),
            Err(status) => status,
        };
        assert_eq!(status.code(), code, "{}", status.message());
        assert!(
            status.message().contains(field),
            "`{}` should name `{field}`",
            status.message()
        );
    }
    let mut ok = client
        .generate(base)
        .await
        .expect("a good request after the bad ones")
        .into_inner();
    let mut saw_final = false;
    while let Some(message) = ok.message().await.unwrap() {
        saw_final |= matches!(message.event, Some(pb::generate_response::Event::Final(_)));
    }
    assert!(saw_final);
    assert_still_serving(&router).await;
}

/// A body over the ingress's limit is a 413 with an OpenAI-shaped JSON error (not axum's plain
/// text), on both routes, and the router goes on serving.
#[tokio::test]
async fn an_oversize_body_is_a_413_with_an_openai_error() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    init_tracing();
    let (router, _keep) = serving_router().await;
    let size = tandem_router::http::BODY_LIMIT_BYTES + (1 << 20);
    let body = format!(r#"{{"prompt": "{}"}}"#, "a".repeat(size));
    for path in ["/v1/completions", "/v1/chat/completions"] {
        let mut stream = tokio::net::TcpStream::connect(router.http_addr).await.unwrap();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        // The router may answer and close before it has read the whole body.
        let _ = stream.write_all(body.as_bytes()).await;
        let mut raw = Vec::new();
        let _ = stream.read_to_end(&mut raw).await;
        let text = String::from_utf8_lossy(&raw);
        assert!(text.starts_with("HTTP/1.1 413"), "{path}: {}", &text[..text.len().min(300)]);
        let json: serde_json::Value = serde_json::from_str(text.split("\r\n\r\n").nth(1).unwrap_or(""))
            .unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {text}"));
        assert_eq!(json["error"]["code"], "request_too_large", "{json}");
        assert_eq!(json["error"]["type"], "invalid_request_error", "{json}");
        assert!(json["error"]["message"].as_str().unwrap().contains("bytes"), "{json}");
    }
    assert_still_serving(&router).await;
}
