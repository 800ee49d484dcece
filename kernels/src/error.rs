//! The crate's one error type.
//!
//! Shape mismatches in the infallible kernels (`linear`, `rms_norm`, ...) are caller bugs and
//! panic with the op name; the `Result`-returning entry points (`write_kv`, `paged_attention`,
//! `Weight::from_f32`, ...) classify bad inputs here, because those inputs (slots, block ids,
//! block tables) come from the engine's bookkeeping and the engine decides what to do.

use crate::simd::Isa;

/// Everything a kernel entry point can reject.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// A buffer does not have the length the op's shape implies.
    #[error("{op}: `{what}` has length {got}, expected {expected}")]
    ShapeMismatch {
        /// The kernel that rejected the call.
        op: &'static str,
        /// The argument or derived quantity.
        what: &'static str,
        /// What the shape requires.
        expected: usize,
        /// What was passed.
        got: usize,
    },
    /// A dimension that must divide another does not (e.g. query heads by KV heads).
    #[error("{op}: {what}: {numerator} is not a multiple of {denominator}")]
    NotDivisible {
        /// The kernel that rejected the call.
        op: &'static str,
        /// What the two numbers are.
        what: &'static str,
        /// The dividend.
        numerator: usize,
        /// The divisor.
        denominator: usize,
    },
    /// A KV slot (`block * block_size + offset`) lies outside the pool.
    #[error("{op}: slot {slot} (token {token}) is outside the pool of {num_slots} slots")]
    SlotOutOfRange {
        /// The kernel that rejected the call.
        op: &'static str,
        /// Index of the token whose slot is bad.
        token: usize,
        /// The slot passed.
        slot: usize,
        /// `num_blocks * block_size`.
        num_slots: usize,
    },
    /// A physical block id lies outside the pool.
    #[error("{op}: block id {block} is outside the pool of {num_blocks} blocks")]
    BlockOutOfRange {
        /// The kernel that rejected the call.
        op: &'static str,
        /// The block id passed.
        block: usize,
        /// Blocks in the pool.
        num_blocks: usize,
    },
    /// A layer index lies outside the layout.
    #[error("{op}: layer {layer} is outside the layout's {num_layers} layers")]
    LayerOutOfRange {
        /// The kernel that rejected the call.
        op: &'static str,
        /// The layer passed.
        layer: usize,
        /// Layers in the layout.
        num_layers: usize,
    },
    /// A sequence's block table does not cover the positions its queries attend to.
    #[error(
        "{op}: sequence {seq} needs {needed_blocks} blocks for position {last_pos}, its table has {table_blocks}"
    )]
    BlockTableTooShort {
        /// The kernel that rejected the call.
        op: &'static str,
        /// Index of the sequence in the call.
        seq: usize,
        /// Last position attended to.
        last_pos: usize,
        /// Blocks needed to hold positions `0..=last_pos`.
        needed_blocks: usize,
        /// Blocks in the sequence's table.
        table_blocks: usize,
    },
    /// A sequence's query rows fall outside `q`.
    #[error("{op}: sequence {seq} uses query rows {first_row}..{end_row} of {total_rows}")]
    QueryRowsOutOfRange {
        /// The kernel that rejected the call.
        op: &'static str,
        /// Index of the sequence in the call.
        seq: usize,
        /// First row used.
        first_row: usize,
        /// One past the last row used.
        end_row: usize,
        /// Rows in `q`.
        total_rows: usize,
    },
    /// Two sequences of one attention call claim the same query rows.
    #[error("{op}: sequences {seq_a} and {seq_b} share query rows")]
    QueryRowsOverlap {
        /// The kernel that rejected the call.
        op: &'static str,
        /// One sequence.
        seq_a: usize,
        /// The other.
        seq_b: usize,
    },
    /// A weight dtype name is not one of f32, f16, bf16, q8_0, q4_1, q4_0.
    #[error("unknown weight dtype `{0}` (expected f32, f16, bf16, q8_0, q4_1 or q4_0)")]
    UnknownWeightDtype(String),
    /// A quantized block's scale (or minimum) is not a finite number: the file is corrupt.
    #[error("quantized weight row {row}, block {block}: its {what} is {value} (not finite)")]
    BadQuantBlock {
        /// Row (output feature) of the block.
        row: usize,
        /// Block index along the row (32 columns each).
        block: usize,
        /// `scale` or `min`.
        what: &'static str,
        /// The value found, rendered (`NaN`, `inf`).
        value: String,
    },
    /// An instruction-set name is not one of portable, avx2, avx512, auto.
    #[error("unknown kernel instruction set `{0}` (expected portable, avx2, avx512 or auto)")]
    UnknownIsa(String),
    /// The requested instruction set is not available on this CPU.
    #[error("instruction set {0} is not supported by this CPU")]
    IsaUnsupported(Isa),
    /// A worker pool needs at least one thread.
    #[error("a worker pool needs at least one thread")]
    ZeroThreads,
    /// Spawning a worker thread failed.
    #[error("spawning kernel worker thread {index} failed: {reason}")]
    SpawnFailed {
        /// Index of the worker that failed to start.
        index: usize,
        /// The OS error, rendered.
        reason: String,
    },
}

impl KernelError {
    /// A low-cardinality name for metrics labels.
    pub const fn error_type(&self) -> &'static str {
        match self {
            KernelError::ShapeMismatch { .. } => "shape_mismatch",
            KernelError::NotDivisible { .. } => "not_divisible",
            KernelError::SlotOutOfRange { .. } => "slot_out_of_range",
            KernelError::BlockOutOfRange { .. } => "block_out_of_range",
            KernelError::LayerOutOfRange { .. } => "layer_out_of_range",
            KernelError::BlockTableTooShort { .. } => "block_table_too_short",
            KernelError::QueryRowsOutOfRange { .. } => "query_rows_out_of_range",
            KernelError::QueryRowsOverlap { .. } => "query_rows_overlap",
            KernelError::UnknownWeightDtype(_) => "unknown_weight_dtype",
            KernelError::BadQuantBlock { .. } => "bad_quant_block",
            KernelError::UnknownIsa(_) => "unknown_isa",
            KernelError::IsaUnsupported(_) => "isa_unsupported",
            KernelError::ZeroThreads => "zero_threads",
            KernelError::SpawnFailed { .. } => "spawn_failed",
        }
    }
}

/// Returns `ShapeMismatch` unless `got == expected`.
pub(crate) fn check_len(
    op: &'static str,
    what: &'static str,
    expected: usize,
    got: usize,
) -> Result<(), KernelError> {
    if expected == got {
        Ok(())
    } else {
        Err(KernelError::ShapeMismatch {
            op,
            what,
            expected,
            got,
        })
    }
}

/// Panics with a shape message unless `got == expected` (for the infallible kernels).
#[track_caller]
pub(crate) fn assert_len(op: &'static str, what: &'static str, expected: usize, got: usize) {
    if let Err(e) = check_len(op, what, expected, got) {
        panic!("{e}");
    }
}
