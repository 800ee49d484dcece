//! The gRPC ingress: `tandem.v1.Inference` (Generate, ListModels) over the shared core, plus
//! the standard `grpc.health.v1.Health` and server reflection on the same port.
//!
//! Authentication: metadata `authorization: Bearer <key>` (when API keys are configured).
//! Tracing: a W3C `traceparent` (and `tracestate`) in the request metadata continues the
//! caller's trace; the response metadata carries the request span's `traceparent`.
//! Health: the overall service `""` and `tandem.v1.Inference` are SERVING exactly while at
//! least one prefill and one decode node accept work, NOT_SERVING otherwise (updated on every
//! membership change). Errors map to codes in [`to_status`]; messages name the field.

use std::future::Future;
use std::pin::Pin;

use futures_util::{Stream, StreamExt};
use tandem_proto::v1 as pb;
use tandem_proto::v1::inference_server::{Inference, InferenceServer};
use tandem_grammar::ResponseFormat;
use tandem_tokenizer::ChatMessage;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status};
use tonic_health::ServingStatus;

use crate::error::RouterError;
use crate::pipeline::{GenerationEvent, RequestContext, Router};
use tandem_telemetry::trace::propagation::{RemoteParent, TRACEPARENT};
use crate::request::{Field, GenerateRequest, Priority, PromptInput, Sampling};

/// The gRPC status for an error.
pub fn to_status(error: &RouterError) -> Status {
    let message = error.to_string();
    let code = match error.root() {
        RouterError::Unauthenticated => tonic::Code::Unauthenticated,
        RouterError::InvalidArgument { field, reason } => {
            return Status::invalid_argument(format!("invalid `{}`: {reason}", field.grpc_name()));
        }
        RouterError::MalformedBody { .. } => tonic::Code::InvalidArgument,
        RouterError::BodyTooLarge { .. } => tonic::Code::ResourceExhausted,
        RouterError::RateLimited {
            key_id,
            limit,
            retry_after,
            ..
        } => return rate_limited(message, key_id, *limit, *retry_after),
        RouterError::ModelNotFound { .. } => tonic::Code::NotFound,
        RouterError::Overloaded { .. }
        | RouterError::QueueTimeout { .. }
        | RouterError::NoCapacity { .. } => tonic::Code::ResourceExhausted,
        RouterError::NoNodes { .. }
        | RouterError::Node { .. }
        | RouterError::Protocol { .. }
        | RouterError::BadNodeAddress { .. } => tonic::Code::Unavailable,
        RouterError::Cancelled => tonic::Code::Cancelled,
        _ => tonic::Code::Internal,
    };
    Status::new(code, message)
}

/// RESOURCE_EXHAUSTED with the google.rpc details a client's retry logic reads: `RetryInfo`
/// (when a retry may pass; absent when the request alone is over the limit) and
/// `QuotaFailure` (which key, which limit); `retry-after` / `retry-after-ms` metadata too.
fn rate_limited(
    message: String,
    key_id: &str,
    limit: tandem_cluster::LimitKind,
    retry_after: Option<std::time::Duration>,
) -> Status {
    use tonic_types::{ErrorDetails, StatusExt};
    let mut details = ErrorDetails::new();
    details.add_quota_failure_violation(
        format!("api_key:{key_id}"),
        format!("{} limit reached", limit.as_str()),
    );
    let mut metadata = tonic::metadata::MetadataMap::new();
    if let Some(after) = retry_after {
        details.set_retry_info(Some(after));
        let secs = (after.as_secs() + u64::from(after.subsec_nanos() > 0)).max(1);
        metadata.insert("retry-after", secs.into());
        metadata.insert("retry-after-ms", (after.as_millis().max(1) as u64).into());
    }
    Status::with_error_details_and_metadata(
        tonic::Code::ResourceExhausted,
        message,
        details,
        metadata,
    )
}

/// `tandem.v1.Inference` over a [`Router`].
#[derive(Clone, Debug)]
pub struct InferenceService {
    router: Router,
}

impl InferenceService {
    /// A service over `router`.
    pub fn new(router: Router) -> Self {
        Self { router }
    }

    fn authorize<T>(&self, request: &Request<T>) -> Result<crate::keys::KeyIdentity, Status> {
        let header = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        self.router.authorize(header).map_err(|e| to_status(&e))
    }
}

