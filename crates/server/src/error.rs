//! The one mapping from errors to HTTP status codes and OpenAI-shaped bodies.

use axum::extract::OriginalUri;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kvrouter_core::router::RouteError;
use std::borrow::Cow;

/// Everything a request can fail with, and whose fault it is.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ServeError {
    /// The client sent something invalid; `param` names the field.
    #[error("{message}")]
    Invalid {
        /// What is wrong.
        message: String,
        /// The offending field (a body field such as `messages[0].content`, or a header name).
        param: Option<Cow<'static, str>>,
    },
    /// The model is not served.
    #[error("The model `{0}` does not exist.")]
    UnknownModel(String),
    /// Routing failed (no workers, all overloaded, bad pin).
    #[error("{0}")]
    Route(RouteError),
    /// Refused under overload (queue full, or every worker busy with `--reject-when-overloaded`):
    /// HTTP 529 with `Retry-After`, so the caller retries under its own policy.
    #[error("{0}; retry later")]
    Rejected(RouteError),
    /// Every attempt at an upstream failed before answering.
    #[error("upstream worker failed: {0}")]
    Upstream(String),
    /// Nothing can take the request now (the global router has no available cluster).
    #[error("{0}; retry later")]
    Unavailable(String),
    /// Missing or wrong admin token.
    #[error("missing or invalid bearer token")]
    Unauthorized,
    /// An admin resource that does not exist.
    #[error("{0}")]
    NotFound(String),
    /// An admin action that clashes with one already running.
    #[error("{0}")]
    Conflict(String),
    /// Something a request names does not exist (a policy version no weight source has);
    /// `param` names the field.
    #[error("{message}")]
    Missing {
        /// What is missing.
        message: String,
        /// The field that names it.
        param: &'static str,
    },
    /// An admin resource that clashes with one that exists (a worker URL registered twice);
    /// `param` names the field.
    #[error("{message}")]
    Exists {
        /// What clashes.
        message: String,
        /// The field that clashes.
        param: &'static str,
    },
    /// The HTTP request itself was refused before any handler ran (unknown route, method not
    /// allowed, body or headers too large); `status` is the HTTP status to answer.
    #[error("{message}")]
    Http {
        /// The HTTP status (4xx).
        status: StatusCode,
        /// What was refused.
        message: String,
    },
}

impl ServeError {
    /// A client error naming a field.
    pub fn invalid(message: impl Into<String>, param: Option<&'static str>) -> Self {
        ServeError::Invalid {
            message: message.into(),
            param: param.map(Cow::Borrowed),
        }
    }

    /// A client error naming a field whose name is built at run time (`messages[3].content`).
    pub fn invalid_at(message: impl Into<String>, param: String) -> Self {
        ServeError::Invalid {
            message: message.into(),
            param: Some(Cow::Owned(param)),
        }
    }

