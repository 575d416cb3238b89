//! Who may call what: the admin API's bearer token (checked by a layer in front of every admin
//! route, before its path or body is parsed), the data plane's API keys (`--api-key`) and the
//! optional protection of the session-release and pick endpoints. Tokens are compared in
//! constant time.

use crate::config::SessionReleaseAuth;
use crate::error::ServeError;
use crate::state::AppState;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// Whether `a` equals `b`, in a time that depends only on their lengths (not on where they
/// first differ), so a caller cannot learn a token byte by byte.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    let n = a.len().max(b.len());
    for i in 0..n {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= x ^ y;
    }
    std::hint::black_box(diff) == 0
}

/// The token of `Authorization: Bearer <token>` ([`kvrouter_openai::bearer_token`]).
fn bearer(headers: &HeaderMap) -> Option<&[u8]> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| kvrouter_openai::bearer_token(v.as_bytes()))
}

/// Checks `Authorization: Bearer <admin token>`. With no admin token configured the admin API
/// does not exist (404).
fn check_admin(s: &AppState, headers: &HeaderMap) -> Result<(), ServeError> {
    let Some(token) = &s.inner.config.admin_token else {
        return Err(ServeError::NotFound(
            "the admin API is off (start with --admin-token)".into(),
        ));
    };
    match bearer(headers) {
        Some(given) if constant_time_eq(given, token.as_bytes()) => Ok(()),
        _ => Err(ServeError::Unauthorized),
    }
}

/// Layer of the data plane with `--api-key` (the OpenAI endpoints, the pick API, session
/// release): the request needs one of the API keys, or the admin token (whose holder may do
/// everything). Otherwise a 401 with `WWW-Authenticate: Bearer`, before the body is read.
pub(crate) async fn api_key(State(s): State<AppState>, request: Request, next: Next) -> Response {
    let config = &s.inner.config;
    keyed(
        config.api_keys.iter().chain(&config.admin_token),
        request,
        next,
    )
    .await
}

/// The same for `serve --global`, taking only the API keys: the client's `authorization` goes
/// on to the clusters, and the global router's admin token must not.
pub(crate) async fn api_key_only(
    State(s): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    keyed(s.inner.config.api_keys.iter(), request, next).await
}

/// Serves `request` when its bearer token is one of `keys`, else a 401 (which names the
/// `Bearer` scheme, as every 401 does).
async fn keyed<'a>(
    keys: impl Iterator<Item = &'a String>,
    request: Request,
    next: Next,
) -> Response {
    let allowed = bearer(request.headers()).is_some_and(|given| {
        // Every key is compared, so the time does not tell which one matched.
        keys.fold(false, |ok, key| {
            constant_time_eq(given, key.as_bytes()) | ok
        })
    });
    match allowed {
        true => next.run(request).await,
        false => ServeError::Unauthorized.into_response(),
    }
}

/// Layer of the admin router: a missing or wrong token is a 401 whatever the path or body.
pub(crate) async fn admin(State(s): State<AppState>, request: Request, next: Next) -> Response {
    match check_admin(&s, request.headers()) {
        Ok(()) => next.run(request).await,
        Err(e) => e.into_response(),
    }
}

/// Layer of `DELETE /v1/sessions/{id}` and `POST /finish_session`: open to every client by
/// default; with `--session-release-auth admin` they need the admin token.
pub(crate) async fn session_release(
    State(s): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let rule = s.inner.config.session_release_auth;
    guarded(rule, &s, request, next).await
}

/// Layer of the pick API (`POST /v1/pick` and its reports): open by default; with
/// `--pick-auth admin` every call needs the admin token.
pub(crate) async fn pick(State(s): State<AppState>, request: Request, next: Next) -> Response {
    let rule = s.inner.config.picks.auth;
    guarded(rule, &s, request, next).await
}

async fn guarded(rule: SessionReleaseAuth, s: &AppState, request: Request, next: Next) -> Response {
    if rule == SessionReleaseAuth::Admin {
        if let Err(e) = check_admin(s, request.headers()) {
            // Without an admin token nobody may call it: 401, not "admin API off".
            let e = match e {
                ServeError::NotFound(_) => ServeError::Unauthorized,
                e => e,
            };
            return e.into_response();
        }
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::constant_time_eq;

    #[test]
    fn constant_time_eq_is_equality() {
        assert!(constant_time_eq(b"", b""));
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"secret2", b"secret"));
        assert!(!constant_time_eq(b"", b"x"));
        // Differing lengths whose common prefix matches and the rest is zero bytes.
        assert!(!constant_time_eq(b"a", b"a\0"));
    }
}
