//! The limits on a worker registration, in one place, and the one check of a [`WorkerEntry`]
//! that every way in goes through: `--worker`, `--workers-file`, `POST /admin/workers`, and the
//! values a worker advertises at `/server_info`.

use crate::config::WorkerEntry;
use crate::error::ServeError;

/// The most data-parallel ranks of one worker (the core's own bound).
pub const MAX_DP_SIZE: u32 = kvrouter_core::router::MAX_DP_SIZE;
/// The largest KV block size, in tokens (the core's own bound).
pub const MAX_BLOCK_SIZE_TOKENS: usize = kvrouter_core::router::MAX_BLOCK_SIZE_TOKENS;
/// The largest per-step token budget (`max_num_batched_tokens`).
pub const MAX_NUM_BATCHED_TOKENS: u64 = 1 << 30;
/// The largest KV capacity per rank, in blocks.
pub const MAX_KV_CAPACITY_BLOCKS: u64 = 1 << 40;
/// The longest worker URL or ZeroMQ endpoint, in bytes.
pub const MAX_URL_BYTES: usize = 2048;
/// The most labels on one worker.
pub const MAX_LABELS: usize = 64;
/// The longest label key or value, in bytes.
pub const MAX_LABEL_BYTES: usize = 256;
/// Longest `profile` (a name or a file path).
pub const MAX_PROFILE_BYTES: usize = 4096;

/// Whether two worker URLs name the same worker ([`worker_url_key`]).
pub(crate) fn same_worker_url(a: &str, b: &str) -> bool {
    worker_url_key(a) == worker_url_key(b)
}

/// A worker URL as the key it is compared by: scheme and host without case, the port spelled
/// out (a default one too), the path without a trailing `/`, the query; user info and a
/// fragment do not count (`HTTP://H:80/` is `http://h:80`). A URL that does not parse is its
/// text without a trailing `/`.
pub(crate) fn worker_url_key(url: &str) -> String {
    let Ok(u) = reqwest::Url::parse(url) else {
        return url.trim_end_matches('/').to_owned();
    };
    let port = u.port_or_known_default().map(|p| format!(":{p}"));
    let query = u.query().map(|q| format!("?{q}"));
    format!(
        "{}://{}{}{}{}",
        u.scheme(),
        u.host_str().unwrap_or_default(),
        port.unwrap_or_default(),
        u.path().trim_end_matches('/'),
        query.unwrap_or_default()
    )
}

/// A field of a worker entry that is out of bounds or malformed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct FieldError {
    /// The field, as spelled in the workers file and the admin API's JSON.
    pub field: &'static str,
    /// What is wrong with it.
    pub message: String,
}

impl From<FieldError> for ServeError {
    fn from(e: FieldError) -> Self {
        ServeError::invalid(e.to_string(), Some(e.field))
    }
}

fn fail<T>(field: &'static str, message: String) -> Result<T, FieldError> {
    Err(FieldError { field, message })
}

fn in_range<T: PartialOrd + std::fmt::Display + Copy>(
    field: &'static str,
    value: Option<T>,
    min: T,
    max: T,
) -> Result<(), FieldError> {
    match value {
        Some(v) if v < min || v > max => fail(field, format!("{v} is not in {min}..={max}")),
        _ => Ok(()),
    }
}

/// A worker's base URL: `http://` or `https://` with a host. Messages show it without the
/// credentials it may carry.
fn check_url(url: &str) -> Result<(), FieldError> {
    if url.len() > MAX_URL_BYTES {
        return fail("url", format!("longer than {MAX_URL_BYTES} bytes"));
    }
    let parsed = reqwest::Url::parse(url).map_err(|e| FieldError {
        field: "url",
        message: format!("{:?} is not a URL ({e})", shown_url(url)),
    })?;
    let shown = shown_url(url);
    // They would show in `/admin/workers`, the logs and the metrics' labels.
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return fail(
            "url",
            format!("{shown:?} carries credentials: give the workers' key with --worker-api-key instead"),
        );
    }
    if !matches!(parsed.scheme(), "http" | "https") {
        return fail(
            "url",
            format!("{shown:?} must start with http:// or https://"),
        );
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return fail("url", format!("{shown:?} has no host"));
    }
    if parsed.port() == Some(0) {
        return fail("url", format!("{shown:?}: port 0 is no port to send to"));
    }
    // The router appends the API paths (`/v1/completions`) to the URL as it is: a query or a
    // fragment would end up before them.
    if parsed.query().is_some() || parsed.fragment().is_some() {
        return fail(
            "url",
            format!("{shown:?} has a query or fragment: a worker's URL is its base, to which the router appends the API paths"),
        );
    }
    Ok(())
}

