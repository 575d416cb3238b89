//! A request body read once, for routing: its JSON object, with a token-id `prompt` (and the
//! pick API's `token_ids`) read straight into `u32`s as the parser meets them, instead of a
//! generic [`Value`] per token that the router would then convert (a 2,048-token prompt is
//! 2,048 `Value::Number`s of 32 bytes each, and the reallocations of their vector).
//!
//! Only arrays that are wholly token ids (`[1, 2]`, or a batch `[[1, 2], [3]]`) are taken out;
//! anything else (text, a mixed or malformed array, a negative or too large id) stays a
//! [`Value`] among the other fields, so every view and every error is the one the [`Value`]
//! reading gives ([`Body::prompt`] equals [`crate::request::prompt`] of the whole body, and
//! [`Body::to_value`] is the body [`serde_json::from_slice`] reads).

use crate::error::RequestError;
use crate::request::{self, Prompt, PromptView};
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use std::borrow::Cow;
use std::fmt;

/// The fields read into token ids when they are wholly token ids.
const PROMPT: &str = "prompt";
const TOKEN_IDS: &str = "token_ids";

/// A JSON array that is wholly token ids (every id an integer from 0 to `u32::MAX`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenIds {
    /// `[1, 2, 3]` (or `[]`).
    Flat(Vec<u32>),
    /// `[[1, 2], [3]]`: a batch of token-id lists (at least one).
    Batch(Vec<Vec<u32>>),
}

impl TokenIds {
    fn to_value(&self) -> Value {
        let list = |ids: &[u32]| Value::Array(ids.iter().map(|&t| Value::from(t)).collect());
        match self {
            TokenIds::Flat(ids) => list(ids),
            TokenIds::Batch(lists) => Value::Array(lists.iter().map(|l| list(l)).collect()),
        }
    }
}

/// A request body: its fields as JSON, less the token-id arrays read into [`TokenIds`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Body {
    /// The body (any JSON; an object for a request), without `prompt`/`token_ids` when they
    /// were read into ids.
    fields: Value,
    prompt: Option<TokenIds>,
    token_ids: Option<TokenIds>,
}

impl From<Value> for Body {
    /// A body already read as JSON (nothing taken out).
    fn from(fields: Value) -> Self {
        Body {
            fields,
            prompt: None,
            token_ids: None,
        }
    }
}

impl Body {
    /// Reads a body from its bytes: the same errors as `serde_json::from_slice::<Value>`
    /// (a body that is no object, or no JSON, is read, or refused, as a plain [`Value`]).
    pub fn from_slice(raw: &[u8]) -> Result<Self, serde_json::Error> {
        match serde_json::from_slice::<Object>(raw) {
            Ok(Object(body)) => Ok(body),
            Err(_) => serde_json::from_slice::<Value>(raw).map(Body::from),
        }
    }

    /// The fields other than a token-id `prompt` or `token_ids`: for every view but the
    /// prompt's ([`Body::prompt`]) and the whole body's ([`Body::to_value`]).
    pub fn fields(&self) -> &Value {
        &self.fields
    }

    /// Whether the body is a JSON object.
    pub fn is_object(&self) -> bool {
        self.fields.is_object()
    }

    /// Whether the body has the field `key` (null included).
    pub fn contains_key(&self, key: &str) -> bool {
        match key {
            PROMPT if self.prompt.is_some() => true,
            TOKEN_IDS if self.token_ids.is_some() => true,
            _ => self.fields.get(key).is_some(),
        }
    }

    /// Sets the field `key` of an object body (nothing on another body).
    pub fn insert(&mut self, key: &str, value: Value) {
        if let Value::Object(map) = &mut self.fields {
            match key {
                PROMPT => self.prompt = None,
                TOKEN_IDS => self.token_ids = None,
                _ => {}
            }
            map.insert(key.to_owned(), value);
        }
    }

    /// The whole body, as `serde_json::from_slice::<Value>` reads it (borrowed when nothing
    /// was read into ids).
    pub fn to_value(&self) -> Cow<'_, Value> {
        match (&self.prompt, &self.token_ids, &self.fields) {
            (None, None, _) => Cow::Borrowed(&self.fields),
            (prompt, token_ids, Value::Object(map)) => {
                let mut map = map.clone();
                for (key, ids) in [(PROMPT, prompt), (TOKEN_IDS, token_ids)] {
                    if let Some(ids) = ids {
                        map.insert(key.to_owned(), ids.to_value());
                    }
                }
                Cow::Owned(Value::Object(map))
            }
            _ => Cow::Borrowed(&self.fields),
        }
    }

    /// The `prompt` of a `/v1/completions` body, as [`request::prompt`] reads the whole body.
    /// Token ids read into the body are borrowed, not copied.
    pub fn prompt(&self) -> Result<PromptView<'_>, RequestError> {
        match &self.prompt {
            None => request::prompt(&self.fields),
            Some(TokenIds::Flat(ids)) if ids.is_empty() => Err(request::prompt_shape()),
            Some(TokenIds::Flat(ids)) => Ok(PromptView {
                first: Prompt::Ids(Cow::Borrowed(ids)),
                count: 1,
            }),
            Some(TokenIds::Batch(lists)) => Ok(PromptView {
                first: Prompt::Ids(Cow::Borrowed(lists.first().map_or(&[], Vec::as_slice))),
                count: lists.len(),
            }),
        }
    }

    /// The pick API's `{"token_ids": [...]}`, made the body's `prompt`: an error when it is
    /// not a list of token ids, or comes with a `prompt` or `messages`. A body without
    /// `token_ids` is left as it is.
    pub fn token_ids_as_prompt(&mut self) -> Result<(), RequestError> {
        let taken = match (self.token_ids.take(), &mut self.fields) {
            (Some(ids), _) => Some(Some(ids)),
            (None, Value::Object(map)) => map.remove(TOKEN_IDS).map(|_| None),
            (None, _) => None,
        };
        let Some(ids) = taken else {
            return Ok(());
        };
        if self.contains_key(PROMPT) || self.contains_key("messages") {
            return Err(RequestError::invalid(
                "give `token_ids`, `prompt` or `messages`, not several",
                TOKEN_IDS,
            ));
        }
        match ids {
            Some(TokenIds::Flat(ids)) => {
                self.prompt = Some(TokenIds::Flat(ids));
                Ok(())
            }
            _ => Err(RequestError::invalid(
                "`token_ids` must be a list of token ids (integers from 0 to 4294967295)",
                TOKEN_IDS,
            )),
        }
    }
}

