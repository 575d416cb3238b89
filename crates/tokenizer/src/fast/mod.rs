//! The Hugging Face encode pipeline without its bookkeeping, for the configurations LLM
//! tokenizers use.
//!
//! `tokenizers` carries every piece of text through the pipeline as a `NormalizedString` with an
//! alignment per byte, rebuilt at every split and at the byte-level transform, and hands the model
//! each piece as `Token`s with their strings: about 2 µs a token for the DeepSeek-V4 tokenizer,
//! and the largest single cost of routing a text request. The router needs the ids alone. For a
//! tokenizer whose normalizer does nothing (or is NFC, for text already in NFC), whose
//! pre-tokenizer is a sequence of regex splits, whitespace splits and a final byte-level step,
//! and which neither truncates nor pads, the ids are the model's ids of each piece in order,
//! where the pieces are found with the tokenizer's own compiled regexes over plain string slices.
//! This module does exactly that and nothing else:
//!
//! - the regexes are the ones `tokenizers` compiles (its `Split` built from the same JSON, its
//!   `SysRegex` for the byte-level GPT-2 pattern), so matches are the same, errors included;
//!   the known patterns ending in GPT-2's `\s+(?!\S)|\s+` run without the lookahead, with the
//!   same matches, in pieces too short for `fancy-regex`'s limits to matter (`matcher.rs`);
//! - splits keep `tokenizers`' rules: `Isolated` keeps matches and gaps, `Removed` drops matches
//!   (gaps with `invert`), empty pieces are dropped, a byte-level step with `add_prefix_space`
//!   prefixes every piece it sees that does not start with a space;
//! - each piece goes to the tokenizer's own model (`Model::tokenize`), so merges, byte fallback
//!   and unknown tokens are the model's; the ids of short pieces are then kept in a bounded
//!   cache (`pieces.rs`), since a piece's ids depend on its text alone;
//! - added tokens are split off first as `tokenizers` does (`added.rs`), or, where a token's
//!   flags make that not exactly reproducible, text holding one is not taken (the caller encodes
//!   it the full way); nor is any configuration not listed above, a post-processor that could
//!   change the ids, or BPE dropout ([`FastPath::new`] answers `None`).
//!
//! `tests/fast.rs` checks the ids against `encode_fast` on random text for the real DeepSeek-V4
//! tokenizer and for small tokenizers of each supported shape.

mod added;
mod config;
mod matcher;
mod pieces;
mod slots;

use added::{AddedTokens, Segment};
use config::{flatten, ids_kept, nfc, normalizer, FileConfig, Normalizer};
use matcher::Matcher;
use pieces::PieceCache;
use tokenizers::Model;

/// GPT-2's pattern, as `tokenizers`' byte-level pre-tokenizer compiles it when `use_regex` is on.
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// One splitting step of the pre-tokenizer.
enum Step {
    /// A regex split: `keep_matches` / `keep_gaps` say which spans survive.
    Regex {
        regex: Matcher,
        keep_matches: bool,
        keep_gaps: bool,
    },
    /// Runs of non-whitespace (`WhitespaceSplit`).
    Whitespace,
}

/// The final byte-level step.
struct ByteLevel {
    add_prefix_space: bool,
    /// GPT-2's regex split, when `use_regex` is on.
    regex: Option<Matcher>,
}

/// Buffers reused across the pieces of one text.
#[derive(Default)]
struct Scratch {
    /// A piece with the byte-level step's prefix space.
    prefixed: String,
    /// A piece in the byte-level alphabet.
    word: String,
    /// The byte-level step's GPT-2 split of a piece.
    spans: Vec<(usize, usize)>,
    /// The pieces of a text, and the next step's.
    pieces: Vec<(usize, usize)>,
    next: Vec<(usize, usize)>,
}

/// The pipeline of one tokenizer.
pub(crate) struct FastPath {
    added: AddedTokens,
    /// Text the normalizer would change takes the full way.
    normalizer: Normalizer,
    steps: Vec<Step>,
    byte_level: Option<ByteLevel>,
    /// Each byte's character in the byte-level alphabet.
    byte_chars: [char; 256],
    /// The ids of pieces seen before.
    cache: PieceCache,
}

impl std::fmt::Debug for FastPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastPath")
            .field("steps", &self.steps.len())
            .field("byte_level", &self.byte_level.is_some())
            .finish_non_exhaustive()
    }
}

/// Whether NFC leaves `text` as it is.
fn is_nfc(text: &str) -> bool {
    text.is_ascii() || nfc(text).eq(text.chars())
}

/// GPT-2's byte-to-character table: printable Latin-1 bytes stand for themselves, the others
/// for 256, 257, … in byte order.
fn byte_chars() -> [char; 256] {
    let keeps = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    let mut table = ['\0'; 256];
    let mut next = 256;
    for (b, slot) in (0u32..).zip(table.iter_mut()) {
        let code = if keeps(b) {
            b
        } else {
            next += 1;
            next - 1
        };
        *slot = char::from_u32(code).expect("below 512 is a valid character");
    }
    table
}

impl FastPath {
    /// The fast path of `tok`, read from `file` (its `tokenizer.json`), or `None` when its
    /// configuration is one this module does not reproduce exactly.
    pub(crate) fn new(tok: &tokenizers::Tokenizer, file: &str) -> Option<Self> {
        if tok.get_truncation().is_some() || tok.get_padding().is_some() {
            return None;
        }
        let file: FileConfig = serde_json::from_str(file).ok()?;
        // BPE dropout samples a split per call: neither cacheable nor reproducible.
        if file.model.dropout.is_some_and(|p| p > 0.0) {
            return None;
        }
        if !ids_kept(tok.get_post_processor().map(serde_json::to_value)) {
            return None;
        }
        let normalizer = normalizer(tok.get_normalizer().map(serde_json::to_value))?;
        let mut steps = Vec::new();
        let mut byte_level = None;
        if let Some(pre) = tok.get_pre_tokenizer() {
            let config = serde_json::to_value(pre).ok()?;
            flatten(&config, &mut steps, &mut byte_level)?;
        }
        Some(Self {
            added: AddedTokens::new(tok, &file.added_tokens, normalizer)?,
            normalizer,
            steps,
            byte_level,
            byte_chars: byte_chars(),
            cache: PieceCache::default(),
        })
    }