/// `url` as messages show it: what lies between `://` and an `@` (a user and password) left
/// out.
fn shown_url(url: &str) -> std::borrow::Cow<'_, str> {
    let Some(start) = url.find("://").map(|i| i + 3) else {
        return url.into();
    };
    let authority_end = url[start..]
        .find(['/', '?', '#'])
        .map_or(url.len(), |i| start + i);
    match url[start..authority_end].rfind('@') {
        Some(at) => format!("{}{}", &url[..start], &url[start + at + 1..]).into(),
        None => url.into(),
    }
}

/// A ZeroMQ endpoint to connect to: `tcp://host:port` (rank r uses port + r, which must stay a
/// port) or `ipc://path`.
fn check_endpoint(field: &'static str, endpoint: &str, dp_size: u32) -> Result<(), FieldError> {
    if endpoint.len() > MAX_URL_BYTES {
        return fail(field, format!("longer than {MAX_URL_BYTES} bytes"));
    }
    if endpoint
        .chars()
        .any(|c| c.is_whitespace() || c.is_control())
    {
        return fail(
            field,
            format!("{endpoint:?} contains whitespace or a control character"),
        );
    }
    if let Some(path) = endpoint.strip_prefix("ipc://") {
        return if path.is_empty() {
            fail(field, "ipc:// needs a path".into())
        } else {
            Ok(())
        };
    }
    let Some(addr) = endpoint.strip_prefix("tcp://") else {
        return fail(
            field,
            format!("{endpoint:?} must be a ZeroMQ endpoint tcp://host:port or ipc://path"),
        );
    };
    let Some((host, port)) = addr.rsplit_once(':') else {
        return fail(field, format!("{endpoint:?} has no :port"));
    };
    if host.is_empty() || host.contains('/') {
        return fail(field, format!("{endpoint:?} has no host"));
    }
    let Ok(port) = port.parse::<u16>() else {
        return fail(field, format!("{endpoint:?}: the port must be 1 to 65535"));
    };
    let last = u32::from(port) + dp_size.saturating_sub(1);
    if port == 0 || last > u32::from(u16::MAX) {
        return fail(
            field,
            format!("{endpoint:?}: ports {port}..={last} (one per rank) must lie in 1..=65535"),
        );
    }
    Ok(())
}

