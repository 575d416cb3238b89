//! What a request's headers (and body) say about how to route it: pins, priority, deadline,
//! session, RL group and accepted policy versions. Malformed values are 400s naming the header.

use crate::error::ServeError;
use axum::http::HeaderMap;
use kvrouter_core::ids::WorkerId;
use kvrouter_core::router::{Pin, MAX_PRIORITY};
use serde_json::Value;
use std::time::Instant;

/// Every header this module reads a request's routing from (each name below is one of these:
/// `every_header_read_is_listed` checks it).
const READ: [&str; 16] = [
    "x-kvrouter-worker-id",
    "x-worker-instance-id",
    "x-dynamo-worker-instance-id",
    "x-kvrouter-dp-rank",
    "x-dp-rank",
    "x-dynamo-dp-rank",
    "x-kvrouter-priority",
    "x-kvrouter-deadline-ms",
    "x-kvrouter-group-id",
    "x-kvrouter-group-size",
    "x-kvrouter-group-need",
    "x-session-id",
    "x-dynamo-session-id",
    "x-kvrouter-policy-version",
    "x-kvrouter-min-policy-version",
    "x-kvrouter-max-policy-staleness",
];

/// The headers to read a request's routing from: `headers`, or an empty map when it holds
/// none of the names this module reads (most requests), so that each of the two dozen lookups
/// below returns at once instead of parsing and hashing its name (about 1.5 µs of a pick).
pub(crate) fn routing_view(headers: &HeaderMap) -> &HeaderMap {
    static NONE: std::sync::LazyLock<HeaderMap> = std::sync::LazyLock::new(HeaderMap::new);
    if headers.keys().any(|k| READ.contains(&k.as_str())) {
        headers
    } else {
        &NONE
    }
}

/// The first of `names` present as text.
pub(crate) fn header_str<'h>(headers: &'h HeaderMap, names: &[&str]) -> Option<&'h str> {
    if headers.is_empty() {
        return None;
    }
    names.iter().find_map(|n| headers.get(*n)?.to_str().ok())
}

/// The value of header `name`, if present: a 400 naming it when it is given more than once (a
/// routing header with two values is ambiguous).
pub(crate) fn one<'h>(
    headers: &'h HeaderMap,
    name: &'static str,
) -> Result<Option<&'h axum::http::HeaderValue>, ServeError> {
    if headers.is_empty() {
        return Ok(None);
    }
    let mut values = headers.get_all(name).iter();
    let first = values.next();
    if values.next().is_some() {
        return Err(ServeError::invalid(
            format!("{name} is given more than once; give it once"),
            Some(name),
        ));
    }
    Ok(first)
}

