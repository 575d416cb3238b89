//! The pick API's reports: a caller that sends a picked request itself tells the router its
//! first token (`POST /v1/pick/{id}/first-token`) and its end (`POST /v1/pick/{id}/finish`),
//! so the load of the pick is right. Reports can also come in a batch
//! (`POST /v1/pick/reports`) or ride on the caller's next pick (its `reports` field, applied
//! before that pick is placed), so a steady client pays one HTTP exchange per pick. A report of
//! a batch answers its own outcome: an unknown, finished or expired id is that report's error,
//! never the batch's or the pick's.

use crate::error::ServeError;
use crate::health::Source;
use crate::picks::{NotOurs, PickTable};
use kvrouter_core::policy::learn::MAX_OUTPUT_SAMPLE;
use serde::Deserialize;
use serde_json::{json, Value};
use std::time::Instant;

/// The body field (of a pick, or of `POST /v1/pick/reports`) that carries reports.
pub(crate) const REPORTS: &str = "reports";

/// Most reports one body carries (a pick's or a batch's); a longer list is refused whole.
pub(crate) const MAX_REPORTS: usize = 1024;

/// Largest token count a report may state (no model has a context near 2^32 tokens).
const MAX_REPORTED_TOKENS: u64 = u32::MAX as u64;

/// How a pick ended, as its caller reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
enum End {
    /// The answer completed.
    Ok,
    /// The caller gave up (or the answer was aborted).
    Cancelled,
    /// The worker failed (connection error, 5xx, broken stream): counts toward its health.
    Failed,
}

/// The body of a finish report; every field optional.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FinishReport {
    status: Option<End>,
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    cached_tokens: Option<u64>,
}

/// Which lifecycle event a batched report is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
enum Event {
    /// As `POST /v1/pick/{id}/first-token`.
    #[serde(alias = "first-token")]
    FirstToken,
    /// As `POST /v1/pick/{id}/finish`.
    Finish,
}

/// A pick's id as a report gives it: the answer's string (a number, as ids were once written,
/// names no pick).
#[derive(Debug, serde::Deserialize)]
#[serde(untagged)]
enum Id {
    Text(String),
    Number(u64),
}

/// One report of a batch: the pick, the event, and for a finish its report's fields.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Report {
    id: Id,
    event: Event,
    status: Option<End>,
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    cached_tokens: Option<u64>,
}

/// The pick number of `id` if this router wrote it ([`crate::picks::PickId`]); any other text
/// names none of its picks.
fn pick_id(table: &PickTable, id: &str) -> Result<u64, ServeError> {
    table.parse_id(id).map_err(|why| {
        ServeError::NotFound(match why {
            NotOurs::Malformed => format!(
                "no outstanding pick `{}` (pick ids are the answers' `id` strings)",
                shown(id)
            ),
            NotOurs::Foreign => format!(
                "pick `{}` was not made by this router (its picks' ids begin `{}`): another \
                 replica or this router before a restart made it; report to the router that \
                 answered the pick",
                shown(id),
                table.tag(),
            ),
        })
    })
}

/// The longest id text an answer repeats whole: a pick id has at most 29 characters (8 hex
/// digits, a dash, 20 digits).
const MAX_SHOWN_ID: usize = 32;

/// The longest message of a malformed report an answer repeats whole (serde's messages quote
/// the offending value or key, which may be huge).
const MAX_SHOWN_MESSAGE: usize = 256;

/// `id` as an answer repeats it: whole up to [`MAX_SHOWN_ID`] bytes, else its start and its
/// length, so a huge id does not come back whole.
fn shown(id: &str) -> std::borrow::Cow<'_, str> {
    cut(id, MAX_SHOWN_ID)
}

/// `text` whole up to `max` bytes, else its first `max` bytes (at a character boundary) and its
/// length.
fn cut(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if text.len() <= max {
        return text.into();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &text[..end], text.len()).into()
}

/// A finish report's token counts must be possible: prompt and cached tokens each at most
/// 2^32 − 1, completion tokens at most [`MAX_OUTPUT_SAMPLE`] (they teach the `cost` policy
/// output lengths), and the cached tokens no more than the prompt's. A refusal names the field,
/// as `reports[at].field` for the `at`-th report of a list.
fn check_counts(report: &FinishReport, at: Option<usize>) -> Result<(), ServeError> {
    // Written only for a refusal (a good report costs no formatting).
    let param = |field: &str| match at {
        Some(at) => format!("{REPORTS}[{at}].{field}"),
        None => field.to_owned(),
    };
    for (field, v, max) in [
        ("prompt_tokens", report.prompt_tokens, MAX_REPORTED_TOKENS),
        (
            "completion_tokens",
            report.completion_tokens,
            MAX_OUTPUT_SAMPLE,
        ),
        ("cached_tokens", report.cached_tokens, MAX_REPORTED_TOKENS),
    ] {
        if v.is_some_and(|v| v > max) {
            return Err(ServeError::invalid_at(
                format!("`{field}` must be at most {max}"),
                param(field),
            ));
        }
    }
    if let (Some(cached), Some(prompt)) = (report.cached_tokens, report.prompt_tokens) {
        if cached > prompt {
            return Err(ServeError::invalid_at(
                format!("`cached_tokens` ({cached}) must not exceed `prompt_tokens` ({prompt})"),
                param("cached_tokens"),
            ));
        }
    }
    Ok(())
}

