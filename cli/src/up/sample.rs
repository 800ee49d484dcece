//! `tandem up`'s sample request: one streamed generation through the router's gRPC ingress,
//! printed as it arrives, authenticated with the key the router accepts (if any).

use std::io::Write;

use anyhow::{Context, bail};
use tandem_proto::v1::inference_client::InferenceClient;
use tandem_proto::v1::{
    ChatMessage, ChatMessages, GenerateRequest, SamplingParams, generate_request, generate_response,
};

use super::UpArgs;

/// The key `tandem up`'s own sample request authenticates with: the first admin key given in
/// plain text in `--api-keys-file`, else the first of `$TANDEM_API_KEYS` (what the router
/// reads too); none when authentication is off.
pub(super) fn sample_key(args: &UpArgs) -> anyhow::Result<Option<String>> {
    if let Some(path) = &args.api_keys_file {
        #[derive(serde::Deserialize)]
        struct File {
            #[serde(default)]
            key: Vec<Entry>,
        }
        #[derive(serde::Deserialize)]
        struct Entry {
            key: Option<String>,
            #[serde(default)]
            admin: bool,
        }
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading --api-keys-file {}", path.display()))?;
        let file: File = toml::from_str(&text)
            .with_context(|| format!("parsing --api-keys-file {}", path.display()))?;
        return match file.key.into_iter().find(|k| k.admin && k.key.is_some()) {
            Some(k) => Ok(k.key),
            None if args.no_sample => Ok(None),
            None => bail!(
                "{} has no admin key given as `key = \"...\"`, which tandem up needs for its sample request (or pass --no-sample)",
                path.display()
            ),
        };
    }
    Ok(std::env::var("TANDEM_API_KEYS").ok().and_then(|v| {
        v.split(',')
            .map(str::trim)
            .find(|k| !k.is_empty())
            .map(str::to_owned)
    }))
}

pub(super) async fn sample(args: &UpArgs) -> anyhow::Result<()> {
    let mut client = InferenceClient::connect(format!("http://{}", args.grpc)).await?;
    let req = GenerateRequest {
        input: Some(generate_request::Input::Chat(ChatMessages {
            messages: vec![ChatMessage {
                role: "user".into(),
                content: args.prompt.clone(),
            }],
        })),
        sampling: Some(SamplingParams {
            max_tokens: args.max_tokens,
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut call = tonic::Request::new(req);
    if let Some(key) = sample_key(args)? {
        call.metadata_mut().insert(
            "authorization",
            format!("Bearer {key}")
                .parse()
                .context("the API key is not valid in a header")?,
        );
    }
    let mut stream = client.generate(call).await?.into_inner();
    let mut out = std::io::stdout().lock();
    while let Some(msg) = stream.message().await? {
        match msg.event {
            Some(generate_response::Event::Delta(d)) => {
                out.write_all(d.text.as_bytes())?;
                out.flush()?;
            }
            Some(generate_response::Event::Final(f)) => {
                writeln!(out)?;
                if let Some(u) = f.usage {
                    eprintln!(
                        "tandem up: {} prompt + {} completion tokens, finish reason {:?}",
                        u.prompt_tokens,
                        u.completion_tokens,
                        f.finish_reason()
                    );
                }
            }
            None => {}
        }
    }
    Ok(())
}
