//! One ext_proc stream: one HTTP request through the gateway, as Envoy sends it (request
//! headers, body chunks, trailers; then response headers, body chunks, trailers). The exchange
//! collects the request until its body is complete, asks its host to place it
//! ([`Step::Place`]), answers the chosen worker in the `x-gateway-destination-endpoint` header
//! and the `envoy.lb` dynamic metadata, and feeds the answer it then sees to the placement,
//! which accounts the first token and the end as a proxied request's guard does.
//!
//! Body modes: `BUFFERED` (and `BUFFERED_PARTIAL`): the destination goes in the body response's
//! header mutation. `FULL_DUPLEX_STREAMED`: nothing is answered until the body is complete;
//! then the headers response (with the destination) and the body, sent back whole. Classic
//! `STREAMED` request bodies cannot carry a body-based destination (Envoy sends the headers on
//! before the body); they are answered as buffered ones.

use crate::pb::envoy::config::core::v3 as core;
use crate::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use crate::pb::envoy::r#type::v3::HttpStatus;
use crate::pb::envoy::service::ext_proc::v3 as ep;
use crate::FailureMode;
use ep::processing_request::Request as In;
use ep::processing_response::Response as Out;
use kvrouter_server::placement::{endpoint_of, Placement};
use kvrouter_server::ServeError;
use prost_types::value::Kind as V;

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
    /// The request is complete: place it and hand the result to [`Exchange::placed`].
    Place {
        headers: http::HeaderMap,
        body: Vec<u8>,
        subset: Option<Vec<String>>,
    },
}

/// Which message completed the request.
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
    headers: http::HeaderMap,
    body: Vec<u8>,
    request_full_duplex: bool,
    response_full_duplex: bool,
    subset: Option<Vec<String>>,
    trigger: Option<Trigger>,
    placement: Option<Placement>,
    response_ok: bool,
}

fn reply(r: Out) -> ep::ProcessingResponse {
    ep::ProcessingResponse {
        response: Some(r),
        ..Default::default()
    }
}

fn common(mutation: Option<ep::HeaderMutation>, body: Option<Vec<u8>>) -> ep::CommonResponse {
    ep::CommonResponse {
        header_mutation: mutation,
        body_mutation: body.map(|b| ep::BodyMutation {
            mutation: Some(ep::body_mutation::Mutation::StreamedResponse(
                ep::StreamedBodyResponse {
                    body: b,
                    end_of_stream: true,
                    ..Default::default()
                },
            )),
        }),
        ..Default::default()
    }
}

fn headers_continue() -> ep::HeadersResponse {
    ep::HeadersResponse {
        response: Some(ep::CommonResponse::default()),
    }
}

fn body_continue() -> ep::BodyResponse {
    ep::BodyResponse {
        response: Some(ep::CommonResponse::default()),
    }
}

/// The headers of an Envoy header map, pseudo-headers (`:path`, `:status`) apart.
fn header_map(h: Option<&core::HeaderMap>) -> (http::HeaderMap, Vec<(String, String)>) {
    let mut out = http::HeaderMap::new();
    let mut pseudo = Vec::new();
    for hv in h.map(|h| h.headers.as_slice()).unwrap_or_default() {
        let value = if hv.raw_value.is_empty() {
            hv.value.as_bytes()
        } else {
            hv.raw_value.as_slice()
        };
        if hv.key.starts_with(':') {
            pseudo.push((hv.key.clone(), String::from_utf8_lossy(value).into_owned()));
            continue;
        }
        if let (Ok(k), Ok(v)) = (
            http::HeaderName::from_bytes(hv.key.as_bytes()),
            http::HeaderValue::from_bytes(value),
        ) {
            out.append(k, v);
        }
    }
    (out, pseudo)
}

/// The subset hint of a request's filter metadata, if any.
fn subset_hint(m: &core::Metadata) -> Option<Vec<String>> {
    let hint = m
        .filter_metadata
        .get(SUBSET_NAMESPACE)?
        .fields
        .get(SUBSET_KEY)?;
    let list = match &hint.kind {
        Some(V::ListValue(l)) => l
            .values
            .iter()
            .filter_map(|v| match &v.kind {
                Some(V::StringValue(s)) => Some(s.clone()),
                _ => None,
            })
            .collect(),
        Some(V::StringValue(s)) => s.split(',').map(|e| e.trim().to_owned()).collect(),
        _ => Vec::new(),
    };
    Some(list)
}

/// The dynamic metadata naming the chosen endpoints.
pub(crate) fn destination_metadata(endpoints: &str) -> prost_types::Struct {
    let inner = prost_types::Struct {
        fields: [(
            DESTINATION.to_owned(),
            prost_types::Value {
                kind: Some(V::StringValue(endpoints.to_owned())),
            },
        )]
        .into(),
    };
    prost_types::Struct {
        fields: [(
            LB_NAMESPACE.to_owned(),
            prost_types::Value {
                kind: Some(V::StructValue(inner)),
            },
        )]
        .into(),
    }
}

fn set_header(key: &str, value: &str) -> ep::HeaderMutation {
    set_headers(&[(key, value)])
}

fn set_headers(pairs: &[(&str, &str)]) -> ep::HeaderMutation {
    let set = pairs
        .iter()
        .map(|(key, value)| core::HeaderValueOption {
            header: Some(core::HeaderValue {
                key: (*key).to_owned(),
                raw_value: value.as_bytes().to_vec(),
                ..Default::default()
            }),
            append_action: core::header_value_option::HeaderAppendAction::OverwriteIfExistsOrAdd
                as i32,
            ..Default::default()
        })
        .collect();
    ep::HeaderMutation {
        set_headers: set,
        remove_headers: Vec::new(),
    }
}

