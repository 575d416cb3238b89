//! `kvrouter bench --pick`: each request asks the router's pick API where to go, is sent to
//! that worker directly, and its first token and finish are reported back.

use super::client::{Outcome, Shared};

/// Where the router placed a request.
pub(super) struct Picked {
    id: String,
    /// The router that handed out the pick (its reports go there: picks are per replica).
    router: String,
    pub(super) url: String,
    pub(super) worker: usize,
}

/// `POST /v1/pick` with the request's body and headers.
pub(super) async fn pick(
    shared: &Shared,
    body: &serde_json::Value,
    headers: &[(&'static str, String)],
    out: &mut Outcome,
) -> Result<Picked, String> {
    let router = shared.url().to_owned();
    let mut req = shared
        .post_to_router(format!("{router}/v1/pick"))
        .json(body);
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    let resp = req.send().await.map_err(|e| format!("pick: {e}"))?;
    let status = resp.status();
    let v: serde_json::Value = resp.json().await.map_err(|e| format!("pick: {e}"))?;
    if !status.is_success() {
        out.refused = super::client::is_refusal(status);
        return Err(format!("pick: HTTP {status}: {}", v["error"]["message"]));
    }
    let (Some(id), Some(url), Some(worker)) = (
        v["id"].as_str(),
        v["worker"]["url"].as_str(),
        v["worker"]["id"].as_u64(),
    ) else {
        return Err(format!("pick: unexpected answer {v}"));
    };
    Ok(Picked {
        id: id.to_owned(),
        router,
        url: url.to_owned(),
        worker: worker as usize,
    })
}

async fn report(shared: &Shared, p: &Picked, event: &str, body: serde_json::Value) {
    let url = format!("{}/v1/pick/{}/{event}", p.router, p.id);
    // Best effort: a lost report only ends the pick at its lease.
    let _ = shared.post_to_router(url).json(&body).send().await;
}

/// Reports the first token of `p`.
pub(super) async fn first_token(shared: &Shared, p: &Picked) {
    report(shared, p, "first-token", serde_json::json!({})).await;
}

/// Reports the end of `p`, with what the answer said of its tokens.
pub(super) async fn finish(shared: &Shared, p: &Picked, ok: bool, out: &Outcome) {
    let body = if ok {
        serde_json::json!({
            "status": "ok",
            "completion_tokens": out.output_tokens,
            "cached_tokens": out.cached_tokens,
        })
    } else {
        serde_json::json!({"status": "failed"})
    };
    report(shared, p, "finish", body).await;
}
