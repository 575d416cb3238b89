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

/// How chat messages become a prompt.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ChatTemplate {
    /// ChatML: `<|im_start|>{role}\n{content}<|im_end|>\n` per message, then
    /// `<|im_start|>assistant\n` when a reply is to be generated.
    #[default]
    ChatMl,
}

impl ChatTemplate {
    /// The prompt for `messages`.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> String {
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
                out
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
            ChatTemplate::ChatMl.render(&msgs, true),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn openai_content_parts_are_joined() {
        let v = serde_json::json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]});
        assert_eq!(ChatMessage::from_openai(&v).unwrap().content, "ab");
        assert!(ChatMessage::from_openai(&serde_json::json!({"content": "x"})).is_none());
    }
}
