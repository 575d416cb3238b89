//! Hugging Face `tokenizer.json` files.

use crate::fast::FastPath;
use crate::{LoadError, Tokenizer};
use std::path::Path;

/// A Hugging Face tokenizer.
pub struct HfTokenizer {
    name: String,
    inner: tokenizers::Tokenizer,
    specials: Vec<String>,
    fillers: Vec<u32>,
    /// The pipeline without its bookkeeping, when this tokenizer's configuration allows it.
    fast: Option<FastPath>,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// Plain words whose single-token forms serve as generated filler.
const FILLER_WORDS: [&str; 24] = [
    " the", " of", " and", " to", " in", " is", " that", " for", " it", " as", " with", " was",
    " on", " be", " at", " by", " this", " had", " not", " are", " but", " from", " or", " have",
];

impl HfTokenizer {
    /// Loads `path` (a `tokenizer.json`, or a folder holding one).
    pub fn from_path(path: &Path) -> Result<Self, LoadError> {
        let file = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_path_buf()
        };
        let shown = file.display().to_string();
        let error = |reason: String| LoadError {
            path: shown.clone(),
            reason,
        };
        let json = crate::read_file(&file).map_err(|e| error(e.to_string()))?;
        let inner: tokenizers::Tokenizer = json.parse().map_err(|e| error(format!("{e}")))?;
        let mut specials: Vec<String> = inner
            .get_added_tokens_decoder()
            .values()
            .map(|t| t.content.clone())
            .collect();
        specials.sort_by(|a, b| b.len().cmp(&a.len()).then(a.cmp(b)));
        specials.dedup();
        let mut fillers = Vec::new();
        for word in FILLER_WORDS {
            if let Ok(enc) = inner.encode(word, false) {
                if let [id] = enc.get_ids() {
                    fillers.push(*id);
                }
            }
        }
        if fillers.is_empty() {
            return Err(LoadError {
                path: shown,
                reason: "no single-token filler word".into(),
            });
        }
        let name = file
            .parent()
            .and_then(|p| p.file_name())
            .map_or_else(|| "hf".to_owned(), |n| n.to_string_lossy().into_owned());
        let fast = FastPath::new(&inner, &json);
        Ok(Self {
            name,
            inner,
            specials,
            fillers,
            fast,
        })
    }
}

impl HfTokenizer {
    /// Whether this tokenizer's configuration takes the fast encode path (`fast/`).
    pub fn has_fast_path(&self) -> bool {
        self.fast.is_some()
    }

    /// The fast path's ids of `text`, or `None` when this tokenizer or this text takes
    /// `tokenizers`' full pipeline (for diagnostics and tests; [`Tokenizer::encode`] picks).
    pub fn fast_encode(&self, text: &str) -> Option<Vec<u32>> {
        self.fast
            .as_ref()
            .and_then(|f| f.encode(self.inner.get_model(), text))
    }
}

impl Tokenizer for HfTokenizer {
    fn name(&self) -> &str {
        &self.name
    }

    fn encode(&self, text: &str) -> Vec<u32> {
        if let Some(ids) = self.fast_encode(text) {
            return ids;
        }
        // Ids only: `encode_fast` skips the offsets `encode` converts for every token.
        match self.inner.encode_fast(text, false) {
            Ok(enc) => enc.get_ids().to_vec(),
            Err(_) => Vec::new(),
        }
    }

    fn decode(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, false).unwrap_or_default()
    }

    /// Every added token: the tokenizer splits them off before anything else.
    fn special_tokens(&self) -> &[String] {
        &self.specials
    }

    fn filler_token(&self, index: u32) -> u32 {
        self.fillers[index as usize % self.fillers.len()]
    }
}