/// The first of `names` the request carries.
fn first_present(headers: &HeaderMap, names: &[&'static str]) -> Option<&'static str> {
    if headers.is_empty() {
        return None;
    }
    names.iter().copied().find(|n| headers.contains_key(*n))
}

/// The first of `names` present, parsed: a 400 naming that header when it does not parse (or is
/// out of the type's range).
fn first_parsed<T: std::str::FromStr>(
    headers: &HeaderMap,
    names: &[&'static str],
    what: &str,
) -> Result<Option<T>, ServeError> {
    let Some(name) = first_present(headers, names) else {
        return Ok(None);
    };
    parse_header(headers, name, || format!("{name} must be {what}"))
}

/// The first of `names` present as visible ASCII text: a 400 naming that header otherwise.
fn first_text<'h>(
    headers: &'h HeaderMap,
    names: &[&'static str],
) -> Result<Option<&'h str>, ServeError> {
    let Some(name) = first_present(headers, names) else {
        return Ok(None);
    };
    one(headers, name)?
        .map(|v| {
            v.to_str().map_err(|_| {
                ServeError::invalid(format!("{name} must be visible ASCII text"), Some(name))
            })
        })
        .transpose()
}

/// The longest deadline budget a request may state (`x-kvrouter-deadline-ms`): larger values
/// are capped to it, so no arithmetic on them can overflow. One day.
pub(crate) const MAX_DEADLINE_MS: u64 = 24 * 60 * 60 * 1000;

/// A header that must parse when present: a 400 naming it otherwise.
fn parse_header<T: std::str::FromStr>(
    headers: &HeaderMap,
    name: &'static str,
    message: impl FnOnce() -> String,
) -> Result<Option<T>, ServeError> {
    one(headers, name)?
        .map(|v| {
            v.to_str()
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .ok_or_else(|| ServeError::invalid(message(), Some(name)))
        })
        .transpose()
}

pub(crate) const SESSION_HEADERS: [&str; 2] = ["x-session-id", "x-dynamo-session-id"];
pub(crate) const GROUP_HEADER: [&str; 1] = ["x-kvrouter-group-id"];

/// The headers that pin a worker, in the order they are read (the first present wins).
const WORKER_HEADERS: [&str; 3] = [
    "x-kvrouter-worker-id",
    "x-worker-instance-id",
    "x-dynamo-worker-instance-id",
];
/// The headers that pin a data-parallel rank, in the order they are read.
const RANK_HEADERS: [&str; 3] = ["x-kvrouter-dp-rank", "x-dp-rank", "x-dynamo-dp-rank"];

/// A pin from an upstream picker's headers (`direct` mode, or any mode when present). A worker
/// id that is not a u64 or a rank that is not a u32 is a 400 naming the header.
pub(crate) fn pin_from(headers: &HeaderMap) -> Result<Option<Pin>, ServeError> {
    let worker = first_parsed::<u64>(
        headers,
        &WORKER_HEADERS,
        "a worker id (a non-negative integer)",
    )?;
    let dp_rank = first_parsed::<u32>(
        headers,
        &RANK_HEADERS,
        "a data-parallel rank (an integer from 0 to 4294967295)",
    )?;
    if let (None, Some(_)) = (worker, dp_rank) {
        // A rank alone pins nothing: it was ignored (found by probing). The message names the
        // worker header of the same family (`x-dynamo-dp-rank`: `x-dynamo-worker-instance-id`).
        let name = first_present(headers, &RANK_HEADERS).unwrap_or(RANK_HEADERS[0]);
        let family = RANK_HEADERS.iter().position(|h| *h == name).unwrap_or(0);
        return Err(ServeError::invalid(
            format!(
                "{name} names a rank of a pinned worker: it needs {}",
                WORKER_HEADERS[family]
            ),
            Some(name),
        ));
    }
    Ok(worker.map(|w| Pin {
        worker: WorkerId(w),
        dp_rank,
    }))
}

/// A pin must name a registered worker, and a rank that worker has: a 400 naming the header
/// otherwise (the routing core would only say "unknown worker", naming no field).
fn check_pin(headers: &HeaderMap, inner: &crate::state::Inner) -> Result<(), ServeError> {
    let Some(pin) = pin_from(headers)? else {
        return Ok(());
    };
    let dp_size = inner
        .workers
        .lock()
        .expect("workers lock")
        .get(&pin.worker)
        .map(|r| r.entry.dp_size.unwrap_or(1));
    let Some(dp_size) = dp_size else {
        let name = first_present(headers, &WORKER_HEADERS).unwrap_or(WORKER_HEADERS[0]);
        return Err(ServeError::invalid(
            format!("{name}: no worker {} is registered", pin.worker.0),
            Some(name),
        ));
    };
    match pin.dp_rank {
        Some(rank) if rank >= dp_size => {
            let name = first_present(headers, &RANK_HEADERS).unwrap_or(RANK_HEADERS[0]);
            Err(ServeError::invalid(
                format!(
                    "{name}: worker {} has no rank {rank} (dp_size {dp_size})",
                    pin.worker.0
                ),
                Some(name),
            ))
        }
        _ => Ok(()),
    }
}

/// Per-request admission inputs from headers and body.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct AdmissionFields {
    pub(crate) priority: u8,
    pub(crate) deadline: Option<kvrouter_core::time::Time>,
    pub(crate) session: Option<u64>,
    pub(crate) group: Option<u64>,
    /// `x-kvrouter-group-size`: samples in the group (M).
    pub(crate) group_size: Option<u32>,
    /// `x-kvrouter-group-need`: samples that are enough (N of M).
    pub(crate) group_need: Option<u32>,
    pub(crate) policy: kvrouter_core::router::VersionRequirement,
    /// The body's output budget (`max_completion_tokens` or `max_tokens` for chats).
    pub(crate) max_output_tokens: Option<u64>,
}

impl AdmissionFields {
    /// Copies the fields into a request to place (first attempt or continuation).
    pub(crate) fn apply(&self, request: &mut kvrouter_core::router::RouteRequest) {
        request.priority = self.priority;
        request.deadline = self.deadline;
        request.session = self.session;
        request.policy = self.policy;
        request.group = self.group;
        request.group_size = self.group_size;
        request.group_need = self.group_need;
        request.max_output_tokens = self.max_output_tokens;
    }
}

/// The policy versions a request accepts: `x-kvrouter-policy-version` (exact),
/// `x-kvrouter-min-policy-version`, `x-kvrouter-max-policy-staleness` (versions behind the newest).
fn version_requirement(
    headers: &HeaderMap,
) -> Result<kvrouter_core::router::VersionRequirement, ServeError> {
    let read = |name: &'static str| {
        parse_header::<u64>(headers, name, || {
            format!("{name} must be a non-negative integer")
        })
    };
    let requirement = kvrouter_core::router::VersionRequirement {
        exact: read("x-kvrouter-policy-version")?,
        min: read("x-kvrouter-min-policy-version")?,
        max_staleness: read("x-kvrouter-max-policy-staleness")?,
    };
    // No worker could ever serve it: it would wait out the queue (found by probing).
    if let (Some(exact), Some(min)) = (requirement.exact, requirement.min) {
        if exact < min {
            return Err(ServeError::invalid(
                format!(
                    "x-kvrouter-min-policy-version {min} is above x-kvrouter-policy-version \
                     {exact}: no version satisfies both"
                ),
                Some("x-kvrouter-min-policy-version"),
            ));
        }
    }
    Ok(requirement)
}