impl WorkerEntry {
    /// Checks every field against the limits above; the error names the first bad field.
    pub fn validate(&self) -> Result<(), FieldError> {
        check_url(&self.url)?;
        in_range("dp_size", self.dp_size, 1, MAX_DP_SIZE)?;
        in_range("block_size", self.block_size, 1, MAX_BLOCK_SIZE_TOKENS)?;
        in_range(
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            1,
            MAX_NUM_BATCHED_TOKENS,
        )?;
        in_range(
            "kv_capacity_blocks",
            self.kv_capacity_blocks,
            1,
            MAX_KV_CAPACITY_BLOCKS,
        )?;
        let dp_size = self.dp_size.unwrap_or(1);
        if let Some(e) = &self.kv_events_endpoint {
            check_endpoint("kv_events_endpoint", e, dp_size)?;
        }
        if let Some(e) = &self.replay_endpoint {
            check_endpoint("replay_endpoint", e, dp_size)?;
        }
        if let Some(p) = &self.profile {
            if p.is_empty() || p.len() > MAX_PROFILE_BYTES {
                return fail(
                    "profile",
                    format!("a profile name or path of 1 to {MAX_PROFILE_BYTES} bytes"),
                );
            }
        }
        if self.models.iter().any(|m| m.trim().is_empty()) {
            return fail("models", "a model name is empty".into());
        }
        if self.labels.len() > MAX_LABELS {
            return fail("labels", format!("more than {MAX_LABELS} labels"));
        }
        if self
            .labels
            .iter()
            .any(|(k, v)| k.len() > MAX_LABEL_BYTES || v.len() > MAX_LABEL_BYTES)
        {
            return fail(
                "labels",
                format!("a key or value is longer than {MAX_LABEL_BYTES} bytes"),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_urls_are_compared_as_urls() {
        assert!(same_worker_url("HTTP://Host:80/", "http://host"));
        assert!(same_worker_url("http://h:8000/v1/", "http://h:8000/v1"));
        assert!(!same_worker_url("http://h:8000", "http://h:8001"));
        assert!(!same_worker_url("http://h:8000", "https://h:8000"));
        assert!(same_worker_url("not a url/", "not a url"));
        assert!(same_worker_url("http://user@[::1]:80/#x", "http://[::1]"));
        assert_eq!(worker_url_key("HTTPS://Host/V1/"), "https://host:443/V1");
    }

    fn entry(url: &str) -> WorkerEntry {
        WorkerEntry {
            url: url.into(),
            ..WorkerEntry::default()
        }
    }

    #[test]
    fn each_bound_names_its_field() {
        let field = |e: WorkerEntry| e.validate().map_err(|e| e.field);
        assert_eq!(field(entry("http://10.0.0.5:8000")), Ok(()));
        assert_eq!(field(entry("https://w.example/")), Ok(()));
        for bad in [
            "ftp://x",
            "garbage://x",
            "http://",
            "10.0.0.5:8000",
            "",
            "http://h:0",
            "http://h:8000/?x=1",
            "http://h:8000#f",
            "http://user:pass@h:8000",
            "http://user@h:8000",
        ] {
            assert_eq!(field(entry(bad)), Err("url"), "{bad}");
        }
        assert_eq!(
            field(entry("http://h:8000/engine-1")),
            Ok(()),
            "a path prefix"
        );
        for secret in [
            "http://user:pass@h:8000",
            "http://user:pass@h:0/?q=1",
            "ftp://user:pass@h",
            "http://user:pass@",
        ] {
            let e = entry(secret).validate().unwrap_err();
            assert!(!e.to_string().contains("pass"), "{e}");
        }
        assert_eq!(shown_url("http://u:p@h:1/x@y"), "http://h:1/x@y");
        assert_eq!(shown_url("http://h:1"), "http://h:1");
        let mut unnamed = entry("http://h:1");
        unnamed.models = vec!["m".into(), " ".into()];
        assert_eq!(field(unnamed), Err("models"));
        let ok = entry("http://w:1");
        let with = |f: fn(&mut WorkerEntry)| {
            let mut e = ok.clone();
            f(&mut e);
            field(e)
        };
        assert_eq!(with(|e| e.dp_size = Some(u32::MAX)), Err("dp_size"));
        assert_eq!(with(|e| e.dp_size = Some(0)), Err("dp_size"));
        assert_eq!(with(|e| e.dp_size = Some(MAX_DP_SIZE)), Ok(()));
        assert_eq!(with(|e| e.block_size = Some(0)), Err("block_size"));
        assert_eq!(with(|e| e.block_size = Some(usize::MAX)), Err("block_size"));
        assert_eq!(
            with(|e| e.max_num_batched_tokens = Some(0)),
            Err("max_num_batched_tokens")
        );
        assert_eq!(
            with(|e| e.kv_capacity_blocks = Some(u64::MAX)),
            Err("kv_capacity_blocks")
        );
        for bad in [
            "garbage://x",
            "tcp://h",
            "tcp://:5557",
            "tcp://h:0",
            "tcp://h:99999",
            "ipc://",
            "tcp://h :1",
        ] {
            let mut e = ok.clone();
            e.kv_events_endpoint = Some(bad.into());
            assert_eq!(field(e), Err("kv_events_endpoint"), "{bad}");
        }
        for good in ["tcp://10.0.0.5:5557", "tcp://[::1]:5557", "ipc:///tmp/kv"] {
            let mut e = ok.clone();
            e.replay_endpoint = Some(good.into());
            assert_eq!(field(e), Ok(()), "{good}");
        }
        // Rank r listens on port + r: the last rank's port must exist.
        assert_eq!(
            with(|e| {
                e.dp_size = Some(4);
                e.kv_events_endpoint = Some("tcp://h:65534".into());
            }),
            Err("kv_events_endpoint")
        );
        assert_eq!(
            with(|e| {
                for i in 0..=MAX_LABELS {
                    e.labels.insert(i.to_string(), String::new());
                }
            }),
            Err("labels")
        );
    }
}