fn unknown(table: &PickTable, id: u64) -> ServeError {
    ServeError::NotFound(format!(
        "no outstanding pick `{}` (finished, expired or never handed out)",
        table.id(id)
    ))
}

fn finish_report(raw: &[u8]) -> Result<FinishReport, ServeError> {
    if raw.iter().all(u8::is_ascii_whitespace) {
        return Ok(FinishReport::default());
    }
    // Syntax first (its error has no field to name), then the shape: a report is an object
    // (serde would take a list of its fields in order too).
    let body: Value = serde_json::from_slice(raw)
        .map_err(|e| ServeError::invalid(format!("the body is not valid JSON: {e}"), None))?;
    if !body.is_object() {
        return Err(ServeError::invalid(
            "a finish report must be a JSON object",
            None,
        ));
    }
    serde_path_to_error::deserialize(body).map_err(|e| {
        let path = e.path().to_string();
        let msg = format!("invalid finish report: {}", e.inner());
        if path == "." || path.is_empty() {
            ServeError::invalid(msg, None)
        } else {
            ServeError::invalid_at(msg, path)
        }
    })
}

/// Marks pick `id`'s first token: its lease now runs to `--pick-max-duration-secs`.
fn mark_first_token(table: &PickTable, id: u64) -> Result<&'static str, ServeError> {
    let until = Instant::now() + table.state().inner.config.picks.max_duration;
    if !table.first_token(id, until) {
        return Err(unknown(table, id));
    }
    Ok("generating")
}

/// Ends pick `id` as `report` says, releasing its load.
fn release(table: &PickTable, id: u64, report: FinishReport) -> Result<&'static str, ServeError> {
    let state = table.state();
    let mut guard = table.take(id).ok_or_else(|| unknown(table, id))?;
    let end = report.status.unwrap_or(End::Ok);
    let metrics = &state.inner.metrics;
    match end {
        End::Ok => {
            let mut usage = serde_json::Map::new();
            for (k, v) in [
                ("prompt_tokens", report.prompt_tokens),
                ("completion_tokens", report.completion_tokens),
            ] {
                if let Some(v) = v {
                    usage.insert(k.into(), v.into());
                }
            }
            if let Some(c) = report.cached_tokens {
                usage.insert("prompt_tokens_details".into(), json!({"cached_tokens": c}));
            }
            guard.finish_reported((!usage.is_empty()).then_some(Value::Object(usage)));
            metrics.picks.inc(&[("source", "api"), ("end", "finished")]);
        }
        End::Cancelled | End::Failed => {
            let label = if end == End::Failed {
                state.observe_health(guard.worker(), false, Source::Request);
                guard.fail();
                "failed"
            } else {
                "cancelled"
            };
            metrics.picks.inc(&[("source", "api"), ("end", label)]);
            // A cancelled pick's guard counts it as cancelled as it ends.
            drop(guard);
        }
    }
    Ok("released")
}

fn answer(table: &PickTable, id: u64, status: &str) -> Value {
    json!({"id": table.id(id).to_string(), "object": "kvrouter.pick", "status": status})
}

/// `POST /v1/pick/{id}/first-token`: the caller got the answer's first token; the lease now
/// runs to `--pick-max-duration-secs`.
pub(crate) fn first_token(table: &PickTable, id: &str) -> Result<Value, ServeError> {
    let id = pick_id(table, id)?;
    Ok(answer(table, id, mark_first_token(table, id)?))
}

/// `POST /v1/pick/{id}/finish`: the pick ended (`status`: `ok`, the default, `cancelled` or
/// `failed`), with the answer's token counts when the caller has them. Its load is released.
pub(crate) fn finish(table: &PickTable, id: &str, raw: &[u8]) -> Result<Value, ServeError> {
    let report = finish_report(raw)?;
    check_counts(&report, None)?;
    let id = pick_id(table, id)?;
    Ok(answer(table, id, release(table, id, report)?))
}

