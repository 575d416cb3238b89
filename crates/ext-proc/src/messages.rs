//! The ext_proc messages the exchange reads and answers: Envoy's header maps and the subset
//! hint in, header mutations, the destination's dynamic metadata and immediate responses out.

use crate::exchange::{DESTINATION, LB_NAMESPACE, SUBSET_KEY, SUBSET_NAMESPACE};
use crate::pb::envoy::config::core::v3 as core;
use crate::pb::envoy::r#type::v3::HttpStatus;
use crate::pb::envoy::service::ext_proc::v3 as ep;
use ep::processing_response::Response as Out;
use kvrouter_server::ServeError;
use prost_types::value::Kind as V;

pub(crate) fn reply(r: Out) -> ep::ProcessingResponse {
    ep::ProcessingResponse {
        response: Some(r),
        ..Default::default()
    }
}

pub(crate) fn common(
    mutation: Option<ep::HeaderMutation>,
    body: Option<Vec<u8>>,
) -> ep::CommonResponse {
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

pub(crate) fn headers_continue() -> ep::HeadersResponse {
    ep::HeadersResponse {
        response: Some(ep::CommonResponse::default()),
    }
}

pub(crate) fn body_continue() -> ep::BodyResponse {
    ep::BodyResponse {
        response: Some(ep::CommonResponse::default()),
    }
}

/// The headers of an Envoy header map, pseudo-headers (`:path`, `:status`) apart.
pub(crate) fn header_map(h: Option<&core::HeaderMap>) -> (http::HeaderMap, Vec<(String, String)>) {
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
pub(crate) fn subset_hint(m: &core::Metadata) -> Option<Vec<String>> {
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

pub(crate) fn set_header(key: &str, value: &str) -> ep::HeaderMutation {
    set_headers(&[(key, value)])
}

pub(crate) fn set_headers(pairs: &[(&str, &str)]) -> ep::HeaderMutation {
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
pub(crate) fn immediate(e: &ServeError) -> ep::ProcessingResponse {
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