    /// The ids of `text` as `encode_fast(text, false)` gives them, or `None` when the text must
    /// take the full way: NFC would change it, it holds an added token that cannot be split off
    /// exactly, a rewritten split found an empty match, or the model refused a piece.
    pub(crate) fn encode(&self, model: &impl Model, text: &str) -> Option<Vec<u32>> {
        if self.normalizer == Normalizer::Nfc && !is_nfc(text) {
            return None;
        }
        let mut ids = Vec::with_capacity(text.len() / 3 + 1);
        let mut scratch = Scratch::default();
        self.added.split(text, |segment| match segment {
            Segment::Token(id) => {
                ids.push(id);
                Some(())
            }
            Segment::Text(start, end) => {
                self.encode_text(model, &text[start..end], &mut scratch, &mut ids)
            }
        })?;
        Some(ids)
    }

    /// Appends the ids of `text`, which holds no added token (and is not empty: a byte-level
    /// step would prefix a space to it).
    fn encode_text(
        &self,
        model: &impl Model,
        text: &str,
        scratch: &mut Scratch,
        ids: &mut Vec<u32>,
    ) -> Option<()> {
        let (pieces, next) = (&mut scratch.pieces, &mut scratch.next);
        pieces.clear();
        pieces.push((0, text.len()));
        for step in &self.steps {
            next.clear();
            for &(start, end) in pieces.iter() {
                if !step.split(text, start, end, next) {
                    return None;
                }
            }
            std::mem::swap(pieces, next);
        }
        let pieces = std::mem::take(&mut scratch.pieces);
        let whole = self.cache.extend_all(text, &pieces, ids, |piece, ids| {
            self.piece_ids(model, piece, scratch, ids)
        });
        scratch.pieces = pieces;
        whole
    }

    /// Appends the ids of one piece the splits left.
    fn piece_ids(
        &self,
        model: &impl Model,
        piece: &str,
        scratch: &mut Scratch,
        ids: &mut Vec<u32>,
    ) -> Option<()> {
        let Some(bl) = &self.byte_level else {
            return push_ids(model, piece, ids);
        };
        let piece = match bl.add_prefix_space && !piece.starts_with(' ') {
            true => {
                scratch.prefixed.clear();
                scratch.prefixed.push(' ');
                scratch.prefixed.push_str(piece);
                scratch.prefixed.as_str()
            }
            false => piece,
        };
        let Some(regex) = &bl.regex else {
            return self.byte_word(model, piece, &mut scratch.word, ids);
        };
        scratch.spans.clear();
        if !regex_spans(
            regex,
            piece,
            (0, piece.len()),
            (true, true),
            &mut scratch.spans,
        ) {
            return None;
        }
        for &(s, e) in &scratch.spans {
            self.byte_word(model, &piece[s..e], &mut scratch.word, ids)?;
        }
        Some(())
    }

    /// The ids of `piece` after the byte-level transform.
    fn byte_word(
        &self,
        model: &impl Model,
        piece: &str,
        word: &mut String,
        ids: &mut Vec<u32>,
    ) -> Option<()> {
        word.clear();
        word.extend(piece.bytes().map(|b| self.byte_chars[usize::from(b)]));
        push_ids(model, word, ids)
    }
}

fn push_ids(model: &impl Model, piece: &str, ids: &mut Vec<u32>) -> Option<()> {
    if piece.is_empty() {
        return Some(());
    }
    let tokens = model.tokenize(piece).ok()?;
    ids.extend(tokens.iter().map(|t| t.id));
    Some(())
}

impl Step {
    /// Appends the non-empty pieces of `text[start..end]` (as ranges of `text`) to `out`.
    /// `false` when it cannot split this text exactly.
    fn split(&self, text: &str, start: usize, end: usize, out: &mut Vec<(usize, usize)>) -> bool {
        match self {
            Step::Whitespace => {
                for part in text[start..end].split(char::is_whitespace) {
                    if !part.is_empty() {
                        let s = part.as_ptr() as usize - text.as_ptr() as usize;
                        out.push((s, s + part.len()));
                    }
                }
                true
            }
            Step::Regex {
                regex,
                keep_matches,
                keep_gaps,
            } => regex_spans(regex, text, (start, end), (*keep_matches, *keep_gaps), out),
        }
    }
}

/// Appends the non-empty matches and gaps of `regex` in `text[start..end]` that `keep` (matches,
/// gaps) names, as ranges of `text`, in order: `tokenizers`' split of one piece.
/// `false` when the matcher cannot split this text exactly (see [`Matcher::each`]).
#[must_use]
fn regex_spans(
    regex: &Matcher,
    text: &str,
    (start, end): (usize, usize),
    (keep_matches, keep_gaps): (bool, bool),
    out: &mut Vec<(usize, usize)>,
) -> bool {
    let mut prev = 0;
    let whole = regex.each(&text[start..end], |s, e| {
        if keep_gaps && prev < s {
            out.push((start + prev, start + s));
        }
        if keep_matches && s < e {
            out.push((start + s, start + e));
        }
        prev = e;
    });
    if keep_gaps && start + prev < end {
        out.push((start + prev, end));
    }
    whole
}

#[cfg(test)]
mod tests;
