//! `system_fingerprint`: which policy version served an answer, stamped on the first event of a
//! stream (and on its usage and finishing events) or on a whole body.

use crate::sse;
use bytes::Bytes;
use serde_json::Value;

/// The `system_fingerprint` of an answer served by policy `version`.
pub fn fingerprint(version: u64) -> String {
    format!("policy-{version}")
}

/// Sets `system_fingerprint` on a parsed body or chunk (replacing an engine's own, SGLang's
/// weight version for instance). Leaves anything but an object alone.
pub fn stamp(v: &mut Value, fingerprint: &str) {
    if let Some(object) = v.as_object_mut() {
        object.insert(KEY.into(), Value::from(fingerprint));
    }
}

/// A whole JSON body, stamped; the body unchanged when it is not a JSON object. The rest of
/// the body stays as the engine wrote it (key order, number spelling): only the field's value
/// is written, or the field added first ([`stamp_raw`]).
pub fn stamp_body(body: Bytes, fingerprint: &str) -> Bytes {
    if let Some(stamped) = stamp_raw(&body, fingerprint) {
        return Bytes::from(stamped);
    }
    match serde_json::from_slice::<Value>(&body) {
        Ok(mut v @ Value::Object(_)) => {
            stamp(&mut v, fingerprint);
            serde_json::to_vec(&v).map(Bytes::from).unwrap_or(body)
        }
        _ => body,
    }
}

/// `raw` (a JSON object, valid) with `system_fingerprint` set in its text: the value of the
/// field replaced, or the field added right after the `{`. `None` when the top level cannot be
/// walked without reading it ([`crate::scan::slot`]).
pub fn stamp_raw(raw: &[u8], fingerprint: &str) -> Option<Vec<u8>> {
    use crate::scan::{slot, Slot};
    let value = Value::from(fingerprint).to_string();
    let mut out = Vec::with_capacity(raw.len() + value.len() + 24);
    match slot(raw, KEY)? {
        Slot::Value(range) => {
            out.extend_from_slice(&raw[..range.start]);
            out.extend_from_slice(value.as_bytes());
            out.extend_from_slice(&raw[range.end..]);
        }
        Slot::Absent { open, empty } => {
            out.extend_from_slice(&raw[..=open]);
            out.extend_from_slice(b"\"system_fingerprint\":");
            out.extend_from_slice(value.as_bytes());
            if !empty {
                out.push(b',');
            }
            out.extend_from_slice(&raw[open + 1..]);
        }
    }
    Some(out)
}

/// The field this module stamps.
const KEY: &str = "system_fingerprint";

/// One whole SSE event with its `data:` payload (a JSON object) stamped in its text: the rest
/// of the event (its line ends, the payload's key order and numbers) as the engine wrote it.
/// `None` when the payload is not one JSON object the walk takes.
pub fn stamp_event(event: &[u8], fingerprint: &str) -> Option<Vec<u8>> {
    let payload = sse::data(event).filter(|d| d.first() == Some(&b'{'))?;
    serde_json::from_slice::<serde::de::IgnoredAny>(payload).ok()?;
    let start = payload.as_ptr() as usize - event.as_ptr() as usize;
    let stamped = stamp_raw(payload, fingerprint)?;
    let mut out = Vec::with_capacity(event.len() + stamped.len() - payload.len());
    out.extend_from_slice(&event[..start]);
    out.extend_from_slice(&stamped);
    out.extend_from_slice(&event[start + payload.len()..]);
    Some(out)
}

