//! The OpenAI-compatible HTTP ingress against fake nodes: stream and JSON shapes, usage,
//! models, health, authentication.

use crate::common;

use common::fakes::{cluster_with_one_pair, expected_output, start_decode, start_prefill};
use common::{MemoryCluster, chat_prompt_len, http, init_tracing, model, options, prompt_tokens};
use serde_json::Value;
use tandem_router::ApiKeys;

fn assert_usage(usage: &Value, prompt: usize, completion: u32) {
    assert_eq!(usage["prompt_tokens"], prompt as u64, "{usage}");
    assert_eq!(usage["completion_tokens"], completion as u64, "{usage}");
    assert_eq!(
        usage["total_tokens"],
        prompt as u64 + completion as u64,
        "{usage}"
    );
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"], 0,
        "{usage}"
    );
}

#[tokio::test]
async fn non_streamed_completion_and_chat_answer_openai_shaped_json_with_usage() {
    init_tracing();
    let (cluster, _nodes) = cluster_with_one_pair().await;
    let router = cluster.router(options()).await;

    let prompt = "The capital of France is";
    let body = format!(r#"{{"model": "smollm2", "prompt": "{prompt}", "max_tokens": 5}}"#);
    let response = http(
        router.http_addr,
        "POST",
        "/v1/completions",
        Some(&body),
        None,
    )
    .await;
    assert_eq!(response.status, 200, "{}", response.body);
    let json = response.json();
    let (_, text) = expected_output(prompt_tokens(prompt), 5);
    assert_eq!(json["object"], "text_completion");
    assert!(json["id"].as_str().unwrap().starts_with("cmpl-"), "{json}");
    assert!(json["created"].as_u64().unwrap() > 0);
    assert_eq!(json["model"], "smollm2");
    assert_eq!(json["choices"][0]["index"], 0);
    assert_eq!(json["choices"][0]["text"], text);
    assert_eq!(json["choices"][0]["finish_reason"], "length");
    assert!(json["choices"][0]["logprobs"].is_null());
    assert_usage(&json["usage"], prompt_tokens(prompt), 5);

    let body = r#"{"model": "smollm2", "messages": [{"role": "user", "content": "Hi!"}], "max_completion_tokens": 4}"#;
    let response = http(
        router.http_addr,
        "POST",
        "/v1/chat/completions",
        Some(body),
        None,
    )
    .await;
    assert_eq!(response.status, 200, "{}", response.body);
    let json = response.json();
    let (_, text) = expected_output(chat_prompt_len("Hi!"), 4);
    assert_eq!(json["object"], "chat.completion");
    assert!(
        json["id"].as_str().unwrap().starts_with("chatcmpl-"),
        "{json}"
    );
    assert_eq!(json["choices"][0]["message"]["role"], "assistant");
    assert_eq!(json["choices"][0]["message"]["content"], text);
    assert_eq!(json["choices"][0]["finish_reason"], "length");
    assert_usage(&json["usage"], chat_prompt_len("Hi!"), 4);
}

#[tokio::test]
async fn streamed_completion_is_sse_chunks_then_done() {
    init_tracing();
    let (cluster, _nodes) = cluster_with_one_pair().await;
    let router = cluster.router(options()).await;
    let prompt = "Once upon a time";
    let body = format!(r#"{{"prompt": "{prompt}", "max_tokens": 6, "stream": true}}"#);
    let response = http(
        router.http_addr,
        "POST",
        "/v1/completions",
        Some(&body),
        None,
    )
    .await;
    assert_eq!(response.status, 200, "{}", response.body);
    assert!(
        response
            .header("content-type")
            .unwrap()
            .starts_with("text/event-stream")
    );
    let data = response.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let (_, expected) = expected_output(prompt_tokens(prompt), 6);
    let mut text = String::new();
    for chunk in &chunks {
        assert_eq!(chunk["object"], "text_completion", "{chunk}");
        assert_eq!(chunk["model"], "smollm2");
        assert_eq!(chunk["id"], chunks[0]["id"]);
        assert!(
            chunk.get("usage").is_none(),
            "usage only when asked: {chunk}"
        );
        text.push_str(chunk["choices"][0]["text"].as_str().unwrap());
    }
    assert_eq!(text, expected);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert!(
        chunks[..chunks.len() - 1]
            .iter()
            .all(|c| c["choices"][0]["finish_reason"].is_null())
    );
    assert_eq!(
        chunks.len(),
        6 + 1,
        "one chunk per token, then the finish chunk"
    );
}

#[tokio::test]
async fn streamed_chat_starts_with_the_role_and_ends_with_usage_when_asked() {
    init_tracing();
    let (cluster, _nodes) = cluster_with_one_pair().await;
    let router = cluster.router(options()).await;
    let body = r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
                   "max_tokens": 3, "stream": true, "stream_options": {"include_usage": true}}"#;
    let response = http(
        router.http_addr,
        "POST",
        "/v1/chat/completions",
        Some(body),
        None,
    )
    .await;
    assert_eq!(response.status, 200, "{}", response.body);
    let data = response.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    for chunk in &chunks {
        assert_eq!(chunk["object"], "chat.completion.chunk", "{chunk}");
        assert!(
            chunk.get("usage").is_some(),
            "usage key on every chunk: {chunk}"
        );
    }
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let usage_chunk = chunks.last().unwrap();
    assert_eq!(usage_chunk["choices"].as_array().unwrap().len(), 0);
    let tokenizer = &model().tokenizer;
    let rendered = tokenizer
        .apply_chat_template(
            &[
                tandem_tokenizer::ChatMessage::new("system", "Be brief."),
                tandem_tokenizer::ChatMessage::new("user", "Hi!"),
            ],
            true,
        )
        .unwrap();
    let prompt = tokenizer.encode(&rendered).len();
    assert_usage(&usage_chunk["usage"], prompt, 3);
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    assert!(finish["usage"].is_null());
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, expected_output(prompt, 3).1);
}

