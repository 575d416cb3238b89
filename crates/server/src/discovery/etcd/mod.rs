//! etcd, through its v3 JSON gateway (`POST /v3/kv/range`, `/v3/watch`, `/v3/lease/*` on the
//! client port; etcd ≥ 3.4 serves it by default). The gateway instead of a gRPC client crate:
//! the router already speaks HTTP/JSON with reqwest, the gateway needs no protobuf toolchain and
//! no second HTTP stack, and the five calls used here are stable, documented etcd API. Keys and
//! values are base64 in JSON, int64 fields are strings.
//!
//! - [`EtcdClient`]: the calls.
//! - `wire`: the pure parsing of gateway answers (unit-tested on recorded answers).
//! - `source`: the router's source: list the prefix, then watch from the next revision.
//! - [`register`]: an engine's registration under a lease, kept alive, revoked on stop.

pub mod register;
pub(crate) mod source;
mod wire;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use serde_json::{json, Value};
use std::time::Duration;

pub use register::Registered;
pub(crate) use wire::Change;

/// Why an etcd call failed.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// No answer (connection refused, timeout, broken stream).
    #[error("etcd at {0} did not answer: {1}")]
    Unreachable(String, String),
    /// An answer that is not what the gateway sends.
    #[error("etcd answered something unexpected: {0}")]
    Protocol(String),
    /// A watch message past the bound ([`wire::MAX_LINE_BYTES`]): a catch-up of many large
    /// revisions at once. The prefix is listed again instead.
    #[error("{0}")]
    TooLarge(String),
}

/// A client of etcd's JSON gateway at `http://host:port`.
#[derive(Clone, Debug)]
pub struct EtcdClient {
    base: String,
    http: reqwest::Client,
    /// The longest wait for a call's answer (and for a watch's first answer).
    call_timeout: Duration,
}

/// The end of the key range of every key starting with `prefix` (etcd's `range_end`).
pub(crate) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0] // every key
}

impl EtcdClient {
    /// The longest wait for a call's answer unless set ([`EtcdClient::with_call_timeout`]).
    pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(5);

    /// A client of `endpoint` (`http://host:port`). Does no I/O.
    pub fn new(endpoint: &str) -> Self {
        Self::with_call_timeout(endpoint, Self::DEFAULT_CALL_TIMEOUT)
    }

    /// A client of `endpoint` whose calls wait at most `call_timeout` for an answer (and
    /// connecting at most 2 s of it). Does no I/O.
    pub fn with_call_timeout(endpoint: &str, call_timeout: Duration) -> Self {
        Self {
            base: endpoint.trim_end_matches('/').to_owned(),
            http: reqwest::Client::builder()
                .connect_timeout(call_timeout.min(Duration::from_secs(2)))
                .build()
                .expect("HTTP client"),
            call_timeout,
        }
    }

    fn unreachable(&self, e: impl std::fmt::Display) -> EtcdError {
        EtcdError::Unreachable(self.base.clone(), e.to_string())
    }

    async fn call(&self, path: &str, body: Value) -> Result<Value, EtcdError> {
        let request = self.http.post(format!("{}{path}", self.base)).json(&body);
        let resp = tokio::time::timeout(self.call_timeout, request.send())
            .await
            .map_err(|_| self.unreachable(format!("no answer within {:?}", self.call_timeout)))?
            .map_err(|e| self.unreachable(e))?;
        let status = resp.status();
        let text = tokio::time::timeout(self.call_timeout, resp.text())
            .await
            .map_err(|_| self.unreachable("answer body timed out"))?
            .map_err(|e| self.unreachable(e))?;
        if !status.is_success() {
            return Err(EtcdError::Protocol(format!(
                "{path}: HTTP {status}: {text}"
            )));
        }
        serde_json::from_str(&text).map_err(|e| EtcdError::Protocol(format!("{path}: {e}")))
    }

    /// Every key under `prefix` with its value, and the store revision they were read at.
    pub(crate) async fn range_prefix(&self, prefix: &str) -> Result<(i64, Vec<Change>), EtcdError> {
        let body = json!({"key": B64.encode(prefix), "range_end": B64.encode(prefix_end(prefix.as_bytes()))});
        let answer = self.call("/v3/kv/range", body).await?;
        wire::range(&answer)
    }

    /// Starts a watch of every key under `prefix` from `start_revision`; the answer streams
    /// one JSON message a line.
    pub(crate) async fn watch(
        &self,
        prefix: &str,
        start_revision: i64,
    ) -> Result<reqwest::Response, EtcdError> {
        let body = json!({"create_request": {
            "key": B64.encode(prefix),
            "range_end": B64.encode(prefix_end(prefix.as_bytes())),
            "start_revision": start_revision.to_string(),
        }});
        let request = self
            .http
            .post(format!("{}/v3/watch", self.base))
            .json(&body);
        let resp = tokio::time::timeout(self.call_timeout, request.send())
            .await
            .map_err(|_| self.unreachable("watch: no answer"))?
            .map_err(|e| self.unreachable(e))?;
        if !resp.status().is_success() {
            return Err(EtcdError::Protocol(format!(
                "watch: HTTP {}",
                resp.status()
            )));
        }
        Ok(resp)
    }

    /// Grants a lease of `ttl_secs`; returns its id.
    pub async fn grant(&self, ttl_secs: u64) -> Result<i64, EtcdError> {
        let answer = self
            .call("/v3/lease/grant", json!({"TTL": ttl_secs.to_string()}))
            .await?;
        wire::int(&answer["ID"]).ok_or_else(|| EtcdError::Protocol(format!("grant: {answer}")))
    }

    /// Renews a lease; returns its remaining TTL in seconds (0: the lease is gone).
    pub async fn keep_alive(&self, lease: i64) -> Result<i64, EtcdError> {
        let answer = self
            .call("/v3/lease/keepalive", json!({"ID": lease.to_string()}))
            .await?;
        Ok(wire::int(&answer["result"]["TTL"]).unwrap_or(0))
    }

    /// Writes `key` = `value`, attached to `lease`.
    pub async fn put(&self, key: &str, value: &[u8], lease: i64) -> Result<(), EtcdError> {
        let body =
            json!({"key": B64.encode(key), "value": B64.encode(value), "lease": lease.to_string()});
        self.call("/v3/kv/put", body).await.map(drop)
    }

    /// Revokes a lease: its keys are deleted at once.
    pub async fn revoke(&self, lease: i64) -> Result<(), EtcdError> {
        self.call("/v3/lease/revoke", json!({"ID": lease.to_string()}))
            .await
            .map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_range_ends_after_its_last_key() {
        assert_eq!(prefix_end(b"/a/"), b"/a0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff"), vec![0]);
    }
}
