//! Added tokens, split off before anything else as `tokenizers` does it (`AddedVocabulary::
//! extract_and_normalize`, over the tries `refresh_added_tokens` builds from the file's entries),
//! for the common case where it can be reproduced exactly: the text is left alone by the
//! normalizer (checked by the caller; the normalized entries are found by their normalized
//! strings, as `tokenizers` finds them), no added token strips spaces, must stand as a
//! single word or is empty, no string is listed twice with different `normalized` flags, and
//! special tokens are not encoded as text. Then `tokenizers` finds
//! the tokens that are not `normalized` in the text (leftmost-longest), and the `normalized` ones
//! in what is left between them (leftmost-longest again); every match is its token's id and the
//! text between matches goes through the pre-tokenizer and model piece by piece. Otherwise text
//! holding any added token's string takes the full way.

use super::config::{nfc, Normalizer};
use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use serde::Deserialize;

/// An entry of a `tokenizer.json`'s `added_tokens`, as written: `tokenizers` builds its splitting
/// from these entries, not from its id map (which keeps one token per id).
#[derive(Debug, Deserialize)]
pub(super) struct AddedJson {
    content: String,
    #[serde(default)]
    single_word: bool,
    #[serde(default)]
    lstrip: bool,
    #[serde(default)]
    rstrip: bool,
    #[serde(default)]
    normalized: bool,
}

/// One pass: the strings to find and their ids, pattern by pattern.
pub(super) struct Pass {
    trie: Option<AhoCorasick>,
    ids: Vec<u32>,
}

impl Pass {
    fn new(tokens: &[(String, u32)]) -> Option<Self> {
        let trie = match tokens.is_empty() {
            true => None,
            false => Some(
                AhoCorasickBuilder::new()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(tokens.iter().map(|(s, _)| s))
                    .ok()?,
            ),
        };
        Some(Self {
            trie,
            ids: tokens.iter().map(|(_, id)| *id).collect(),
        })
    }

    /// Calls `f` with each match in `text[start..end]` as a token and the non-empty text
    /// between them as a gap (ranges of `text`), in order.
    fn split(
        &self,
        text: &str,
        (start, end): (usize, usize),
        f: &mut impl FnMut(Segment) -> Option<()>,
    ) -> Option<()> {
        let mut at = start;
        if let Some(trie) = &self.trie {
            for m in trie.find_iter(&text[start..end]) {
                if at < start + m.start() {
                    f(Segment::Text(at, start + m.start()))?;
                }
                f(Segment::Token(self.ids[m.pattern().as_usize()]))?;
                at = start + m.end();
            }
        }
        if at < end {
            f(Segment::Text(at, end))?;
        }
        Some(())
    }
}

/// A part of a text: an added token's id, or the range of text between them.
pub(super) enum Segment {
    Token(u32),
    Text(usize, usize),
}

/// A tokenizer's added tokens.
pub(super) enum AddedTokens {
    /// Split off exactly: the tokens that are not `normalized`, then those that are.
    Split { raw: Pass, normalized: Pass },
    /// Text holding any of these strings takes the full way.
    Refuse(AhoCorasick),
}

impl AddedTokens {
    /// The added tokens of `tok`, listed in its file as `listed`, under its `normalizer`.
    pub(super) fn new(
        tok: &tokenizers::Tokenizer,
        listed: &[AddedJson],
        normalizer: Normalizer,
    ) -> Option<Self> {
        // A string listed twice with different flags lands in one trie or the other by
        // `tokenizers`' rules for special and plain entries: not reproduced, refused.
        let mut flags = std::collections::HashMap::new();
        let consistent = listed
            .iter()
            .all(|t| *flags.entry(t.content.as_str()).or_insert(t.normalized) == t.normalized);
        let exact = consistent
            && !tok.get_encode_special_tokens()
            && listed
                .iter()
                .all(|t| !(t.lstrip || t.rstrip || t.single_word || t.content.is_empty()));
        if !exact {
            // Every string that could be split off, from the file and from the id map.
            let decoder = tok.get_added_tokens_decoder();
            let strings = listed
                .iter()
                .map(|t| t.content.clone())
                .chain(decoder.into_values().map(|t| t.content))
                .filter(|s| !s.is_empty());
            return Some(Self::Refuse(AhoCorasick::new(strings).ok()?));
        }
        // `tokenizers` finds the normalized entries by their normalized strings.
        let pattern = |t: &AddedJson| -> String {
            match (t.normalized, normalizer) {
                (true, Normalizer::Nfc) => nfc(&t.content).collect(),
                _ => t.content.clone(),
            }
        };
        let with_id = |normalized: bool| -> Option<Vec<(String, u32)>> {
            listed
                .iter()
                .filter(|t| t.normalized == normalized)
                .map(|t| Some((pattern(t), tok.token_to_id(&t.content)?)))
                .collect()
        };
        Some(Self::Split {
            raw: Pass::new(&with_id(false)?)?,
            normalized: Pass::new(&with_id(true)?)?,
        })
    }

    /// Calls `f` with the added tokens of `text` and the text between them, in order; `None`
    /// when the text must take the full way (or `f` said so).
    pub(super) fn split(&self, text: &str, mut f: impl FnMut(Segment) -> Option<()>) -> Option<()> {
        match self {
            Self::Refuse(strings) => match strings.is_match(text) {
                true => None,
                false if text.is_empty() => Some(()),
                false => f(Segment::Text(0, text.len())),
            },
            Self::Split { raw, normalized } => {
                raw.split(text, (0, text.len()), &mut |segment| match segment {
                    Segment::Text(s, e) => normalized.split(text, (s, e), &mut f),
                    token => f(token),
                })
            }
        }
    }
}
