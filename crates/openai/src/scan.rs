//! Reading token ids from a body's raw JSON text, and the one-pass reading of a whole object
//! body that finds them ([`object`]).
//!
//! [`object`] walks the top level of an object itself: each key (a plain string), and each
//! value either read as token ids in one tight scan, or found by a skip (strings, brackets) and
//! handed to `serde_json` to read as a [`Value`]. Every byte is checked: the structure here, the
//! values by `serde_json` or by the id scan, which takes only JSON integers. Anything this walk
//! does not take (an escaped key, deep nesting, any error) answers `None`, and the caller reads
//! the body with `serde_json` instead, so errors are always `serde_json`'s.

use crate::body::TokenIds;
use serde_json::{Map, Value};

/// The fields read into token ids when they are wholly token ids.
pub(crate) const PROMPT: &str = "prompt";
pub(crate) const TOKEN_IDS: &str = "token_ids";

/// Values nested deeper than this are left to `serde_json` (whose recursion limit counts the
/// enclosing object too).
const MAX_DEPTH: usize = 64;

/// A cursor over JSON text.
pub(crate) struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, at: 0 }
    }

    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.bytes.get(self.at) {
            self.at += 1;
        }
    }

    /// The next byte after any whitespace, consumed.
    fn next(&mut self) -> Option<u8> {
        self.skip_whitespace();
        let b = *self.bytes.get(self.at)?;
        self.at += 1;
        Some(b)
    }

    fn peek(&mut self) -> Option<u8> {
        self.skip_whitespace();
        self.bytes.get(self.at).copied()
    }

    /// A token id: a JSON integer from 0 to `u32::MAX` (not a negative, fractional or exponent
    /// number, a larger one, or one with a leading zero).
    fn id(&mut self) -> Option<u32> {
        self.skip_whitespace();
        if let Some(id) = self.short_id() {
            return id;
        }
        let start = self.at;
        let mut value: u64 = 0;
        while let Some(&b) = self.bytes.get(self.at) {
            let digit = b.wrapping_sub(b'0');
            if digit > 9 || self.at - start == 10 {
                break;
            }
            value = value * 10 + u64::from(digit);
            self.at += 1;
        }
        let digits = self.at - start;
        if digits == 0 || (digits > 1 && self.bytes[start] == b'0') {
            return None;
        }
        match self.bytes.get(self.at) {
            Some(b'0'..=b'9' | b'.' | b'e' | b'E') => None,
            _ => u32::try_from(value).ok(),
        }
    }

    /// [`Cursor::id`] of an id of at most 7 digits with 8 bytes of text from the cursor, read
    /// eight bytes at a time (no loop per digit, whose exit the CPU mispredicts once per id);
    /// `None` when it does not apply (the caller reads the id digit by digit).
    fn short_id(&mut self) -> Option<Option<u32>> {
        const ONES: u64 = 0x0101_0101_0101_0101;
        let eight: [u8; 8] = self.bytes.get(self.at..self.at + 8)?.try_into().ok()?;
        let chunk = u64::from_le_bytes(eight);
        // Each byte's digit value; a byte that is no digit has a high nibble set here or after
        // adding 6. A carry out of a byte that is no digit only touches the bytes after it.
        let values = chunk ^ (0x30 * ONES);
        let high = 0xF0 * ONES;
        let not_digit = (values | values.wrapping_add(0x06 * ONES)) & high;
        let digits = (not_digit.trailing_zeros() / 8) as usize;
        if digits == 8 {
            return None;
        }
        let start = self.at;
        self.at += digits;
        if digits == 0 || (digits > 1 && self.bytes[start] == b'0') {
            return Some(None);
        }
        if let Some(b'.' | b'e' | b'E') = self.bytes.get(self.at) {
            return Some(None);
        }
        // The digits as the low bytes of an eight-digit number with leading zeros, folded in
        // pairs, fours and eights.
        let mut v = values << (8 * (8 - digits));
        v = (v.wrapping_mul(10) + (v >> 8)) & 0x00FF_00FF_00FF_00FF;
        v = (v.wrapping_mul(100) + (v >> 16)) & 0x0000_FFFF_0000_FFFF;
        v = v.wrapping_mul(10_000) + (v >> 32);
        Some(Some(v as u32))
    }

    /// `[id, ...]`, with room for `capacity` ids.
    fn list(&mut self, capacity: usize) -> Option<Vec<u32>> {
        if self.next()? != b'[' {
            return None;
        }
        let mut ids = Vec::with_capacity(capacity);
        if self.peek()? == b']' {
            self.at += 1;
            return Some(ids);
        }
        loop {
            ids.push(self.id()?);
            // `, ` and `,` between ids, as serializers write them, without a whitespace loop.
            match self.bytes.get(self.at) {
                Some(b',') => self.at += 1,
                Some(b']') => {
                    self.at += 1;
                    return Some(ids);
                }
                _ => match self.next()? {
                    b',' => {}
                    b']' => return Some(ids),
                    _ => return None,
                },
            }
        }
    }

    /// Token ids at the cursor when the value there is wholly ids (`[1, 2]` or a batch
    /// `[[1, 2], [3]]`); `None` for anything else. The cursor ends after the value.
    fn token_ids(&mut self) -> Option<TokenIds> {
        let start = self.at;
        if self.next()? != b'[' {
            return None;
        }
        if self.peek()? == b'[' {
            let mut lists = Vec::new();
            loop {
                lists.push(self.list(0)?);
                match self.next()? {
                    b',' => {}
                    b']' => return Some(TokenIds::Batch(lists)),
                    _ => return None,
                }
            }
        }
        // Room for the ids of a typical list (`12345, ` is 7 bytes); a denser one grows.
        let capacity = (self.bytes.len() - start) / 6 + 1;
        self.at = start;
        self.list(capacity).map(TokenIds::Flat)
    }

    /// A key: a string without escapes or control characters (else `None`), cursor after it.
    fn plain_key(&mut self) -> Option<&'a str> {
        if self.next()? != b'"' {
            return None;
        }
        let start = self.at;
        let len = self.bytes[start..]
            .iter()
            .position(|&b| b == b'"' || b == b'\\' || b < 0x20)?;
        self.at = start + len;
        if self.bytes[self.at] != b'"' {
            return None;
        }
        self.at += 1;
        std::str::from_utf8(&self.bytes[start..start + len]).ok()
    }

    /// Skips one value (not checked: `serde_json` reads it next) at the cursor: where it ends,
    /// at the `,` or `}` after it. `None` when there is none, or it nests too deep.
    fn skip_value(&mut self) -> Option<usize> {
        let mut depth = 0usize;
        loop {
            match *self.bytes.get(self.at)? {
                b'"' => {
                    // To the closing quote, past escaped characters.
                    self.at += 1;
                    loop {
                        let n = self
                            .bytes
                            .get(self.at..)?
                            .iter()
                            .position(|&b| b == b'"' || b == b'\\')?;
                        self.at += n;
                        if self.bytes[self.at] == b'"' {
                            break;
                        }
                        self.at += 2;
                    }
                }
                b'[' | b'{' => {
                    depth += 1;
                    if depth > MAX_DEPTH {
                        return None;
                    }
                }
                b']' | b'}' if depth > 0 => depth -= 1,
                b',' | b'}' if depth == 0 => return Some(self.at),
                _ => {}
            }
            self.at += 1;
        }
    }

    pub(crate) fn at_end(&mut self) -> bool {
        self.skip_whitespace();
        self.at == self.bytes.len()
    }
}