/// The reports of a body's `reports` field: a list of at most [`MAX_REPORTS`] (`null`: none),
/// else a 400 naming it.
pub(crate) fn report_list(value: Value) -> Result<Vec<Value>, ServeError> {
    match value {
        Value::Null => Ok(Vec::new()),
        Value::Array(list) if list.len() > MAX_REPORTS => Err(ServeError::invalid(
            format!(
                "`reports` holds {} reports; at most {MAX_REPORTS} go in one body",
                list.len()
            ),
            Some(REPORTS),
        )),
        Value::Array(list) => Ok(list),
        _ => Err(ServeError::invalid(
            "`reports` must be a list of pick reports ({\"id\", \"event\": \"first_token\" or \"finish\", ...})",
            Some(REPORTS),
        )),
    }
}

/// Applies one report of a batch (the `at`-th): its outcome, `{"id", "status"}` or
/// `{"id", "error": {...}}` (an OpenAI-shaped error naming `reports[at]...` for a malformed
/// report).
fn apply_one(table: &PickTable, at: usize, value: Value) -> Value {
    if !value.is_object() {
        let e = ServeError::invalid_at(
            "a pick report must be a JSON object",
            format!("{REPORTS}[{at}]"),
        );
        return json!({"id": Value::Null, "error": e.body()["error"].take()});
    }
    // Read plainly; only a report that cannot be read is read again for the path of its
    // error (tracking the path of every field cost each good report a microsecond).
    let outcome = Report::deserialize(&value)
        .or_else(|_| serde_path_to_error::deserialize::<_, Report>(&value))
        .map_err(|e| {
            let path = cut(&e.path().to_string(), MAX_SHOWN_ID).into_owned();
            let param = if path == "." || path.is_empty() {
                format!("{REPORTS}[{at}]")
            } else {
                format!("{REPORTS}[{at}].{path}")
            };
            // serde's words for an untagged id ("did not match any variant") say nothing.
            let msg = if path == "id" {
                "`id` must be a pick id as the pick's answer gives it: a string such as \
                 `b685ce83-17`"
                    .to_owned()
            } else {
                cut(&e.inner().to_string(), MAX_SHOWN_MESSAGE).into_owned()
            };
            ServeError::invalid_at(format!("invalid pick report: {msg}"), param)
        })
        .and_then(|r| {
            let id = match &r.id {
                Id::Text(text) => pick_id(table, text)?,
                Id::Number(n) => pick_id(table, &n.to_string())?,
            };
            let status = match r.event {
                Event::FirstToken => mark_first_token(table, id)?,
                Event::Finish => {
                    let report = FinishReport {
                        status: r.status,
                        prompt_tokens: r.prompt_tokens,
                        completion_tokens: r.completion_tokens,
                        cached_tokens: r.cached_tokens,
                    };
                    check_counts(&report, Some(at))?;
                    release(table, id, report)?
                }
            };
            Ok((id, status))
        });
    match outcome {
        Ok((id, status)) => json!({"id": table.id(id).to_string(), "status": status}),
        Err(e) => {
            // The id as given, for the outcome of a report that cannot be read.
            let given = match value.get("id") {
                Some(Value::String(text)) => Value::String(shown(text).into_owned()),
                Some(other @ (Value::Number(_) | Value::Bool(_) | Value::Null)) => other.clone(),
                // A list or an object is not an id: its type is enough to repeat.
                Some(_) | None => Value::Null,
            };
            let mut error = e.body()["error"].take();
            // A report's only 404 is its id naming no outstanding pick: that is the field.
            if matches!(e, ServeError::NotFound(_)) {
                error["param"] = json!(format!("{REPORTS}[{at}].id"));
            }
            json!({"id": given, "error": error})
        }
    }
}

/// Applies `reports` in order: each one's outcome, in the same order.
pub(crate) fn apply(table: &PickTable, reports: Vec<Value>) -> Vec<Value> {
    reports
        .into_iter()
        .enumerate()
        .map(|(at, r)| apply_one(table, at, r))
        .collect()
}

/// `POST /v1/pick/reports` with `{"reports": [...]}`: applies them in order and answers each
/// one's outcome. Only a body that is not such an object is an error.
pub(crate) fn batch(table: &PickTable, raw: &[u8]) -> Result<Value, ServeError> {
    let body: Value = serde_json::from_slice(raw)
        .map_err(|e| ServeError::invalid(format!("the body is not valid JSON: {e}"), None))?;
    let Value::Object(mut body) = body else {
        return Err(ServeError::invalid("the body must be a JSON object", None));
    };
    let Some(reports) = body.remove(REPORTS) else {
        return Err(ServeError::invalid(
            "`reports` is missing (a list of pick reports)",
            Some(REPORTS),
        ));
    };
    if let Some(other) = body.keys().next() {
        return Err(ServeError::invalid_at(
            format!("unknown field `{other}`, expected `{REPORTS}`"),
            other.clone(),
        ));
    }
    let outcomes = apply(table, report_list(reports)?);
    Ok(json!({"object": "kvrouter.pick.reports", REPORTS: outcomes}))
}
