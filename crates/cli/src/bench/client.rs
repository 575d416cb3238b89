//! The client side of `kvrouter bench`: one streamed request, folded into what it measured.

use futures::StreamExt;
use kvrouter_core::time::Time;
use kvrouter_openai::sse;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A `--url` as bench uses it: `http(s)://HOST:PORT`, maybe with a base path (a router behind a
/// prefix), without a trailing `/`, a query, a fragment or bench's own `/v1`.
pub(super) fn base_url(url: &str) -> anyhow::Result<String> {
    let url = url.trim_end_matches('/');
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        anyhow::bail!("--url {url:?}: expected http://HOST:PORT");
    }
    match reqwest::Url::parse(url) {
        Ok(u) if u.query().is_some() || u.fragment().is_some() => {
            anyhow::bail!("--url {url:?}: expected http://HOST:PORT, without a query or fragment")
        }
        Ok(u) if u.path().ends_with("/v1") => anyhow::bail!(
            "--url {url:?}: drop the /v1 (bench adds /v1/completions and /v1/models itself)"
        ),
        Ok(_) => Ok(url.to_owned()),
        Err(e) => anyhow::bail!("--url {url:?}: {e}"),
    }
}

/// What one request measured (times relative to the start of the run).
#[derive(Debug, Default)]
pub(super) struct Outcome {
    /// When its body was ready and sending began (the request's arrival for its TTFT).
    pub(super) sent: Option<Time>,
    pub(super) first_token: Option<Time>,
    pub(super) last_token: Option<Time>,
    pub(super) finish: Option<Time>,
    pub(super) itl_sum_ms: f64,
    pub(super) itl_count: u32,
    pub(super) output_tokens: u32,
    pub(super) cached_tokens: u32,
    pub(super) error: Option<String>,
    /// The error was a refusal under overload (HTTP 429 or 529), not a failure.
    pub(super) refused: bool,
    /// The worker that served it, when the endpoint says (`x-kvrouter-worker`).
    pub(super) worker: Option<usize>,
    /// The router's decision with every candidate's score, when it says
    /// (`x-kvrouter-decision`, `serve --expose-decisions`).
    pub(super) decision: Option<serde_json::Value>,
    /// It finished with `finish_reason: "abort"` (ended early by first-N-of-M).
    pub(super) ended_early: bool,
    /// Streamed chunks that carried text: the output's length when no usage block came.
    pub(super) text_chunks: u32,
    /// A usage block came (its `completion_tokens` is the output's length).
    pub(super) usage_seen: bool,
}

pub(super) struct Shared {
    pub(super) client: reqwest::Client,
    /// `--header` entries, sent on every request to a --url endpoint (not to picked workers).
    pub(super) router_headers: reqwest::header::HeaderMap,
    /// The endpoints; requests go to them in turn (`--url` repeated: router replicas).
    pub(super) urls: Vec<String>,
    pub(super) next_url: std::sync::atomic::AtomicUsize,
    pub(super) model: String,
    pub(super) start: Instant,
    pub(super) timeout: Duration,
    pub(super) session_header: bool,
    pub(super) group_header: bool,
    /// Requests per group, when sizes are sent.
    pub(super) group_sizes: Option<std::collections::HashMap<u64, u32>>,
    pub(super) group_need: Option<u32>,
    /// Ask the pick API where to send each request, then send it there directly.
    pub(super) pick: bool,
}

impl Shared {
    /// The next endpoint, round-robin.
    pub(super) fn url(&self) -> &str {
        let i = self
            .next_url
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        &self.urls[i % self.urls.len()]
    }

    /// A POST to `url`, one of the --url endpoints, with the `--header` entries.
    pub(super) fn post_to_router(&self, url: String) -> reqwest::RequestBuilder {
        self.client.post(url).headers(self.router_headers.clone())
    }

    pub(super) fn now(&self) -> Time {
        Time::from_micros(self.start.elapsed().as_micros() as u64)
    }
}

/// `POST /finish_session` for `session` (its `x-session-id`) at the first URL; whether the
/// endpoint answered 2xx within the request timeout.
pub(super) async fn end_session(shared: Arc<Shared>, session: u64) -> bool {
    let ask = shared
        .post_to_router(format!("{}/finish_session", shared.urls[0]))
        .json(&serde_json::json!({ "session_id": session.to_string() }))
        .timeout(shared.timeout)
        .send();
    matches!(ask.await, Ok(r) if r.status().is_success())
}

pub(super) async fn send(
    shared: Arc<Shared>,
    body: serde_json::Value,
    session: Option<u64>,
    group: Option<u64>,
) -> Outcome {
    let mut out = Outcome {
        sent: Some(shared.now()),
        ..Outcome::default()
    };
    let result = tokio::time::timeout(
        shared.timeout,
        stream_one(&shared, body, session, group, &mut out),
    )
    .await
    .unwrap_or_else(|_| Err("timed out".to_owned()));
    if let Err(e) = result {
        out.error = Some(e);
    }
    out.finish = Some(shared.now());
    out
}