/// The chunk with its first SSE event stamped, when the chunk starts with a whole `data:` event
/// carrying a JSON object; the chunk unchanged otherwise.
pub fn stamp_first_event(chunk: Bytes, fingerprint: &str) -> Bytes {
    if !chunk.starts_with(b"data:") {
        return chunk;
    }
    let Some(first) = sse::events(&chunk).next() else {
        return chunk;
    };
    if !(first.ends_with(b"\n\n") || first.ends_with(b"\n\r\n")) {
        return chunk;
    }
    if let Some(mut out) = stamp_event(first, fingerprint) {
        out.extend_from_slice(&chunk[first.len()..]);
        return Bytes::from(out);
    }
    let Some(mut event @ Value::Object(_)) = sse::json(first) else {
        return chunk;
    };
    stamp(&mut event, fingerprint);
    let mut out = sse::data_event(&event);
    out.extend_from_slice(&chunk[first.len()..]);
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_event_of_a_stream_carries_the_fingerprint() {
        let chunk = Bytes::from_static(
            b"data: {\"id\":\"x\",\"system_fingerprint\":null}\n\ndata: {\"id\":\"y\"}\n\n",
        );
        let out = stamp_first_event(chunk, "policy-3");
        let first = sse::json(sse::events(&out).next().unwrap()).unwrap();
        assert_eq!(
            first["system_fingerprint"], "policy-3",
            "the engine's null replaced"
        );
        assert_eq!(first["id"], "x");
        let text = std::str::from_utf8(&out).unwrap();
        assert_eq!(text.matches("system_fingerprint").count(), 1, "{text}");
        assert!(
            text.ends_with("data: {\"id\":\"y\"}\n\n"),
            "later events unchanged"
        );
        // Not an event, not a whole one, or not an object: left alone.
        for other in [
            &b": keep-alive\n\n"[..],
            &b"data: {\"id\":\"x\""[..],
            &b"data: [DONE]\n\n"[..],
        ] {
            assert_eq!(
                &stamp_first_event(Bytes::from(other), "policy-3")[..],
                other
            );
        }
        // CRLF events are whole events too.
        let crlf = stamp_first_event(Bytes::from_static(b"data: {}\r\n\r\n"), "p");
        assert_eq!(sse::json(&crlf).unwrap()["system_fingerprint"], "p");
    }

    /// Found by a probe: stamping read and rewrote the engine's body, so keys came out sorted
    /// (a completion's `top_logprobs` lost their rank order) and numbers respelled
    /// (`1e-05` as `0.00001`, a 30-digit integer as a float). Only the field is written now.
    #[test]
    fn stamping_leaves_the_rest_of_the_engines_text_as_it_was() {
        let body = r#"{"id":"x","choices":[{"top_logprobs":[{"zeta":-0.1,"alpha":-2e-05}]}],"n":123456789012345678901234567890}"#;
        let out = stamp_body(Bytes::from(body), "policy-4");
        let text = std::str::from_utf8(&out).unwrap();
        assert_eq!(
            text,
            format!("{{\"system_fingerprint\":\"policy-4\",{}", &body[1..])
        );
        // An engine's own value is replaced in place; an empty object gets the field alone.
        let out = stamp_body(
            Bytes::from(r#"{"a":1,"system_fingerprint" : null ,"b":2}"#),
            "p",
        );
        assert_eq!(&out[..], br#"{"a":1,"system_fingerprint" : "p","b":2}"#);
        assert_eq!(
            &stamp_body(Bytes::from(" {} "), "p")[..],
            br#" {"system_fingerprint":"p"} "#
        );
        // The first event of a stream, in CRLF, keeps its framing and its text.
        let chunk = Bytes::from("data: {\"z\":1,\"a\":1e-05}\r\n\r\ndata: [DONE]\r\n\r\n");
        let out = stamp_first_event(chunk, "p");
        assert_eq!(
            &out[..],
            b"data: {\"system_fingerprint\":\"p\",\"z\":1,\"a\":1e-05}\r\n\r\ndata: [DONE]\r\n\r\n"
        );
        // What the walk does not take is still stamped, through a `Value`.
        let out = stamp_body(Bytes::from(r#"{"\u0061":1}"#), "p");
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(
            (v["a"].as_u64(), v["system_fingerprint"].as_str()),
            (Some(1), Some("p"))
        );
    }

    #[test]
    fn whole_bodies_are_stamped() {
        let out = stamp_body(Bytes::from_static(b"{\"id\":\"a\"}"), &fingerprint(7));
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["system_fingerprint"], "policy-7");
        assert_eq!(&stamp_body(Bytes::from_static(b"oops"), "p")[..], b"oops");
        assert_eq!(&stamp_body(Bytes::from_static(b"[1]"), "p")[..], b"[1]");
    }
}
