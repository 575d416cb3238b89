//! Chat messages and their rendering into a prompt.

use serde::{Deserialize, Serialize};

/// One chat message. `content` is the text (parts of a multi-part content are joined).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, …
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// Reads an OpenAI message object: `content` may be a string, null, or an array of parts
    /// whose `text` fields are joined.
    pub fn from_openai(value: &serde_json::Value) -> Option<Self> {
        let role = value.get("role")?.as_str()?.to_owned();
        let content = match value.get("content") {
            None | Some(serde_json::Value::Null) => String::new(),
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(parts)) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(serde_json::Value::as_str))
                .collect::<Vec<_>>()
                .join(""),
            Some(_) => return None,
        };
        Some(Self { role, content })
    }
}

/// Why a template could not be loaded or rendered.
#[derive(Debug, thiserror::Error)]
#[error("chat template {origin}: {reason}")]
pub struct TemplateError {
    /// Where the template came from.
    pub origin: String,
    /// What went wrong.
    pub reason: String,
}

/// How chat messages become a prompt.
#[derive(Debug, Default)]
pub enum ChatTemplate {
    /// ChatML: `<|im_start|>{role}\n{content}<|im_end|>\n` per message, then
    /// `<|im_start|>assistant\n` when a reply is to be generated.
    #[default]
    ChatMl,
    /// A Jinja template as Hugging Face ships them (`messages`, `add_generation_prompt`,
    /// `bos_token`, `eos_token`, `raise_exception`).
    Jinja {
        /// Compiled template environment.
        env: Box<minijinja::Environment<'static>>,
        /// Where it came from.
        origin: String,
        /// `bos_token` in the template context.
        bos_token: String,
        /// `eos_token` in the template context.
        eos_token: String,
    },
}

