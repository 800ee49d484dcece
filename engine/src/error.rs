//! The engine's one boundary error type.
//!
//! Each variant says *what* failed, with structured fields; callers decide what to do. Variants
//! are classified once here: [`EngineError::error_type`] gives a low-cardinality label for metrics
//! and [`EngineError::is_invalid_request`] separates the caller's mistakes (bad prompt, bad
//! sampling parameters: never retry unchanged) from the engine's own failures.

use std::path::PathBuf;

use crate::tokenizer::TokenizerError;
use tandem_grammar::GrammarError;
use tandem_kernels::KernelError;
use tandem_kernels_cuda::CudaError;
use tandem_kv_layout::LayoutError;

/// Everything the engine can fail with.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The model path does not exist.
    #[error("model not found at {path}")]
    ModelNotFound {
        /// The path that was asked for.
        path: PathBuf,
    },
    /// The model file exists but is not a valid checkpoint (truncated, corrupt, wrong format).
    #[error("invalid model file {path}: {reason}")]
    ModelFormat {
        /// The offending file.
        path: PathBuf,
        /// What was wrong.
        reason: String,
    },
    /// A tensor the architecture needs is absent from the checkpoint.
    #[error("tensor `{name}` is missing from the checkpoint")]
    MissingTensor {
        /// Checkpoint tensor name.
        name: String,
    },
    /// A tensor has the wrong shape for the configuration.
    #[error("tensor `{name}` has shape {got:?}, expected {expected:?}")]
    TensorShape {
        /// Checkpoint tensor name.
        name: String,
        /// Shape the config implies.
        expected: Vec<usize>,
        /// Shape found.
        got: Vec<usize>,
    },
    /// The checkpoint's architecture is not a Llama-family decoder.
    #[error("unsupported architecture `{0}` (tandem serves Llama-family decoders)")]
    UnsupportedArchitecture(String),
    /// A configuration value is invalid.
    #[error("invalid value for `{field}`: {value} ({reason})")]
    InvalidConfig {
        /// Config field or flag name.
        field: &'static str,
        /// The value given, rendered.
        value: String,
        /// Why it is rejected.
        reason: String,
    },
    /// Reading a file failed.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The tokenizer could not be built or used.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// A compute kernel rejected its inputs (an engine bug, or a corrupt block table).
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// The KV layout is invalid or does not match.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A request parameter is invalid (names the field).
    #[error("invalid request: `{field}` = {value}: {reason}")]
    InvalidRequest {
        /// Request field name, as the API spells it.
        field: &'static str,
        /// The value given, rendered.
        value: String,
        /// Why it is rejected.
        reason: String,
    },
    /// The prompt plus the requested output does not fit the model's context window.
    #[error(
        "prompt of {prompt_tokens} tokens + max_tokens {max_new_tokens} exceeds the context length of {max_context_tokens} tokens"
    )]
    ContextOverflow {
        /// Prompt length in tokens.
        prompt_tokens: usize,
        /// Requested new tokens.
        max_new_tokens: usize,
        /// The model's (or configured) context window.
        max_context_tokens: usize,
    },
    /// The request needs more KV blocks than the whole pool holds, so it could never run.
    #[error("request needs {required_blocks} KV blocks but the pool has only {total_blocks}")]
    NeverFits {
        /// Blocks for prompt + max new tokens.
        required_blocks: usize,
        /// Blocks in the pool.
        total_blocks: usize,
    },
    /// The waiting queue is full; retry later.
    #[error("engine queue is full ({capacity} waiting requests)")]
    QueueFull {
        /// The configured bound.
        capacity: usize,
    },
    /// Not enough free KV blocks right now for a reservation (another node may have them).
    #[error("no room for {requested_blocks} KV blocks ({free_blocks} free)")]
    OutOfBlocks {
        /// Blocks asked for.
        requested_blocks: usize,
        /// Blocks free at the time.
        free_blocks: usize,
    },
    /// A reservation id that is not (or no longer) held.
    #[error("unknown KV reservation {0}")]
    UnknownReservation(u64),
    /// A request id is already in use.
    #[error("request id {0} is already in use")]
    DuplicateRequest(u64),
    /// The CUDA backend failed: no driver or library (names what was searched), no such device,
    /// an unsupported arch, out of device memory, a kernel that did not compile, a failed call.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// Structured output: the request's `response_format` is invalid or unsupported
    /// ([`GrammarError::Invalid`], the caller's mistake), or the grammar machinery failed.
    #[error(transparent)]
    Grammar(#[from] GrammarError),
}

impl EngineError {
    /// A low-cardinality label for metrics and logs.
    pub fn error_type(&self) -> &'static str {
        match self {
            EngineError::ModelNotFound { .. } => "model_not_found",
            EngineError::ModelFormat { .. }
            | EngineError::MissingTensor { .. }
            | EngineError::TensorShape { .. }
            | EngineError::UnsupportedArchitecture(_) => "model_format",
            EngineError::InvalidConfig { .. } => "invalid_config",
            EngineError::Io { .. } => "io",
            EngineError::Tokenizer(_) => "tokenizer",
            EngineError::Kernel(_) => "kernel",
            EngineError::Layout(_) => "layout",
            EngineError::InvalidRequest { .. } => "invalid_request",
            EngineError::ContextOverflow { .. } => "context_overflow",
            EngineError::NeverFits { .. } => "never_fits",
            EngineError::QueueFull { .. } | EngineError::OutOfBlocks { .. } => "overloaded",
            EngineError::UnknownReservation(_) => "unknown_reservation",
            EngineError::DuplicateRequest(_) => "duplicate_request",
            EngineError::Cuda(_) => "cuda",
            EngineError::Grammar(GrammarError::Invalid { .. }) => "invalid_request",
            EngineError::Grammar(_) => "grammar",
        }
    }

    /// True when the request itself is at fault: retrying it unchanged can never succeed.
    pub fn is_invalid_request(&self) -> bool {
        matches!(
            self,
            EngineError::InvalidRequest { .. }
                | EngineError::Grammar(GrammarError::Invalid { .. })
                | EngineError::ContextOverflow { .. }
                | EngineError::NeverFits { .. }
                | EngineError::DuplicateRequest(_)
        )
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        EngineError::Io { path: path.into(), source }
    }
}
