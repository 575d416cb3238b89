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
        object.insert("system_fingerprint".into(), Value::from(fingerprint));
    }
}

/// A whole JSON body, stamped; the body unchanged when it is not a JSON object.
pub fn stamp_body(body: Bytes, fingerprint: &str) -> Bytes {
    match serde_json::from_slice::<Value>(&body) {
        Ok(mut v @ Value::Object(_)) => {
            stamp(&mut v, fingerprint);
            serde_json::to_vec(&v).map(Bytes::from).unwrap_or(body)
        }
        _ => body,
    }
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

    #[test]
    fn whole_bodies_are_stamped() {
        let out = stamp_body(Bytes::from_static(b"{\"id\":\"a\"}"), &fingerprint(7));
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["system_fingerprint"], "policy-7");
        assert_eq!(&stamp_body(Bytes::from_static(b"oops"), "p")[..], b"oops");
        assert_eq!(&stamp_body(Bytes::from_static(b"[1]"), "p")[..], b"[1]");
    }
}
