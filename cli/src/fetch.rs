//! `tandem model fetch`: the default model (SmolLM2-135M-Instruct) in the model cache. The code
//! lives in `tandem_node::fetch` so the node binaries, which fall back to the default model
//! when `--model` is absent, share it; this module re-exports it unchanged.

pub use tandem_node::fetch::*;
