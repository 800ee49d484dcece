//! ChatML chat templates: `<|im_start|>{role}\n{content}<|im_end|>\n` per message.
//!
//! Vocabularies carry their template as Jinja source (`tokenizer.chat_template`). This module is
//! not a Jinja engine: it recognises ChatML templates (any template containing `<|im_start|>`)
//! and extracts the one thing that varies between them, the default system message that is
//! prepended when the conversation does not start with a system message (SmolLM2's is
//! "You are a helpful AI assistant named SmolLM, trained by Hugging Face"). The default is the
//! first constant string literal of the form `<|im_start|>system\n…<|im_end|>` in the source
//! (Jinja `\n` / `\'` escapes undone). No template at all means plain ChatML without a default
//! system message; a template that is not ChatML is kept as [`ChatTemplate::Unsupported`] and
//! rendering it is an error, so loading a tokenizer never fails because of its template.

use serde::{Deserialize, Serialize};

use super::error::TokenizerError;

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// Who speaks: `system`, `user`, `assistant` (any string is rendered as is).
    pub role: String,
    /// What they say.
    pub content: String,
}

impl ChatMessage {
    /// A message from `role` saying `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

const IM_START: &str = "<|im_start|>";
const IM_END: &str = "<|im_end|>";

/// A chat template this module can render, or the marker that it cannot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ChatTemplate {
    /// ChatML, with the system message used when the conversation has none.
    ChatMl {
        /// Prepended as a system message when the first message is not from `system`.
        default_system: Option<String>,
    },
    /// A template that is not ChatML.
    Unsupported,
}

impl ChatTemplate {
    /// Interpret a vocabulary's Jinja template source (`None`: plain ChatML).
    pub(crate) fn from_source(source: Option<&str>) -> Self {
        let Some(source) = source else {
            return Self::ChatMl {
                default_system: None,
            };
        };
        if !source.contains(IM_START) {
            return Self::Unsupported;
        }
        Self::ChatMl {
            default_system: default_system_message(source),
        }
    }

    /// Render `messages` (and the assistant's opening tag if `add_generation_prompt`).
    pub(crate) fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let Self::ChatMl { default_system } = self else {
            return Err(TokenizerError::UnsupportedChatTemplate);
        };
        let mut out = String::new();
        let mut push = |role: &str, content: &str| {
            out.push_str(IM_START);
            out.push_str(role);
            out.push('\n');
            out.push_str(content);
            out.push_str(IM_END);
            out.push('\n');
        };
        if let (Some(first), Some(system)) = (messages.first(), default_system)
            && first.role != "system"
        {
            push("system", system);
        }
        for m in messages {
            push(&m.role, &m.content);
        }
        if add_generation_prompt {
            out.push_str(IM_START);
            out.push_str("assistant\n");
        }
        Ok(out)
    }
}

/// The first constant `<|im_start|>system\n…<|im_end|>` literal in a Jinja source, unescaped.
fn default_system_message(source: &str) -> Option<String> {
    let opener = format!("{IM_START}system");
    let mut rest = source;
    while let Some(at) = rest.find(&opener) {
        let after = &rest[at + opener.len()..];
        let body = after
            .strip_prefix('\n')
            .or_else(|| after.strip_prefix("\\n"));
        if let Some(body) = body
            && let Some(end) = body.find(IM_END)
        {
            let text = &body[..end];
            let dynamic = ["{{", "{%", "' +", "+ '", "'+", "+'"]
                .iter()
                .any(|s| text.contains(s));
            if !dynamic {
                return Some(text.replace("\\n", "\n").replace("\\'", "'"));
            }
        }
        rest = after;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn smollm2_template_prepends_its_default_system_message() {
        let t = ChatTemplate::from_source(Some(SMOLLM2_TEMPLATE));
        let out = t.render(&[ChatMessage::new("user", "Hi")], true).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn explicit_system_message_replaces_the_default() {
        let t = ChatTemplate::from_source(Some(SMOLLM2_TEMPLATE));
        let msgs = [
            ChatMessage::new("system", "Be terse."),
            ChatMessage::new("user", "Hi"),
        ];
        let out = t.render(&msgs, false).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        );
    }

    #[test]
    fn missing_template_renders_plain_chatml() {
        let t = ChatTemplate::from_source(None);
        assert_eq!(
            t,
            ChatTemplate::ChatMl {
                default_system: None
            }
        );
        let out = t.render(&[ChatMessage::new("user", "Hi")], false).unwrap();
        assert_eq!(out, "<|im_start|>user\nHi<|im_end|>\n");
        assert_eq!(t.render(&[], true).unwrap(), "<|im_start|>assistant\n");
    }

    #[test]
    fn escaped_newlines_in_the_template_literal_are_undone() {
        let src = r"{{ '<|im_start|>system\nYou\'re kind.<|im_end|>\n' }}{{'<|im_start|>' + m }}";
        assert_eq!(default_system_message(src).as_deref(), Some("You're kind."));
    }

    #[test]
    fn non_chatml_template_fails_to_render() {
        let t = ChatTemplate::from_source(Some("{{ bos_token }}[INST] {{ m }} [/INST]"));
        let err = t
            .render(&[ChatMessage::new("user", "Hi")], true)
            .unwrap_err();
        assert!(matches!(err, TokenizerError::UnsupportedChatTemplate));
    }
}
