//! The model the router serves, as far as the router needs it: its name, tokenizer and
//! context length. Read from the same GGUF file the nodes load, with the tokenizer crate's own
//! GGUF metadata reader (the router links no inference library; the tensor
//! data is never read, so this costs ~0.2 s and a few MB whatever the model size).
//!
//! Where the file is: `--model` (env `TANDEM_MODEL`), else the default model in the cache
//! (`$TANDEM_MODEL_DIR`, else `$XDG_CACHE_HOME/tandem/models`, else
//! `~/.cache/tandem/models`, file `SmolLM2-135M-Instruct.Q4_1.gguf`): the same rule as
//! `tandem model fetch`. A missing file is [`RouterError::ModelMissing`], whose message says to
//! run `tandem model fetch`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use tandem_grammar::Vocabulary;
use tandem_tokenizer::{GgufMetadata, Tokenizer};

use crate::config::env_names;
use crate::error::RouterError;

/// File name of the default model in the cache (as `tandem model fetch` places it).
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Context length assumed when the GGUF does not say.
const FALLBACK_CONTEXT_TOKENS: u32 = 2048;

/// The default model's path: the model cache directory joined with [`DEFAULT_MODEL_FILE`].
pub fn default_model_path() -> PathBuf {
    let dir = if let Some(dir) = std::env::var_os(env_names::MODEL_DIR) {
        PathBuf::from(dir)
    } else {
        std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .unwrap_or_else(|| PathBuf::from(".cache"))
            .join("tandem")
            .join("models")
    };
    dir.join(DEFAULT_MODEL_FILE)
}

/// What the router knows about the served model. Cheap to clone.
#[derive(Clone, Debug)]
pub struct ServedModel {
    /// The name clients pass as `model` (and `ListModels` reports).
    pub name: String,
    /// The file it was read from.
    pub path: PathBuf,
    /// The model's tokenizer (shared).
    pub tokenizer: Arc<Tokenizer>,
    /// Longest prompt + output the model accepts, in tokens.
    pub context_tokens: u32,
    /// The tokenizer's vocabulary for structured output, built by the first request that asks
    /// (~0.1 s) and shared by every clone.
    grammar: Arc<OnceLock<Result<Arc<Vocabulary>, String>>>,
}

impl ServedModel {
    /// Reads the tokenizer and context length from the GGUF at `path`. The name is `name`, or
    /// else the file name without its `.gguf` extension.
    pub fn from_gguf(path: &Path, name: Option<&str>) -> Result<Self, RouterError> {
        if !path.is_file() {
            return Err(RouterError::ModelMissing {
                path: path.to_path_buf(),
            });
        }
        let read_error = |message: String| RouterError::ModelRead {
            path: path.to_path_buf(),
            message,
        };
        let meta = GgufMetadata::read(path).map_err(|e| read_error(e.to_string()))?;
        let tokenizer = Tokenizer::from_gguf(&meta)?;
        let context_tokens = meta.context_length().map_or(FALLBACK_CONTEXT_TOKENS, |n| {
            n.min(u64::from(u32::MAX)) as u32
        });
        let name = match name {
            Some(name) => name.to_string(),
            None => path
                .file_name()
                .map(|f| f.to_string_lossy())
                .map(|f| f.strip_suffix(".gguf").unwrap_or(&f).to_string())
                .unwrap_or_else(|| "model".to_string()),
        };
        Ok(Self {
            name,
            path: path.to_path_buf(),
            tokenizer: Arc::new(tokenizer),
            context_tokens,
            grammar: Arc::default(),
        })
    }

    /// The vocabulary `response_format` schemas are checked against (built on first use).
    pub fn grammar(&self) -> Result<&Arc<Vocabulary>, String> {
        self.grammar
            .get_or_init(|| {
                let t = &self.tokenizer;
                Vocabulary::new(t.clone(), t.vocab_size(), &[t.eos_token_id()])
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(Clone::clone)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_model_file_says_how_to_fetch_it() {
        let err = ServedModel::from_gguf(Path::new("/nonexistent/model.gguf"), None).unwrap_err();
        assert!(matches!(err, RouterError::ModelMissing { .. }));
        assert!(err.to_string().contains("tandem model fetch"), "{err}");
    }

    #[test]
    fn a_file_that_is_not_gguf_is_a_read_error() {
        let path =
            std::env::temp_dir().join(format!("tandem-router-notgguf-{}", std::process::id()));
        std::fs::write(&path, b"definitely not a gguf file").unwrap();
        let err = ServedModel::from_gguf(&path, None).unwrap_err();
        let _ = std::fs::remove_file(&path);
        assert!(matches!(err, RouterError::ModelRead { .. }), "{err}");
    }
}
