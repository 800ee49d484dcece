//! Bad input gets a typed error and changes nothing: over-long prompts, zero max tokens,
//! unknown model paths, corrupt or truncated GGUF files, out-of-vocabulary token ids.

use crate::common;

use std::io::Write;
use std::time::Instant;

use common::*;
use tandem_engine::{EngineError, KvDtype, ModelSource, SamplingParams, WeightDtype, loader};

#[test]
fn request_errors_are_typed_and_leave_the_engine_unchanged() {
    let mut cfg = config(KvDtype::F32, 64);
    cfg.scheduler.max_model_len = 256;
    let mut e = engine(WeightDtype::F32, cfg);
    let now = Instant::now();
    let too_long = greedy(1, vec![300; 250], 10);
    match e.add_request(too_long, now) {
        Err(EngineError::ContextOverflow { prompt_tokens: 250, max_new_tokens: 10, max_context_tokens: 256 }) => {}
        other => panic!("{other:?}"),
    }
    let mut zero = greedy(2, vec![300; 4], 1);
    zero.params = SamplingParams { max_new_tokens: 0, ..SamplingParams::default() };
    assert!(matches!(e.add_request(zero, now), Err(EngineError::InvalidRequest { field: "max_tokens", .. })));
    assert!(matches!(e.add_request(greedy(3, vec![], 4), now), Err(EngineError::InvalidRequest { field: "prompt", .. })));
    assert!(matches!(e.add_request(greedy(4, vec![49_152], 4), now), Err(EngineError::InvalidRequest { field: "prompt", .. })));
    // More blocks than the pool has (64 blocks × 16 tokens = 1024 > max_model_len here, so use a
    // pool of 4 blocks to reach NeverFits).
    let mut small = engine(WeightDtype::F32, config(KvDtype::F32, 4));
    assert!(matches!(small.add_request(greedy(5, vec![300; 60], 10), now), Err(EngineError::NeverFits { required_blocks: 5, total_blocks: 4 })));
    assert!(small.is_idle());
    assert!(e.is_idle(), "rejected requests left nothing behind");
    assert_eq!(e.scheduler().blocks().num_free(), 64);
    // And the engine still serves.
    assert_eq!(run(&mut e, vec![greedy(6, vec![300, 301, 302], 3)])[0].tokens.len(), 3);
}

#[test]
fn unknown_paths_and_corrupt_checkpoints_are_typed_errors() {
    let missing = ModelSource::Path("/nonexistent/model.gguf".into());
    assert!(matches!(loader::load(&missing, WeightDtype::F32), Err(EngineError::ModelNotFound { .. })));

    let dir = std::env::temp_dir().join(format!("tandem-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let garbage = dir.join("garbage.gguf");
    std::fs::File::create(&garbage).unwrap().write_all(b"this is not a gguf file at all").unwrap();
    assert!(matches!(loader::load(&ModelSource::Path(garbage), WeightDtype::F32), Err(EngineError::ModelFormat { .. })));

    // The real file cut in half: header intact, tensor data missing.
    let real = std::fs::read(model_path()).unwrap();
    let truncated = dir.join("truncated.gguf");
    std::fs::write(&truncated, &real[..real.len() / 2]).unwrap();
    match loader::load(&ModelSource::Path(truncated), WeightDtype::F32) {
        Err(EngineError::ModelFormat { reason, .. }) => assert!(reason.contains("tensor"), "{reason}"),
        Err(other) => panic!("expected ModelFormat, got {other:?}"),
        Ok(_) => panic!("a truncated GGUF loaded"),
    }
    let _ = std::fs::remove_dir_all(&dir);
}
