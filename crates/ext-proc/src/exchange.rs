//! One ext_proc stream: one HTTP request through the gateway, as Envoy sends it (request
//! headers, body chunks, trailers; then response headers, body chunks, trailers). The exchange
//! collects what it needs of the request, asks its host to place it ([`Step::Place`]), answers
//! the chosen worker in the `x-gateway-destination-endpoint` header and the `envoy.lb` dynamic
//! metadata, and feeds the answer it then sees to the placement, which accounts the first token
//! and the end as a proxied request's guard does.
//!
//! Envoy picks the upstream host when it lets the request headers go on to its router, so the
//! destination must be set before then. Request body modes (the stream's `protocol_config`):
//! - `BUFFERED`, `BUFFERED_PARTIAL` (and no `protocol_config`): Envoy holds the headers until
//!   the body's response; the headers are answered at once, the body placed when complete, and
//!   the destination goes in the body response's header mutation. A `BUFFERED_PARTIAL` body cut
//!   at Envoy's buffer limit (its one message without `end_of_stream`, not whole JSON) is placed
//!   from the headers alone, as in `STREAMED` mode.
//! - `STREAMED`: Envoy sends no body before the headers are answered, and lets the headers go on
//!   (choosing the host) as soon as they are, before any body response. The request is placed
//!   from its headers alone ([`kvrouter_server::placement::place_without_body`]: sessions, pins,
//!   `x-gateway-model-name`, load; no prompt) and the destination goes in the headers response;
//!   body chunks are let through.
//! - `STREAMED` with `send_body_without_waiting_for_header_response`: Envoy streams the body
//!   before the headers are answered and holds the headers until they are. Nothing is answered
//!   until the body is complete (its last chunk, its trailers, or a chunk that completes its
//!   JSON: Envoy sends trailers only after the chunks before them were answered); then the
//!   headers response (with the destination) and one response per body chunk, in order.
//! - `FULL_DUPLEX_STREAMED`: nothing is answered until the body is complete; then the headers
//!   response (with the destination) and the body, sent back whole.
//!
//! The answer ([`Observe`]): with `Full`, every response phase the gateway sends is observed
//! (the first body chunk marks the first token, the end carries the usage). With `Headers`, the
//! response headers' answer asks Envoy for no more of the answer ([`headers_only_override`]),
//! and the answer's end is the gRPC stream's end ([`Exchange::closed`]).

use crate::messages::{
    body_continue, common, destination_metadata, header_map, headers_continue, immediate, reply,
    set_headers, subset_hint,
};
use crate::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use crate::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::HeaderSendMode;
use crate::pb::envoy::extensions::filters::http::ext_proc::v3::ProcessingMode;
use crate::pb::envoy::service::ext_proc::v3 as ep;
use crate::{ExtProcConfig, FailureMode, Observe};
use ep::processing_request::Request as In;
use ep::processing_response::Response as Out;
use kvrouter_server::placement::{endpoint_of, Placement};
use kvrouter_server::ServeError;

/// The header and metadata key of the chosen endpoints.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The chosen worker's id, for a kvrouter frontend behind the gateway (`--router-mode direct`).
pub const WORKER_HEADER: &str = "x-kvrouter-worker-id";
/// The chosen data-parallel rank, with [`WORKER_HEADER`].
pub const RANK_HEADER: &str = "x-kvrouter-dp-rank";
/// The dynamic metadata namespace of the chosen endpoints.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The filter metadata namespace of the subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The subset hint's key: the endpoints the picker must choose from.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";

/// What the host does next.
pub(crate) enum Step {
    /// Send these responses (none: wait for the next message).
    Reply(Vec<ep::ProcessingResponse>),
    /// Place the request and hand the result to [`Exchange::placed`]; `body: None`: from its
    /// headers alone (the body comes after the destination is fixed).
    Place {
        headers: http::HeaderMap,
        body: Option<Vec<u8>>,
        subset: Option<Vec<String>>,
    },
}

