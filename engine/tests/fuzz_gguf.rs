//! The GGUF reader on corrupted files: the real model's header (metadata, tokenizer, tensor
//! directory) truncated at random points, with bytes flipped and length fields overwritten by
//! huge values, goes through what a node does before it reads a tensor: the header reader, the
//! model config and the tokenizer. No input may panic or allocate without bound (a huge length
//! must be refused, not allocated); every refusal is a typed error with a message.
//!
//! Deterministic: `TANDEM_SEED=N` reproduces a run; `TANDEM_FUZZ_CASES=N` runs longer.

use crate::common;

use std::io::Read;

use tandem_engine::ModelConfig;
use tandem_engine::loader::gguf;
use tandem_engine::rng::Rng;
use tandem_engine::tokenizer::Tokenizer;

#[test]
fn corrupted_gguf_headers_are_refused_with_typed_errors_and_never_panic() {
    let seed: u64 = std::env::var("TANDEM_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(1);
    let cases: usize = std::env::var("TANDEM_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    let model = common::model_path();
    // The header and a little tensor data: all the reader and the tokenizer look at.
    let header_len = gguf::open(&model).unwrap().0.tensor_data_offset as usize + 4096;
    let mut header = Vec::new();
    std::fs::File::open(&model)
        .unwrap()
        .take(header_len as u64)
        .read_to_end(&mut header)
        .unwrap();
    let dir = std::env::temp_dir().join(format!("tandem-fuzz-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("case.gguf");

    let mut rng = Rng::new(seed);
    let (mut opened, mut refused) = (0usize, 0usize);
    for case in 0..cases {
        let mut bytes = header.clone();
        // The counts and the first entries' lengths live near the start: aim most faults there.
        let near = |rng: &mut Rng, len: usize| {
            if rng.below(2) == 0 { rng.below(4096.min(len) as u64) as usize } else { rng.below(len as u64) as usize }
        };
        for _ in 0..1 + rng.below(3) {
            match rng.below(4) {
                0 => {
                    let at = near(&mut rng, bytes.len());
                    bytes[at] ^= 1 << rng.below(8);
                }
                1 => {
                    let at = near(&mut rng, bytes.len().saturating_sub(8)) & !7;
                    let huge = [u64::MAX, 1 << 40, 1 << 62, u32::MAX as u64][rng.below(4) as usize];
                    bytes[at..at + 8].copy_from_slice(&huge.to_le_bytes());
                }
                2 => {
                    let at = near(&mut rng, bytes.len().saturating_sub(4));
                    bytes[at..at + 4].copy_from_slice(&(rng.next_u64() as u32).to_le_bytes());
                }
                _ => {
                    let keep = near(&mut rng, bytes.len());
                    bytes.truncate(keep);
                }
            }
        }
        std::fs::write(&path, &bytes).unwrap();
        let result = gguf::open(&path).map_err(|e| e.to_string()).and_then(|(content, _)| {
            ModelConfig::from_gguf(&content, &path).map_err(|e| e.to_string())
        });
        // The tokenizer's own metadata reader (the router's) meets the same bytes.
        let tokenizer = tandem_engine::tokenizer::GgufMetadata::read(&path)
            .map_err(|e| e.to_string())
            .and_then(|meta| Tokenizer::from_gguf(&meta).map_err(|e| e.to_string()));
        if let Err(e) = &tokenizer {
            assert!(!e.is_empty(), "seed {seed}, case {case}: an empty error");
        }
        let result = result.and(tokenizer);
        match result {
            Ok(_) => opened += 1,
            Err(e) => {
                refused += 1;
                assert!(!e.is_empty(), "seed {seed}, case {case}: an empty error");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!("seed {seed}: {cases} corrupted headers, {opened} still readable, {refused} refused");
    assert!(refused > cases / 4, "the corruption must reach the reader: {refused} refused");
}
