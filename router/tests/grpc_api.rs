//! The gRPC ingress against fake nodes: the Generate stream's shape, ListModels, the standard
//! health service following membership, server reflection, and a cancelled call.

use crate::common;

use std::sync::atomic::Ordering;

use common::fakes::{expected_output, start_decode, start_prefill};
use common::{
    MemoryCluster, collect, grpc_request, init_tracing, options, prompt_tokens, wait_until,
};
use futures_util::StreamExt;
use tandem_proto::v1 as pb;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

#[tokio::test]
async fn generate_streams_deltas_with_token_ids_then_one_final_with_usage_and_request_id() {
    init_tracing();
    let mut cluster = MemoryCluster::new();
    let p = start_prefill("p0").await;
    let d = start_decode("d0").await;
    cluster.register(p.info()).await;
    cluster.register(d.info()).await;
    let router = cluster.router(options()).await;
    let mut client = router.grpc().await;

    let mut request = grpc_request("The sky is", 7);
    request.request_id = "caller-42".into();
    request.priority = pb::Priority::Batch as i32;
    let out = collect(client.generate(request).await.unwrap().into_inner())
        .await
        .unwrap();
    let (ids, text) = expected_output(prompt_tokens("The sky is"), 7);
    assert_eq!((out.ids, out.text), (ids, text));
    let last = out.last.expect("exactly one final message");
    assert_eq!(last.request_id, "caller-42");
    assert_eq!(last.finish_reason(), pb::FinishReason::Length);
    let usage = last.usage.unwrap();
    assert_eq!(
        (usage.prompt_tokens as usize, usage.completion_tokens),
        (prompt_tokens("The sky is"), 7)
    );

    // Chat input and pre-tokenized input take the same path.
    let chat = pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Chat(pb::ChatMessages {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: "Hi".into(),
            }],
        })),
        ..grpc_request("", 3)
    };
    assert_eq!(
        collect(client.generate(chat).await.unwrap().into_inner())
            .await
            .unwrap()
            .ids
            .len(),
        3
    );
    let tokens = pb::GenerateRequest {
        input: Some(pb::generate_request::Input::TokenIds(pb::TokenIds {
            ids: vec![1, 2, 3, 4],
        })),
        ..grpc_request("", 2)
    };
    let out = collect(client.generate(tokens).await.unwrap().into_inner())
        .await
        .unwrap();
    assert_eq!(out.ids, expected_output(4, 2).0);

    let models = client
        .list_models(pb::ListModelsRequest {})
        .await
        .unwrap()
        .into_inner()
        .models;
    assert_eq!(models.len(), 1);
    assert_eq!(models[0].name, "smollm2");
    assert_eq!(models[0].max_output_tokens, 64);
    assert!(models[0].max_context_tokens > 0);
}

#[tokio::test]
async fn the_health_service_reports_serving_only_with_both_roles_and_reflection_lists_the_api() {
    init_tracing();
    let mut cluster = MemoryCluster::new();
    let router = cluster.router(options()).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", router.grpc_addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel.clone());
    let mut watch = health
        .watch(HealthCheckRequest {
            service: "tandem.v1.Inference".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let mut next_status = async move || {
        let message = tokio::time::timeout(common::WAIT, watch.next())
            .await
            .expect("a health update");
        message.expect("stream open").expect("ok").status()
    };
    assert_eq!(next_status().await, ServingStatus::NotServing);

    let p = start_prefill("p0").await;
    let d = start_decode("d0").await;
    cluster.register(p.info()).await;
    cluster.register(d.info()).await;
    assert_eq!(next_status().await, ServingStatus::Serving);
    let overall = health
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap();
    assert_eq!(overall.into_inner().status(), ServingStatus::Serving);
    cluster.deregister("d0").await;
    assert_eq!(next_status().await, ServingStatus::NotServing);

    let mut reflection = ServerReflectionClient::new(channel.clone());
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut replies = reflection
        .server_reflection_info(futures_util::stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let reply = replies
        .message()
        .await
        .unwrap()
        .expect("a reflection reply");
    let Some(MessageResponse::ListServicesResponse(list)) = reply.message_response else {
        panic!("unexpected reflection reply: {reply:?}");
    };
    let names: Vec<_> = list.service.iter().map(|s| s.name.as_str()).collect();
    assert!(names.contains(&"tandem.v1.Inference"), "{names:?}");
    assert!(names.contains(&"grpc.health.v1.Health"), "{names:?}");

    // The older v1alpha protocol (grpcurl, Python's grpcio-reflection) lists the same.
    use tonic_reflection::pb::v1alpha as alpha;
    let mut reflection = alpha::server_reflection_client::ServerReflectionClient::new(channel);
    let request = alpha::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(alpha::server_reflection_request::MessageRequest::ListServices(
            String::new(),
        )),
    };
    let reply = reflection
        .server_reflection_info(futures_util::stream::iter([request]))
        .await
        .expect("v1alpha reflection is served")
        .into_inner()
        .message()
        .await
        .unwrap()
        .expect("a v1alpha reflection reply");
    let Some(alpha::server_reflection_response::MessageResponse::ListServicesResponse(list)) =
        reply.message_response
    else {
        panic!("unexpected v1alpha reply: {reply:?}");
    };
    let names: Vec<_> = list.service.iter().map(|s| s.name.as_str()).collect();
    assert!(names.contains(&"tandem.v1.Inference"), "{names:?}");
}

#[tokio::test]
async fn cancelling_a_grpc_call_mid_stream_cancels_the_decode_stream() {
    init_tracing();
    let mut cluster = MemoryCluster::new();
    let p = start_prefill("p0").await;
    let d = start_decode("d0").await;
    cluster.register(p.info()).await;
    cluster.register(d.info()).await;
    let router = cluster.router(options()).await;
    d.behaviour.hold_after_batches.store(2, Ordering::SeqCst);

    let mut client = router.grpc().await;
    let mut stream = client
        .generate(grpc_request("stop me", 20))
        .await
        .unwrap()
        .into_inner();
    assert!(stream.message().await.unwrap().is_some(), "a first delta");
    wait_until("decode holding", &d.behaviour.holding, || {
        d.behaviour.held.load(Ordering::SeqCst) == 1
    })
    .await;
    drop(stream);
    wait_until("decode stream cancelled", &d.behaviour.changed, || {
        d.behaviour.cancelled_streams.load(Ordering::SeqCst) == 1
    })
    .await;
    assert_eq!(d.behaviour.completed_streams.load(Ordering::SeqCst), 0);
}
