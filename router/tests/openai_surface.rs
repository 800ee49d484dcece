//! The rest of the OpenAI surface against fake nodes: `n` choices (JSON, SSE and gRPC, by
//! index, usage counting the prompt once), `logprobs` in both OpenAI shapes, penalties passed
//! to the nodes, and the bad values of each refused with a 400 naming the field.

use crate::common;

use std::time::Duration;

use common::fakes::{cluster_with_one_pair, expected_output, fake_logprob};
use common::{chat_prompt_len, http, init_tracing, model, options};
use serde_json::Value;
use tandem_cluster::Role;
use tandem_proto::v1 as pb;

fn token_text(id: u32) -> String {
    String::from_utf8_lossy(model().tokenizer.token_bytes(id).unwrap()).into_owned()
}

#[tokio::test]
async fn n_choices_answer_by_index_with_chat_logprobs_and_the_prompt_counted_once() {
    init_tracing();
    let (cluster, _nodes) = cluster_with_one_pair().await;
    let router = cluster.router(options()).await;
    let body = r#"{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4, "n": 3,
                   "logprobs": true, "top_logprobs": 1}"#;
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
    let prompt = chat_prompt_len("Hi!");
    let (ids, text) = expected_output(prompt, 4);
    let choices = json["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{json}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i as u64);
        assert_eq!(c["message"]["content"], text);
        let content = c["logprobs"]["content"].as_array().unwrap();
        assert_eq!(content.len(), 4, "one entry per token: {c}");
        for (e, &id) in content.iter().zip(&ids) {
            let want = fake_logprob(id);
            assert_eq!(e["token"], token_text(id));
            assert!((e["logprob"].as_f64().unwrap() - f64::from(want.logprob)).abs() < 1e-6);
            assert_eq!(
                e["bytes"].as_array().unwrap().len(),
                model().tokenizer.token_bytes(id).unwrap().len()
            );
            assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 1);
        }
    }
    assert_eq!(
        json["usage"]["prompt_tokens"], prompt as u64,
        "the prompt once"
    );
    assert_eq!(
        json["usage"]["completion_tokens"], 12,
        "every choice's output"
    );
    // Without logprobs the field is null.
    let body = r#"{"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 2}"#;
    let json = http(
        router.http_addr,
        "POST",
        "/v1/chat/completions",
        Some(body),
        None,
    )
    .await
    .json();
    assert!(json["choices"][0]["logprobs"].is_null(), "{json}");
}

#[tokio::test]
async fn streamed_choices_interleave_by_index_and_usage_follows_the_last() {
    init_tracing();
    let (cluster, _nodes) = cluster_with_one_pair().await;
    let router = cluster.router(options()).await;
    let prompt = "Once upon a time";
    let body = format!(
        r#"{{"prompt": "{prompt}", "max_tokens": 5, "n": 2, "logprobs": 0, "stream": true,
             "stream_options": {{"include_usage": true}}}}"#
    );
    let response = http(
        router.http_addr,
        "POST",
        "/v1/completions",
        Some(&body),
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
    let prompt_len = model().tokenizer.encode(prompt).len();
    let (ids, expected) = expected_output(prompt_len, 5);
    let (mut text, mut tokens, mut finishes) = ([String::new(), String::new()], [0, 0], [0, 0]);
    for c in chunks.iter().flat_map(|c| c["choices"].as_array().unwrap()) {
        let i = c["index"].as_u64().unwrap() as usize;
        text[i].push_str(c["text"].as_str().unwrap());
        finishes[i] += usize::from(!c["finish_reason"].is_null());
        if let Some(l) = c["logprobs"].as_object() {
            let n = l["tokens"].as_array().unwrap().len();
            assert_eq!(l["token_logprobs"].as_array().unwrap().len(), n);
            assert!(
                l["top_logprobs"].is_null(),
                "logprobs: 0 asks for no alternatives"
            );
            tokens[i] += n;
        }
    }
    assert_eq!(text, [expected.clone(), expected]);
    assert_eq!(tokens, [ids.len(), ids.len()]);
    assert_eq!(finishes, [1, 1]);
    let usage: Vec<&Value> = chunks
        .iter()
        .filter(|c| c["usage"].is_object())
        .map(|c| &c["usage"])
        .collect();
    assert_eq!(usage.len(), 1);
    assert_eq!(usage[0]["prompt_tokens"], prompt_len as u64);
    assert_eq!(usage[0]["completion_tokens"], 10);
    assert_eq!(chunks.last().unwrap()["choices"], serde_json::json!([]));
}