/// How Envoy sends the request body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RequestBody {
    /// `BUFFERED`, or not said.
    Buffered,
    /// `BUFFERED_PARTIAL`: one body message, cut at Envoy's buffer limit when larger.
    BufferedPartial,
    /// `STREAMED`: the headers are answered (and go on) before any body is sent.
    Streamed,
    /// `STREAMED` with `send_body_without_waiting_for_header_response`.
    StreamedEarly,
    /// `FULL_DUPLEX_STREAMED`.
    FullDuplex,
}

impl RequestBody {
    fn of(c: &ep::ProtocolConfiguration) -> Self {
        match BodySendMode::try_from(c.request_body_mode) {
            Ok(BodySendMode::FullDuplexStreamed) => Self::FullDuplex,
            Ok(BodySendMode::Streamed) if c.send_body_without_waiting_for_header_response => {
                Self::StreamedEarly
            }
            Ok(BodySendMode::Streamed) => Self::Streamed,
            Ok(BodySendMode::BufferedPartial) => Self::BufferedPartial,
            _ => Self::Buffered,
        }
    }

    /// Whether body chunks wait, unanswered, for the placement.
    fn holds_chunks(self) -> bool {
        matches!(self, Self::StreamedEarly | Self::FullDuplex)
    }
}

/// Which message completed what the placement needs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Trigger {
    Headers,
    Body,
    Trailers,
}

/// The state of one stream.
pub(crate) struct Exchange {
    failure: FailureMode,
    max_body_bytes: usize,
    observe: Observe,
    /// The request body mode as the gateway said it (`protocol_config`), echoed in a mode
    /// override so that it matches an `allowed_override_modes` entry.
    request_body_mode: i32,
    /// Envoy honours a mode override on this stream: not when it sends bodies before the
    /// headers' answer (`send_body_without_waiting_for_header_response`) or either body mode is
    /// `FULL_DUPLEX_STREAMED` (its `Filter::onReceiveMessage` ignores `mode_override` then).
    override_possible: bool,
    /// The response headers were answered with [`headers_only_override`] and no body chunk
    /// came since: the stream's end is the answer's end.
    end_by_close: bool,
    /// The gateway sends nothing more: the answer ended (response headers or a body chunk
    /// with `end_of_stream`, or trailers; none follow an `end_of_stream`), or it was refused
    /// with an immediate response (after which Envoy closes the stream).
    over: bool,
    headers: http::HeaderMap,
    body: Vec<u8>,
    request_body: RequestBody,
    /// Body chunks received and not answered yet (`STREAMED` early bodies).
    held_chunks: usize,
    response_full_duplex: bool,
    subset: Option<Vec<String>>,
    trigger: Option<Trigger>,
    placement: Option<Placement>,
    response_ok: bool,
}

/// Whether `body` is a whole JSON document (checked only when it ends with `}`; read without
/// building it).
fn complete_json(body: &[u8]) -> bool {
    let end = body.iter().rev().find(|b| !b.is_ascii_whitespace());
    end == Some(&b'}') && serde_json::from_slice::<serde::de::IgnoredAny>(body).is_ok()
}