/// `raw` (a JSON value the parser has checked) as token ids, when it is wholly ids: `[1, 2]`
/// or a batch `[[1, 2], [3]]`. `None` for anything else, which is then read as JSON.
pub(crate) fn read_ids(raw: &[u8]) -> Option<TokenIds> {
    let mut cursor = Cursor::new(raw);
    let ids = cursor.token_ids()?;
    cursor.at_end().then_some(ids)
}

/// An object body's fields, less its `prompt` and `token_ids` when they are wholly token ids.
pub(crate) struct Fields {
    pub(crate) map: Map<String, Value>,
    pub(crate) prompt: Option<TokenIds>,
    pub(crate) token_ids: Option<TokenIds>,
}

/// Reads a JSON object body in one pass (see the module doc); `None` when this walk does not
/// take it, or it is not a valid JSON object: the caller reads it with `serde_json` then.
pub(crate) fn object(raw: &[u8]) -> Option<Fields> {
    let mut c = Cursor::new(raw);
    let mut fields = Fields {
        map: Map::new(),
        prompt: None,
        token_ids: None,
    };
    if c.next()? != b'{' {
        return None;
    }
    if c.peek()? == b'}' {
        c.at += 1;
        return c.at_end().then_some(fields);
    }
    loop {
        let key = c.plain_key()?;
        if c.next()? != b':' {
            return None;
        }
        c.skip_whitespace();
        let slot = match key {
            PROMPT => Some(&mut fields.prompt),
            TOKEN_IDS => Some(&mut fields.token_ids),
            _ => None,
        };
        let start = c.at;
        // A repeated key: the last one wins, as in a `Value`.
        let ids = match (&slot, c.bytes.get(start)) {
            (Some(_), Some(b'[')) => c.token_ids(),
            _ => None,
        };
        match (slot, ids) {
            (Some(slot), Some(ids)) => {
                fields.map.remove(key);
                *slot = Some(ids);
            }
            (slot, _) => {
                c.at = start;
                let end = c.skip_value()?;
                let value = serde_json::from_slice(&c.bytes[start..end]).ok()?;
                if let Some(slot) = slot {
                    *slot = None;
                }
                fields.map.insert(key.to_owned(), value);
            }
        }
        match c.next()? {
            b',' => {}
            b'}' => return c.at_end().then_some(fields),
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_arrays_of_ids_are_read_as_ids() {
        let flat = |ids: &[u32]| Some(TokenIds::Flat(ids.to_vec()));
        assert_eq!(read_ids(b"[]"), flat(&[]));
        assert_eq!(read_ids(b" [ 0 , 7,4294967295 ] "), flat(&[0, 7, u32::MAX]));
        assert_eq!(read_ids(b"[1,2, 3 ,4\n,5]"), flat(&[1, 2, 3, 4, 5]));
        assert_eq!(
            read_ids(b"[[1, 2], [], [3]]"),
            Some(TokenIds::Batch(vec![vec![1, 2], vec![], vec![3]]))
        );
        for raw in [
            "[4294967296]",
            "[12345678901]",
            "[-1]",
            "[1.0]",
            "[1e2]",
            "[1E2]",
            "[01]",
            "[00]",
            "[\"1\"]",
            "[[1], 2]",
            "[1, [2]]",
            "[[[1]]]",
            "[null]",
            "[1,]",
            "[,1]",
            "[1 2]",
            "[1",
            "\"[1]\"",
            "7",
            "{}",
        ] {
            assert_eq!(read_ids(raw.as_bytes()), None, "{raw}");
        }
    }

    /// Ids of every length, read eight bytes at a time or digit by digit (near the end of the
    /// text), with every follower, read as `serde_json` reads them.
    #[test]
    fn ids_of_every_length_read_as_serde_reads_them() {
        let mut n: u64 = 0;
        for digits in 1..=11u32 {
            for v in [
                10u64.pow(digits - 1),
                10u64.pow(digits) - 1,
                10u64.pow(digits) / 3,
            ] {
                let v = if digits == 1 { v - 1 + n % 2 } else { v };
                n += 1;
                for text in [
                    format!("[{v}]"),
                    format!("[{v}, {v},{v} ,\n{v}]               "),
                    format!("[{v}]{}", " ".repeat(8)),
                    format!("[{v}.5]      "),
                    format!("[{v}e1]      "),
                    format!("[{v}x]       "),
                    format!("[0{v}]       "),
                ] {
                    let naive: Option<Vec<u32>> = serde_json::from_str::<Vec<Value>>(&text)
                        .ok()
                        .and_then(|vs| {
                            vs.iter()
                                .map(|v| v.as_u64().and_then(|v| u32::try_from(v).ok()))
                                .collect()
                        });
                    assert_eq!(
                        read_ids(text.as_bytes()),
                        naive.map(TokenIds::Flat),
                        "{text}"
                    );
                }
            }
        }
    }

    /// Long lists of ids of every length, with every separator and a bad id at any place,
    /// read as `serde_json` reads them.
    #[test]
    fn long_lists_read_as_serde_reads_them() {
        let serde_ids = |text: &str| -> Option<Vec<u32>> {
            let vs = serde_json::from_str::<Vec<Value>>(text).ok()?;
            vs.iter()
                .map(|v| v.as_u64().and_then(|v| u32::try_from(v).ok()))
                .collect()
        };
        // Deterministic ids of 1 to 10 digits (xorshift).
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let seps = [",", ", ", " ,", ",\n", ",  "];
        for round in 0..300 {
            let n = 1 + next() % 60;
            let mut ids: Vec<String> = (0..n)
                .map(|_| {
                    let digits = 1 + next() % 10;
                    (next() % 10u64.pow(digits as u32)).to_string()
                })
                .collect();
            if round % 3 == 0 {
                // One bad id somewhere: a leading zero, a fraction, an exponent, too large, or
                // a byte above 0x7F.
                let at = (next() % n) as usize;
                let bad = ["07", "1.5", "2e3", "4294967296", "\u{e9}", "-3", "99x"];
                ids[at] = bad[(next() % bad.len() as u64) as usize].to_owned();
            }
            let mut text = String::from("[");
            for (i, id) in ids.iter().enumerate() {
                if i > 0 {
                    text.push_str(seps[(next() % seps.len() as u64) as usize]);
                }
                text.push_str(id);
            }
            text.push(']');
            text.push_str(&" ".repeat((next() % 10) as usize));
            assert_eq!(
                read_ids(text.as_bytes()),
                serde_ids(&text).map(TokenIds::Flat),
                "{text}"
            );
        }
    }

    /// The walk takes what it can check and leaves the rest to `serde_json`.
    #[test]
    fn the_walk_declines_what_it_does_not_read_itself() {
        let taken = |raw: &str| object(raw.as_bytes()).is_some();
        for raw in [
            r#"{}"#,
            r#" { "prompt" : [1, 2] , "model":"m" } "#,
            r#"{"a": "x\"},]", "b": {"c": [1, {"d": "}"}]}, "prompt": "text"}"#,
            r#"{"token_ids": [[1], [2, 3]], "n": -1.5e3, "t": true, "z": null}"#,
            r#"{"ünï": "ok"}"#,
        ] {
            assert!(taken(raw), "{raw}");
        }
        for raw in [
            r#"{"a\"b": 1}"#,
            r#"{"a": 1,}"#,
            r#"{"a": 1} x"#,
            r#"{"a" 1}"#,
            r#"{"prompt": [01]}"#,
            r#"{"a": [1}"#,
            r#"[1]"#,
            "",
        ] {
            assert!(!taken(raw), "{raw}");
        }
        let deep = format!("{{\"a\": {}{}}}", "[".repeat(100), "]".repeat(100));
        assert!(!taken(&deep));
    }
}
