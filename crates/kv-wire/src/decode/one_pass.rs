//! A payload of the usual shape read in one pass.
//!
//! [`super::decode_checked`] walks a payload three times: [`msgpack::check`] over all of it,
//! then each event's fields skipped to find where they start, then the fields read. For a
//! 1,024-block `BlockStored` the two walks before the read were about 70 % of the decode. Here
//! the batch is read once: the token-id and hash lists as they are met, every other field
//! noted where it starts and stepped over by [`msgpack::check_value`] (which is the check's
//! own walk of that value, with the budget the check would have left there), and the event
//! then made by the same [`super::event_from`] as the checked reading.
//!
//! So every byte of the payload's value is either read here or checked as [`msgpack::check`]
//! checks it, and the answer is the checked reading's. Anything else (any error, any shape the
//! checked reading refuses or reads differently) is declined (`None`), and the caller reads the
//! payload the checked way, which gives every error its words.

use super::{
    event_from, hash_items, token_items, Fields, Lists, BLOCK_HASHES, FIELDS, MAX_DEPTH, REMOVED,
    RESERVE_EVENTS, STORED, TOKEN_IDS,
};
use crate::model::{WireBatch, WireEvent};
use crate::msgpack::{self, Item, Reader};

/// The check's budget for the batch's own items: a container's items get two levels less than
/// it (one for the container, one for each item).
const BATCH_ITEM_DEPTH: u16 = MAX_DEPTH as u16 - 2;
/// ... and for an event's items (its tag, keys and field values): two levels less for the
/// events list, and two for the event.
const EVENT_ITEM_DEPTH: u16 = BATCH_ITEM_DEPTH - 4;

/// The batch in `payload`, or `None` where the checked reading must answer.
pub(super) fn decode(payload: &[u8]) -> Option<WireBatch> {
    let mut r = Reader::new(payload);
    let Ok(Item::Array(len)) = r.next() else {
        return None;
    };
    if len < 2 {
        return None;
    }
    let ts = match r.next().ok()? {
        Item::F64(v) => v,
        Item::F32(v) => f64::from(v),
        Item::Int(i) => i.as_i64()? as f64,
        _ => return None,
    };
    let Ok(Item::Array(count)) = r.next() else {
        return None;
    };
    let mut events = Vec::with_capacity(count.min(RESERVE_EVENTS));
    for _ in 0..count {
        events.push(event(&mut r)?);
    }
    let dp_rank = match len {
        2 => None,
        _ => match r.next().ok()? {
            Item::Nil => None,
            Item::Int(i) => Some(i.as_i64()?),
            _ => return None,
        },
    };
    for _ in 3..len {
        msgpack::check_value(&mut r, BATCH_ITEM_DEPTH).ok()?;
    }
    Some(WireBatch {
        ts,
        events,
        dp_rank,
    })
}

/// One event, map or array form.
fn event(r: &mut Reader<'_>) -> Option<WireEvent> {
    let mut fields = Fields {
        tag: "",
        at: Default::default(),
    };
    let mut lists = Lists::default();
    match r.next().ok()? {
        Item::Map(n) => {
            let mut seen = [false; FIELDS.len()];
            let mut tag = None;
            let mut type_seen = false;
            for _ in 0..n {
                // A key that is no string names no field (stepped over whole).
                let mut probe = r.clone();
                let key = match probe.next() {
                    Ok(Item::Str(s)) => {
                        *r = probe;
                        std::str::from_utf8(s).ok()
                    }
                    _ => {
                        msgpack::check_value(r, EVENT_ITEM_DEPTH).ok()?;
                        None
                    }
                };
                if key == Some("type") && !type_seen {
                    type_seen = true;
                    tag = r.clone().next().ok().and_then(Item::as_str);
                }
                // The first entry of a name counts.
                match key.and_then(|k| FIELDS.iter().position(|f| *f == k)) {
                    Some(i) if !seen[i] => {
                        seen[i] = true;
                        field(r, i, &mut fields, &mut lists)?;
                    }
                    _ => msgpack::check_value(r, EVENT_ITEM_DEPTH).ok()?,
                }
            }
            fields.tag = tag?;
        }
        Item::Array(n) if n > 0 => {
            let Ok(Item::Str(tag)) = r.next() else {
                return None;
            };
            fields.tag = std::str::from_utf8(tag).ok()?;
            let order: &[usize] = if fields.tag == "BlockRemoved" {
                &REMOVED
            } else {
                &STORED
            };
            for position in 0..n - 1 {
                match order.get(position) {
                    Some(&i) => field(r, i, &mut fields, &mut lists)?,
                    None => msgpack::check_value(r, EVENT_ITEM_DEPTH).ok()?,
                }
            }
        }
        _ => return None,
    }
    event_from(&fields, lists).ok()
}

/// The value at `r` as the event's field `i`, past it: a list of hashes or token ids read
/// now, anything else noted where it starts (nil: not at all, as the checked reading notes it).
fn field<'a>(
    r: &mut Reader<'a>,
    i: usize,
    fields: &mut Fields<'a>,
    lists: &mut Lists,
) -> Option<()> {
    let at = r.clone();
    let mut probe = r.clone();
    match (i, probe.next()) {
        (_, Ok(Item::Nil)) => {
            *r = probe;
            return Some(());
        }
        (BLOCK_HASHES, Ok(Item::Array(n))) => {
            *r = probe;
            lists.block_hashes = Some(hash_items(r, n).ok()?);
        }
        (TOKEN_IDS, Ok(Item::Array(n))) => {
            *r = probe;
            lists.token_ids = Some(token_items(r, n).ok()?);
        }
        _ => msgpack::check_value(r, EVENT_ITEM_DEPTH).ok()?,
    }
    fields.at[i] = Some(at);
    Some(())
}