    /// HTTP status, OpenAI error type and param.
    pub fn parts(&self) -> (StatusCode, &'static str, Option<&str>) {
        match self {
            ServeError::Invalid { param, .. } => (
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                param.as_deref(),
            ),
            ServeError::UnknownModel(_) => (
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                Some("model"),
            ),
            ServeError::Route(e) if e.is_client_error() => {
                // Only a pin names a rank, and `direct` mode needs one: the header is the field.
                let param = match e {
                    RouteError::MissingTarget => Some("x-kvrouter-worker-id"),
                    RouteError::UnknownRank(_) => Some("x-kvrouter-dp-rank"),
                    _ => None,
                };
                (StatusCode::BAD_REQUEST, "invalid_request_error", param)
            }
            ServeError::Route(RouteError::DeadlineExceeded) => {
                (StatusCode::GATEWAY_TIMEOUT, "deadline_exceeded", None)
            }
            ServeError::Route(_) => (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", None),
            ServeError::Rejected(_) => (overloaded(), "overloaded", None),
            ServeError::Upstream(_) => (StatusCode::BAD_GATEWAY, "upstream_error", None),
            ServeError::Unavailable(_) => {
                (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", None)
            }
            ServeError::Unauthorized => (StatusCode::UNAUTHORIZED, "authentication_error", None),
            ServeError::NotFound(_) => (StatusCode::NOT_FOUND, "invalid_request_error", None),
            ServeError::Conflict(_) => (StatusCode::CONFLICT, "conflict", None),
            ServeError::Exists { param, .. } => (StatusCode::CONFLICT, "conflict", Some(*param)),
            ServeError::Missing { param, .. } => {
                (StatusCode::NOT_FOUND, "invalid_request_error", Some(*param))
            }
            // A bound of the router's own (`--pick-max-outstanding`): overload, as a full queue.
            ServeError::Http { status, .. } if *status == overloaded() => {
                (*status, "overloaded", None)
            }
            ServeError::Http { status, .. } => (*status, "invalid_request_error", None),
        }
    }

    /// The label used in `kvrouter_requests_total{status=...}`.
    pub fn status_label(&self) -> &'static str {
        match self {
            ServeError::Invalid { .. }
            | ServeError::UnknownModel(_)
            | ServeError::Unauthorized
            | ServeError::NotFound(_)
            | ServeError::Conflict(_)
            | ServeError::Exists { .. }
            | ServeError::Missing { .. }
            | ServeError::Http { .. } => "client_error",
            ServeError::Route(e) if e.is_client_error() => "client_error",
            ServeError::Route(RouteError::DeadlineExceeded) => "deadline_exceeded",
            ServeError::Route(_) => "unavailable",
            ServeError::Rejected(_) => "rejected",
            ServeError::Upstream(_) => "upstream_error",
            ServeError::Unavailable(_) => "unavailable",
        }
    }

    /// The OpenAI-shaped body.
    pub fn body(&self) -> serde_json::Value {
        let (status, kind, param) = self.parts();
        kvrouter_openai::error_body(&self.to_string(), kind, param, status.as_u16())
    }
}

impl From<kvrouter_openai::RequestError> for ServeError {
    fn from(e: kvrouter_openai::RequestError) -> Self {
        match e {
            kvrouter_openai::RequestError::Invalid { message, param } => {
                ServeError::Invalid { message, param }
            }
            kvrouter_openai::RequestError::UnknownModel(m) => ServeError::UnknownModel(m),
        }
    }
}

/// 529, the status the seeds' frontend answers when it sheds load.
pub(crate) fn overloaded() -> StatusCode {
    StatusCode::from_u16(529).expect("529 is a valid status code")
}

/// Seconds a rejected client should wait before retrying.
pub(crate) const RETRY_AFTER_SECS: u64 = 1;

impl IntoResponse for ServeError {
    fn into_response(self) -> Response {
        let (status, _, _) = self.parts();
        let mut response = (status, axum::Json(self.body())).into_response();
        if status == overloaded() {
            response
                .headers_mut()
                .insert(axum::http::header::RETRY_AFTER, RETRY_AFTER_SECS.into());
        }
        // RFC 9110: a 401 names the scheme it wants.
        if status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                axum::http::header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static("Bearer"),
            );
        }
        response
    }
}

/// The answer to a path no route serves: a 404 in the OpenAI shape. The path is the one the
/// client sent (a nested router such as `/admin` sees it without its prefix).
pub(crate) async fn unknown_route(OriginalUri(uri): OriginalUri) -> ServeError {
    ServeError::Http {
        status: StatusCode::NOT_FOUND,
        message: format!("no route for {}", uri.path()),
    }
}

/// The answer to a known path with the wrong method: a 405 in the OpenAI shape.
pub(crate) async fn wrong_method(
    method: axum::http::Method,
    OriginalUri(uri): OriginalUri,
) -> ServeError {
    ServeError::Http {
        status: StatusCode::METHOD_NOT_ALLOWED,
        message: format!("{method} is not allowed on {}", uri.path()),
    }
}

/// The body of an admin request as `T`: a 400 naming the field that does not fit (`dp_size`,
/// `labels.a`), not only the line and column.
pub(crate) fn parse_json<T: serde::de::DeserializeOwned>(
    body: &[u8],
    what: &str,
) -> Result<T, ServeError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let message = format!("invalid {what}: {}", e.inner());
        // "." is the whole body; "?" is a place the parser could not name (a body cut short).
        if path == "." || path == "?" {
            ServeError::invalid(message, None)
        } else {
            ServeError::invalid_at(format!("{message} (field `{path}`)"), path)
        }
    })?;
    // One JSON value and nothing after it: a second object would otherwise be dropped unread.
    de.end()
        .map_err(|e| ServeError::invalid(format!("invalid {what}: {e}"), None))?;
    Ok(value)
}

/// Most request headers the router reads; more is a 431 (hyper's own, wordless 431 is set
/// higher in the serve loop, as a backstop).
pub(crate) const MAX_REQUEST_HEADERS: usize = 100;
/// Most bytes of request header names and values together; more is a 431.
pub(crate) const MAX_REQUEST_HEADER_BYTES: usize = 64 * 1024;

