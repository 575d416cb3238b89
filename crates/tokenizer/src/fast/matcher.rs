//! The regexes of a pre-tokenizer, with GPT-2's whitespace rule run without backtracking.
//!
//! GPT-2, Llama 3, Qwen and DeepSeek split text with patterns that end in `\s+(?!\S)|\s+`: a
//! run of whitespace is one piece, except that before a non-space it leaves its last character
//! to the next piece (so " word" keeps its space). The lookahead makes `tokenizers` run the whole
//! pattern in `fancy-regex`'s backtracking machine, about twelve times slower than the same
//! pattern without it in `regex`'s automata, and the largest cost of tokenizing such text.
//!
//! For a pattern `A|\s+(?!\S)|\s+` the matcher runs `A|(\s+)` instead. Both are leftmost-first,
//! so at a position where `A` matches both give `A`'s match. Where it does not, `\s+(?!\S)`
//! takes the whole whitespace run if it ends the text, else the run but its last character if
//! that leaves at least one, else fails and `\s+` takes the one character; `(\s+)` takes the
//! whole run. So the matches are the same but for one case, corrected here: the `(\s+)` branch
//! matched a run of two or more characters that does not end the text; then the match ends one
//! character earlier, and the search goes on from there.
//!
//! Only the heads `A` of the patterns the known tokenizers use are rewritten ([`KNOWN_HEADS`]: an
//! arbitrary head could parse differently once the suffix is cut, or backtrack so much that
//! `fancy-regex` gives up where the automata would not), and only in pieces of at most
//! [`MAX_REWRITTEN_BYTES`]: `fancy-regex` stops a search after a million backtracks or a stack of
//! a million entries, and `tokenizers` then leaves the rest of the piece unsplit. These heads
//! cost it at most about nine backtracks and one stack entry per character, so no search within
//! such a piece reaches either limit, and longer pieces run as `tokenizers` compiles them, limits
//! included. Any other pattern runs as `tokenizers` compiles it.

use tokenizers::utils::SysRegex;

/// The ending the rewrite applies to.
const TAIL: &str = r"|\s+(?!\S)|\s+";

/// Longest piece the rewrite runs on (64 KiB); longer pieces run in `fancy-regex`.
pub(super) const MAX_REWRITTEN_BYTES: usize = 1 << 16;

/// The heads `A` of the known patterns `A|\s+(?!\S)|\s+`: GPT-2's, Llama 3's, Qwen 2's (one
/// digit at a time) and DeepSeek V3's and V4's third split.
const KNOWN_HEADS: [&str; 4] = [
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+",
];

/// One split pattern.
pub(super) enum Matcher {
    /// The pattern as `tokenizers` compiled it.
    Fancy(SysRegex),
    /// `A|(?P<tail>\s+)` for a pattern `A|\s+(?!\S)|\s+`, and the pattern as compiled (for
    /// long pieces).
    Tail(regex::Regex, SysRegex),
}

impl Matcher {
    /// The matcher of `pattern`, which `tokenizers` compiled as `compiled`.
    pub(super) fn new(pattern: &str, compiled: SysRegex) -> Self {
        let rewritten = pattern
            .strip_suffix(TAIL)
            .filter(|head| KNOWN_HEADS.contains(head))
            .and_then(|head| regex::Regex::new(&format!("{head}|(?P<tail>\\s+)")).ok());
        match rewritten {
            Some(re) => Self::Tail(re, compiled),
            None => Self::Fancy(compiled),
        }
    }

    /// Calls `f(start, end)` for each match in `text`, in order, as `tokenizers`' `find_iter`
    /// finds them. `false` (after calling `f` for some) when the rewrite cannot say: it found an
    /// empty match.
    pub(super) fn each(&self, text: &str, mut f: impl FnMut(usize, usize)) -> bool {
        let re = match self {
            Self::Tail(re, _) if text.len() <= MAX_REWRITTEN_BYTES => re,
            Self::Fancy(compiled) | Self::Tail(_, compiled) => {
                for (s, e) in compiled.find_iter(text) {
                    f(s, e);
                }
                return true;
            }
        };
        let mut at = 0;
        while let Some(m) = re.find_at(text, at) {
            let (s, mut e) = (m.start(), m.end());
            if s == e {
                return false;
            }
            let run = &text[s..e];
            if e < text.len()
                && run.chars().nth(1).is_some()
                && run.chars().all(char::is_whitespace)
            {
                // A whitespace run before a non-space: `\s+(?!\S)` leaves its last character,
                // unless `A` matched it (then it is `A`'s match, kept whole).
                let tail = re.captures_at(text, s).and_then(|c| c.name("tail"));
                if tail.is_some_and(|t| t.start() == s && t.end() == e) {
                    e -= run.chars().next_back().map_or(0, char::len_utf8);
                }
            }
            f(s, e);
            at = e;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spans(m: &Matcher, text: &str) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        assert!(m.each(text, |s, e| out.push((s, e))));
        out
    }

    #[test]
    fn the_rewrite_finds_what_the_lookahead_finds() {
        let pattern = format!("{}{TAIL}", KNOWN_HEADS[0]);
        let tail = Matcher::new(&pattern, SysRegex::new(&pattern).unwrap());
        assert!(matches!(tail, Matcher::Tail(..)));
        let pattern = pattern.as_str();
        let fancy = Matcher::Fancy(SysRegex::new(pattern).unwrap());
        for text in [
            "a   b",
            "a b",
            "a  ",
            "   ",
            " \n\t x",
            "x\u{3000}\u{3000}y",
            "it's  42  ok \n",
        ] {
            assert_eq!(spans(&tail, text), spans(&fancy, text), "{text:?}");
        }
        // The whitespace run before "b" leaves its last space to " b".
        assert_eq!(spans(&tail, "a   b"), [(0, 1), (1, 3), (3, 5)]);
    }

    #[test]
    fn only_known_heads_are_rewritten() {
        // Unknown heads, one of which would parse differently once the suffix is cut (its `|`
        // is a literal).
        for pattern in [r"\p{N}{1,3}", r"x*|\s+(?!\S)|\s+", r"x\|\s+(?!\S)|\s+"] {
            assert!(matches!(
                Matcher::new(pattern, SysRegex::new(pattern).unwrap()),
                Matcher::Fancy(_)
            ));
        }
        for head in KNOWN_HEADS {
            let pattern = format!("{head}{TAIL}");
            let m = Matcher::new(&pattern, SysRegex::new(&pattern).unwrap());
            assert!(matches!(m, Matcher::Tail(..)), "{head}");
        }
    }
}