/// The immediate answer for a request that could not be placed: the router's error, with
/// overload shed as 429 (the protocol's "drop this request").
fn immediate(e: &ServeError) -> ep::ProcessingResponse {
    let (status, _, _) = e.parts();
    let code = match status.as_u16() {
        529 => 429,
        c => c,
    };
    reply(Out::ImmediateResponse(ep::ImmediateResponse {
        status: Some(HttpStatus { code: code.into() }),
        headers: Some(set_header("content-type", "application/json")),
        body: e.body().to_string().into_bytes(),
        details: format!("kvrouter: {e}"),
        ..Default::default()
    }))
}

impl Exchange {
    pub(crate) fn new(failure: FailureMode, max_body_bytes: usize) -> Self {
        Self {
            failure,
            max_body_bytes,
            headers: http::HeaderMap::new(),
            body: Vec::new(),
            request_full_duplex: false,
            response_full_duplex: false,
            subset: None,
            trigger: None,
            placement: None,
            response_ok: true,
        }
    }

    fn place(&mut self, trigger: Trigger) -> Step {
        self.trigger = Some(trigger);
        Step::Place {
            headers: std::mem::take(&mut self.headers),
            body: std::mem::take(&mut self.body),
            subset: self.subset.clone(),
        }
    }

    /// Takes one message from the gateway.
    pub(crate) fn on_message(&mut self, msg: ep::ProcessingRequest) -> Step {
        if let Some(c) = &msg.protocol_config {
            let full = BodySendMode::FullDuplexStreamed as i32;
            self.request_full_duplex = c.request_body_mode == full;
            self.response_full_duplex = c.response_body_mode == full;
        }
        if let Some(hint) = msg.metadata_context.as_ref().and_then(subset_hint) {
            self.subset = Some(hint);
        }
        let placed = self.trigger.is_some();
        match msg.request {
            Some(In::RequestHeaders(h)) => {
                self.headers = header_map(h.headers.as_ref()).0;
                if h.end_of_stream {
                    return self.place(Trigger::Headers);
                }
                if self.request_full_duplex {
                    return Step::Reply(Vec::new());
                }
                Step::Reply(vec![reply(Out::RequestHeaders(headers_continue()))])
            }
            Some(In::RequestBody(b)) if !placed => {
                if self.body.len() + b.body.len() > self.max_body_bytes {
                    let e = ServeError::Http {
                        status: http::StatusCode::PAYLOAD_TOO_LARGE,
                        message: format!(
                            "the request body is larger than {} bytes",
                            self.max_body_bytes
                        ),
                    };
                    return Step::Reply(vec![immediate(&e)]);
                }
                self.body.extend_from_slice(&b.body);
                if b.end_of_stream {
                    return self.place(Trigger::Body);
                }
                if self.request_full_duplex {
                    return Step::Reply(Vec::new());
                }
                Step::Reply(vec![reply(Out::RequestBody(body_continue()))])
            }
            Some(In::RequestBody(_)) => Step::Reply(vec![reply(Out::RequestBody(body_continue()))]),
            Some(In::RequestTrailers(_)) if !placed => self.place(Trigger::Trailers),
            Some(In::RequestTrailers(_)) => Step::Reply(vec![reply(Out::RequestTrailers(
                ep::TrailersResponse::default(),
            ))]),
            Some(In::ResponseHeaders(h)) => {
                let (_, pseudo) = header_map(h.headers.as_ref());
                let status = pseudo
                    .iter()
                    .find(|(k, _)| k == ":status")
                    .and_then(|(_, v)| v.parse::<u16>().ok());
                self.response_ok = status.is_none_or(|s| (200..300).contains(&s));
                if h.end_of_stream {
                    self.end();
                }
                Step::Reply(vec![reply(Out::ResponseHeaders(headers_continue()))])
            }
            Some(In::ResponseBody(b)) => {
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
                }
                Step::Reply(vec![reply(Out::ResponseBody(out))])
            }
            Some(In::ResponseTrailers(_)) => {
                self.end();
                Step::Reply(vec![reply(Out::ResponseTrailers(
                    ep::TrailersResponse::default(),
                ))])
            }
            None => Step::Reply(Vec::new()),
        }
    }

    /// The answer ended: the placement's load is released (finished, or failed on a non-2xx).
    fn end(&mut self) {
        if let Some(p) = self.placement.take() {
            p.end(self.response_ok);
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
                FailureMode::Closed => return vec![immediate(&e)],
                // Fail open: the request goes on without a destination (the gateway's own
                // load balancing places it).
                FailureMode::Open => {
                    tracing::warn!("ext_proc: no placement ({e}); failing open");
                    (None, None)
                }
            },
        };
        let trigger = self.trigger.unwrap_or(Trigger::Body);
        let mut out = Vec::new();
        if self.request_full_duplex || trigger == Trigger::Headers {
            let r = ep::HeadersResponse {
                response: Some(common(mutation.clone(), None)),
            };
            out.push(reply(Out::RequestHeaders(r)));
            if self.request_full_duplex && trigger != Trigger::Headers {
                let r = ep::BodyResponse {
                    response: Some(common(None, Some(body))),
                };
                out.push(reply(Out::RequestBody(r)));
            }
        } else {
            let r = ep::BodyResponse {
                response: Some(common(mutation, None)),
            };
            out.push(reply(Out::RequestBody(r)));
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
