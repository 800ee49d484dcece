//! tandem inference engine (being built).

pub mod tokenizer;
