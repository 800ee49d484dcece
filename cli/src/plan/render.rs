//! Rendering a [`Plan`] as an aligned text table or as one JSON object.
//!
//! The JSON object always carries the seven integer keys the spec names
//! (`kv_bytes_per_token, kv_bytes_at_batch, weight_bytes_per_gpu, kv_budget_bytes,
//! max_batch_at_seq_len, max_concurrent_requests, batches_in_flight`), all in bytes or counts,
//! plus the inputs, the per-GPU figures, the other mode's capacity and the notes. The table
//! shows the same figures with a human binary unit beside each byte count, says which KV mode
//! it used, and explains in one line how the other mode differs.

use serde::Serialize;

use super::calc::{Capacity, KvPerGpu, Plan};
use super::units::human_bytes;
use super::{Resolved, WeightSource};

/// The JSON form of a plan. Field order is the output order.
#[derive(Serialize)]
struct PlanJson<'a> {
    kv_bytes_per_token: u64,
    kv_bytes_at_batch: u64,
    weight_bytes_per_gpu: u64,
    kv_budget_bytes: u64,
    max_batch_at_seq_len: u64,
    max_concurrent_requests: u64,
    batches_in_flight: u64,
    kv_per_gpu: &'static str,
    kv_heads_per_gpu: usize,
    kv_bytes_per_token_per_gpu: u64,
    kv_bytes_per_request_per_gpu: u64,
    kv_bytes_at_batch_per_gpu: u64,
    weight_bytes: u64,
    gpu_mem_bytes: u64,
    reserve_bytes: u64,
    param_count: Option<u64>,
    model: Option<String>,
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    kv_dtype: &'static str,
    block_size_tokens: usize,
    tp: u32,
    seq_len_tokens: u64,
    batch: u64,
    alternative: &'a Capacity,
    notes: Vec<String>,
}

/// The plan as one pretty-printed JSON object.
pub fn json(resolved: &Resolved, plan: &Plan) -> String {
    let i = &plan.input;
    let c = &plan.chosen;
    let out = PlanJson {
        kv_bytes_per_token: plan.kv_bytes_per_token,
        kv_bytes_at_batch: plan.kv_bytes_at_batch,
        weight_bytes_per_gpu: plan.weight_bytes_per_gpu,
        kv_budget_bytes: plan.kv_budget_bytes,
        max_batch_at_seq_len: plan.max_batch_at_seq_len(),
        max_concurrent_requests: c.max_concurrent_requests,
        batches_in_flight: c.batches_in_flight,
        kv_per_gpu: c.mode.as_str(),
        kv_heads_per_gpu: c.kv_heads_per_gpu,
        kv_bytes_per_token_per_gpu: c.kv_bytes_per_token_per_gpu,
        kv_bytes_per_request_per_gpu: c.kv_bytes_per_request_per_gpu,
        kv_bytes_at_batch_per_gpu: c.kv_bytes_at_batch_per_gpu,
        weight_bytes: i.weight_bytes,
        gpu_mem_bytes: i.gpu_mem_bytes,
        reserve_bytes: i.reserve_bytes,
        param_count: match resolved.weights {
            WeightSource::Params { count, .. } => Some(count),
            WeightSource::Gb(_) => resolved.model.as_ref().and_then(|m| m.param_count),
        },
        model: resolved
            .model
            .as_ref()
            .map(|m| m.path.display().to_string()),
        layers: i.shape.num_layers,
        kv_heads: i.shape.num_kv_heads,
        head_dim: i.shape.head_dim,
        kv_dtype: i.kv_dtype.as_str(),
        block_size_tokens: i.block_size_tokens,
        tp: i.tp,
        seq_len_tokens: i.seq_len_tokens,
        batch: i.batch,
        alternative: &plan.alternative,
        notes: notes(plan),
    };
    serde_json::to_string_pretty(&out).expect("a struct of integers and strings always serialises")
}

