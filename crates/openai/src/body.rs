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
use serde::de::value::{MapAccessDeserializer, SeqAccessDeserializer};
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
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
    /// Reads a body from its bytes: the same errors as `serde_json::from_slice::<Value>`.
    pub fn from_slice(raw: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(raw)
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
    pub fn prompt(&self) -> Result<PromptView, RequestError> {
        match &self.prompt {
            None => request::prompt(&self.fields),
            Some(TokenIds::Flat(ids)) if ids.is_empty() => Err(request::prompt_shape()),
            Some(TokenIds::Flat(ids)) => Ok(PromptView {
                first: Prompt::Ids(ids.clone()),
                count: 1,
            }),
            Some(TokenIds::Batch(lists)) => Ok(PromptView {
                first: Prompt::Ids(lists.first().cloned().unwrap_or_default()),
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

impl<'de> Deserialize<'de> for Body {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(BodyVisitor)
    }
}

struct BodyVisitor;

impl<'de> Visitor<'de> for BodyVisitor {
    type Value = Body;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Body, A::Error> {
        let mut body = Body {
            fields: Value::Null,
            prompt: None,
            token_ids: None,
        };
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
            // A repeated key: the last one wins, as in a `Value`.
            match access.next_value_seed(Node::FIELD)? {
                Parsed::Ids(ids) => {
                    map.remove(&key);
                    *slot = Some(ids);
                }
                other => {
                    *slot = None;
                    map.insert(key, other.into_value());
                }
            }
        }
        body.fields = Value::Object(map);
        Ok(body)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Body, A::Error> {
        Value::deserialize(SeqAccessDeserializer::new(seq)).map(Body::from)
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Body, E> {
        Ok(Value::Bool(v).into())
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Body, E> {
        Ok(Value::from(v).into())
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Body, E> {
        Ok(Value::from(v).into())
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Body, E> {
        Ok(Value::from(v).into())
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Body, E> {
        Ok(Value::String(v.to_owned()).into())
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Body, E> {
        Ok(Value::String(v).into())
    }

    fn visit_unit<E: de::Error>(self) -> Result<Body, E> {
        Ok(Value::Null.into())
    }
}

/// What a node of a `prompt`/`token_ids` field was read as.
enum Parsed {
    /// A token id (an array's item).
    Id(u32),
    /// An array that is wholly token ids (or, at the field, a batch of them).
    Ids(TokenIds),
    /// Anything else.
    Json(Value),
}

impl Parsed {
    fn into_value(self) -> Value {
        match self {
            Parsed::Id(t) => Value::from(t),
            Parsed::Ids(ids) => ids.to_value(),
            Parsed::Json(v) => v,
        }
    }
}

/// Reads one node of a field: the field itself (depth 0), an item of its array (1) or an item
/// of an item (2). Ids are read at depths 1 and 2; arrays of ids at depths 0 and 1.
#[derive(Clone, Copy)]
struct Node {
    depth: u8,
}

impl Node {
    const FIELD: Node = Node { depth: 0 };
}

/// The items of an array read so far.
enum Items {
    Flat(Vec<u32>),
    Batch(Vec<Vec<u32>>),
    Json(Vec<Value>),
}

impl Items {
    fn push(&mut self, item: Parsed) {
        match (&mut *self, item) {
            (Items::Flat(ids), Parsed::Id(t)) => ids.push(t),
            (Items::Batch(lists), Parsed::Ids(TokenIds::Flat(l))) if !lists.is_empty() => {
                lists.push(l)
            }
            (Items::Flat(ids), Parsed::Ids(TokenIds::Flat(l))) if ids.is_empty() => {
                *self = Items::Batch(vec![l])
            }
            (Items::Json(values), item) => values.push(item.into_value()),
            (_, item) => {
                let mut values = self.take_values();
                values.push(item.into_value());
                *self = Items::Json(values);
            }
        }
    }

    fn take_values(&mut self) -> Vec<Value> {
        match std::mem::replace(self, Items::Json(Vec::new())) {
            Items::Flat(ids) => ids.into_iter().map(Value::from).collect(),
            Items::Batch(lists) => lists
                .into_iter()
                .map(|l| TokenIds::Flat(l).to_value())
                .collect(),
            Items::Json(values) => values,
        }
    }
}

impl<'de> DeserializeSeed<'de> for Node {
    type Value = Parsed;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Parsed, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Node {
    type Value = Parsed;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Parsed, A::Error> {
        if self.depth >= 2 {
            return Value::deserialize(SeqAccessDeserializer::new(seq)).map(Parsed::Json);
        }
        let item = Node {
            depth: self.depth + 1,
        };
        let mut items = Items::Flat(Vec::new());
        while let Some(parsed) = seq.next_element_seed(item)? {
            items.push(parsed);
        }
        Ok(match items {
            Items::Flat(ids) => Parsed::Ids(TokenIds::Flat(ids)),
            // Only the field holds batches: at depth 1 an array of arrays is plain JSON.
            Items::Batch(lists) if self.depth == 0 => Parsed::Ids(TokenIds::Batch(lists)),
            mut other => Parsed::Json(Value::Array(other.take_values())),
        })
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Parsed, E> {
        match u32::try_from(v) {
            Ok(t) if self.depth > 0 => Ok(Parsed::Id(t)),
            _ => Ok(Parsed::Json(Value::from(v))),
        }
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Parsed, A::Error> {
        Value::deserialize(MapAccessDeserializer::new(map)).map(Parsed::Json)
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Parsed, E> {
        Ok(Parsed::Json(Value::Bool(v)))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Parsed, E> {
        Ok(Parsed::Json(Value::from(v)))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Parsed, E> {
        Ok(Parsed::Json(Value::from(v)))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Parsed, E> {
        Ok(Parsed::Json(Value::String(v.to_owned())))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Parsed, E> {
        Ok(Parsed::Json(Value::String(v)))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Parsed, E> {
        Ok(Parsed::Json(Value::Null))
    }
}
