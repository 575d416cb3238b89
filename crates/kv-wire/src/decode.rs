//! Tolerant decoding of payloads and sequence frames.

use crate::model::{RawHash, WireBatch, WireEvent};
use crate::msgpack::{self, Int, Item, Reader};

mod one_pass;

/// Why a frame could not be decoded. The message is dropped and counted; nothing panics.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Not valid msgpack.
    #[error("payload is not valid msgpack: {0}")]
    Msgpack(String),
    /// Valid msgpack, wrong shape.
    #[error("unexpected payload shape: {0}")]
    Shape(String),
    /// The sequence frame is not 8 bytes.
    #[error("sequence frame has {0} bytes, expected 8")]
    SeqLength(usize),
}

fn shape(msg: impl Into<String>) -> WireError {
    WireError::Shape(msg.into())
}

/// The sequence number of a message (8 bytes, big-endian).
pub fn decode_seq(frame: &[u8]) -> Result<u64, WireError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| WireError::SeqLength(frame.len()))?;
    Ok(u64::from_be_bytes(bytes))
}

/// Nesting the decoder follows at most: a batch is array → events → event → field → items, so
/// anything deeper is not a KV event payload (and must not cost stack).
pub const MAX_DEPTH: usize = 16;

/// Decodes a msgpack payload `[ts, events, dp_rank?]` straight into the model: in one pass
/// where the payload has the usual shape (`one_pass`), else as [`decode_checked`] reads it
/// (checked whole as msgpack, nesting at most [`MAX_DEPTH`], then read); the answer is
/// [`decode_checked`]'s either way.
pub fn decode_payload(payload: &[u8]) -> Result<WireBatch, WireError> {
    if let Some(batch) = one_pass::decode(payload) {
        return Ok(batch);
    }
    decode_checked(payload)
}

/// The one-pass reading alone (`None`: declined, read by [`decode_checked`]); for its tests.
#[doc(hidden)]
pub fn decode_one_pass(payload: &[u8]) -> Option<WireBatch> {
    one_pass::decode(payload)
}

/// [`decode_payload`] without its one-pass reading: the whole payload checked first, then
/// read. Every payload the one pass declines is read here, so every error comes from here.
#[doc(hidden)]
pub fn decode_checked(payload: &[u8]) -> Result<WireBatch, WireError> {
    msgpack::check(payload, u16::try_from(MAX_DEPTH).unwrap_or(u16::MAX))
        .map_err(|e| WireError::Msgpack(e.to_string()))?;
    let mut r = Reader::new(payload);
    let Item::Array(len) = next(&mut r)? else {
        return Err(shape("batch is not an array"));
    };
    if len < 2 {
        return Err(shape(format!("batch has {len} elements, expected 2 or 3")));
    }
    let ts = match next(&mut r)? {
        Item::F64(v) => v,
        Item::F32(v) => f64::from(v),
        v => v
            .as_i64()
            .map(|i| i as f64)
            .ok_or_else(|| shape("ts is not a number"))?,
    };
    let Item::Array(count) = next(&mut r)? else {
        return Err(shape("events is not an array"));
    };
    // A declared count is no allocation size (a list of a million one-byte nils is 1 MB of
    // payload, not a million events).
    let mut events = Vec::with_capacity(count.min(RESERVE_EVENTS));
    for _ in 0..count {
        events.push(decode_event(&mut r)?);
    }
    let dp_rank = match (len > 2).then(|| next(&mut r)).transpose()? {
        None | Some(Item::Nil) => None,
        Some(v) => Some(
            v.as_i64()
                .ok_or_else(|| shape("dp rank is not an integer"))?,
        ),
    };
    Ok(WireBatch {
        ts,
        events,
        dp_rank,
    })
}

/// Most events, hashes and token ids reserved for ahead of reading them (a longer list grows as
/// it is read): what a declared length can make the decoder allocate before its items are seen.
const RESERVE_EVENTS: usize = 64;
const RESERVE_ITEMS: usize = 1 << 16;

/// The next item, a reader's error as a [`WireError`] (on a payload [`msgpack::check`]
/// accepted an error here is a bug's; the one pass also reads hashes with it from bytes not yet
/// checked, where an error only declines the payload).
#[inline]
fn next<'a>(r: &mut Reader<'a>) -> Result<Item<'a>, WireError> {
    r.next().map_err(|e| WireError::Msgpack(e.to_string()))
}

#[inline]
fn skip(r: &mut Reader<'_>) -> Result<(), WireError> {
    r.skip().map_err(|e| WireError::Msgpack(e.to_string()))
}

