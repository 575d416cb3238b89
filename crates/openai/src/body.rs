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
//!
//! An object body is read in one pass (`scan::object`: the ids scanned once, the other values
//! read by `serde_json`); what that pass does not take, and every error, is read by the serde
//! visitor here (the parser checks and skips an id array, then it is scanned).

use crate::error::RequestError;
use crate::request::{self, Prompt, PromptView};
use crate::scan::{read_ids, PROMPT, TOKEN_IDS};
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use std::borrow::Cow;
use std::fmt;

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
        // One pass over an object body (most are); anything else, and every error, as
        // `serde_json` reads it.
        if let Some(f) = crate::scan::object(raw) {
            return Ok(Body {
                fields: Value::Object(f.map),
                prompt: f.prompt,
                token_ids: f.token_ids,
            });
        }
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

    /// Takes the field `key` out of an object body (`None`: it has none, or is no object).
    /// Token ids read into the body come back as their JSON array.
    pub fn remove(&mut self, key: &str) -> Option<Value> {
        let ids = match key {
            PROMPT => self.prompt.take(),
            TOKEN_IDS => self.token_ids.take(),
            _ => None,
        };
        let value = match &mut self.fields {
            Value::Object(map) => map.remove(key),
            _ => None,
        };
        ids.map(|ids| ids.to_value()).or(value)
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
            Some(TokenIds::Flat(ids)) if ids.is_empty() => Err(request::prompt_empty()),
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

    /// Gives the body `token_ids` read from outside its JSON (the pick API's binary ids, see
    /// [`ids_from_le_bytes`]): an error when the JSON has `token_ids` of its own.
    pub fn set_token_ids(&mut self, ids: Vec<u32>) -> Result<(), RequestError> {
        if self.contains_key(TOKEN_IDS) {
            return Err(RequestError::invalid(
                "`token_ids` is given twice: in the JSON part and as binary ids after it",
                TOKEN_IDS,
            ));
        }
        self.token_ids = Some(TokenIds::Flat(ids));
        Ok(())
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
            Some(TokenIds::Flat(ids)) if ids.is_empty() => Err(RequestError::invalid(
                "`token_ids` is empty: give at least one token id",
                TOKEN_IDS,
            )),
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

/// Token ids as 4-byte little-endian unsigned integers, one after another (the pick API's
/// binary ids): `None` when the length is not a multiple of 4.
pub fn ids_from_le_bytes(raw: &[u8]) -> Option<Vec<u32>> {
    let words = raw.chunks_exact(4);
    if !words.remainder().is_empty() {
        return None;
    }
    // Filled in place (a copy the compiler vectorizes), not collected from the iterator.
    let mut ids = vec![0u32; raw.len() / 4];
    for (id, w) in ids.iter_mut().zip(words) {
        *id = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
    }
    Some(ids)
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

    /// Binary ids read back as the numbers written, and become the prompt as JSON ids do; a
    /// length that is no multiple of 4 and ids given twice are refused.
    #[test]
    fn binary_ids_are_the_json_ids() {
        let ids = [0u32, 1, 255, 256, 65_536, 151_000, u32::MAX];
        let raw: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(ids_from_le_bytes(&raw).unwrap(), ids);
        assert_eq!(ids_from_le_bytes(&[]).unwrap(), Vec::<u32>::new());
        for cut in 1..4 {
            assert_eq!(ids_from_le_bytes(&raw[..raw.len() - cut]), None);
        }
        let mut binary = Body::from_slice(br#"{"model": "m"}"#).unwrap();
        binary.set_token_ids(ids.to_vec()).unwrap();
        binary.token_ids_as_prompt().unwrap();
        let json = format!("{{\"model\": \"m\", \"token_ids\": {ids:?}}}");
        let mut json = Body::from_slice(json.as_bytes()).unwrap();
        json.token_ids_as_prompt().unwrap();
        assert_eq!(binary, json);
        for twice in [r#"{"token_ids": [1]}"#, r#"{"token_ids": "x"}"#] {
            let mut body = Body::from_slice(twice.as_bytes()).unwrap();
            let e = body.set_token_ids(vec![1]).unwrap_err();
            assert!(e.to_string().contains("twice"), "{twice}: {e}");
        }
        // With a prompt of its own the ids then conflict as JSON ones do.
        let mut both = Body::from_slice(br#"{"prompt": "hi"}"#).unwrap();
        both.set_token_ids(vec![1]).unwrap();
        assert!(both.token_ids_as_prompt().is_err());
    }
}
