//! What `kvrouter serve` says when it starts, after its first line (`listening on ... mode=...
//! workers=N`, which scripts read): models, block size, tokenizer, chat template, and each
//! worker's URL and KV-event endpoint. Pure: built from values, printed by the caller.

use kvrouter_server::WorkerEntry;

/// Most workers listed one per line; the rest are counted (GET /admin/workers lists them all).
pub(crate) const MAX_WORKER_LINES: usize = 64;

/// Where the chat template came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TemplateSource {
    /// `--chat-template PATH`.
    Flag(String),
    /// `chat_template` of the tokenizer_config.json beside `--tokenizer`.
    TokenizerConfig(String),
    /// `--tokenizer` given, but no chat_template beside it: ChatML was taken instead.
    ChatMlFallback { tokenizer: String },
    /// Neither flag: the built-in tokenizer with ChatML.
    ChatMlDefault,
}

impl std::fmt::Display for TemplateSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Flag(p) => write!(f, "jinja {p} (--chat-template)"),
            Self::TokenizerConfig(p) => write!(f, "jinja {p} (beside --tokenizer)"),
            Self::ChatMlFallback { tokenizer } => write!(
                f,
                "ChatML FALLBACK: no chat_template in a tokenizer_config.json beside {tokenizer}; \
                 give --chat-template if the model expects another format"
            ),
            Self::ChatMlDefault => write!(f, "ChatML (built-in default)"),
        }
    }
}

/// What the lines are built from.
pub(crate) struct Facts<'a> {
    pub(crate) models: &'a [String],
    pub(crate) block_size_tokens: usize,
    pub(crate) tokenizer: String,
    pub(crate) template: &'a TemplateSource,
    pub(crate) kv_events: bool,
    pub(crate) workers: &'a [WorkerEntry],
}

/// The lines after the first, each starting with two spaces.
pub(crate) fn lines(f: &Facts<'_>) -> Vec<String> {
    let models = if f.models.is_empty() {
        "(none learned: the first worker's /v1/models did not answer; give --model-name)".into()
    } else {
        f.models.join(", ")
    };
    let mut out = vec![
        format!("  models: {models}"),
        format!(
            "  kv block size: {} tokens (--kv-cache-block-size; engines must match)",
            f.block_size_tokens
        ),
        format!("  tokenizer: {}", f.tokenizer),
        format!("  chat template: {}", f.template),
    ];
    for w in f.workers.iter().take(MAX_WORKER_LINES) {
        let events = match (&w.kv_events_endpoint, f.kv_events) {
            (_, false) => "off (--no-router-kv-events: cache predicted from routing)".to_owned(),
            (Some(e), true) => e.clone(),
            (None, true) => "none (not given, not advertised at /server_info: its cache is \
                             predicted from routing, kept --router-ttl-secs)"
                .to_owned(),
        };
        let id = w.id.map_or("?".to_owned(), |i| i.to_string());
        let dp = w.dp_size.unwrap_or(1);
        let dp = if dp > 1 {
            format!(" dp_size={dp}")
        } else {
            String::new()
        };
        out.push(format!("  worker {id}: {} kv-events={events}{dp}", w.url));
    }
    if f.workers.len() > MAX_WORKER_LINES {
        out.push(format!(
            "  ... and {} more workers (GET /admin/workers)",
            f.workers.len() - MAX_WORKER_LINES
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(id: u64, events: Option<&str>) -> WorkerEntry {
        WorkerEntry {
            id: Some(id),
            url: format!("http://10.0.0.{id}:8000"),
            kv_events_endpoint: events.map(str::to_owned),
            ..WorkerEntry::default()
        }
    }

    #[test]
    fn names_models_block_size_tokenizer_template_and_each_worker() {
        let workers = [worker(0, Some("tcp://10.0.0.0:5557")), worker(1, None)];
        let t = TemplateSource::ChatMlFallback {
            tokenizer: "/m/tokenizer.json".into(),
        };
        let text = lines(&Facts {
            models: &["qwen".into()],
            block_size_tokens: 16,
            tokenizer: "hf /m/tokenizer.json".into(),
            template: &t,
            kv_events: true,
            workers: &workers,
        })
        .join("\n");
        assert!(text.contains("models: qwen"), "{text}");
        assert!(text.contains("kv block size: 16 tokens"), "{text}");
        assert!(text.contains("tokenizer: hf /m/tokenizer.json"), "{text}");
        assert!(text.contains("ChatML FALLBACK"), "{text}");
        assert!(
            text.contains("worker 0: http://10.0.0.0:8000 kv-events=tcp://10.0.0.0:5557"),
            "{text}"
        );
        assert!(
            text.contains("worker 1: http://10.0.0.1:8000 kv-events=none"),
            "{text}"
        );
    }

    #[test]
    fn worker_lines_are_bounded() {
        let workers: Vec<WorkerEntry> = (0..100).map(|i| worker(i, None)).collect();
        let out = lines(&Facts {
            models: &[],
            block_size_tokens: 64,
            tokenizer: "builtin".into(),
            template: &TemplateSource::ChatMlDefault,
            kv_events: false,
            workers: &workers,
        });
        assert_eq!(out.len(), 4 + MAX_WORKER_LINES + 1);
        assert!(out.last().unwrap().contains("36 more"));
        assert!(out[0].contains("give --model-name"));
    }
}