/// The mode override of [`Observe::Headers`], sent on the response headers' answer: no response
/// body, and response trailers if the answer has any. Envoy (`ext_proc.cc`, as of 1.37) applies
/// it in `Filter::onReceiveMessage` when the filter sets `allow_mode_override` (and the override
/// is in `allowed_override_modes`, if that list is set; header modes `DEFAULT` keep the
/// configured ones, body modes are taken as given, hence the request body mode echoed). It then
/// sends no body chunk. It keeps the stream open because trailers are still wanted:
/// `Filter::closeGrpcStreamIfLastRespReceived` closes it after the response headers' answer
/// only when `bodyMode() == NONE && !sendTrailers()`, and `encodeHeaders` only when
/// `noExternalProcess()`. An HTTP/1.1 answer has no trailers, so the stream stays open until
/// the HTTP stream ends: `Filter::onDestroy` calls `closeStreamMaybeGraceful`, which half-closes
/// the stream (`closeStream`) and then resets it (`ProcessorStreamImpl::close`; or, with the
/// runtime flag `ext_proc_graceful_grpc_close`, off by default, waits for the server to close).
/// It does so both when the answer completed and when the downstream client went away, so a
/// cancellation after the response headers cannot be told from a completion.
fn headers_only_override(request_body_mode: i32) -> ProcessingMode {
    ProcessingMode {
        request_body_mode,
        response_body_mode: BodySendMode::None as i32,
        response_trailer_mode: HeaderSendMode::Send as i32,
        ..Default::default()
    }
}

impl Exchange {
    pub(crate) fn new(config: &ExtProcConfig) -> Self {
        Self {
            failure: config.failure_mode,
            max_body_bytes: config.max_body_bytes,
            observe: config.observe,
            request_body_mode: BodySendMode::None as i32,
            override_possible: true,
            end_by_close: false,
            over: false,
            headers: http::HeaderMap::new(),
            body: Vec::new(),
            request_body: RequestBody::Buffered,
            held_chunks: 0,
            response_full_duplex: false,
            subset: None,
            trigger: None,
            placement: None,
            response_ok: true,
        }
    }

    fn place(&mut self, trigger: Trigger, with_body: bool) -> Step {
        self.trigger = Some(trigger);
        let body = std::mem::take(&mut self.body);
        Step::Place {
            headers: std::mem::take(&mut self.headers),
            body: with_body.then_some(body),
            subset: self.subset.clone(),
        }
    }

    /// Takes one message from the gateway.
    pub(crate) fn on_message(&mut self, msg: ep::ProcessingRequest) -> Step {
        if let Some(c) = &msg.protocol_config {
            self.request_body = RequestBody::of(c);
            let full = BodySendMode::FullDuplexStreamed as i32;
            self.response_full_duplex = c.response_body_mode == full;
            self.request_body_mode = c.request_body_mode;
            self.override_possible = !c.send_body_without_waiting_for_header_response
                && c.request_body_mode != full
                && !self.response_full_duplex;
        }
        if let Some(hint) = msg.metadata_context.as_ref().and_then(subset_hint) {
            self.subset = Some(hint);
        }
        let placed = self.trigger.is_some();
        match msg.request {
            Some(In::RequestHeaders(h)) => {
                self.headers = header_map(h.headers.as_ref()).0;
                if h.end_of_stream {
                    // No body follows (`GET /v1/models`): placed from the headers alone, as a
                    // streamed body is (an empty body is not a prompt to refuse).
                    return self.place(Trigger::Headers, false);
                }
                match self.request_body {
                    RequestBody::Streamed => self.place(Trigger::Headers, false),
                    RequestBody::StreamedEarly | RequestBody::FullDuplex => Step::Reply(Vec::new()),
                    RequestBody::Buffered | RequestBody::BufferedPartial => {
                        Step::Reply(vec![reply(Out::RequestHeaders(headers_continue()))])
                    }
                }
            }
            Some(In::RequestBody(b)) if !placed => self.on_body(b),
            Some(In::RequestBody(_)) => Step::Reply(vec![reply(Out::RequestBody(body_continue()))]),
            Some(In::RequestTrailers(_)) if !placed => self.place(Trigger::Trailers, true),
            Some(In::RequestTrailers(_)) => Step::Reply(vec![reply(Out::RequestTrailers(
                ep::TrailersResponse::default(),
            ))]),
            Some(In::ResponseHeaders(h)) => {
                let (headers, pseudo) = header_map(h.headers.as_ref());
                let status = pseudo
                    .iter()
                    .find(|(k, _)| k == ":status")
                    .and_then(|(_, v)| v.parse::<u16>().ok());
                self.response_ok = status.is_none_or(|s| (200..300).contains(&s));
                if let (Some(p), Some(status)) = (self.placement.as_mut(), status) {
                    let stream = headers
                        .get(http::header::CONTENT_TYPE)
                        .and_then(|v| v.to_str().ok())
                        .is_some_and(|v| v.starts_with("text/event-stream"));
                    p.answered(status, stream);
                }
                let mut out = reply(Out::ResponseHeaders(headers_continue()));
                if h.end_of_stream {
                    self.end();
                    self.over = true;
                } else if self.observe == Observe::Headers && self.override_possible {
                    // The answer began; its body will not be seen.
                    if let Some(p) = self.placement.as_mut() {
                        p.first_token();
                    }
                    out.mode_override = Some(headers_only_override(self.request_body_mode));
                    self.end_by_close = self.placement.is_some();
                }
                Step::Reply(vec![out])
            }
            Some(In::ResponseBody(b)) => Step::Reply(vec![self.on_response_body(b)]),
            Some(In::ResponseTrailers(_)) => {
                self.end();
                self.over = true;
                Step::Reply(vec![reply(Out::ResponseTrailers(
                    ep::TrailersResponse::default(),
                ))])
            }
            None => Step::Reply(Vec::new()),
        }
    }

