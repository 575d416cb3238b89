//! Which `tokenizer.json` configurations the fast path takes, and the steps it builds from them.

use super::added::AddedJson;
use super::{ByteLevel, Matcher, Step, GPT2_PATTERN};
use serde::Deserialize;
use serde_json::Value;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::utils::SysRegex;
use tokenizers::SplitDelimiterBehavior;

/// What this module reads of a `tokenizer.json` beyond what `tokenizers` exposes.
#[derive(Deserialize)]
pub(super) struct FileConfig {
    #[serde(default)]
    pub(super) added_tokens: Vec<AddedJson>,
    pub(super) model: ModelConfig,
}

#[derive(Deserialize)]
pub(super) struct ModelConfig {
    #[serde(default)]
    pub(super) dropout: Option<f64>,
}

/// Whether a post-processor leaves the ids alone when no special tokens are added: none, a
/// byte-level, BERT or RoBERTa one, a template whose single-sequence form holds the sequence
/// once (`TemplateProcessing` repeats it once per `$A`, even then), or a sequence of these.
pub(super) fn ids_kept(config: Option<Result<Value, serde_json::Error>>) -> bool {
    fn kept(v: &Value) -> bool {
        match v.get("type").and_then(Value::as_str) {
            Some("ByteLevel" | "BertProcessing" | "RobertaProcessing") => true,
            Some("TemplateProcessing") => {
                v.get("single")
                    .and_then(Value::as_array)
                    .is_some_and(|pieces| {
                        let seqs: Vec<&Value> =
                            pieces.iter().filter_map(|p| p.get("Sequence")).collect();
                        seqs.len() == 1 && seqs[0].get("id").and_then(Value::as_str) == Some("A")
                    })
            }
            Some("Sequence") => v
                .get("processors")
                .and_then(Value::as_array)
                .is_some_and(|ps| ps.iter().all(kept)),
            _ => false,
        }
    }
    match config {
        None => true,
        Some(Ok(v)) => kept(&v),
        Some(Err(_)) => false,
    }
}

/// What a normalizer the fast path takes does to text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Normalizer {
    /// Nothing: none, or an empty sequence.
    Identity,
    /// Unicode NFC (Qwen's tokenizers), alone or in a sequence: it leaves text that is already in
    /// NFC alone, and the fast path takes only such text.
    Nfc,
}

/// The characters of `text` in NFC, by the tables `tokenizers` normalizes with.
pub(super) fn nfc(text: &str) -> impl Iterator<Item = char> + '_ {
    use unicode_normalization_alignments::UnicodeNormalization;
    text.nfc().map(|(c, _)| c)
}

/// The normalizer of a configuration, or `None` for one the fast path does not take.
pub(super) fn normalizer(config: Option<Result<Value, serde_json::Error>>) -> Option<Normalizer> {
    fn of(v: &Value) -> Option<Normalizer> {
        match v.get("type")?.as_str()? {
            "NFC" => Some(Normalizer::Nfc),
            "Sequence" => {
                let parts = v.get("normalizers")?.as_array()?;
                let mut nfc = false;
                for part in parts {
                    nfc |= of(part)? == Normalizer::Nfc;
                }
                Some(if nfc {
                    Normalizer::Nfc
                } else {
                    Normalizer::Identity
                })
            }
            _ => None,
        }
    }
    match config {
        None => Some(Normalizer::Identity),
        Some(Ok(v)) => of(&v),
        Some(Err(_)) => None,
    }
}

/// Adds the steps of a pre-tokenizer's configuration; `None` for anything unsupported, or for a
/// step after the byte-level one (it would split transformed text).
pub(super) fn flatten(
    config: &Value,
    steps: &mut Vec<Step>,
    byte_level: &mut Option<ByteLevel>,
) -> Option<()> {
    if byte_level.is_some() {
        return None;
    }
    match config.get("type")?.as_str()? {
        "Sequence" => {
            for step in config.get("pretokenizers")?.as_array()? {
                flatten(step, steps, byte_level)?;
            }
        }
        "Split" => {
            let split: Split = serde_json::from_value(config.clone()).ok()?;
            let (keep_matches, keep_gaps) = match (split.behavior, split.invert) {
                (SplitDelimiterBehavior::Isolated, _) => (true, true),
                (SplitDelimiterBehavior::Removed, false) => (false, true),
                (SplitDelimiterBehavior::Removed, true) => (true, false),
                _ => return None,
            };
            let regex = match &split.pattern {
                SplitPattern::Regex(pattern) => Matcher::new(pattern, split.regex),
                SplitPattern::String(_) => Matcher::Fancy(split.regex),
            };
            steps.push(Step::Regex {
                regex,
                keep_matches,
                keep_gaps,
            });
        }
        "WhitespaceSplit" => steps.push(Step::Whitespace),
        "ByteLevel" => {
            let flag = |name: &str, default: bool| match config.get(name) {
                None => Some(default),
                Some(v) => v.as_bool(),
            };
            let regex = match flag("use_regex", true)? {
                true => Some(Matcher::new(
                    GPT2_PATTERN,
                    SysRegex::new(GPT2_PATTERN).ok()?,
                )),
                false => None,
            };
            *byte_level = Some(ByteLevel {
                add_prefix_space: flag("add_prefix_space", true)?,
                regex,
            });
        }
        _ => return None,
    }
    Some(())
}
