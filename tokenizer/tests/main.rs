//! tandem-tokenizer's integration tests, one binary: each file beside this one is a module, so the
//! set compiles and links once instead of once per file. One file's tests:
//! `cargo test -p tandem-tokenizer --test it -- FILE::`.

mod fuzz_tokenizer;
mod hf_agreement;
mod reference_sanity;