    /// A chunk of the request body, before the request was placed.
    fn on_body(&mut self, b: ep::HttpBody) -> Step {
        if self.body.len() + b.body.len() > self.max_body_bytes {
            let e = ServeError::Http {
                status: http::StatusCode::PAYLOAD_TOO_LARGE,
                message: format!(
                    "the request body is larger than {} bytes",
                    self.max_body_bytes
                ),
            };
            self.over = true;
            return Step::Reply(vec![immediate(&e)]);
        }
        if self.body.is_empty() {
            // The usual case, the whole body in one message: taken, not copied.
            self.body = b.body;
        } else {
            self.body.extend_from_slice(&b.body);
        }
        let early = self.request_body == RequestBody::StreamedEarly;
        if early {
            self.held_chunks += 1;
        }
        if b.end_of_stream || (early && complete_json(&self.body)) {
            return self.place(Trigger::Body, true);
        }
        if self.request_body == RequestBody::BufferedPartial {
            // The one body message of this mode, and no end: either trailers follow, or Envoy
            // cut the body at its buffer limit and sends no more. A cut body cannot be read:
            // the request is placed from its headers then.
            let whole = complete_json(&self.body);
            return self.place(Trigger::Body, whole);
        }
        if self.request_body.holds_chunks() {
            return Step::Reply(Vec::new());
        }
        Step::Reply(vec![reply(Out::RequestBody(body_continue()))])
    }

    /// A chunk of the answer: accounted, and let through (sent back in full-duplex mode).
    fn on_response_body(&mut self, b: ep::HttpBody) -> ep::ProcessingResponse {
        // A chunk after the override: the gateway did not take it (no `allow_mode_override`),
        // and the answer is observed in full.
        self.end_by_close = false;
        if let Some(p) = self.placement.as_mut() {
            if !b.body.is_empty() {
                p.on_chunk(&b.body);
            }
        }
        let eos = b.end_of_stream;
        let out = if self.response_full_duplex {
            let mut r = ep::BodyResponse {
                response: Some(common(None, Some(b.body))),
            };
            if let Some(ep::body_mutation::Mutation::StreamedResponse(s)) = r
                .response
                .as_mut()
                .and_then(|c| c.body_mutation.as_mut())
                .and_then(|m| m.mutation.as_mut())
            {
                s.end_of_stream = eos;
            }
            r
        } else {
            body_continue()
        };
        if eos {
            self.end();
            self.over = true;
        }
        reply(Out::ResponseBody(out))
    }