/// Converts the proto request into the core's.
pub fn from_proto(request: pb::GenerateRequest) -> Result<GenerateRequest, RouterError> {
    let input = match request.input {
        Some(pb::generate_request::Input::Prompt(text)) => PromptInput::Text(text),
        Some(pb::generate_request::Input::Chat(chat)) => PromptInput::Chat(
            chat.messages
                .into_iter()
                .map(|m| ChatMessage::new(m.role, m.content))
                .collect(),
        ),
        Some(pb::generate_request::Input::TokenIds(ids)) => PromptInput::TokenIds(ids.ids),
        None => {
            return Err(RouterError::invalid(
                Field::Prompt,
                "is required: set one of prompt, chat or token_ids",
            ));
        }
    };
    let priority = match pb::Priority::try_from(request.priority) {
        Ok(pb::Priority::Interactive) => Priority::Interactive,
        Ok(pb::Priority::Batch) => Priority::Batch,
        Err(_) => {
            return Err(RouterError::invalid(
                Field::Priority,
                format!("{} is not a Priority value", request.priority),
            ));
        }
    };
    let sampling = request.sampling.unwrap_or_default();
    let response_format = match &sampling.response_format {
        Some(f) => ResponseFormat::from_proto(f)
            .map_err(|e| RouterError::invalid(Field::ResponseFormat, e.to_string()))?,
        None => None,
    };
    if sampling.resumed_output_tokens != 0 {
        return Err(RouterError::invalid(
            Field::Unsupported("sampling.resumed_output_tokens"),
            "is set by the router when it migrates a request; callers leave it 0",
        ));
    }
    Ok(GenerateRequest {
        model: request.model,
        input,
        sampling: Sampling {
            temperature: sampling.temperature,
            top_p: sampling.top_p,
            top_k: sampling.top_k,
            seed: sampling.seed,
            stop: sampling.stop,
            max_tokens: (sampling.max_tokens > 0).then_some(sampling.max_tokens),
            ignore_eos: sampling.ignore_eos,
            presence_penalty: sampling.presence_penalty,
            frequency_penalty: sampling.frequency_penalty,
            repetition_penalty: (sampling.repetition_penalty != 0.0)
                .then_some(sampling.repetition_penalty),
            logprobs: sampling.logprobs,
            top_logprobs: sampling.top_logprobs,
            response_format,
        },
        priority,
        request_id: (!request.request_id.is_empty()).then_some(request.request_id),
    })
}

fn to_response(index: u32, event: GenerationEvent) -> pb::GenerateResponse {
    let event = match event {
        GenerationEvent::Delta {
            text,
            token_ids,
            logprobs,
        } => pb::generate_response::Event::Delta(pb::TokenDelta {
            text,
            token_ids,
            logprobs,
            index,
        }),
        GenerationEvent::Final(done) => pb::generate_response::Event::Final(pb::GenerateFinal {
            finish_reason: done.finish_reason.to_proto() as i32,
            usage: Some(pb::Usage {
                prompt_tokens: done.usage.prompt_tokens,
                cached_prompt_tokens: done.usage.cached_prompt_tokens,
                completion_tokens: done.usage.completion_tokens,
            }),
            request_id: done.request_id,
            index,
        }),
    };
    pb::GenerateResponse { event: Some(event) }
}

/// The response stream of `Generate`.
pub type GenerateStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Inference for InferenceService {
    type GenerateStream = GenerateStream;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let key = self.authorize(&request)?;
        let context = RequestContext {
            parent: RemoteParent::from_grpc(request.metadata()),
            key,
        };
        let request = request.into_inner();
        let n = request.n.max(1);
        let request = from_proto(request).map_err(|e| to_status(&e))?;
        let choices = self
            .router
            .generate_choices(request, context, n)
            .await
            .map_err(|e| to_status(&e))?;
        let first = choices.first();
        let traceparent = first
            .traceparent()
            .and_then(|t| tonic::metadata::MetadataValue::try_from(t).ok());
        let rate_limit = first.rate_limit();
        // Dropping this stream (the client cancelled) drops every GenerationStream, which
        // cancels the request on the nodes.
        let responses = choices.merged().map(|(index, item)| {
            item.map(|event| to_response(index, event))
                .map_err(|e| to_status(&e))
        });
        let mut response = Response::new(Box::pin(responses) as Self::GenerateStream);
        // The trace id goes back to the caller in the response metadata.
        if let Some(value) = traceparent {
            response.metadata_mut().insert(TRACEPARENT, value);
        }
        for (name, value) in rate_limit.iter().flat_map(|s| s.headers()) {
            if let Ok(v) = tonic::metadata::MetadataValue::try_from(value) {
                response.metadata_mut().insert(name, v);
            }
        }
        Ok(response)
    }

    async fn list_models(
        &self,
        request: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        self.authorize(&request)?;
        let model = self.router.model();
        let options = self.router.options();
        Ok(Response::new(pb::ListModelsResponse {
            models: vec![pb::ModelInfo {
                name: model.name.clone(),
                max_context_tokens: model.context_tokens,
                max_output_tokens: options.tokens.max_tokens_limit,
            }],
        }))
    }
}

/// Serves `Inference`, health and reflection on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    tls: Option<&crate::tls::TlsIdentity>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), RouterError> {
    let serve_error = |message: String| RouterError::Serve {
        server: "grpc",
        message,
    };
    let (health, health_service) = tonic_health::server::health_reporter();
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(tandem_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| serve_error(e.to_string()))?;
    // v1alpha too: grpcurl and Python's grpcio-reflection still ask for it.
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(tandem_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .map_err(|e| serve_error(e.to_string()))?;
    let health_task = tokio::spawn({
        let router = router.clone();
        async move {
            let mut last = None;
            loop {
                let status = if router.is_ready() {
                    ServingStatus::Serving
                } else {
                    ServingStatus::NotServing
                };
                // Watchers get one message per change, not one per membership event.
                if last != Some(status) {
                    health.set_service_status("", status).await;
                    health
                        .set_service_status("tandem.v1.Inference", status)
                        .await;
                    last = Some(status);
                }
                router.membership_changed().await;
            }
        }
    });
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        builder = builder
            .tls_config(tls.grpc_config())
            .map_err(|e| serve_error(format!("TLS: {e}")))?;
    }
    let result = builder
        .add_service(health_service)
        .add_service(reflection)
        .add_service(reflection_v1alpha)
        .add_service(InferenceServer::new(InferenceService::new(router)))
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown)
        .await
        .map_err(|e| serve_error(e.to_string()));
    health_task.abort();
    result
}
