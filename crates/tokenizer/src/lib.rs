//! kvrouter-tokenizer: turning requests into token ids the same way in the router and in the
//! mock engine.
//!
//! # Layout
//! - [`builtin`]: the documented built-in tokenizer (no files needed).
//! - [`hf`]: Hugging Face `tokenizer.json` files through the `tokenizers` crate; `fast`: its
//!   encode pipeline without the bookkeeping, for the configurations LLM tokenizers use.
//! - [`chat`]: chat messages and their rendering into a prompt (ChatML by default, or Jinja).
//! - [`cache`]: segment-cached tokenization for routing.

pub mod builtin;
pub mod cache;
pub mod chat;
mod fast;
pub mod hf;

/// Reads a tokenizer or template file: a regular file (a device or FIFO such as `/dev/zero`
/// was read without end).
pub(crate) fn read_file(path: &std::path::Path) -> std::io::Result<String> {
    if !std::fs::metadata(path)?.is_file() {
        let why = "not a regular file";
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, why));
    }
    std::fs::read_to_string(path)
}

pub use builtin::BuiltinTokenizer;
pub use cache::CachedTokenizer;
pub use chat::{ChatMessage, ChatTemplate, TemplateError};
pub use hf::HfTokenizer;

use std::fmt::Debug;
use std::path::Path;
use std::sync::Arc;

/// A tokenizer: text to ids and back, with its special tokens recognised atomically.
pub trait Tokenizer: Debug + Send + Sync {
    /// A short name for logs and `/v1/models`.
    fn name(&self) -> &str;
    /// Token ids of `text`, special tokens included as single ids, nothing added around it.
    fn encode(&self, text: &str) -> Vec<u32>;
    /// The text of `ids`.
    fn decode(&self, ids: &[u32]) -> String;
    /// The special token strings, longest first (segments between them tokenize independently).
    fn special_tokens(&self) -> &[String];
    /// The id the mock engine emits for its `index`-th generated token: a plain word piece whose
    /// text encodes back to the same id, so a conversation that resends a reply hits the cache.
    fn filler_token(&self, index: u32) -> u32;
}

/// Why a tokenizer could not be loaded.
#[derive(Debug, thiserror::Error)]
#[error("loading tokenizer {path}: {reason}")]
pub struct LoadError {
    /// The file.
    pub path: String,
    /// What went wrong.
    pub reason: String,
}

/// Loads `tokenizer.json` from a file (or the file inside a folder), or the built-in tokenizer
/// when no path is given.
pub fn load(path: Option<&Path>) -> Result<Arc<dyn Tokenizer>, LoadError> {
    match path {
        None => Ok(Arc::new(BuiltinTokenizer::new())),
        Some(p) => Ok(Arc::new(HfTokenizer::from_path(p)?)),
    }
}