/// The session key of a session header value (`x-session-id`, `x-dynamo-session-id`).
pub(crate) fn session_key(id: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(id.as_bytes())
}

/// The `session_id` of a `POST /finish_session` body, or the error naming it.
pub(crate) fn finish_session_id(body: &[u8]) -> Result<String, ServeError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ServeError::invalid(format!("the body is not valid JSON: {e}"), None))?;
    match v.get("session_id") {
        Some(Value::String(id)) => Ok(id.clone()),
        None | Some(Value::Null) => Err(ServeError::invalid(
            "`session_id` is required",
            Some("session_id"),
        )),
        Some(_) => Err(ServeError::invalid(
            "`session_id` must be a string",
            Some("session_id"),
        )),
    }
}

pub(crate) fn admission_fields(
    headers: &HeaderMap,
    kind: kvrouter_openai::Kind,
    body: &Value,
    arrival: Instant,
    inner: &crate::state::Inner,
) -> Result<AdmissionFields, ServeError> {
    let bad_priority = |param: &'static str| {
        ServeError::invalid(
            format!("{param} must be an integer from 0 to {MAX_PRIORITY}"),
            Some(param),
        )
    };
    check_pin(headers, inner)?;
    let priority = match one(headers, "x-kvrouter-priority")? {
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<u8>().ok())
            .filter(|p| *p <= MAX_PRIORITY)
            .ok_or_else(|| bad_priority("x-kvrouter-priority"))?,
        None => match body.get("priority") {
            None | Some(Value::Null) => 0,
            Some(v) => v
                .as_u64()
                .and_then(|p| u8::try_from(p).ok())
                .filter(|p| *p <= MAX_PRIORITY)
                .ok_or_else(|| bad_priority("priority"))?,
        },
    };
    let deadline = match parse_header::<u64>(headers, "x-kvrouter-deadline-ms", || {
        "x-kvrouter-deadline-ms must be a whole number of milliseconds".into()
    })? {
        Some(0) => {
            return Err(ServeError::invalid(
                "x-kvrouter-deadline-ms must be ≥ 1 (a budget in milliseconds)",
                Some("x-kvrouter-deadline-ms"),
            ))
        }
        ms => ms,
    }
    .map(|ms| {
        let budget = std::time::Duration::from_millis(ms.min(MAX_DEADLINE_MS));
        let since_start = arrival.saturating_duration_since(inner.epoch) + budget;
        kvrouter_core::time::Time::from_micros(
            u64::try_from(since_start.as_micros()).unwrap_or(u64::MAX),
        )
    });
    let count = |name: &'static str| -> Result<Option<u32>, ServeError> {
        let bounds = || format!("{name} must be a whole number from 1 to {}", u32::MAX);
        match parse_header::<u32>(headers, name, bounds)? {
            Some(0) => Err(ServeError::invalid(bounds(), Some(name))),
            n => Ok(n),
        }
    };
    let group = first_text(headers, &GROUP_HEADER)?.map(session_key);
    let group_size = count("x-kvrouter-group-size")?;
    let group_need = count("x-kvrouter-group-need")?;
    if group.is_none() && (group_size.is_some() || group_need.is_some()) {
        return Err(ServeError::invalid(
            "x-kvrouter-group-size and x-kvrouter-group-need need x-kvrouter-group-id",
            Some("x-kvrouter-group-id"),
        ));
    }
    if let (Some(n), Some(m)) = (group_need, group_size) {
        if n > m {
            return Err(ServeError::invalid(
                format!("x-kvrouter-group-need ({n}) is more than x-kvrouter-group-size ({m})"),
                Some("x-kvrouter-group-need"),
            ));
        }
    }
    Ok(AdmissionFields {
        priority,
        deadline,
        session: first_text(headers, &SESSION_HEADERS)?.map(session_key),
        group,
        group_size,
        group_need,
        policy: version_requirement(headers)?,
        // Read as the engine reads it; a bad one is left to the engine to refuse, naming it.
        max_output_tokens: kvrouter_openai::request::max_tokens(kind, body)
            .ok()
            .flatten()
            .map(u64::from),
    })
}