#[tokio::test]
async fn models_lists_the_served_model_and_health_follows_membership() {
    init_tracing();
    let mut cluster = MemoryCluster::new();
    let router = cluster.router(options()).await;
    let models = http(router.http_addr, "GET", "/v1/models", None, None).await;
    assert_eq!(models.status, 200);
    let json = models.json();
    assert_eq!(json["object"], "list");
    assert_eq!(json["data"][0]["id"], "smollm2");
    assert_eq!(json["data"][0]["object"], "model");

    let health = http(router.http_addr, "GET", "/health", None, None).await;
    assert_eq!(health.status, 503, "no nodes yet");
    let p = start_prefill("p0").await;
    cluster.register(p.info()).await;
    assert_eq!(
        http(router.http_addr, "GET", "/health", None, None)
            .await
            .status,
        503,
        "no decode node yet"
    );
    let d = start_decode("d0").await;
    cluster.register(d.info()).await;
    assert_eq!(
        http(router.http_addr, "GET", "/health", None, None)
            .await
            .status,
        200
    );
    cluster.deregister("p0").await;
    assert_eq!(
        http(router.http_addr, "GET", "/health", None, None)
            .await
            .status,
        503,
        "prefill left"
    );

    let unknown = http(router.http_addr, "GET", "/v2/nothing", None, None).await;
    assert_eq!(unknown.status, 404);
    assert!(unknown.json()["error"]["message"].is_string());
}

#[tokio::test]
async fn api_keys_are_required_on_v1_routes_but_not_on_health() {
    init_tracing();
    let (cluster, _nodes) = cluster_with_one_pair().await;
    let mut opts = options();
    opts.api_keys = ApiKeys::new(["sk-test".to_string()]);
    let router = cluster.router(opts).await;
    let body = r#"{"prompt": "hi", "max_tokens": 2}"#;
    for key in [None, Some("sk-wrong")] {
        let response = http(router.http_addr, "POST", "/v1/completions", Some(body), key).await;
        assert_eq!(response.status, 401, "{}", response.body);
        let error = &response.json()["error"];
        assert_eq!(error["type"], "authentication_error");
        assert_eq!(error["code"], "invalid_api_key");
        assert!(error.get("param").is_some());
    }
    assert_eq!(
        http(router.http_addr, "GET", "/v1/models", None, None)
            .await
            .status,
        401
    );
    let ok = http(
        router.http_addr,
        "POST",
        "/v1/completions",
        Some(body),
        Some("sk-test"),
    )
    .await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    assert_eq!(
        http(router.http_addr, "GET", "/health", None, None)
            .await
            .status,
        200
    );

    let mut grpc = router.grpc().await;
    let status = grpc
        .list_models(tandem_proto::v1::ListModelsRequest {})
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated);
    let mut request = tonic::Request::new(tandem_proto::v1::ListModelsRequest {});
    request
        .metadata_mut()
        .insert("authorization", "Bearer sk-test".parse().unwrap());
    assert_eq!(
        grpc.list_models(request)
            .await
            .unwrap()
            .into_inner()
            .models
            .len(),
        1
    );
}