async fn stream_one(
    shared: &Shared,
    body: serde_json::Value,
    session: Option<u64>,
    group: Option<u64>,
    out: &mut Outcome,
) -> Result<(), String> {
    let mut headers: Vec<(&'static str, String)> = Vec::new();
    if let (true, Some(s)) = (shared.session_header, session) {
        headers.push(("x-session-id", s.to_string()));
    }
    if let (true, Some(g)) = (shared.group_header, group) {
        headers.push(("x-kvrouter-group-id", g.to_string()));
        if let Some(size) = shared.group_sizes.as_ref().and_then(|m| m.get(&g)) {
            headers.push(("x-kvrouter-group-size", size.to_string()));
        }
        if let Some(n) = shared.group_need {
            headers.push(("x-kvrouter-group-need", n.to_string()));
        }
    }
    if !shared.pick {
        let mut req = shared
            .post_to_router(format!("{}/v1/completions", shared.url()))
            .json(&body);
        for (k, v) in headers {
            req = req.header(k, v);
        }
        return stream_from(shared, req, out, None).await;
    }
    let picked = super::pick::pick(shared, &body, &headers, out).await?;
    let req = shared
        .client
        .post(format!("{}/v1/completions", picked.url))
        .json(&body);
    out.worker = Some(picked.worker);
    let result = stream_from(shared, req, out, Some(&picked)).await;
    super::pick::finish(shared, &picked, result.is_ok(), out).await;
    result
}

/// Sends `req` and folds its streamed answer into `out` (reporting the first token of a
/// pick, if any).
/// An answer that refuses the request under overload (the router's queue or busy filters),
/// counted as refused rather than failed.
pub(super) fn is_refusal(status: reqwest::StatusCode) -> bool {
    matches!(status.as_u16(), 429 | 529)
}

async fn stream_from(
    shared: &Shared,
    req: reqwest::RequestBuilder,
    out: &mut Outcome,
    picked: Option<&super::pick::Picked>,
) -> Result<(), String> {
    let resp = req.send().await.map_err(|e| format!("send: {e}"))?;
    let status = resp.status();
    if !status.is_success() {
        out.refused = is_refusal(status);
        let text = resp.text().await.unwrap_or_default();
        return Err(format!(
            "HTTP {status}: {}",
            text.chars().take(200).collect::<String>()
        ));
    }
    if picked.is_none() {
        out.worker = resp
            .headers()
            .get("x-kvrouter-worker")
            .and_then(|v| v.to_str().ok()?.parse().ok());
        out.decision = resp
            .headers()
            .get("x-kvrouter-decision")
            .and_then(|v| serde_json::from_slice(v.as_bytes()).ok());
    }
    let mut stream = resp.bytes_stream();
    let mut events = sse::EventSplitter::new();
    let mut done = false;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| format!("stream: {e}"))?;
        events.push(&chunk);
        while let Some(event) = events.next_event() {
            for data in sse::data_lines(&event) {
                if sse::is_done(data) {
                    done = true;
                    continue;
                }
                let first = out.first_token.is_none();
                on_chunk(shared.now(), data, out)?;
                if let (true, Some(_), Some(p)) = (first, out.first_token, picked) {
                    super::pick::first_token(shared, p).await;
                }
            }
        }
        if events.over_limit() {
            return Err(format!(
                "stream: over {} MiB without an event break (not SSE)",
                sse::MAX_EVENT_BYTES >> 20
            ));
        }
    }
    stream_ended(out, done)
}

/// Checks a stream that ended (`done`: it sent `[DONE]`) and settles its output's length.
fn stream_ended(out: &mut Outcome, done: bool) -> Result<(), String> {
    if !done {
        return Err("stream ended without [DONE]".to_owned());
    }
    // An endpoint that sends no usage block (it ignores `stream_options.include_usage`): one
    // token per chunk with text, as vLLM and SGLang stream them.
    if !out.usage_seen {
        out.output_tokens = out.text_chunks;
    }
    // A stream with no text, no counted output and no early end served nothing.
    if out.first_token.is_none() && out.output_tokens == 0 && !out.ended_early {
        return Err("the stream carried no token".to_owned());
    }
    Ok(())
}