/// Longest request target (path and query) the router reads; longer is a 414. hyper's own,
/// wordless 414 (the `http` crate's limit, about 64 KiB) stays above it.
pub(crate) const MAX_URI_BYTES: usize = 8 * 1024;

/// The refusal of a request with a too long URI, too many or too large headers (an
/// OpenAI-shaped 414 or 431), or a body announced past the limit (413), before any handler
/// reads it; `None` for a request within every limit. The router's edge asks it first
/// (`edge.rs`).
pub(crate) fn head_refusal<B>(request: &axum::http::Request<B>) -> Option<Response> {
    let uri_bytes = request
        .uri()
        .path_and_query()
        .map_or(0, |p| p.as_str().len());
    let refusal = |status, message| Some(ServeError::Http { status, message }.into_response());
    if uri_bytes > MAX_URI_BYTES {
        return refusal(
            StatusCode::URI_TOO_LONG,
            format!("request URI too long: {uri_bytes} bytes (at most {MAX_URI_BYTES})"),
        );
    }
    let headers = request.headers();
    let bytes: usize = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len())
        .sum();
    if headers.len() > MAX_REQUEST_HEADERS || bytes > MAX_REQUEST_HEADER_BYTES {
        let message = format!(
            "request headers too large: {} headers, {bytes} bytes (at most {MAX_REQUEST_HEADERS} \
             headers and {MAX_REQUEST_HEADER_BYTES} bytes)",
            headers.len()
        );
        return refusal(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, message);
    }
    // A body announced past the limit is refused before any of it is read.
    let limit = kvrouter_openai::MAX_REQUEST_BODY_BYTES as u64;
    let announced = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if let Some(n) = announced.filter(|n| *n > limit) {
        return refusal(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body too large: {n} bytes announced (at most {limit})"),
        );
    }
    // The body is read as it comes: a compressed one was parsed as if plain (a gzip body was
    // "not valid JSON"; one marked `br` but plain was taken). Every coding named, in every
    // `content-encoding` header, must be `identity`; only where a body is read.
    let reads_body = matches!(
        *request.method(),
        axum::http::Method::POST | axum::http::Method::PUT | axum::http::Method::PATCH
    );
    let coded = headers
        .get_all(axum::http::header::CONTENT_ENCODING)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .map(<[u8]>::trim_ascii)
        .find(|c| !c.is_empty() && !c.eq_ignore_ascii_case(b"identity"));
    if let (true, Some(coding)) = (reads_body, coded) {
        let message = format!(
            "content-encoding {:?} is not supported: send the body uncompressed",
            String::from_utf8_lossy(coding)
        );
        let status = StatusCode::UNSUPPORTED_MEDIA_TYPE;
        let body = kvrouter_openai::error_body(
            &message,
            "invalid_request_error",
            Some("content-encoding"),
            status.as_u16(),
        );
        return Some((status, axum::Json(body)).into_response());
    }
    None
}

/// [`head_refusal`] as an axum layer, for routers without `serve`'s edge (`serve --global`).
pub(crate) async fn head_checked(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match head_refusal(&request) {
        Some(refused) => refused,
        None => next.run(request).await,
    }
}

/// Largest body of a plain-text rejection that is read to become the message.
const REJECTION_TEXT_BYTES: usize = 4096;

/// The header naming the cluster a global router's answer came from (`serve --global`).
pub(crate) const CLUSTER_HEADER: &str = "x-kvrouter-cluster";

/// Response-mapping layer: axum's built-in rejections (a body over the limit, a malformed path
/// parameter, a wrong method, ...) answer plain text or nothing; they become OpenAI-shaped JSON
/// with the same status (and `Allow`, `Retry-After` kept). Upstream answers passed through
/// (they carry `x-kvrouter-worker`, or a cluster's `x-kvrouter-cluster` under `--global`) and
/// JSON answers are left alone.
pub(crate) async fn shape_rejections(response: Response) -> Response {
    if is_shaped(&response) {
        return response;
    }
    shaped(response).await
}

/// Whether `response` goes out as it is: no error, JSON already, or an upstream's answer
/// passed through ([`shape_rejections`]).
pub(crate) fn is_shaped(response: &Response) -> bool {
    let status = response.status();
    let headers = response.headers();
    let is_json = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("application/json"));
    !(status.is_client_error() || status.is_server_error())
        || is_json
        || headers.contains_key("x-kvrouter-worker")
        || headers.contains_key(CLUSTER_HEADER)
}

