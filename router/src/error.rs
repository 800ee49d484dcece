//! The crate's one error type, [`RouterError`], and the classification of node failures.
//!
//! A variant says *what failed* (which step, which node, what the node answered), never which
//! HTTP status or gRPC code to send: the ingress layers map errors to wire statuses
//! (`grpc.rs`, `http/error.rs`), and the README's error table lists both mappings.
//!
//! Node failures are classified once, in [`NodeFault::from_code`], where the node's answer is
//! known. [`RouterError::is_retry_safe`] then answers one question for the pipeline: *may this
//! request be sent again, on another prefill/decode pair, without the client seeing a seam?*
//! That is only ever true before any output reached the client; once it has, a failure becomes
//! [`RouterError::Interrupted`], which is never retried by the router.
//!
//! | fault | typical cause | retry safe (no output sent yet) |
//! |---|---|---|
//! | `Busy` | RESOURCE_EXHAUSTED: no free blocks, queue full | yes, on another node |
//! | `Unreachable` | UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, ABORTED; UNKNOWN without the nodes' `tandem-error-kind` label (a transport error: connection reset) | yes |
//! | `KvCorrupt` | DATA_LOSS from decode: a block failed verification | yes: re-prefill on a fresh reservation |
//! | `ReservationLost` | FAILED_PRECONDITION / NOT_FOUND: reservation expired or reused | yes: fresh reservation |
//! | `Rejected` | INVALID_ARGUMENT, OUT_OF_RANGE, UNIMPLEMENTED: the node refuses the request itself | no |
//! | `Internal` | INTERNAL, UNKNOWN, anything else | yes (bounded): another node may succeed |

use std::path::PathBuf;
use std::time::Duration;

use tandem_cluster::{ClusterError, LimitKind, Role};
use tandem_tokenizer::TokenizerError;

use crate::ratelimit::RateLimitStatus;
use crate::request::Field;

/// Status metadata key in which nodes say whether a retry on another pair may succeed
/// (`true` / `false`).
pub const RETRY_SAFE_METADATA: &str = "tandem-retry-safe";

/// Status metadata key in which nodes label their errors (`checksum_mismatch`, ...).
pub const ERROR_KIND_METADATA: &str = "tandem-error-kind";

/// The pipeline step a node failure happened in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// `Decode.Reserve`.
    Reserve,
    /// `Prefill.Prefill`, before or after the first token.
    Prefill,
    /// `Decode.Decode`.
    Decode,
}

impl Step {
    /// A stable lowercase name for logs and metric labels.
    pub const fn as_str(self) -> &'static str {
        match self {
            Step::Reserve => "reserve",
            Step::Prefill => "prefill",
            Step::Decode => "decode",
        }
    }
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a node's failure means for the request, classified from its gRPC code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeFault {
    /// The node has no capacity now (RESOURCE_EXHAUSTED).
    Busy,
    /// The node could not be reached or went away (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED,
    /// ABORTED, transport errors).
    Unreachable,
    /// A KV transfer failed verification on the decode node (DATA_LOSS): nothing was decoded.
    KvCorrupt,
    /// The reservation is gone (expired, reused) (FAILED_PRECONDITION, NOT_FOUND).
    ReservationLost,
    /// The node refused the request itself (INVALID_ARGUMENT, OUT_OF_RANGE, UNIMPLEMENTED,
    /// PERMISSION_DENIED, UNAUTHENTICATED, ALREADY_EXISTS): sending it elsewhere will not help.
    Rejected,
    /// Anything else (INTERNAL, UNKNOWN, ...).
    Internal,
    /// The node stopped answering mid-stream: no message within the stream idle timeout, or
    /// its connection's HTTP/2 keep-alive went unanswered (a hung or frozen process).
    Stalled,
}

impl NodeFault {
    /// Classifies a node's gRPC status code.
    pub fn from_code(code: tonic::Code) -> Self {
        use tonic::Code;
        match code {
            Code::ResourceExhausted => NodeFault::Busy,
            Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Aborted => {
                NodeFault::Unreachable
            }
            Code::DataLoss => NodeFault::KvCorrupt,
            Code::FailedPrecondition | Code::NotFound => NodeFault::ReservationLost,
            Code::InvalidArgument
            | Code::OutOfRange
            | Code::Unimplemented
            | Code::PermissionDenied
            | Code::Unauthenticated
            | Code::AlreadyExists => NodeFault::Rejected,
            Code::Ok | Code::Unknown | Code::Internal => NodeFault::Internal,
        }
    }

    /// Whether the request may be sent to another pair (when no output reached the client).
    pub const fn is_retry_safe(self) -> bool {
        !matches!(self, NodeFault::Rejected)
    }