/// The fields an event may have: their names (map form), by index; the first ten are also
/// `BlockStored`'s positions after the tag (array form); `cache_salt` is SGLang's, a map field
/// only.
const FIELDS: [&str; 11] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "cache_salt",
];
const BLOCK_HASHES: usize = 0;
const PARENT_BLOCK_HASH: usize = 1;
const TOKEN_IDS: usize = 2;
const BLOCK_SIZE: usize = 3;
const LORA_ID: usize = 4;
const MEDIUM: usize = 5;
const LORA_NAME: usize = 6;
const EXTRA_KEYS: usize = 7;
const GROUP_IDX: usize = 8;
const KV_CACHE_SPEC_KIND: usize = 9;
const CACHE_SALT: usize = 10;

/// `BlockStored`'s fields by position after the tag (array form).
const STORED: [usize; 10] = [
    BLOCK_HASHES,
    PARENT_BLOCK_HASH,
    TOKEN_IDS,
    BLOCK_SIZE,
    LORA_ID,
    MEDIUM,
    LORA_NAME,
    EXTRA_KEYS,
    GROUP_IDX,
    KV_CACHE_SPEC_KIND,
];

/// `BlockRemoved`'s fields by position after the tag (not where `BlockStored` has them).
const REMOVED: [usize; 3] = [BLOCK_HASHES, MEDIUM, GROUP_IDX];

/// An event's fields, each where its value starts (a map's first entry of that name, or the
/// array's item at the field's position), by index in [`FIELDS`]; `None`: absent or nil.
struct Fields<'a> {
    tag: &'a str,
    at: [Option<Reader<'a>>; FIELDS.len()],
}

impl<'a> Fields<'a> {
    fn get(&self, field: usize) -> Option<Reader<'a>> {
        self.at[field].clone()
    }

    /// The field's value when it is a single item (no container).
    fn item(&self, field: usize) -> Option<Item<'a>> {
        self.get(field).and_then(|mut r| r.next().ok())
    }
}

/// Reads one event (map or array form) up to its end: its tag and where its fields are.
fn read_fields<'a>(r: &mut Reader<'a>) -> Result<Fields<'a>, WireError> {
    let mut at: [Option<Reader<'a>>; FIELDS.len()] = Default::default();
    let not_nil = |v: &Reader<'a>| !matches!(v.clone().next(), Ok(Item::Nil));
    match next(r)? {
        Item::Map(n) => {
            let mut seen = [false; FIELDS.len()];
            let mut tag = None;
            let mut type_seen = false;
            for _ in 0..n {
                // A key may be any value (a list, say): skipped whole, it names no field.
                let key = next(&mut r.clone())?.as_str();
                skip(r)?;
                let value = r.clone();
                if key == Some("type") && !type_seen {
                    type_seen = true;
                    tag = r.clone().next().ok().and_then(Item::as_str);
                }
                if let Some(i) = key.and_then(|k| FIELDS.iter().position(|f| *f == k)) {
                    if !seen[i] {
                        seen[i] = true;
                        at[i] = Some(value).filter(not_nil);
                    }
                }
                skip(r)?;
            }
            let tag = tag.ok_or_else(|| shape("event map has no string \"type\""))?;
            Ok(Fields { tag, at })
        }
        Item::Array(n) => {
            if n == 0 {
                return Err(shape("event array has no tag"));
            }
            let tag = next(r)?
                .as_str()
                .ok_or_else(|| shape("event array has no tag"))?;
            // Positions after the tag name fields by the tag's own order.
            let order: &[usize] = if tag == "BlockRemoved" {
                &REMOVED
            } else {
                &STORED
            };
            for position in 0..n - 1 {
                if let Some(&i) = order.get(position) {
                    at[i] = Some(r.clone()).filter(not_nil);
                }
                skip(r)?;
            }
            Ok(Fields { tag, at })
        }
        _ => {
            // The rest of the value (a string's bytes, say) was read with its header.
            Err(shape("event is neither a map nor an array"))
        }
    }
}

fn decode_event(r: &mut Reader<'_>) -> Result<WireEvent, WireError> {
    event_from(&read_fields(r)?, Lists::default())
}

/// An event's list fields already read (by the one-pass decoder): used instead of reading them
/// from their place in [`Fields`].
#[derive(Default)]
struct Lists {
    block_hashes: Option<Vec<RawHash>>,
    token_ids: Option<Vec<u32>>,
}