fn token_text(v: Option<&serde_json::Value>) -> String {
    match v {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Object(o)) => o
            .get("content")
            .and_then(serde_json::Value::as_str)
            .unwrap_or("")
            .to_owned(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    /// A Jinja template from its source text.
    pub fn jinja(
        source: String,
        origin: String,
        bos_token: String,
        eos_token: String,
    ) -> Result<Self, TemplateError> {
        let mut env = minijinja::Environment::new();
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template_owned("chat", source)
            .map_err(|e| TemplateError {
                origin: origin.clone(),
                reason: e.to_string(),
            })?;
        Ok(ChatTemplate::Jinja {
            env: Box::new(env),
            origin,
            bos_token,
            eos_token,
        })
    }

    /// A Jinja template file.
    pub fn from_file(path: &std::path::Path) -> Result<Self, TemplateError> {
        let origin = path.display().to_string();
        let source = crate::read_file(path).map_err(|e| TemplateError {
            origin: origin.clone(),
            reason: e.to_string(),
        })?;
        Self::jinja(source, origin, String::new(), String::new())
    }

    /// The `chat_template` of a `tokenizer_config.json` beside a tokenizer, if it has one.
    pub fn from_tokenizer_config(
        tokenizer: &std::path::Path,
    ) -> Result<Option<Self>, TemplateError> {
        let dir = if tokenizer.is_dir() {
            tokenizer.to_path_buf()
        } else {
            tokenizer
                .parent()
                .map(|p| p.to_path_buf())
                .unwrap_or_default()
        };
        let path = dir.join("tokenizer_config.json");
        let Ok(text) = crate::read_file(&path) else {
            return Ok(None);
        };
        let origin = path.display().to_string();
        let config: serde_json::Value = serde_json::from_str(&text).map_err(|e| TemplateError {
            origin: origin.clone(),
            reason: e.to_string(),
        })?;
        let Some(source) = config
            .get("chat_template")
            .and_then(serde_json::Value::as_str)
        else {
            return Ok(None);
        };
        let bos = token_text(config.get("bos_token"));
        let eos = token_text(config.get("eos_token"));
        Self::jinja(source.to_owned(), origin, bos, eos).map(Some)
    }

    /// The prompt that continues the last (assistant) message instead of starting a new one:
    /// vLLM's `continue_final_message`. The last message is left open.
    pub fn render_continuation(&self, messages: &[ChatMessage]) -> Result<String, TemplateError> {
        let Some((last, history)) = messages.split_last() else {
            return self.render(messages, false);
        };
        match self {
            ChatTemplate::ChatMl => {
                let mut out = self.render(history, false)?;
                out.push_str("<|im_start|>");
                out.push_str(&last.role);
                out.push('\n');
                out.push_str(&last.content);
                Ok(out)
            }
            ChatTemplate::Jinja { .. } => {
                // Render with the message closed, then cut everything after its content.
                let full = self.render(messages, false)?;
                match full
                    .rfind(last.content.as_str())
                    .filter(|_| !last.content.is_empty())
                {
                    Some(at) => Ok(full[..at + last.content.len()].to_owned()),
                    None => Ok(full),
                }
            }
        }
    }

    /// The prompt for `messages`.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        match self {
            ChatTemplate::ChatMl => {
                let mut out = String::new();
                for m in messages {
                    out.push_str("<|im_start|>");
                    out.push_str(&m.role);
                    out.push('\n');
                    out.push_str(&m.content);
                    out.push_str("<|im_end|>\n");
                }
                if add_generation_prompt {
                    out.push_str("<|im_start|>assistant\n");
                }
                Ok(out)
            }
            ChatTemplate::Jinja {
                env,
                origin,
                bos_token,
                eos_token,
            } => {
                let template = env.get_template("chat").map_err(|e| TemplateError {
                    origin: origin.clone(),
                    reason: e.to_string(),
                })?;
                template
                    .render(minijinja::context! {
                        messages => messages,
                        add_generation_prompt => add_generation_prompt,
                        bos_token => bos_token,
                        eos_token => eos_token,
                    })
                    .map_err(|e| TemplateError {
                        origin: origin.clone(),
                        reason: e.to_string(),
                    })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_renders_every_message_and_the_generation_prompt() {
        let msgs = vec![
            ChatMessage {
                role: "system".into(),
                content: "Be brief.".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "Hi".into(),
            },
        ];
        assert_eq!(
            ChatTemplate::ChatMl.render(&msgs, true).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn jinja_templates_render_like_chatml_when_they_say_the_same() {
        let source = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        let t = ChatTemplate::jinja(source.into(), "test".into(), String::new(), String::new())
            .unwrap();
        let msgs = vec![ChatMessage {
            role: "user".into(),
            content: "Hi".into(),
        }];
        assert_eq!(
            t.render(&msgs, true).unwrap(),
            ChatTemplate::ChatMl.render(&msgs, true).unwrap()
        );
        let bad = ChatTemplate::jinja(
            "{% if %}".into(),
            "bad".into(),
            String::new(),
            String::new(),
        );
        assert!(bad.unwrap_err().to_string().contains("bad"));
        let raising = ChatTemplate::jinja(
            "{{ raise_exception('no system role') }}".into(),
            "t".into(),
            String::new(),
            String::new(),
        )
        .unwrap();
        assert!(raising
            .render(&msgs, true)
            .unwrap_err()
            .reason
            .contains("no system role"));
    }

    #[test]
    fn a_continuation_leaves_the_last_message_open() {
        let msgs = vec![
            ChatMessage {
                role: "user".into(),
                content: "Hi".into(),
            },
            ChatMessage {
                role: "assistant".into(),
                content: "Hel".into(),
            },
        ];
        let open = ChatTemplate::ChatMl.render_continuation(&msgs).unwrap();
        assert_eq!(
            open,
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHel"
        );
        let fresh = ChatTemplate::ChatMl.render(&msgs[..1], true).unwrap();
        assert!(
            open.starts_with(&fresh),
            "the continuation extends the original prompt"
        );
    }

    #[test]
    fn openai_content_parts_are_joined() {
        let v = serde_json::json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]});
        assert_eq!(ChatMessage::from_openai(&v).unwrap().content, "ab");
        assert!(ChatMessage::from_openai(&serde_json::json!({"content": "x"})).is_none());
    }
}
