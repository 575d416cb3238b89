//! The one mapping from errors to HTTP status codes and OpenAI-shaped error bodies.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use std::borrow::Cow;

/// An error answered to the client.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
    pub(crate) kind: &'static str,
    pub(crate) param: Option<Cow<'static, str>>,
}

impl ApiError {
    /// The client sent something invalid; `param` names the offending field.
    pub(crate) fn invalid(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(Cow::Borrowed),
        }
    }

    /// A body that is no JSON.
    pub(crate) fn not_json(e: serde_json::Error) -> Self {
        Self::invalid(format!("the body is not valid JSON: {e}"), None)
    }

    /// A body that is JSON but no object.
    pub(crate) fn not_an_object() -> Self {
        Self::invalid("the body must be a JSON object", None)
    }

    /// No such route.
    pub(crate) fn not_found(message: String) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message,
            kind: "invalid_request_error",
            param: None,
        }
    }

    /// A known route with the wrong method.
    pub(crate) fn method_not_allowed(message: String) -> Self {
        Self {
            status: StatusCode::METHOD_NOT_ALLOWED,
            message,
            kind: "invalid_request_error",
            param: None,
        }
    }

    /// A `/v1` call without the engine's API key.
    pub(crate) fn unauthorized() -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            message: "missing or invalid API key (Authorization: Bearer <key>)".into(),
            kind: "authentication_error",
            param: None,
        }
    }

    /// A body past the engine's bound.
    pub(crate) fn too_large(limit: usize) -> Self {
        Self {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("request body too large (at most {limit} bytes)"),
            kind: "invalid_request_error",
            param: None,
        }
    }

    /// The engine failed.
    pub(crate) fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "internal_error",
            param: None,
        }
    }

    pub(crate) fn body(&self) -> serde_json::Value {
        kvrouter_openai::error_body(
            &self.message,
            self.kind,
            self.param.as_deref(),
            self.status.as_u16(),
        )
    }
}

impl From<kvrouter_openai::RequestError> for ApiError {
    fn from(e: kvrouter_openai::RequestError) -> Self {
        let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::BAD_REQUEST);
        let message = e.to_string();
        let param = match e {
            kvrouter_openai::RequestError::Invalid { param, .. } => param,
            kvrouter_openai::RequestError::UnknownModel(_) => Some(Cow::Borrowed("model")),
        };
        Self {
            status,
            message,
            kind: "invalid_request_error",
            param,
        }
    }
}

/// The body limit's refusal (axum answers it as plain text) as an OpenAI error, bounded as
/// the router's bodies are.
pub(crate) async fn shape_too_large(response: Response) -> Response {
    if response.status() == StatusCode::PAYLOAD_TOO_LARGE {
        return ApiError::too_large(kvrouter_openai::MAX_REQUEST_BODY_BYTES).into_response();
    }
    response
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}
