//! `tandem bench-engine`: prefill and decode throughput of the local engine, beside the
//! machine's single-sequence memory-bandwidth bound measured in the same run.
//!
//! - Prefill: one sequence of `--prompt-len` seeded random tokens computed in one step (like
//!   llama.cpp's pp512), prefix caching off so every run recomputes.
//! - Decode at batch B: B sequences with short distinct prompts are prefilled, then
//!   `--decode-tokens` steps of B tokens each are timed (like tg128 / batched-bench).
//! - Bound: weight bytes streamed per decoded token ÷ memory read bandwidth (measured here by
//!   reading a 1 GiB buffer on every core), i.e. the best one sequence could do.
//!
//! Each figure is the median of `--runs` runs; min and max are printed beside it.

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::Context;
use clap::{Args, ValueEnum};
use serde::Serialize;
use tandem_engine::rng::Rng;
use tandem_engine::grammar::ResponseFormat;
use tandem_engine::{Engine, EngineArgs, Priority, Request, SamplingParams};

use crate::load::engine_from_args;

/// Output format.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum Format {
    /// Aligned text.
    Table,
    /// One JSON object.
    Json,
}

/// Flags of `tandem bench-engine`.
#[derive(Args, Debug, Clone)]
pub struct BenchEngineArgs {
    /// Prompt length of the prefill measurement.
    #[arg(long, default_value_t = 512)]
    pub prompt_len: usize,
    /// Batch sizes of the decode measurements, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,32")]
    pub batch: Vec<usize>,
    /// Decode steps timed per batch size.
    #[arg(long, default_value_t = 64)]
    pub decode_tokens: usize,
    /// Prompt length of each decoding sequence.
    #[arg(long, default_value_t = 32)]
    pub decode_prompt_len: usize,
    /// Runs per figure (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Decode sampled at this temperature (0 = greedy): what sampling costs per step. On CUDA
    /// the tokens are picked on the device (the report's `tokens_picked_on_device`).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// With `--temperature`: nucleus sampling at this top-p (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Decode with presence 0.5, frequency 0.5 and repetition 1.1 penalties (what they cost:
    /// run once with and once without, alternating).
    #[arg(long)]
    pub penalties: bool,
    /// Decode under a JSON schema (an array of at least 16 `{"name", "age"}` objects, so no
    /// sequence can end inside the measured steps): what grammar-constrained decoding costs per
    /// token. Run once with and once without, alternating.
    #[arg(long)]
    pub structured: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// A median with its spread.
#[derive(Debug, Serialize, Clone, Copy)]
pub struct Spread {
    /// Median.
    pub median: f64,
    /// Smallest run.
    pub min: f64,
    /// Largest run.
    pub max: f64,
}

impl Spread {
    fn of(mut v: Vec<f64>) -> Spread {
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Spread {
            median,
            min: v[0],
            max: v[n - 1],
        }
    }
}

#[derive(Debug, Serialize)]
struct Report {
    model: String,
    /// Where the forward ran (`--device`: `cpu`, `cuda:0`).
    device: String,
    /// The `--dtype` choice and the storage it gave, e.g. `auto (q4_1+q8_0)`.
    dtype: String,
    kv_dtype: &'static str,
    threads: usize,
    prompt_len: usize,
    prefill_tok_s: f64,
    decode_tok_s: BTreeMap<String, f64>,
    prefill_spread: Spread,
    decode_spread: BTreeMap<String, Spread>,
    weight_bytes_per_token: usize,
    mem_read_gb_s: f64,
    bandwidth_bound_tok_s: f64,
    flops_per_token: u64,
    runs: usize,
    /// Decode sampling (`--temperature`, `--top-p`; 0 = greedy).
    temperature: f32,
    top_p: f32,
    /// Decode sampled with penalties (`--penalties`).
    penalties: bool,
    /// Decode under the `--structured` JSON schema.
    structured: bool,
    /// With `--structured`: the grammar's own cost per token (mask + advance), measured alone
    /// on the same vocabulary and schema, median of `runs` walks of `decode_tokens` tokens.
    grammar_us_per_token: Option<f64>,
    /// Tokens picked on the device (greedy or sampled there; 0 on the CPU, which samples rows).
    tokens_picked_on_device: u64,
    /// CUDA: decode steps replayed from captured graphs, and failed captures (0 on the CPU).
    cuda_graph_replays: u64,
    cuda_graph_fallbacks: u64,
}

/// Measures read bandwidth of this machine (GB/s, 1e9) on the kernel pool's threads over 1 GiB.
pub fn measure_read_bandwidth_gbs() -> f64 {
    tandem_kernels::probe::read_bandwidth_gbs(tandem_kernels::global_pool(), 1 << 30, 5)
}

fn random_prompt(rng: &mut Rng, len: usize, vocab: usize) -> Vec<u32> {
    // Skip the first 256 ids (byte tokens and specials in most BPE vocabularies).
    (0..len)
        .map(|_| 256 + rng.below((vocab - 256) as u64) as u32)
        .collect()
}

fn bench_prefill(engine: &mut Engine, prompt_len: usize, seed: u64) -> anyhow::Result<f64> {
    let vocab = engine.model().config().vocab_size;
    let prompt = random_prompt(&mut Rng::new(seed), prompt_len, vocab);
    let req = Request {
        id: 1_000_000 + seed,
        prompt,
        params: SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(1)
        },
        priority: Priority::Interactive,
    };
    engine.add_request(req, Instant::now())?;
    let t0 = Instant::now();
    while !engine.is_idle() {
        engine.step()?;
    }
    Ok(prompt_len as f64 / t0.elapsed().as_secs_f64())
}