/// The event its fields make.
fn event_from(fields: &Fields<'_>, lists: Lists) -> Result<WireEvent, WireError> {
    let block_hashes = || match lists.block_hashes {
        Some(read) => Ok(read),
        None => hashes(fields.get(BLOCK_HASHES), "block_hashes"),
    };
    let string = |field: usize| fields.item(field).and_then(Item::as_str).map(str::to_owned);
    let int = |field: usize| fields.item(field).and_then(Item::as_i64);
    match fields.tag {
        "BlockStored" => {
            let block_hashes = block_hashes()?;
            let parent_block_hash = fields
                .get(PARENT_BLOCK_HASH)
                .map(|mut r| hash(&mut r))
                .transpose()?;
            let token_ids = match lists.token_ids {
                Some(read) => read,
                None => tokens(fields.get(TOKEN_IDS))?,
            };
            let block_size = fields
                .item(BLOCK_SIZE)
                .and_then(Item::as_u64)
                .ok_or_else(|| shape("BlockStored without an integer block_size"))?;
            let lora_id = int(LORA_ID);
            let medium = string(MEDIUM);
            let lora_name = string(LORA_NAME);
            let extra_key_strings = extra_keys(fields.get(EXTRA_KEYS))?;
            let group_idx = int(GROUP_IDX);
            let kv_cache_spec_kind = string(KV_CACHE_SPEC_KIND);
            // SGLang sends the salt as a field (map form only); vLLM puts it in the first block's
            // extra keys next to the adapter name.
            let cache_salt = string(CACHE_SALT).or_else(|| {
                // The first string past the adapter's name (skipped once: a salt may equal it).
                extra_key_strings.first().and_then(|keys| {
                    let skip =
                        usize::from(lora_name.is_some() && keys.first() == lora_name.as_ref());
                    keys.get(skip).cloned()
                })
            });
            Ok(WireEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size: u32::try_from(block_size).map_err(|_| shape("block_size too large"))?,
                lora_id,
                medium,
                lora_name,
                cache_salt,
                extra_key_strings,
                group_idx,
                kv_cache_spec_kind,
            })
        }
        "BlockRemoved" => Ok(WireEvent::BlockRemoved {
            block_hashes: block_hashes()?,
            medium: string(MEDIUM),
            group_idx: int(GROUP_IDX),
        }),
        "AllBlocksCleared" => Ok(WireEvent::AllBlocksCleared),
        other => Ok(WireEvent::Unknown(other.to_owned())),
    }
}

/// Reads the hash at `r`, past it.
fn hash(r: &mut Reader<'_>) -> Result<RawHash, WireError> {
    if let Some(i) = r.int() {
        return Ok(match i {
            Int::Pos(u) => RawHash::Uint(u),
            Int::Neg(i) => RawHash::Int(i),
        });
    }
    match next(r)? {
        Item::Int(Int::Pos(u)) => Ok(RawHash::Uint(u)),
        Item::Int(Int::Neg(i)) => Ok(RawHash::Int(i)),
        Item::Bin(b) => Ok(RawHash::Bytes(b.to_vec())),
        _ => Err(shape("a block hash is neither an integer nor bytes")),
    }
}

/// The length of the list starting at `r` (its items follow), or `None` when it is no list.
fn list(r: &mut Reader<'_>) -> Result<Option<usize>, WireError> {
    Ok(match next(r)? {
        Item::Array(n) => Some(n),
        _ => None,
    })
}

fn hashes(value: Option<Reader<'_>>, field: &str) -> Result<Vec<RawHash>, WireError> {
    let not_a_list = || shape(format!("{field} is not an array"));
    let mut r = value.ok_or_else(not_a_list)?;
    let n = list(&mut r)?.ok_or_else(not_a_list)?;
    hash_items(&mut r, n)
}

/// The `n` hashes of a list whose header was read, past them: an integer or bytes is read
/// whole; anything else ends the decode.
fn hash_items(r: &mut Reader<'_>, n: usize) -> Result<Vec<RawHash>, WireError> {
    let mut out = Vec::with_capacity(n.min(r.rest().len()).min(RESERVE_ITEMS));
    for _ in 0..n {
        out.push(hash(r)?);
    }
    Ok(out)
}

fn tokens(value: Option<Reader<'_>>) -> Result<Vec<u32>, WireError> {
    let not_a_list = || shape("token_ids is not an array");
    let mut r = value.ok_or_else(not_a_list)?;
    let n = list(&mut r)?.ok_or_else(not_a_list)?;
    token_items(&mut r, n)
}

/// The `n` token ids of a list whose header was read, past them.
fn token_items(r: &mut Reader<'_>, n: usize) -> Result<Vec<u32>, WireError> {
    let mut out = Vec::with_capacity(n.min(r.rest().len()).min(RESERVE_ITEMS));
    for _ in 0..n {
        let token = r
            .int()
            .and_then(Int::as_u64)
            .and_then(|t| u32::try_from(t).ok())
            .ok_or_else(|| shape("a token id is not a 32-bit unsigned integer"))?;
        out.push(token);
    }
    Ok(out)
}