/// The plan as an aligned table with units, the mode line and any notes.
pub fn table(resolved: &Resolved, plan: &Plan) -> String {
    let i = &plan.input;
    let c = &plan.chosen;
    let seq = i.seq_len_tokens;
    let mut out = String::new();
    let source = match &resolved.model {
        Some(m) => format!("{}: {}", m.path.display(), model_kind(&m.format)),
        None => "flags".to_string(),
    };
    out.push_str(&format!(
        "tandem plan: {} layers × {} KV heads × head dim {}, KV {}; from {source}\n",
        i.shape.num_layers,
        i.shape.num_kv_heads,
        i.shape.head_dim,
        i.kv_dtype.as_str()
    ));
    out.push_str(&format!(
        "unit: TP {} × {} GPUs, {seq} tokens per request, batch {}\n\n",
        i.tp,
        human_bytes(i.gpu_mem_bytes),
        i.batch
    ));

    let weights_label = match resolved.weights {
        WeightSource::Gb(gb) => format!("weights (total, --weights-gb {gb})"),
        WeightSource::Params {
            count,
            dtype,
            from_model,
        } => format!(
            "weights (total, {count} params{} × {})",
            if from_model { " from model" } else { "" },
            dtype.describe()
        ),
    };
    let bytes_rows = [
        (
            "KV per token (whole model)".to_string(),
            plan.kv_bytes_per_token,
        ),
        (
            "KV per token per GPU".to_string(),
            c.kv_bytes_per_token_per_gpu,
        ),
        (
            format!("KV per request per GPU ({seq} tokens)"),
            c.kv_bytes_per_request_per_gpu,
        ),
        (
            format!("KV at batch {} × {seq} tokens (whole model)", i.batch),
            plan.kv_bytes_at_batch,
        ),
        (
            format!("KV at batch {} per GPU", i.batch),
            c.kv_bytes_at_batch_per_gpu,
        ),
        (weights_label, i.weight_bytes),
        (
            format!("weights per GPU (ceil(weights / {}))", i.tp),
            plan.weight_bytes_per_gpu,
        ),
        ("reserve per GPU".to_string(), i.reserve_bytes),
        (
            "KV budget per GPU (GPU − weights − reserve)".to_string(),
            plan.kv_budget_bytes,
        ),
    ];
    let count_rows = [
        (
            format!("max batch at {seq} tokens"),
            plan.max_batch_at_seq_len(),
        ),
        (
            "max concurrent requests per unit".to_string(),
            c.max_concurrent_requests,
        ),
        (
            format!("batches in flight (batch {})", i.batch),
            c.batches_in_flight,
        ),
    ];
    let label_w = bytes_rows
        .iter()
        .chain(&count_rows)
        .map(|(l, _)| l.chars().count())
        .max()
        .unwrap_or(0);
    let num_w = bytes_rows
        .iter()
        .chain(&count_rows)
        .map(|(_, v)| v.to_string().len())
        .max()
        .unwrap_or(0);
    let pad = |l: &str| format!("{l}{}", " ".repeat(label_w - l.chars().count()));
    out.push_str(&format!(
        "{}  {:>num_w$}  human\n",
        pad("quantity"),
        "bytes"
    ));
    for (label, bytes) in &bytes_rows {
        out.push_str(&format!(
            "{}  {bytes:>num_w$}  {}\n",
            pad(label),
            human_bytes(*bytes)
        ));
    }
    out.push_str(&format!("\n{}  {:>num_w$}\n", pad("quantity"), "count"));
    for (label, count) in &count_rows {
        out.push_str(&format!("{}  {count:>num_w$}\n", pad(label)));
    }
    out.push('\n');
    out.push_str(&mode_line(plan));
    out.push('\n');
    for note in notes(plan) {
        out.push_str(&format!("note: {note}\n"));
    }
    out.push_str("units: KiB/MiB/GiB = 2^10/2^20/2^30 bytes (the flags' KB and GB mean the same)");
    out
}

fn model_kind(format: &super::model::ModelFormat) -> String {
    match format {
        super::model::ModelFormat::Gguf { architecture } => format!("GGUF, {architecture}"),
        super::model::ModelFormat::HuggingFace { safetensors_files } => {
            format!("Hugging Face config.json, {safetensors_files} safetensors files")
        }
    }
}

/// One line saying which KV mode the plan used and how the other mode's figures differ.
pub fn mode_line(plan: &Plan) -> String {
    let i = &plan.input;
    let (c, a) = (&plan.chosen, &plan.alternative);
    let kv = i.shape.num_kv_heads;
    if i.tp == 1 {
        return format!(
            "KV per GPU: {} — TP 1, so the one GPU holds all {kv} KV heads and split and full agree.",
            c.mode.as_str()
        );
    }
    let alt = format!(
        "{} concurrent requests, {} batches in flight",
        a.max_concurrent_requests, a.batches_in_flight
    );
    match c.mode {
        KvPerGpu::Split => format!(
            "KV per GPU: split (default) — each GPU holds {} of {kv} KV heads ({}/token){}; the seed's \
             --kv-per-gpu full charges every GPU all {kv} heads ({}/token): {alt}.",
            c.kv_heads_per_gpu,
            human_bytes(c.kv_bytes_per_token_per_gpu),
            if i.tp as usize > kv {
                format!(", replicated since TP {} > {kv} heads", i.tp)
            } else {
                String::new()
            },
            human_bytes(a.kv_bytes_per_token_per_gpu),
        ),
        KvPerGpu::Full => format!(
            "KV per GPU: full (the seed's arithmetic) — every GPU is charged all {kv} KV heads ({}/token); \
             under TP {} the heads are really split {} per GPU ({}/token): {alt} (the default, split).",
            human_bytes(c.kv_bytes_per_token_per_gpu),
            i.tp,
            a.kv_heads_per_gpu,
            human_bytes(a.kv_bytes_per_token_per_gpu),
        ),
    }
}

/// Warnings about the plan: nothing fits, the batch does not fit, no reserve, an uneven split.
pub fn notes(plan: &Plan) -> Vec<String> {
    let i = &plan.input;
    let c = &plan.chosen;
    let mut notes = Vec::new();
    if c.max_concurrent_requests == 0 {
        notes.push(format!(
            "no request of {} tokens fits: one needs {} of KV per GPU and the KV budget is {} \
             (max batch 0); shorten --seq-len, raise --tp or free memory",
            i.seq_len_tokens,
            human_bytes(c.kv_bytes_per_request_per_gpu),
            human_bytes(plan.kv_budget_bytes)
        ));
    } else if c.batches_in_flight == 0 {
        notes.push(format!(
            "a batch of {} does not fit: the unit holds {} requests of {} tokens",
            i.batch, c.max_concurrent_requests, i.seq_len_tokens
        ));
    }
    if i.reserve_bytes == 0 {
        notes.push(
            "no reserve: activations, the CUDA context and runtime buffers need memory too \
             (--reserve-gb or --reserve-frac)"
                .to_string(),
        );
    }
    let kv = i.shape.num_kv_heads;
    if c.mode == KvPerGpu::Split && (i.tp as usize) < kv && !kv.is_multiple_of(i.tp as usize) {
        notes.push(format!(
            "{kv} KV heads do not divide evenly over TP {}: the fullest GPU holds {} and bounds the unit",
            i.tp, c.kv_heads_per_gpu
        ));
    }
    notes
}