fn bench_decode(
    engine: &mut Engine,
    batch: usize,
    args: &BenchEngineArgs,
    seed: u64,
) -> anyhow::Result<f64> {
    let vocab = engine.model().config().vocab_size;
    let mut rng = Rng::new(seed);
    let now = Instant::now();
    for i in 0..batch {
        let prompt = random_prompt(&mut rng, args.decode_prompt_len, vocab);
        let mut params = SamplingParams {
            ignore_eos: true,
            temperature: args.temperature,
            top_p: args.top_p,
            seed: Some(seed * 1000 + i as u64),
            ..SamplingParams::greedy(args.decode_tokens + 1)
        };
        if args.penalties {
            params.presence_penalty = 0.5;
            params.frequency_penalty = 0.5;
            params.repetition_penalty = 1.1;
        }
        if args.structured {
            // End of sequence stays the grammar's to allow, and it cannot before 16 items.
            params.ignore_eos = false;
            params.response_format = Some(structured_format());
        }
        engine.add_request(
            Request {
                id: 2_000_000 + seed * 1000 + i as u64,
                prompt,
                params,
                priority: Priority::Interactive,
            },
            now,
        )?;
    }
    // Prefill everyone (until each has its first token).
    let mut started = 0;
    while started < batch {
        started += engine.step()?.len();
    }
    let t0 = Instant::now();
    let mut tokens = 0usize;
    while !engine.is_idle() {
        tokens += engine.step()?.len();
    }
    Ok(tokens as f64 / t0.elapsed().as_secs_f64())
}

/// The `--structured` schema: records of a name and an age, at least 16 of them (at ~10 tokens
/// an item, longer than the measured steps).
fn structured_format() -> ResponseFormat {
    ResponseFormat::JsonSchema {
        name: "people".into(),
        schema: serde_json::json!({
            "type": "array",
            "minItems": 16,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120}
                },
                "required": ["name", "age"],
                "additionalProperties": false
            }
        }),
    }
}

/// The grammar alone: microseconds per token to mask a vocabulary-sized row and advance past
/// the best allowed token, over a walk of `tokens` tokens (a fixed pseudo-random row, so the
/// walk visits names, numbers and punctuation).
fn grammar_us_per_token(engine: &Engine, tokens: usize, seed: u64) -> anyhow::Result<f64> {
    let t = engine.tokenizer().context("--structured needs the model's tokenizer")?;
    let vocab = engine.model().config().vocab_size;
    let grammar = tandem_engine::grammar::Vocabulary::new(t.clone(), vocab, &[t.eos_token_id()])?;
    let mut c = grammar.compile(&structured_format())?;
    let mut rng = Rng::new(seed);
    let base: Vec<f32> = (0..vocab).map(|_| rng.below(1000) as f32).collect();
    let mut row = base.clone();
    let t0 = Instant::now();
    for _ in 0..tokens {
        row.copy_from_slice(&base);
        c.mask(&mut row)?;
        let best = tandem_kernels::argmax(&row) as u32;
        c.commit(best)?;
    }
    Ok(t0.elapsed().as_secs_f64() * 1e6 / tokens as f64)
}