/// vLLM's per-block extra keys, kept as the strings each block's list holds (a block that is
/// no list holds none; blocks without keys at the end are dropped, keeping the list canonical).
fn extra_keys(value: Option<Reader<'_>>) -> Result<Vec<Vec<String>>, WireError> {
    let Some(mut r) = value else {
        return Ok(Vec::new());
    };
    let Some(blocks) = list(&mut r)? else {
        return Ok(Vec::new());
    };
    let mut keys: Vec<Vec<String>> = Vec::with_capacity(blocks.min(RESERVE_EVENTS));
    for _ in 0..blocks {
        let mut block = r.clone();
        let mut strings = Vec::new();
        if let Some(n) = list(&mut block)? {
            for _ in 0..n {
                let mut item = block.clone();
                if let Some(s) = next(&mut item)?.as_str() {
                    strings.push(s.to_owned());
                }
                skip(&mut block)?;
            }
        }
        keys.push(strings);
        skip(&mut r)?;
    }
    while keys.last().is_some_and(Vec::is_empty) {
        keys.pop();
    }
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_salt_survives_the_wire_even_when_it_equals_the_adapter_name() {
        use crate::{encode_payload, from_kv_events, to_kv_events, ConvertOptions};
        use kvrouter_core::event::{BlockContent, KvEvent, Medium, StoredBlock};
        use kvrouter_core::hashing::HashNamespace;
        use kvrouter_core::ids::{EngineHash, WorkerId};
        let ns = |lora: Option<&str>, salt: Option<&str>| HashNamespace {
            lora_name: lora.map(str::to_owned),
            cache_salt: salt.map(str::to_owned),
        };
        for namespace in [
            ns(Some("a"), Some("a")),
            ns(Some("a"), Some("s")),
            ns(None, Some("s")),
            ns(Some("a"), None),
            ns(None, None),
        ] {
            let event = KvEvent::Stored {
                worker: WorkerId(0),
                dp_rank: 0,
                parent: None,
                blocks: vec![StoredBlock {
                    engine_hash: EngineHash(1),
                    content: BlockContent::Tokens(vec![1, 2]),
                }],
                block_size: 2,
                medium: Medium::Gpu,
                namespace: namespace.clone(),
            };
            let batch = from_kv_events(0.0, 0, std::slice::from_ref(&event)).unwrap();
            let mut back = decode_payload(&encode_payload(&batch)).unwrap();
            // A wire event that names the salt but no extra keys encodes them itself.
            if let WireEvent::BlockStored {
                extra_key_strings, ..
            } = &mut back.events[0]
            {
                extra_key_strings.clear();
            }
            let back = decode_payload(&encode_payload(&back)).unwrap();
            let opts = ConvertOptions {
                worker: WorkerId(0),
                default_dp_rank: 0,
            };
            let got: Vec<KvEvent> = to_kv_events(&back, opts)
                .into_iter()
                .map(|e| e.unwrap().unwrap())
                .collect();
            assert_eq!(got, vec![event], "{namespace:?}");
        }
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(decode_payload(&[]).is_err());
        assert!(decode_payload(&[0xc1]).is_err());
        assert!(decode_payload(&[0x90]).is_err()); // empty array
        assert!(decode_payload(&[0x92, 0x01, 0x02]).is_err()); // events not an array
        assert_eq!(decode_seq(&[0; 7]), Err(WireError::SeqLength(7)));
        assert_eq!(decode_seq(&[0, 0, 0, 0, 0, 0, 1, 2]), Ok(0x102));
    }

    #[test]
    fn deep_nesting_and_huge_declared_lengths_are_errors() {
        // A million nested one-element arrays.
        assert!(matches!(
            decode_payload(&vec![0x91; 1_000_000]),
            Err(WireError::Msgpack(_))
        ));
        // An array32 declaring 4 G elements, a bin32 declaring 4 GiB: nothing is allocated.
        assert!(decode_payload(&[0xdd, 0xff, 0xff, 0xff, 0xff, 0x01]).is_err());
        assert!(decode_payload(&[0x92, 0x00, 0xc6, 0xff, 0xff, 0xff, 0xff]).is_err());
        // 8 M events declared and backed by 8 M one-byte nils: valid msgpack, and the first
        // nil is no event (the decoder reserves room for 64 events, not 8 M, before it reads).
        let mut nils = vec![0x92, 0x00, 0xdd, 0x00, 0x7f, 0xff, 0xff];
        nils.resize(nils.len() + 0x7f_ffff, 0xc0);
        assert_eq!(
            decode_payload(&nils),
            Err(WireError::Shape(
                "event is neither a map nor an array".into()
            ))
        );
    }
}