    /// A stable lowercase name for logs and metric labels.
    pub const fn as_str(self) -> &'static str {
        match self {
            NodeFault::Busy => "busy",
            NodeFault::Unreachable => "unreachable",
            NodeFault::KvCorrupt => "kv_corrupt",
            NodeFault::ReservationLost => "reservation_lost",
            NodeFault::Rejected => "rejected",
            NodeFault::Internal => "internal",
            NodeFault::Stalled => "stalled",
        }
    }
}

/// Everything that can go wrong in the router.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    /// No API key, or one that is not configured.
    #[error("missing or invalid API key (send `Authorization: Bearer <key>`)")]
    Unauthenticated,
    /// A request field is invalid; `field` names it.
    #[error("invalid `{field}`: {reason}", field = field.http_name())]
    InvalidArgument {
        /// The offending field.
        field: Field,
        /// Why, in words, with the values involved.
        reason: String,
    },
    /// The request body is not valid JSON for this endpoint (serde's message).
    #[error("malformed request body: {message}")]
    MalformedBody {
        /// serde_json's message, prefixed with the field's path when there is one.
        message: String,
        /// The path of the offending field (`max_tokens`, `messages[0].role`), if known.
        path: Option<String>,
    },
    /// The request body is larger than the ingress accepts.
    #[error("request body too large: the limit is {limit_bytes} bytes")]
    BodyTooLarge {
        /// The limit.
        limit_bytes: usize,
    },
    /// The request names a model this router does not serve.
    #[error("model `{requested}` does not exist; this cluster serves `{served}`")]
    ModelNotFound {
        /// What the request asked for.
        requested: String,
        /// What is served.
        served: String,
    },
    /// The admission queue is full: the request was refused at once.
    #[error("overloaded: {max_in_flight} requests in flight and {max_queued} waiting; retry later")]
    Overloaded {
        /// The in-flight limit.
        max_in_flight: usize,
        /// The queue limit.
        max_queued: usize,
    },
    /// The caller's API key is over one of its limits (see `ratelimit`).
    #[error("rate limit reached for key `{key_id}`: {}", rate_limit_message(*limit, *retry_after, status))]
    RateLimited {
        /// The key id.
        key_id: String,
        /// The limit met.
        limit: LimitKind,
        /// When a retry may pass (`None`: never, the request is larger than the limit).
        retry_after: Option<Duration>,
        /// The key's limits and what is left of them (the `x-ratelimit-*` headers).
        status: RateLimitStatus,
    },
    /// The request waited in the admission queue for longer than its class allows.
    #[error("overloaded: this {} request waited {waited:?} in the admission queue (the {} limit is {limit:?}); retry later", priority.as_str(), priority.as_str())]
    QueueTimeout {
        /// Its class.
        priority: crate::request::Priority,
        /// How long it waited.
        waited: Duration,
        /// The class's limit.
        limit: Duration,
    },
    /// No node of `role` is registered and accepting work.
    #[error("no {role} node is available; retry later")]
    NoNodes {
        /// The missing role.
        role: Role,
    },
    /// Every decode node refused the reservation for lack of free KV blocks.
    #[error("no decode node has {blocks_needed} free KV blocks ({tried} tried); retry later")]
    NoCapacity {
        /// Decode nodes asked.
        tried: usize,
        /// Blocks the request needs (prompt + max output).
        blocks_needed: u64,
    },
    /// A node answered a call with an error status.
    #[error("{role} node {node_id} failed at {step} ({fault}, {code:?}): {message}", fault = fault.as_str())]
    Node {
        /// The node's role.
        role: Role,
        /// The node.
        node_id: String,
        /// The step that failed.
        step: Step,
        /// What the failure means.
        fault: NodeFault,
        /// Whether another pair may succeed: the node's `tandem-retry-safe` metadata when it
        /// sent one (it knows the cause best), else [`NodeFault::is_retry_safe`].
        retry_safe: bool,
        /// The gRPC code the node (or the transport) answered.
        code: tonic::Code,
        /// The status message.
        message: String,
    },
    /// A node's stream broke the protocol (ended early, events out of order).
    #[error("{role} node {node_id} broke the protocol at {step}: {what}")]
    Protocol {
        /// The node's role.
        role: Role,
        /// The node.
        node_id: String,
        /// The step.
        step: Step,
        /// What was wrong.
        what: &'static str,
    },
    /// A registered node's gRPC address is not a valid URI.
    #[error("{role} node {node_id} registered an invalid gRPC address `{addr}`: {reason}")]
    BadNodeAddress {
        /// The node's role.
        role: Role,
        /// The node.
        node_id: String,
        /// The address as registered.
        addr: String,
        /// The parser's message.
        reason: String,
    },
    /// A failure after output had reached the client: the stream cannot be resumed
    /// transparently, so it ends with this error.
    #[error("generation interrupted after {tokens_sent} tokens: {cause}")]
    Interrupted {
        /// Tokens the client had received.
        tokens_sent: u32,
        /// What failed.
        #[source]
        cause: Box<RouterError>,
    },
    /// Every attempt failed with a retry-safe error.
    #[error("gave up after {attempts} attempts; last: {last}")]
    RetriesExhausted {
        /// Attempts made.
        attempts: u32,
        /// The last attempt's error.
        #[source]
        last: Box<RouterError>,
    },
    /// The client went away; the request was cancelled on every node.
    #[error("cancelled by the client")]
    Cancelled,
    /// The request's pipeline task ended without a result (a bug or a runtime shutdown).
    #[error("the request's pipeline ended without a result")]
    PipelineLost,
    /// The model file is missing.
    #[error("model file {} not found; run `tandem model fetch` or pass --model", path.display())]
    ModelMissing {
        /// Where it was looked for.
        path: PathBuf,
    },
    /// The model file could not be read as GGUF.
    #[error("cannot read model {}: {message}", path.display())]
    ModelRead {
        /// The file.
        path: PathBuf,
        /// The reader's message.
        message: String,
    },
    /// The tokenizer could not be built from the model file.
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] TokenizerError),
    /// A configuration value is invalid.
    #[error("invalid configuration `{field}` = `{value}`: {reason}")]
    Config {
        /// The flag or file key.
        field: &'static str,
        /// The value given.
        value: String,
        /// Why it is invalid.
        reason: String,
    },
    /// A TLS file could not be used (startup).
    #[error("TLS: {}: {message}", path.display())]
    Tls {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// The control plane failed (startup: discovery watch, load subscription).
    #[error("control plane: {0}")]
    Cluster(#[from] ClusterError),
    /// A server could not run.
    #[error("{server} server: {message}")]
    Serve {
        /// `"grpc"` or `"http"`.
        server: &'static str,
        /// The server's error.
        message: String,
    },
}

fn rate_limit_message(
    limit: LimitKind,
    retry_after: Option<Duration>,
    status: &RateLimitStatus,
) -> String {
    let what = match limit {
        LimitKind::Requests => format!(
            "{} requests per second",
            status.limits.requests_per_second.unwrap_or(0.0)
        ),
        LimitKind::Tokens => format!(
            "{} tokens per minute (prompt + output)",
            status.limits.tokens_per_minute.unwrap_or(0)
        ),
        LimitKind::Concurrency => format!(
            "{} concurrent requests",
            status.limits.max_concurrent_requests.unwrap_or(0)
        ),
    };
    match retry_after {
        Some(after) => format!("limit {what}; retry after {:.1} s", after.as_secs_f64()),
        None => format!("limit {what}; this request alone exceeds it and can never pass"),
    }
}

impl RouterError {
    /// Builds an [`RouterError::InvalidArgument`].
    pub fn invalid(field: Field, reason: impl Into<String>) -> Self {
        RouterError::InvalidArgument {
            field,
            reason: reason.into(),
        }
    }

    /// Classifies a node's status once, where it is received.
    pub(crate) fn node(role: Role, node_id: &str, step: Step, status: &tonic::Status) -> Self {
        // Nodes label every status they send (`tandem-error-kind`); an UNKNOWN status without
        // the label came from the transport (connection reset, h2 error): the node went away.
        let from_transport = status.code() == tonic::Code::Unknown
            && status.metadata().get(ERROR_KIND_METADATA).is_none();
        let fault = if from_transport {
            NodeFault::Unreachable
        } else {
            NodeFault::from_code(status.code())
        };
        let retry_safe = match status
            .metadata()
            .get(RETRY_SAFE_METADATA)
            .and_then(|v| v.to_str().ok())
        {
            Some("true") => true,
            Some("false") => false,
            _ => fault.is_retry_safe(),
        };
        RouterError::Node {
            role,
            node_id: node_id.to_string(),
            step,
            fault,
            retry_safe,
            code: status.code(),
            message: status.message().to_string(),
        }
    }

    /// Whether the router may send the request to another prefill/decode pair: true for node
    /// failures classified retry-safe and protocol breaks, always before any output reached
    /// the client (later failures are [`RouterError::Interrupted`]).
    pub fn is_retry_safe(&self) -> bool {
        match self {
            RouterError::Node { retry_safe, .. } => *retry_safe,
            RouterError::Protocol { .. } | RouterError::BadNodeAddress { .. } => true,
            _ => false,
        }
    }

    /// Whether the caller's request was at fault (HTTP 4xx other than overload): a malformed
    /// or invalid request, a wrong key, an unknown model.
    pub fn is_client_error(&self) -> bool {
        matches!(
            self.root(),
            RouterError::Unauthenticated
                | RouterError::InvalidArgument { .. }
                | RouterError::MalformedBody { .. }
                | RouterError::BodyTooLarge { .. }
                | RouterError::ModelNotFound { .. }
                | RouterError::RateLimited { .. }
        )
    }

    /// A low-cardinality name for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            RouterError::Unauthenticated => "unauthenticated",
            RouterError::InvalidArgument { .. } => "invalid_argument",
            RouterError::MalformedBody { .. } => "malformed_body",
            RouterError::BodyTooLarge { .. } => "body_too_large",
            RouterError::ModelNotFound { .. } => "model_not_found",
            RouterError::RateLimited { .. } => "rate_limited",
            RouterError::Overloaded { .. } => "overloaded",
            RouterError::QueueTimeout { .. } => "queue_timeout",
            RouterError::NoNodes { .. } => "no_nodes",
            RouterError::NoCapacity { .. } => "no_capacity",
            RouterError::Node { fault, .. } => fault.as_str(),
            RouterError::Protocol { .. } => "protocol",
            RouterError::BadNodeAddress { .. } => "bad_node_address",
            RouterError::Interrupted { .. } => "interrupted",
            RouterError::RetriesExhausted { .. } => "retries_exhausted",
            RouterError::Cancelled => "cancelled",
            RouterError::PipelineLost => "pipeline_lost",
            RouterError::ModelMissing { .. } => "model_missing",
            RouterError::ModelRead { .. } => "model_read",
            RouterError::Tokenizer(_) => "tokenizer",
            RouterError::Config { .. } => "config",
            RouterError::Tls { .. } => "tls",
            RouterError::Cluster(_) => "cluster",
            RouterError::Serve { .. } => "serve",
        }
    }

    /// The error that decides the wire status: the last attempt's for
    /// [`RouterError::RetriesExhausted`], the cause's for [`RouterError::Interrupted`].
    pub fn root(&self) -> &RouterError {
        match self {
            RouterError::RetriesExhausted { last, .. } => last.root(),
            RouterError::Interrupted { cause, .. } => cause.root(),
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_requests_the_node_itself_refuses_are_unsafe_to_retry() {
        use tonic::Code;
        for code in [Code::InvalidArgument, Code::OutOfRange, Code::Unimplemented] {
            assert!(!NodeFault::from_code(code).is_retry_safe(), "{code:?}");
        }
        for code in [
            Code::ResourceExhausted,
            Code::Unavailable,
            Code::DataLoss,
            Code::FailedPrecondition,
            Code::Internal,
        ] {
            assert!(NodeFault::from_code(code).is_retry_safe(), "{code:?}");
        }
        assert_eq!(NodeFault::from_code(Code::DataLoss), NodeFault::KvCorrupt);
    }

    #[test]
    fn interrupted_and_admission_errors_are_never_retried() {
        let node = RouterError::node(
            Role::Decode,
            "d0",
            Step::Decode,
            &tonic::Status::unavailable("gone"),
        );
        assert!(node.is_retry_safe());
        let mut refused = tonic::Status::unavailable("corrupt and final");
        refused
            .metadata_mut()
            .insert(RETRY_SAFE_METADATA, "false".parse().unwrap());
        assert!(!RouterError::node(Role::Prefill, "p0", Step::Prefill, &refused).is_retry_safe());
        let reset =
            tonic::Status::unknown("h2 protocol error: error reading a body from connection");
        assert!(matches!(
            RouterError::node(Role::Decode, "d0", Step::Decode, &reset),
            RouterError::Node {
                fault: NodeFault::Unreachable,
                retry_safe: true,
                ..
            }
        ));
        let mut labelled = tonic::Status::unknown("engine bug");
        labelled
            .metadata_mut()
            .insert(ERROR_KIND_METADATA, "internal".parse().unwrap());
        assert!(matches!(
            RouterError::node(Role::Decode, "d0", Step::Decode, &labelled),
            RouterError::Node {
                fault: NodeFault::Internal,
                ..
            }
        ));
        let interrupted = RouterError::Interrupted {
            tokens_sent: 3,
            cause: Box::new(node),
        };
        assert!(!interrupted.is_retry_safe());
        assert_eq!(interrupted.root().kind(), "unreachable");
        assert!(
            !RouterError::Overloaded {
                max_in_flight: 1,
                max_queued: 0
            }
            .is_retry_safe()
        );
    }
}