    /// The answer ended: the placement's load is released (finished, or failed on a non-2xx).
    fn end(&mut self) {
        if let Some(p) = self.placement.take() {
            if self.end_by_close {
                // Trailers after the override: no body was seen, its length is not known.
                p.end_unmeasured(self.response_ok);
            } else {
                p.end(self.response_ok);
            }
        }
    }

    /// Whether the gateway sends nothing more on this stream: the picker may end its side
    /// with its last answer (one write for both).
    pub(crate) fn over(&self) -> bool {
        self.over
    }

    /// The gateway closed (or reset) the stream (called on drop). After the response headers
    /// were answered with [`headers_only_override`] that is the answer's end (see there);
    /// otherwise the answer had not ended, and dropping the placement releases its load as
    /// cancelled.
    fn closed(&mut self) {
        if self.end_by_close {
            self.end();
        }
    }

    /// The request was placed (or not): the responses that name the destination, or refuse.
    /// `body` is the request body, sent back whole in full-duplex mode.
    pub(crate) fn placed(
        &mut self,
        result: Result<Placement, ServeError>,
        body: Vec<u8>,
    ) -> Vec<ep::ProcessingResponse> {
        let (mutation, metadata) = match result {
            Ok(p) => {
                let endpoints: Vec<String> = std::iter::once(p.url())
                    .chain(p.fallback_urls().iter().map(String::as_str))
                    .filter_map(endpoint_of)
                    .collect();
                let endpoints = endpoints.join(",");
                // The worker id and rank too, for a kvrouter frontend behind the gateway in
                // `--router-mode direct` (the selection is made once, here).
                let (worker, rank) = (p.worker().to_string(), p.dp_rank().to_string());
                let mutation = set_headers(&[
                    (DESTINATION, &endpoints),
                    (WORKER_HEADER, &worker),
                    (RANK_HEADER, &rank),
                ]);
                self.placement = Some(p);
                (Some(mutation), Some(destination_metadata(&endpoints)))
            }
            Err(e) => match self.failure {
                FailureMode::Closed => {
                    self.over = true;
                    return vec![immediate(&e)];
                }
                // Fail open: the request goes on without a destination (the gateway's own
                // load balancing places it).
                FailureMode::Open => {
                    tracing::warn!("ext_proc: no placement ({e}); failing open");
                    (None, None)
                }
            },
        };
        let trigger = self.trigger.unwrap_or(Trigger::Body);
        let headers_response = |mutation| {
            reply(Out::RequestHeaders(ep::HeadersResponse {
                response: Some(common(mutation, None)),
            }))
        };
        let mut out = Vec::new();
        match (trigger, self.request_body) {
            (Trigger::Headers, _) => out.push(headers_response(mutation)),
            (_, RequestBody::FullDuplex) => {
                out.push(headers_response(mutation));
                let r = ep::BodyResponse {
                    response: Some(common(None, Some(body))),
                };
                out.push(reply(Out::RequestBody(r)));
            }
            (_, RequestBody::StreamedEarly) => {
                out.push(headers_response(mutation));
                // Each chunk held gets its own response, in order.
                for _ in 0..std::mem::take(&mut self.held_chunks) {
                    out.push(reply(Out::RequestBody(body_continue())));
                }
            }
            (_, RequestBody::Buffered | RequestBody::BufferedPartial | RequestBody::Streamed) => {
                let r = ep::BodyResponse {
                    response: Some(common(mutation, None)),
                };
                out.push(reply(Out::RequestBody(r)));
            }
        }
        if trigger == Trigger::Trailers {
            out.push(reply(Out::RequestTrailers(ep::TrailersResponse::default())));
        }
        if let Some(first) = out.first_mut() {
            first.dynamic_metadata = metadata;
        }
        out
    }
}

impl Drop for Exchange {
    /// Envoy's close is a half-close and a reset in a row: when the reset arrives first, the
    /// server drops the stream's response without reading the half-close.
    fn drop(&mut self) {
        self.closed();
    }
}