/// The OpenAI-shaped error for a rejection that [`is_shaped`] does not pass: its plain-text
/// body (up to [`REJECTION_TEXT_BYTES`]) becomes the message.
pub(crate) async fn shaped(response: Response) -> Response {
    use axum::http::header;
    let status = response.status();
    let (parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, REJECTION_TEXT_BYTES)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_owned())
        .unwrap_or_default();
    let message = if text.is_empty() {
        status.canonical_reason().unwrap_or("error").to_owned()
    } else {
        text
    };
    let mut out = ServeError::Http { status, message }.into_response();
    for name in [header::ALLOW, header::RETRY_AFTER, header::WWW_AUTHENTICATE] {
        if let Some(v) = parts.headers.get(&name) {
            out.headers_mut().insert(name, v.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_maps_to_a_status_and_names_its_field() {
        let e = ServeError::invalid("bad", Some("messages"));
        assert_eq!(e.parts().0, StatusCode::BAD_REQUEST);
        assert_eq!(e.body()["error"]["param"], "messages");
        assert_eq!(
            ServeError::UnknownModel("x".into()).parts().0,
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            ServeError::Route(RouteError::AllEligibleWorkersOverloaded)
                .parts()
                .0,
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(
            ServeError::Route(RouteError::MissingTarget).parts(),
            (
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Some("x-kvrouter-worker-id")
            )
        );
        assert_eq!(
            ServeError::Upstream("reset".into()).parts().0,
            StatusCode::BAD_GATEWAY
        );
        assert_eq!(ServeError::Unauthorized.parts().0, StatusCode::UNAUTHORIZED);
        let rejected = ServeError::Rejected(RouteError::QueueFull {
            requests: 3,
            tokens: 10,
        });
        assert_eq!(rejected.parts().0.as_u16(), 529);
        assert_eq!(rejected.into_response().headers()["retry-after"], "1");
        assert_eq!(
            ServeError::Route(RouteError::DeadlineExceeded).parts().0,
            StatusCode::GATEWAY_TIMEOUT
        );
    }

    #[test]
    fn an_admin_body_is_one_json_value_and_a_cut_one_names_no_field() {
        #[derive(Debug, serde::Deserialize)]
        struct Add {
            #[allow(dead_code)]
            url: String,
        }
        parse_json::<Add>(br#" {"url":"http://a"} "#, "worker").unwrap();
        // A second object was dropped unread (the first worker registered, the second lost).
        let e =
            parse_json::<Add>(br#"{"url":"http://a"}{"url":"http://b"}"#, "worker").unwrap_err();
        assert_eq!(e.parts().0, StatusCode::BAD_REQUEST);
        assert!(e.body()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("trailing characters"));
        let e = parse_json::<Add>(br#"{"url":"http://a"} xyz"#, "worker").unwrap_err();
        assert_eq!(e.parts().0, StatusCode::BAD_REQUEST);
        // A body cut short has no field to name: no `?` as the parameter.
        let e = parse_json::<Add>(b"{", "worker").unwrap_err();
        assert!(e.body()["error"]["param"].is_null(), "{}", e.body());
        assert!(!e.body()["error"]["message"].as_str().unwrap().contains('?'));
    }

    /// A cluster's answer passed through by the global router (or a worker's by the router) goes
    /// back as it was, its header kept; the router's own plain-text refusals become JSON, and a
    /// full pick table is overload, as a full queue.
    #[tokio::test]
    async fn passed_through_answers_are_left_alone_and_rejections_shaped() {
        use axum::http::header::CONTENT_TYPE;
        let plain = |extra: Option<&'static str>| {
            let mut r = (StatusCode::INTERNAL_SERVER_ERROR, "<html>oops</html>").into_response();
            r.headers_mut()
                .insert(CONTENT_TYPE, "text/html".parse().unwrap());
            if let Some(name) = extra {
                r.headers_mut().insert(name, "a".parse().unwrap());
            }
            r
        };
        for name in [CLUSTER_HEADER, "x-kvrouter-worker"] {
            let out = shape_rejections(plain(Some(name))).await;
            assert_eq!(out.headers()[name], "a");
            let body = axum::body::to_bytes(out.into_body(), 1 << 10)
                .await
                .unwrap();
            assert_eq!(&body[..], b"<html>oops</html>");
        }
        let out = shape_rejections(plain(None)).await;
        assert_eq!(out.headers()[CONTENT_TYPE], "application/json");
        let full = ServeError::Http {
            status: overloaded(),
            message: "full".into(),
        };
        assert_eq!(full.body()["error"]["type"], "overloaded");
    }
}