/// Folds one `data:` payload into the outcome.
fn on_chunk(now: Time, data: &[u8], out: &mut Outcome) -> Result<(), String> {
    let v: serde_json::Value =
        serde_json::from_slice(data).map_err(|e| format!("bad SSE JSON: {e}"))?;
    if let Some(err) = v.get("error") {
        return Err(format!("in-band error: {err}"));
    }
    let has_text = v["choices"].as_array().is_some_and(|c| {
        c.iter()
            .any(|c| c["text"].as_str().is_some_and(|t| !t.is_empty()))
    });
    if has_text {
        out.text_chunks = out.text_chunks.saturating_add(1);
        if out.first_token.is_none() {
            out.first_token = Some(now);
        } else if let Some(last) = out.last_token {
            out.itl_sum_ms += now.since(last).as_secs_f64() * 1e3;
            out.itl_count += 1;
        }
        out.last_token = Some(now);
    }
    let aborted = v["choices"]
        .as_array()
        .is_some_and(|c| c.iter().any(|c| c["finish_reason"] == "abort"));
    out.ended_early |= aborted;
    if let Some(usage) = v.get("usage").filter(|u| !u.is_null()) {
        out.output_tokens =
            usage_count(usage, "completion_tokens", "usage.completion_tokens")?.unwrap_or(0);
        out.cached_tokens = usage_count(
            &usage["prompt_tokens_details"],
            "cached_tokens",
            "usage.prompt_tokens_details.cached_tokens",
        )?
        .unwrap_or(0);
        out.usage_seen = true;
    }
    Ok(())
}

/// A token count of a usage block: absent or null is `None`; anything but a whole number
/// (negative, fractional, a string) is an error naming the field (`name`, its whole path).
fn usage_count(block: &serde_json::Value, field: &str, name: &str) -> Result<Option<u32>, String> {
    match block.get(field) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|n| Some(u32::try_from(n).unwrap_or(u32::MAX)))
            .ok_or_else(|| format!("{name} is not a whole number: {v}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_chunks_fold_into_an_outcome() {
        let mut o = Outcome::default();
        on_chunk(
            Time::from_millis(10),
            br#"{"choices":[{"text":"a"}]}"#,
            &mut o,
        )
        .unwrap();
        on_chunk(
            Time::from_millis(14),
            br#"{"choices":[{"text":"b"}]}"#,
            &mut o,
        )
        .unwrap();
        on_chunk(
            Time::from_millis(20),
            br#"{"choices":[{"text":"c"}]}"#,
            &mut o,
        )
        .unwrap();
        on_chunk(
            Time::from_millis(20),
            br#"{"choices":[],"usage":{"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":16}}}"#,
            &mut o,
        )
        .unwrap();
        assert_eq!(o.first_token, Some(Time::from_millis(10)));
        assert_eq!(o.itl_count, 2);
        assert!((o.itl_sum_ms - 10.0).abs() < 1e-9);
        assert_eq!((o.output_tokens, o.cached_tokens), (3, 16));
        let err = on_chunk(
            Time::ZERO,
            br#"{"error":{"message":"worker died"}}"#,
            &mut o,
        );
        assert!(err.unwrap_err().contains("worker died"));
        assert!(on_chunk(Time::ZERO, b"not json", &mut o).is_err());
    }

    #[test]
    fn a_stream_without_usage_counts_its_text_chunks() {
        let mut o = Outcome::default();
        for t in ["a", "", "b"] {
            let chunk = serde_json::json!({"choices": [{"text": t}]}).to_string();
            on_chunk(Time::ZERO, chunk.as_bytes(), &mut o).unwrap();
        }
        stream_ended(&mut o, true).unwrap();
        assert_eq!(o.output_tokens, 2);
        // With a usage block, its count stands.
        let mut o = Outcome::default();
        on_chunk(Time::ZERO, br#"{"choices":[{"text":"a"}]}"#, &mut o).unwrap();
        on_chunk(Time::ZERO, br#"{"usage":{"completion_tokens":5}}"#, &mut o).unwrap();
        stream_ended(&mut o, true).unwrap();
        assert_eq!(o.output_tokens, 5);
        assert!(stream_ended(&mut Outcome::default(), true)
            .unwrap_err()
            .contains("no token"));
        assert!(stream_ended(&mut o, false).unwrap_err().contains("[DONE]"));
    }

    #[test]
    fn a_usage_count_that_is_no_whole_number_is_an_error_naming_it() {
        for (usage, field) in [
            (r#"{"completion_tokens":-3}"#, "usage.completion_tokens"),
            (r#"{"completion_tokens":2.5}"#, "usage.completion_tokens"),
            (r#"{"completion_tokens":"7"}"#, "usage.completion_tokens"),
            (
                r#"{"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":-1}}"#,
                "usage.prompt_tokens_details.cached_tokens",
            ),
        ] {
            let chunk = format!(r#"{{"choices":[],"usage":{usage}}}"#);
            let err = on_chunk(Time::ZERO, chunk.as_bytes(), &mut Outcome::default());
            assert!(err.unwrap_err().contains(field), "{usage}");
        }
        let mut o = Outcome::default();
        on_chunk(
            Time::ZERO,
            br#"{"usage":{"completion_tokens":null}}"#,
            &mut o,
        )
        .unwrap();
        assert_eq!(o.output_tokens, 0);
    }
}
