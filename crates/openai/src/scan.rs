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

mod ids;

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
        // Room for the ids of a list of ids of three digits or more, `,` between them (`123,`
        // is 4 bytes; a denser one grows): a list read in two streams is joined without a copy
        // to a larger vector.
        let capacity = (self.bytes.len() - start) / 4 + 1;
        self.at = start;
        let mut ids = self.list(capacity)?;
        // Room sized by a long value after the list (a long text field, say) is given back.
        if ids.capacity() > 2 * ids.len() + 1024 {
            ids.shrink_to_fit();
        }
        Some(TokenIds::Flat(ids))
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
                        // SIMD search: a long text prompt is most of a body's bytes.
                        let n = memchr::memchr2(b'"', b'\\', self.bytes.get(self.at..)?)?;
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

/// Where a top-level key's value is in an object body's raw text.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Slot {
    /// The value's bytes (its last occurrence, as a `Value` reads it; trailing whitespace
    /// included).
    Value(std::ops::Range<usize>),
    /// Not there: the object opens at this byte (its `{`), and has no field at all if `empty`.
    Absent { open: usize, empty: bool },
}

/// Where `key`'s value is at the top level of the object `raw`, walked as [`object`] walks it
/// (values skipped, not read: `raw` is known to be valid JSON); `None` when this walk does not
/// take it (an escaped key, deep nesting, not an object).
pub(crate) fn slot(raw: &[u8], key: &str) -> Option<Slot> {
    let mut c = Cursor::new(raw);
    if c.next()? != b'{' {
        return None;
    }
    let open = c.at - 1;
    if c.peek()? == b'}' {
        return Some(Slot::Absent { open, empty: true });
    }
    let mut found = None;
    loop {
        let this = c.plain_key()?;
        if c.next()? != b':' {
            return None;
        }
        c.skip_whitespace();
        let start = c.at;
        let end = c.skip_value()?;
        if this == key {
            found = Some(start..end);
        }
        match c.next()? {
            b',' => {}
            b'}' => return Some(found.map_or(Slot::Absent { open, empty: false }, Slot::Value)),
            _ => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_top_level_keys_value_is_found_in_the_raw_text() {
        let raw = br#"{"a": {"k": 1}, "k" : "x" , "b": [1]}"#;
        let Some(Slot::Value(r)) = slot(raw, "k") else {
            panic!()
        };
        assert_eq!(&raw[r], br#""x" "#);
        assert_eq!(
            slot(br#" {"a": 1}"#, "k"),
            Some(Slot::Absent {
                open: 1,
                empty: false
            })
        );
        assert_eq!(
            slot(b"{ }", "k"),
            Some(Slot::Absent {
                open: 0,
                empty: true
            })
        );
        let Some(Slot::Value(r)) = slot(br#"{"k": 1, "k": null}"#, "k") else {
            panic!()
        };
        assert_eq!(r, 14..18, "the last one, as a Value reads it");
        assert_eq!(slot(br#"{"\u006b": 1}"#, "k"), None);
        assert_eq!(slot(b"[1]", "k"), None);
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
