//! `tandem generate`: one completion on the local engine, streamed to stdout as it is produced.
//! Only the completion goes to stdout; logs and usage go to stderr.

use std::io::{IsTerminal, Write};
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use tandem_engine::tokenizer::ChatMessage;
use tandem_engine::{EngineArgs, Priority, Request, SamplingParams};

use crate::load::engine_from_args;

/// Flags of `tandem generate`.
#[derive(Args, Debug, Clone)]
pub struct GenerateArgs {
    /// The prompt text (with --chat: the user message).
    #[arg(long)]
    pub prompt: String,
    /// Wrap the prompt as a chat user message in the model's chat template (ChatML).
    #[arg(long)]
    pub chat: bool,
    /// System message for --chat (default: the model template's own).
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// Maximum new tokens.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Sampling seed (same seed, same output).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop when the output contains this string (repeatable; not printed).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Print the generated token ids to stderr at the end.
    #[arg(long)]
    pub print_token_ids: bool,
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// Runs `tandem generate`.
pub fn run(args: &GenerateArgs) -> anyhow::Result<()> {
    if args.prompt.is_empty() {
        bail!("invalid request: `prompt` is empty");
    }
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
        max_new_tokens: args.max_tokens,
        stop: args.stop.clone(),
        ignore_eos: false,
    };
    params.validate()?;
    let mut engine = engine_from_args(&args.engine)?;
    let tok = engine
        .tokenizer()
        .context("this model has no tokenizer; `generate` needs text")?
        .clone();
    let text = if args.chat {
        let mut msgs = Vec::new();
        if let Some(s) = &args.system {
            msgs.push(ChatMessage {
                role: "system".into(),
                content: s.clone(),
            });
        }
        msgs.push(ChatMessage {
            role: "user".into(),
            content: args.prompt.clone(),
        });
        tok.apply_chat_template(&msgs, true)?
    } else {
        args.prompt.clone()
    };
    let prompt = tok.encode(&text);
    let t0 = Instant::now();
    let mut first_token_at = None;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut write_err = None;
    let done = engine.generate(
        vec![Request {
            id: 1,
            prompt,
            params,
            priority: Priority::Interactive,
        }],
        |o| {
            first_token_at.get_or_insert_with(|| t0.elapsed());
            if write_err.is_none()
                && let Err(e) = out.write_all(o.text.as_bytes()).and_then(|_| out.flush()) {
                    write_err = Some(e);
                }
        },
    )?;
    if let Some(e) = write_err {
        return Err(e).context("writing to stdout");
    }
    if out.is_terminal() {
        writeln!(out)?;
    }
    let c = &done[0];
    let elapsed = t0.elapsed().as_secs_f64();
    let ttft = first_token_at.unwrap_or_default().as_secs_f64();
    let decode_rate =
        (c.usage.completion_tokens.saturating_sub(1)) as f64 / (elapsed - ttft).max(1e-9);
    tracing::info!(
        prompt_tokens = c.usage.prompt_tokens,
        completion_tokens = c.usage.completion_tokens,
        finish_reason = c.finish_reason.as_openai_str(),
        ttft_ms = (ttft * 1e3) as u64,
        decode_tok_s = format!("{decode_rate:.1}"),
        "done"
    );
    if args.print_token_ids {
        eprintln!("token_ids: {:?}", c.tokens);
    }
    Ok(())
}