/// A body parsed as an object, its token-id fields read into ids; any other body fails, and
/// [`Body::from_slice`] reads it as a plain [`Value`] instead.
struct Object(Body);

impl<'de> Deserialize<'de> for Object {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(ObjectVisitor)
    }
}

struct ObjectVisitor;

impl<'de> Visitor<'de> for ObjectVisitor {
    type Value = Object;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Object, A::Error> {
        let mut body = Body::default();
        let mut map = Map::new();
        while let Some(key) = access.next_key::<String>()? {
            let slot = match key.as_str() {
                PROMPT => &mut body.prompt,
                TOKEN_IDS => &mut body.token_ids,
                _ => {
                    let value = access.next_value::<Value>()?;
                    map.insert(key, value);
                    continue;
                }
            };
            // The parser checks and skips the value; then it is read as ids when it is wholly
            // ids, else as JSON. A repeated key: the last one wins, as in a `Value`.
            let raw = access.next_value::<&'de RawValue>()?.get();
            match read_ids(raw.as_bytes()) {
                Some(ids) => {
                    map.remove(&key);
                    *slot = Some(ids);
                }
                None => {
                    *slot = None;
                    let value = serde_json::from_str(raw).map_err(de::Error::custom)?;
                    map.insert(key, value);
                }
            }
        }
        body.fields = Value::Object(map);
        Ok(Object(body))
    }
}

/// A cursor over a JSON value the parser has already checked.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
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

    /// A token id: an integer from 0 to `u32::MAX` (not a negative, fractional or exponent
    /// number, nor a larger one).
    fn id(&mut self) -> Option<u32> {
        self.skip_whitespace();
        let start = self.at;
        let mut value: u64 = 0;
        while let Some(&b) = self.bytes.get(self.at) {
            if !b.is_ascii_digit() || self.at - start == 10 {
                break;
            }
            value = value * 10 + u64::from(b - b'0');
            self.at += 1;
        }
        match self.bytes.get(self.at) {
            _ if self.at == start => None,
            Some(b'0'..=b'9' | b'.' | b'e' | b'E') => None,
            _ => u32::try_from(value).ok(),
        }
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
            match self.next()? {
                b',' => {}
                b']' => return Some(ids),
                _ => return None,
            }
        }
    }

    fn at_end(&mut self) -> bool {
        self.skip_whitespace();
        self.at == self.bytes.len()
    }
}

/// `raw` (a JSON value the parser has checked) as token ids, when it is wholly ids: `[1, 2]`
/// or a batch `[[1, 2], [3]]`. `None` for anything else, which is then read as JSON.
fn read_ids(raw: &[u8]) -> Option<TokenIds> {
    let mut cursor = Cursor { bytes: raw, at: 0 };
    if cursor.next()? != b'[' {
        return None;
    }
    let ids = if cursor.peek()? == b'[' {
        let mut lists = Vec::new();
        loop {
            lists.push(cursor.list(0)?);
            match cursor.next()? {
                b',' => {}
                b']' => break TokenIds::Batch(lists),
                _ => return None,
            }
        }
    } else {
        // Room for every id (one more than the commas), without regrowing.
        let commas = raw.iter().filter(|&&b| b == b',').count();
        cursor.at = 0;
        TokenIds::Flat(cursor.list(commas + 1)?)
    };
    cursor.at_end().then_some(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The prompt view of ids read into the body borrows them (no copy of a long prompt);
    /// text in the fields is borrowed too.
    #[test]
    fn prompt_views_borrow_the_ids() {
        let borrowed = |raw: &str| {
            let body = Body::from_slice(raw.as_bytes()).unwrap();
            let view = body.prompt().unwrap();
            match view.first {
                Prompt::Ids(Cow::Borrowed(ids)) => (ids.to_vec(), view.count),
                other => panic!("{raw}: {other:?}"),
            }
        };
        assert_eq!(borrowed(r#"{"prompt": [1, 2, 3]}"#), (vec![1, 2, 3], 1));
        assert_eq!(borrowed(r#"{"prompt": [[4], [5, 6]]}"#), (vec![4], 2));
        let text = Body::from_slice(br#"{"prompt": "hi"}"#).unwrap();
        assert!(matches!(
            text.prompt().unwrap().first,
            Prompt::Text(Cow::Borrowed("hi"))
        ));
    }

    #[test]
    fn only_arrays_of_ids_are_read_as_ids() {
        let flat = |ids: &[u32]| Some(TokenIds::Flat(ids.to_vec()));
        assert_eq!(read_ids(b"[]"), flat(&[]));
        assert_eq!(read_ids(b" [ 0 , 7,4294967295 ] "), flat(&[0, 7, u32::MAX]));
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
            "[\"1\"]",
            "[[1], 2]",
            "[1, [2]]",
            "[[[1]]]",
            "[null]",
            "\"[1]\"",
            "7",
            "{}",
        ] {
            assert_eq!(read_ids(raw.as_bytes()), None, "{raw}");
        }
    }
}