/// Runs the benchmark and returns what to print.
pub fn run(args: &BenchEngineArgs) -> anyhow::Result<String> {
    anyhow::ensure!(args.runs > 0, "--runs must be at least 1");
    anyhow::ensure!(
        args.prompt_len > 0 && args.decode_prompt_len > 0,
        "prompt lengths must be > 0"
    );
    anyhow::ensure!(args.batch.iter().all(|&b| b > 0), "batch sizes must be > 0");
    // Refused before the engine loads, naming the flag's field.
    SamplingParams { temperature: args.temperature, top_p: args.top_p, ..SamplingParams::greedy(1) }.validate()?;
    let mut eargs = args.engine.clone();
    eargs.no_prefix_caching = true;
    eargs.max_tokens_per_step = eargs.max_tokens_per_step.max(args.prompt_len);
    let max_batch = args.batch.iter().copied().max().unwrap_or(1);
    eargs.max_num_seqs = eargs.max_num_seqs.max(max_batch);
    let mut engine = engine_from_args(&eargs).context("building the engine")?;
    // The machine's bandwidth drifts (shared host): the probe runs again around the decode
    // measurements and the best figure is kept, so the bound stays an upper bound.
    let mut mem_bw = measure_read_bandwidth_gbs();
    let model = engine.model();
    let bytes_per_token = model.weight_bytes_per_token();
    let storage = model.weight_storage();
    let cfg = model.config().clone();
    let flops_per_token = 2
        * (cfg.param_count() - (cfg.vocab_size * cfg.hidden_size) as u64
            + if cfg.tie_word_embeddings {
                (cfg.vocab_size * cfg.hidden_size) as u64
            } else {
                0
            });

    // Warm up once (page faults, pool threads), then measure.
    bench_prefill(&mut engine, args.prompt_len.min(64), 0)?;
    let prefill = Spread::of(
        (0..args.runs)
            .map(|r| bench_prefill(&mut engine, args.prompt_len, r as u64 + 1))
            .collect::<Result<_, _>>()?,
    );
    let mut decode = BTreeMap::new();
    for &b in &args.batch {
        if b == 1 {
            mem_bw = mem_bw.max(measure_read_bandwidth_gbs());
        }
        let v: Vec<f64> = (0..args.runs)
            .map(|r| bench_decode(&mut engine, b, args, (b * 100 + r) as u64))
            .collect::<Result<_, _>>()?;
        decode.insert(b, Spread::of(v));
        if b == 1 {
            mem_bw = mem_bw.max(measure_read_bandwidth_gbs());
        }
    }
    let grammar_us = if args.structured {
        let v: Vec<f64> = (0..args.runs)
            .map(|r| grammar_us_per_token(&engine, args.decode_tokens, r as u64))
            .collect::<Result<_, _>>()?;
        Some(Spread::of(v).median)
    } else {
        None
    };
    let stats = engine.stats();
    let report = Report {
        model: match (&eargs.model, &eargs.dummy_weights) {
            (_, Some(cfg)) => format!("dummy weights of {} (seed {})", cfg.display(), eargs.dummy_seed),
            (Some(p), None) => p.display().to_string(),
            (None, None) => "SmolLM2-135M-Instruct (default)".into(),
        },
        device: eargs.device.to_string(),
        dtype: format!("{} ({storage})", eargs.dtype),
        kv_dtype: eargs.kv_dtype.as_str(),
        threads: tandem_engine::kernels_threads(),
        prompt_len: args.prompt_len,
        prefill_tok_s: prefill.median,
        decode_tok_s: decode
            .iter()
            .map(|(b, s)| (b.to_string(), s.median))
            .collect(),
        prefill_spread: prefill,
        decode_spread: decode.iter().map(|(b, s)| (b.to_string(), *s)).collect(),
        weight_bytes_per_token: bytes_per_token,
        mem_read_gb_s: mem_bw,
        bandwidth_bound_tok_s: mem_bw * 1e9 / bytes_per_token as f64,
        flops_per_token,
        runs: args.runs,
        temperature: args.temperature,
        top_p: args.top_p,
        penalties: args.penalties,
        structured: args.structured,
        grammar_us_per_token: grammar_us,
        tokens_picked_on_device: stats.tokens_picked_on_device,
        cuda_graph_replays: stats.cuda_graph_replays,
        cuda_graph_fallbacks: stats.cuda_graph_fallbacks,
    };
    Ok(match args.format {
        Format::Json => serde_json::to_string(&report)?,
        Format::Table => {
            let mut s = format!(
                "model {} · device {} · weights {} · KV {} · {} threads · medians of {} runs (min–max){}{}{}\n",
                report.model,
                report.device,
                report.dtype,
                report.kv_dtype,
                report.threads,
                report.runs,
                if args.temperature > 0.0 {
                    format!(" · sampled T {} top-p {}", args.temperature, args.top_p)
                } else {
                    String::new()
                },
                if args.penalties { " · penalties" } else { "" },
                if args.structured { " · JSON schema" } else { "" },
            );
            s += &format!(
                "prefill  {:>5} tokens      {:>9.1} tok/s  ({:.1}–{:.1})\n",
                args.prompt_len, prefill.median, prefill.min, prefill.max
            );
            for (b, sp) in &decode {
                s += &format!(
                    "decode   batch {:>3}         {:>9.1} tok/s  ({:.1}–{:.1})  {:.3} ms/step\n",
                    b,
                    sp.median,
                    sp.min,
                    sp.max,
                    1e3 * *b as f64 / sp.median
                );
            }
            s += &format!(
                "bound    1 seq at {:.1} GB/s (host memory)  {:>9.1} tok/s  ({} MB of weights per token)\n",
                mem_bw,
                report.bandwidth_bound_tok_s,
                bytes_per_token / 1_000_000
            );
            if let Some(one) = decode.get(&1) {
                s += &format!(
                    "decode batch 1 / bound     {:>9.1} %\n",
                    100.0 * one.median / report.bandwidth_bound_tok_s
                );
            }
            if let Some(us) = report.grammar_us_per_token {
                s += &format!("grammar  mask + advance    {us:>9.1} µs per token (alone)\n");
            }
            s
        }
    })
}