#[tokio::test]
async fn grpc_choices_carry_their_index_and_each_ends_with_its_final() {
    init_tracing();
    let (cluster, _nodes) = cluster_with_one_pair().await;
    let router = cluster.router(options()).await;
    let mut request = common::grpc_request("The sky is", 3);
    request.n = 2;
    request.sampling.as_mut().unwrap().logprobs = true;
    let mut stream = router
        .grpc()
        .await
        .generate(request)
        .await
        .unwrap()
        .into_inner();
    let (mut ids, mut finals, mut logprobs) = ([vec![], vec![]], [0, 0], [0, 0]);
    while let Some(message) = tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .unwrap()
        .unwrap()
    {
        match message.event.unwrap() {
            pb::generate_response::Event::Delta(d) => {
                logprobs[d.index as usize] += d.logprobs.len();
                assert_eq!(d.logprobs.len(), d.token_ids.len());
                ids[d.index as usize].extend(d.token_ids);
            }
            pb::generate_response::Event::Final(f) => {
                finals[f.index as usize] += 1;
                assert!(
                    f.request_id.ends_with(&format!("-{}", f.index)),
                    "choice i runs as {{id}}-{{i}}: {}",
                    f.request_id
                );
            }
        }
    }
    let (want, _) = expected_output(common::prompt_tokens("The sky is"), 3);
    assert_eq!(ids, [want.clone(), want]);
    assert_eq!(finals, [1, 1]);
    assert_eq!(logprobs, [3, 3]);
}

#[tokio::test]
async fn bad_choice_counts_logprobs_and_penalties_are_refused_by_name() {
    init_tracing();
    let (cluster, _nodes) = cluster_with_one_pair().await;
    let router = cluster.router(options()).await;
    for (field, body) in [
        ("n", r#""n": 0"#),
        ("n", r#""n": 17"#),
        ("presence_penalty", r#""presence_penalty": 2.5"#),
        ("frequency_penalty", r#""frequency_penalty": -3"#),
        ("repetition_penalty", r#""repetition_penalty": 0"#),
        ("top_logprobs", r#""logprobs": true, "top_logprobs": 21"#),
        ("top_logprobs", r#""top_logprobs": 2"#),
        ("logprobs", r#""logprobs": "yes""#),
    ] {
        let body = format!(
            r#"{{"messages": [{{"role": "user", "content": "x"}}], "max_tokens": 2, {body}}}"#
        );
        let response = http(
            router.http_addr,
            "POST",
            "/v1/chat/completions",
            Some(&body),
            None,
        )
        .await;
        assert_eq!(response.status, 400, "{body}: {}", response.body);
        assert_eq!(
            response.json()["error"]["param"],
            field,
            "{body}: {}",
            response.body
        );
    }
    // n beyond the decode pool's KV: the limit is named. The fake decode node reports 64
    // blocks of 16 tokens = 1,024 tokens; 16 choices of (prompt + 60) do not fit.
    cluster.loads.set(Role::Decode, "d0", Duration::ZERO, |r| {
        r.total_blocks = 64;
        r.free_blocks = 64;
    });
    let body = r#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": 60, "n": 16}"#;
    let response = http(
        router.http_addr,
        "POST",
        "/v1/chat/completions",
        Some(body),
        None,
    )
    .await;
    assert_eq!(response.status, 400, "{}", response.body);
    let error = response.json()["error"].clone();
    assert_eq!(error["param"], "n", "{error}");
    assert!(
        error["message"].as_str().unwrap().contains("at most n = "),
        "{error}"
    );
    let ok = r#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "n": 2}"#;
    let response = http(
        router.http_addr,
        "POST",
        "/v1/chat/completions",
        Some(ok),
        None,
    )
    .await;
    assert_eq!(response.status, 200, "two choices fit: {}", response.body);
}
