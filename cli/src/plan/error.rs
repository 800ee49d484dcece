//! The planner's error type: one `thiserror` enum for everything `tandem plan` can reject.
//!
//! Each variant names the step that failed and carries the values involved, so a caller (or a
//! test) can branch on the class of the failure rather than on its text. `main` turns it into
//! `anyhow` for printing; nothing here decides an exit code.

use std::path::PathBuf;

use super::units::human_bytes;

/// Why a capacity plan could not be computed.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// A flag (or a value read from a model) is out of range: negative, NaN, zero where at least
    /// one is needed, or too large to count in bytes.
    #[error("invalid {field} `{value}`: {reason}")]
    InvalidValue {
        /// The flag or field, as the user spells it (e.g. `--tp`).
        field: &'static str,
        /// The offending value, rendered.
        value: String,
        /// What the value must be.
        reason: &'static str,
    },
    /// An input the plan needs was given neither by a flag nor by `--model`.
    #[error("no {what} given: pass {hint}")]
    Missing {
        /// What is missing (e.g. `weights`).
        what: &'static str,
        /// The flags that would supply it.
        hint: &'static str,
    },
    /// The weight shard and the reserve leave no room for KV on a GPU.
    #[error(
        "weights do not fit: {} of weights per GPU ({} over TP {tp}) + {} reserve >= {} GPU memory; \
         raise --tp, use larger GPUs or a smaller --weight-dtype",
        human_bytes(*weight_bytes_per_gpu),
        human_bytes(*weight_bytes),
        human_bytes(*reserve_bytes),
        human_bytes(*gpu_mem_bytes)
    )]
    WeightsDoNotFit {
        /// All weights of the model.
        weight_bytes: u64,
        /// The shard one GPU holds (`weight_bytes / tp`, rounded up).
        weight_bytes_per_gpu: u64,
        /// Memory set aside per GPU for activations and runtime.
        reserve_bytes: u64,
        /// Memory of one GPU.
        gpu_mem_bytes: u64,
        /// Tensor-parallel degree.
        tp: u32,
    },
    /// The model path could not be opened or read.
    #[error("cannot read model at {}", path.display())]
    ModelRead {
        /// The file or directory given to `--model`.
        path: PathBuf,
        /// The underlying I/O failure.
        #[source]
        source: std::io::Error,
    },
    /// The model path is neither a GGUF file nor a directory with `config.json`.
    #[error(
        "unrecognised model at {}: expected a GGUF file or a Hugging Face directory with config.json",
        path.display()
    )]
    UnknownModelFormat {
        /// The path given to `--model`.
        path: PathBuf,
    },
    /// A GGUF file whose header could not be parsed.
    #[error("malformed GGUF {} at byte {offset}: {reason}", path.display())]
    GgufMalformed {
        /// The GGUF file.
        path: PathBuf,
        /// Byte offset where parsing failed.
        offset: u64,
        /// What was wrong there.
        reason: String,
    },
    /// A `config.json` or safetensors header that is not the JSON we expect.
    #[error("malformed JSON in {}", path.display())]
    JsonMalformed {
        /// The JSON file (or safetensors file whose header is JSON).
        path: PathBuf,
        /// The parse failure.
        #[source]
        source: serde_json::Error,
    },
    /// A model file lacks a field the plan needs.
    #[error("{} has no `{key}` (needed for the KV shape)", path.display())]
    ModelFieldMissing {
        /// The file that was read.
        path: PathBuf,
        /// The missing key (GGUF metadata key or config.json field).
        key: String,
    },
    /// The KV layout rejected the shape.
    #[error(transparent)]
    Layout(#[from] tandem_kv_layout::LayoutError),
}

impl PlanError {
    /// A short, stable name for the class of failure (for logs and metrics labels).
    pub fn error_type(&self) -> &'static str {
        match self {
            PlanError::InvalidValue { .. } => "invalid_value",
            PlanError::Missing { .. } => "missing_input",
            PlanError::WeightsDoNotFit { .. } => "weights_do_not_fit",
            PlanError::ModelRead { .. } => "model_read",
            PlanError::UnknownModelFormat { .. } => "unknown_model_format",
            PlanError::GgufMalformed { .. } => "gguf_malformed",
            PlanError::JsonMalformed { .. } => "json_malformed",
            PlanError::ModelFieldMissing { .. } => "model_field_missing",
            PlanError::Layout(_) => "layout",
        }
    }
}
