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
//! character earlier, and the search goes on from there. Any other pattern runs as `tokenizers`
//! compiles it.

use tokenizers::utils::SysRegex;

/// The ending the rewrite applies to.
const TAIL: &str = r"|\s+(?!\S)|\s+";

/// One split pattern.
pub(super) enum Matcher {
    /// The pattern as `tokenizers` compiled it.
    Fancy(SysRegex),
    /// `A|(?P<tail>\s+)` for a pattern `A|\s+(?!\S)|\s+`.
    Tail(regex::Regex),
}

impl Matcher {
    /// The matcher of `pattern`, which `tokenizers` compiled as `compiled`.
    pub(super) fn new(pattern: &str, compiled: SysRegex) -> Self {
        let rewritten = pattern
            .strip_suffix(TAIL)
            .and_then(|head| regex::Regex::new(&format!("{head}|(?P<tail>\\s+)")).ok());
        match rewritten {
            Some(re) => Self::Tail(re),
            None => Self::Fancy(compiled),
        }
    }

    /// Calls `f(start, end)` for each match in `text`, in order, as `tokenizers`' `find_iter`
    /// finds them. `false` (after calling `f` for some) when the rewrite cannot say: it found an
    /// empty match.
    pub(super) fn each(&self, text: &str, mut f: impl FnMut(usize, usize)) -> bool {
        let re = match self {
            Self::Fancy(re) => {
                for (s, e) in re.find_iter(text) {
                    f(s, e);
                }
                return true;
            }
            Self::Tail(re) => re,
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
        let pattern = r"'s| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
        let tail = Matcher::new(pattern, SysRegex::new(pattern).unwrap());
        assert!(matches!(tail, Matcher::Tail(_)));
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
    fn other_patterns_and_empty_matches_are_not_rewritten() {
        let plain = r"\p{N}{1,3}";
        assert!(matches!(
            Matcher::new(plain, SysRegex::new(plain).unwrap()),
            Matcher::Fancy(_)
        ));
        let empty = r"x*|\s+(?!\S)|\s+";
        let m = Matcher::new(empty, SysRegex::new(empty).unwrap());
        assert!(!m.each("ab", |_, _| {}));
    }
}
