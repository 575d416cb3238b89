//! The one OpenAI error shape, and what reading a request body can fail with.

use serde_json::{json, Value};
use std::borrow::Cow;

/// The OpenAI error body: `{"error": {"message", "type", "param", "code"}}`. `code` is the HTTP
/// status. Every error kvrouter answers (router, mock engine, in-band stream errors) is built here.
pub fn error_body(message: &str, kind: &str, param: Option<&str>, code: u16) -> Value {
    json!({"error": {"message": message, "type": kind, "param": param, "code": code}})
}

/// A request body that cannot be read: the client is at fault, retrying elsewhere will not help.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// A field is missing or malformed; `param` names it (`prompt`, `messages[3].content`).
    #[error("{message}")]
    Invalid {
        /// What is wrong.
        message: String,
        /// The offending field.
        param: Option<Cow<'static, str>>,
    },
    /// The model is not served.
    #[error("The model `{0}` does not exist.")]
    UnknownModel(String),
}

impl RequestError {
    /// A malformed field whose name is known at compile time.
    pub fn invalid(message: impl Into<String>, param: &'static str) -> Self {
        RequestError::Invalid {
            message: message.into(),
            param: Some(Cow::Borrowed(param)),
        }
    }

    /// A malformed field whose name is built at run time (`messages[3].content`).
    pub fn invalid_at(message: impl Into<String>, param: String) -> Self {
        RequestError::Invalid {
            message: message.into(),
            param: Some(Cow::Owned(param)),
        }
    }

    /// The field at fault.
    pub fn param(&self) -> Option<&str> {
        match self {
            RequestError::Invalid { param, .. } => param.as_deref(),
            RequestError::UnknownModel(_) => Some("model"),
        }
    }

    /// The HTTP status: 400, or 404 for a model not served.
    pub fn status(&self) -> u16 {
        match self {
            RequestError::Invalid { .. } => 400,
            RequestError::UnknownModel(_) => 404,
        }
    }

    /// The OpenAI-shaped body.
    pub fn body(&self) -> Value {
        error_body(
            &self.to_string(),
            "invalid_request_error",
            self.param(),
            self.status(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_error_body_has_the_openai_shape() {
        let v = error_body("bad", "invalid_request_error", Some("prompt"), 400);
        assert_eq!(
            v,
            json!({"error": {"message": "bad", "type": "invalid_request_error", "param": "prompt", "code": 400}})
        );
        let e = error_body("down", "upstream_error", None, 502);
        assert!(e["error"]["param"].is_null());
        assert_eq!(e["error"].as_object().unwrap().len(), 4);
    }

    #[test]
    fn request_errors_name_their_field_and_status() {
        let e = RequestError::invalid_at("no", "messages[2].content".into());
        assert_eq!(e.body()["error"]["param"], "messages[2].content");
        assert_eq!(e.body()["error"]["code"], 400);
        let m = RequestError::UnknownModel("x".into());
        assert_eq!((m.status(), m.param()), (404, Some("model")));
        assert_eq!(
            m.body()["error"]["message"],
            "The model `x` does not exist."
        );
    }
}