/// The session key of a request's session header, if any (the global router's sessions).
pub(crate) fn session(headers: &HeaderMap) -> Result<Option<u64>, ServeError> {
    Ok(first_text(headers, &SESSION_HEADERS)?.map(session_key))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    /// The `x-` header names written as whole string literals in `code`.
    fn literal_names(code: &str) -> Vec<&str> {
        code.match_indices("\"x-")
            .filter_map(|(at, _)| {
                let name = code[at + 1..].split('"').next()?;
                name.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                    .then_some(name)
            })
            .collect()
    }

    #[test]
    fn every_header_read_is_listed() {
        // Each `x-` header named by a string literal in this file's code (its tests left out):
        // a name read here but not in READ would be skipped for a request carrying only it.
        let source = include_str!("headers.rs");
        let code = source.split("#[cfg(test)]").next().unwrap();
        let mut names = literal_names(code);
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), READ.len(), "{names:?}");
        for name in names {
            assert!(READ.contains(&name), "{name} is read but not in READ");
        }
        // The scan itself finds a name READ lacks.
        assert_eq!(
            literal_names("let _ = one(h, \"x-kvrouter-new\"); // \"x-y z\""),
            ["x-kvrouter-new"]
        );
    }

    #[test]
    fn the_view_is_empty_only_without_a_routing_header() {
        let mut h = HeaderMap::new();
        h.insert("content-type", HeaderValue::from_static("application/json"));
        h.insert("x-request-id", HeaderValue::from_static("r1"));
        h.insert("x-kvrouter-json-length", HeaderValue::from_static("2"));
        assert!(routing_view(&h).is_empty());
        assert_eq!(pin_from(routing_view(&h)).unwrap(), None);
        for name in READ {
            let mut with = h.clone();
            with.insert(name, HeaderValue::from_static("7"));
            let view = routing_view(&with);
            assert_eq!(view.len(), with.len(), "{name}");
            assert_eq!(header_str(view, &[name]), Some("7"), "{name}");
        }
        // A pin and a session read through the view as through the map.
        let mut pinned = h.clone();
        pinned.insert("x-worker-instance-id", HeaderValue::from_static("3"));
        pinned.insert("x-dp-rank", HeaderValue::from_static("1"));
        pinned.insert("x-session-id", HeaderValue::from_static("s"));
        let view = routing_view(&pinned);
        assert_eq!(pin_from(view).unwrap(), pin_from(&pinned).unwrap());
        assert_eq!(
            pin_from(view).unwrap().map(|p| (p.worker.0, p.dp_rank)),
            Some((3, Some(1)))
        );
        assert_eq!(session(view).unwrap(), Some(session_key("s")));
        assert_eq!(version_requirement(view).unwrap().exact, None);
    }
}
