//! Building a node's engine: resolve the model (fetching the default one on first use, as
//! `tandem generate` does), load it, allocate the KV pool in transport memory and wrap it.
//!
//! Runs on the engine thread (loading takes 1–2 s for the default model and allocates the
//! weights there); nothing here touches tokio.

use std::sync::Arc;
use std::time::Instant;

use tandem_engine::kv::KvPool;
use tandem_engine::{Engine, EngineArgs, Model, ModelSource, Staging, loader};
use tandem_kv_transfer::{KvTransport, NetTransport, PoolRegistration};

use crate::error::NodeError;
use crate::fetch;
use crate::transport::TransferBacking;

/// Where the weights come from: `--model`, `--dummy-weights`, or the default model (fetched
/// into the cache if missing).
pub fn resolve_source(args: &EngineArgs) -> Result<ModelSource, NodeError> {
    Ok(match args.source(fetch::default_model_path) {
        ModelSource::Path(p) if args.model.is_none() => {
            let path = fetch::ensure_default_model().map_err(|e| NodeError::ModelFetch {
                path: p.clone(),
                reason: format!("{e:#}"),
            })?;
            ModelSource::Path(path.canonicalize().unwrap_or(path))
        }
        s => s,
    })
}

/// The warm-up's forward pass: a 4-token prompt, 2 greedy tokens, every block freed after
/// (the engine's counters keep it: a node's first step counts are the warm-up's).
fn warm_forward_pass(engine: &mut Engine) -> Result<std::time::Duration, NodeError> {
    let t0 = Instant::now();
    let request = tandem_engine::Request {
        id: u64::MAX,
        prompt: vec![1, 2, 3, 4],
        params: tandem_engine::SamplingParams {
            ignore_eos: true,
            ..tandem_engine::SamplingParams::greedy(2)
        },
        priority: tandem_engine::Priority::Interactive,
    };
    let out = engine
        .generate(vec![request], |_| {})
        .map_err(NodeError::Engine)?;
    if out.first().map(|c| c.tokens.len()) != Some(2) {
        return Err(NodeError::Fatal {
            what: "the warm-up forward pass",
            reason: "the generation did not produce its 2 tokens".into(),
        });
    }
    Ok(t0.elapsed())
}

/// Lets `transport` move KV straight to and from `engine`'s device memory by CUDA IPC
/// (`--kv-cuda-ipc`): between two nodes on the same GPU, blocks go device to device; other
/// peers keep the staged path. The transport must be TCP and the engine's KV on a GPU.
pub fn attach_cuda_ipc(engine: &Engine, transport: &NetTransport) -> Result<(), NodeError> {
    let access = engine
        .kv_device_access()
        .map_err(NodeError::Engine)?
        .ok_or_else(|| NodeError::InvalidConfig {
            flag: "--kv-cuda-ipc",
            value: "true".into(),
            reason: "the engine's KV is in host memory (it needs --device cuda[:N])".into(),
        })?;
    let device = Arc::new(tandem_kv_transfer::device::CudaDeviceKv(access));
    transport
        .attach_device(device)
        .map_err(|source| NodeError::Transport {
            transport: transport.capabilities().name,
            source,
        })
}

/// Loads the model and builds an engine whose KV pool lives in memory `transport` allocated;
/// returns the engine and the pool's registration (to push from or receive into).
///
/// On the CPU the engine's KV is that memory. With `--device cuda` the KV is in device memory
/// and the transport's pool is its host mirror, copied `staging`'s way (a prefill node pushes:
/// every layer it writes is copied out before the layer-wise push sends it; a decode node
/// receives: adopted prompts are copied up). The device is checked before the model is
/// fetched or loaded.
pub fn build_engine(
    args: &EngineArgs,
    transport: &dyn KvTransport,
    staging: Staging,
) -> Result<(Engine, PoolRegistration), NodeError> {
    args.device.check().map_err(NodeError::Engine)?;
    let dtype = args.load_dtype().map_err(NodeError::Engine)?;
    let source = resolve_source(args)?;
    let cfg = args.engine_config().map_err(NodeError::Engine)?;
    let t0 = Instant::now();
    let loaded = loader::load(&source, dtype).map_err(NodeError::Engine)?;
    let model = Model::on_device(loaded.weights, args.device).map_err(NodeError::Engine)?;
    let (layout, num_blocks) = Engine::pool_shape(&model, &cfg).map_err(NodeError::Engine)?;
    let transport_name = transport.capabilities().name;
    let registration =
        transport
            .allocate(layout, num_blocks)
            .map_err(|source| NodeError::Transport {
                transport: transport_name,
                source,
            })?;
    let pool = KvPool::external(
        layout,
        num_blocks,
        Arc::new(TransferBacking(registration.clone())),
    )
    .map_err(NodeError::Engine)?;
    let mut engine = if args.device.is_cuda() {
        Engine::with_staged_pool(model, loaded.tokenizer, cfg, pool, staging)
    } else {
        Engine::with_pool(model, loaded.tokenizer, cfg, pool)
    }
    .map_err(NodeError::Engine)?;
    let warm = warm_forward_pass(&mut engine)?;
    tracing::info!(
        warm_up_ms = warm.as_millis() as u64,
        "warm: one real forward pass (4-token prompt, 2 tokens) ran"
    );
    tracing::info!(
        model = ?source,
        device = %args.device,
        dtype = dtype.as_str(),
        storage = engine.model().weight_storage(),
        kv_blocks = num_blocks,
        kv_layout = %layout,
        fingerprint = format_args!("{:016x}", layout.fingerprint()),
        transport = transport_name,
        load_ms = t0.elapsed().as_millis() as u64,
        "engine ready"
    );
    Ok((engine, registration))
}
