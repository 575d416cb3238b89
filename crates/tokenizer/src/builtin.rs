//! The built-in tokenizer: deterministic, reversible, needs no files.
//!
//! Text is first split at special tokens (`<|im_start|>`, `<|im_end|>`, `<|endoftext|>`), which
//! become ids 1, 2 and 0. The text between them is pre-tokenized like GPT-2: a piece is an
//! optional single space followed by a run of non-whitespace characters, or a run of whitespace.
//! Each piece's UTF-8 bytes are cut into chunks of up to three bytes from the piece's start, and a
//! chunk of `n` bytes `b0 b1 b2` becomes the id `n << 24 | b0 << 16 | b1 << 8 | b2`. So one
//! token stands for about three to four characters of English, like a BPE vocabulary, decoding is
//! exact, and appending text never changes the ids of earlier pieces.

use crate::Tokenizer;

const SPECIALS: [(&str, u32); 3] = [("<|endoftext|>", 0), ("<|im_start|>", 1), ("<|im_end|>", 2)];

/// The built-in tokenizer. See the module docs for the scheme.
#[derive(Clone, Debug)]
pub struct BuiltinTokenizer {
    specials: Vec<String>,
}

impl Default for BuiltinTokenizer {
    fn default() -> Self {
        Self::new()
    }
}

fn pack(chunk: &[u8]) -> u32 {
    let mut id = (chunk.len() as u32) << 24;
    for (i, b) in chunk.iter().enumerate() {
        id |= u32::from(*b) << (16 - 8 * i);
    }
    id
}

fn unpack(id: u32, out: &mut Vec<u8>) {
    let n = (id >> 24) as usize;
    for i in 0..n.min(3) {
        out.push((id >> (16 - 8 * i)) as u8);
    }
}

/// GPT-2-like pre-tokenization of plain text (no special tokens inside).
pub(crate) fn pieces(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let start = i;
        let c = text[i..].chars().next().expect("in bounds");
        if c.is_whitespace() {
            let mut j = i;
            while j < bytes.len() {
                let d = text[j..].chars().next().expect("in bounds");
                if !d.is_whitespace() {
                    break;
                }
                j += d.len_utf8();
            }
            // Leave a single trailing space to lead the next word.
            if j < bytes.len() && bytes[j - 1] == b' ' && j - 1 > start {
                j -= 1;
            } else if j < bytes.len() && bytes[j - 1] == b' ' && j - 1 == start {
                // A lone space before a word: it belongs to the word.
                j = start;
            }
            if j > start {
                out.push(&text[start..j]);
                i = j;
                continue;
            }
        }
        // Optional leading space, then non-whitespace.
        let mut j = i;
        if bytes[j] == b' ' {
            j += 1;
        }
        while j < bytes.len() {
            let d = text[j..].chars().next().expect("in bounds");
            if d.is_whitespace() {
                break;
            }
            j += d.len_utf8();
        }
        out.push(&text[start..j]);
        i = j;
    }
    out
}

impl BuiltinTokenizer {
    /// The tokenizer.
    pub fn new() -> Self {
        let mut specials: Vec<String> = SPECIALS.iter().map(|(s, _)| (*s).to_owned()).collect();
        specials.sort_by_key(|s| std::cmp::Reverse(s.len()));
        Self { specials }
    }

    fn encode_plain(&self, text: &str, out: &mut Vec<u32>) {
        for piece in pieces(text) {
            for chunk in piece.as_bytes().chunks(3) {
                out.push(pack(chunk));
            }
        }
    }
}

impl Tokenizer for BuiltinTokenizer {
    fn name(&self) -> &str {
        "builtin"
    }

    fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        // Where each special token next occurs at or after `at` (`None`: nowhere). One is looked
        // for again only once `at` has passed it, so the text is scanned once per special token,
        // not once per occurrence of any of them (which made text full of one special token
        // quadratic).
        let mut next = SPECIALS.map(|(s, _)| text.find(s));
        let mut at = 0;
        loop {
            for ((s, _), p) in SPECIALS.iter().zip(next.iter_mut()) {
                if p.is_some_and(|p| p < at) {
                    *p = text[at..].find(s).map(|q| at + q);
                }
            }
            let first = SPECIALS
                .iter()
                .zip(&next)
                .filter_map(|((s, id), p)| p.map(|p| (p, *s, *id)))
                .min();
            match first {
                Some((p, s, id)) => {
                    self.encode_plain(&text[at..p], &mut out);
                    out.push(id);
                    at = p + s.len();
                }
                None => {
                    self.encode_plain(&text[at..], &mut out);
                    break;
                }
            }
        }
        out
    }

    fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 3);
        for &id in ids {
            match SPECIALS.iter().find(|(_, sid)| *sid == id) {
                Some((s, _)) => bytes.extend_from_slice(s.as_bytes()),
                None => unpack(id, &mut bytes),
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    fn special_tokens(&self) -> &[String] {
        &self.specials
    }

    fn filler_token(&self, index: u32) -> u32 {
        // " xy" with x, y lowercase letters: a whole piece of three bytes.
        let x = b'a' + (index % 26) as u8;
        let y = b'a' + ((index / 26) % 26) as u8;
        pack(&[b' ', x, y])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first special token in `rest`, searched afresh each time (the straightforward rule the
    /// encoder must agree with).
    fn naive_encode(t: &BuiltinTokenizer, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let next = SPECIALS
                .iter()
                .filter_map(|(s, id)| rest.find(s).map(|at| (at, *s, *id)))
                .min();
            match next {
                Some((at, s, id)) => {
                    t.encode_plain(&rest[..at], &mut out);
                    out.push(id);
                    rest = &rest[at + s.len()..];
                }
                None => {
                    t.encode_plain(rest, &mut out);
                    break;
                }
            }
        }
        out
    }

    use proptest::prelude::*;

    proptest! {
        #[test]
        fn special_tokens_split_the_text_as_a_fresh_search_would(
            parts in prop::collection::vec(
                prop_oneof![
                    prop::sample::select(vec![
                        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|im_", "|>", "<|",
                    ]).prop_map(str::to_owned),
                    "[a-z <|>é\n]{0,12}",
                ],
                0..40,
            )
        ) {
            let t = BuiltinTokenizer::new();
            let text: String = parts.concat();
            prop_assert_eq!(t.encode(&text), naive_encode(&t, &text));
        }
    }

    #[test]
    fn pieces_follow_gpt2_style_splitting() {
        assert_eq!(pieces("Hello world"), vec!["Hello", " world"]);
        assert_eq!(pieces("a  b"), vec!["a", " ", " b"]);
        assert_eq!(pieces("x\n y"), vec!["x", "\n", " y"]);
        assert_eq!(pieces(" lead"), vec![" lead"]);
        assert_eq!(pieces("end "), vec!["end", " "]);
    }

    #[test]
    fn encode_decode_round_trips_with_specials() {
        let t = BuiltinTokenizer::new();
        let text = "<|im_start|>user\nHéllo, wörld! 你好<|im_end|>\n";
        let ids = t.encode(text);
        assert_eq!(ids[0], 1);
        assert_eq!(t.decode(&ids), text);
        assert_eq!(t.encode("abcdef").len(), 2);
    }

    #[test]
    fn filler_text_encodes_back_to_the_same_ids() {
        let t = BuiltinTokenizer::new();
        let ids: Vec<u32> = (0..50).map(|i| t.filler_token(i * 7)).collect();
        let text = format!("assistant\n{}", t.decode(&ids));
        let again = t.encode(&text);
        assert_eq!(&again[again.len() - ids.len()..], &ids[..]);
    }
}
