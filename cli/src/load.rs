//! Building an engine from [`EngineArgs`]: check the device (`--device cuda` with no driver fails
//! here, before any model is fetched or loaded), resolve the model (fetching the default one on
//! first use), load it in the dtype the device runs, upload it (CUDA), allocate the KV pool on
//! the device, and say what was built on stderr.

use std::time::Instant;

use anyhow::Context;
use tandem_engine::{Engine, EngineArgs, Model, ModelSource, loader};

use crate::fetch;

/// Loads the model and builds an engine as `args` say.
pub fn engine_from_args(args: &EngineArgs) -> anyhow::Result<Engine> {
    args.device.check()?;
    let dtype = args.load_dtype()?;
    let source = match args.source(fetch::default_model_path) {
        ModelSource::Path(p) if args.model.is_none() => ModelSource::Path(
            fetch::ensure_default_model()
                .context("fetching the default model")?
                .canonicalize()
                .unwrap_or(p),
        ),
        s => s,
    };
    let cfg = args.engine_config()?;
    let t0 = Instant::now();
    let loaded =
        loader::load(&source, dtype).with_context(|| format!("loading {source:?}"))?;
    let model = Model::on_device(loaded.weights, args.device)?;
    let c = model.config();
    tracing::info!(
        layers = c.num_hidden_layers,
        hidden = c.hidden_size,
        heads = c.num_attention_heads,
        kv_heads = c.kv_heads(),
        device = %args.device,
        dtype = args.dtype.as_str(),
        storage = model.weight_storage(),
        weight_mib = model.weight_bytes() >> 20,
        load_ms = t0.elapsed().as_millis() as u64,
        "model loaded"
    );
    let engine = Engine::new(model, loaded.tokenizer, cfg)?;
    tracing::info!(
        kv_blocks = engine.scheduler().blocks().num_blocks(),
        kv_layout = %engine.kv_layout(),
        "KV pool allocated"
    );
    Ok(engine)
}
