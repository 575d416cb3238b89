//! `kvrouter serve`'s observability flags: decision headers, request traces, logs, the access
//! log, OTLP export and the metric names.

use crate::headings as H;
use anyhow::{bail, Context};
use clap::Args;
use kvrouter_server::access::AccessLog;
use kvrouter_server::otel::Otel;
use std::sync::Arc;

/// What the router tells about the requests it routes.
#[derive(Debug, Args)]
pub(crate) struct ObservabilityArgs {
    /// Add x-kvrouter-decision (the score breakdown) to responses.
    #[arg(help_heading = H::OBSERVABILITY, long)]
    pub(crate) expose_decisions: bool,
    /// Keep the timelines of the last N request attempts for GET /admin/trace (Chrome trace
    /// JSON for Perfetto); 0 = off, at most 1,000,000.
    #[arg(help_heading = H::OBSERVABILITY, long, default_value_t = 0)]
    pub(crate) trace_capture: usize,
    #[command(flatten)]
    pub(crate) log: crate::logging::LogArgs,
    /// Write one access line per request when it ends (log target `kvrouter::access`: request
    /// id, model, worker, status, tokens, queue, TTFT and duration).
    #[arg(help_heading = H::OBSERVABILITY, long)]
    access_log: bool,
    /// With --access-log: the fraction of requests that get a line (0 to 1, spread evenly).
    #[arg(help_heading = H::OBSERVABILITY, long, default_value_t = 1.0)]
    access_log_sample: f64,
    /// Export a trace per sampled request over OTLP/HTTP (protobuf) to this collector base URL
    /// (spans go to URL/v1/traces), e.g. http://127.0.0.1:4318; off when not given.
    #[arg(help_heading = H::OBSERVABILITY, long)]
    otlp_endpoint: Option<String>,
    /// With --otlp-endpoint: the fraction of requests traced (0 to 1, spread evenly).
    #[arg(help_heading = H::OBSERVABILITY, long, default_value_t = 1.0)]
    otlp_sample_ratio: f64,
    /// The prefix of every metric name on /metrics (letters, digits, `_` and `:`, not starting
    /// with a digit; may be empty).
    #[arg(help_heading = H::OBSERVABILITY, long, default_value = "kvrouter_")]
    metrics_prefix: String,
}

/// The longest `--metrics-prefix`.
const MAX_METRICS_PREFIX_BYTES: usize = 64;

/// The most request timelines `--trace-capture` keeps (each a few hundred bytes to kilobytes).
const MAX_TRACE_CAPTURE: usize = 1_000_000;

impl ObservabilityArgs {
    /// `--trace-capture`, bounded (found by a probe: 2^64 − 1 was accepted, memory unbounded).
    pub(crate) fn trace_capture(&self) -> anyhow::Result<usize> {
        if self.trace_capture > MAX_TRACE_CAPTURE {
            anyhow::bail!("--trace-capture takes at most {MAX_TRACE_CAPTURE} timelines");
        }
        Ok(self.trace_capture)
    }

    /// `--metrics-prefix`, checked to make valid Prometheus metric names.
    pub(crate) fn metrics_prefix(&self) -> anyhow::Result<String> {
        let p = &self.metrics_prefix;
        let ok_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
        if p.len() > MAX_METRICS_PREFIX_BYTES
            || !p.chars().all(ok_char)
            || p.starts_with(|c: char| c.is_ascii_digit())
        {
            bail!(
                "--metrics-prefix {p:?}: use at most {MAX_METRICS_PREFIX_BYTES} letters, digits, `_` \
                 and `:`, not starting with a digit"
            );
        }
        Ok(p.to_owned())
    }

    /// The OTLP collector URL and the sample ratio, checked (`None` without --otlp-endpoint);
    /// nothing is opened.
    pub(crate) fn otel_settings(&self) -> anyhow::Result<Option<(&str, f64)>> {
        Ok(match (&self.otlp_endpoint, self.otlp_sample_ratio) {
            (_, s) if !(0.0..=1.0).contains(&s) => {
                bail!("--otlp-sample-ratio must be between 0 and 1, got {s}")
            }
            (Some(url), s) => {
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    bail!("--otlp-endpoint {url:?}: give an http:// or https:// URL");
                }
                Some((url.as_str(), s))
            }
            (None, _) => None,
        })
    }

    /// The OTLP exporter (`None` without --otlp-endpoint).
    pub(crate) fn otel(&self) -> anyhow::Result<Option<Arc<Otel>>> {
        let Some((url, s)) = self.otel_settings()? else {
            return Ok(None);
        };
        let otel = Otel::open(url, s).with_context(|| format!("--otlp-endpoint {url}"))?;
        Ok(Some(Arc::new(otel)))
    }

    /// The access log (`None` without --access-log).
    pub(crate) fn access_log(&self) -> anyhow::Result<Option<Arc<AccessLog>>> {
        Ok(match (self.access_log, self.access_log_sample) {
            (_, s) if !(0.0..=1.0).contains(&s) => {
                bail!("--access-log-sample must be between 0 and 1, got {s}")
            }
            (true, s) => Some(Arc::new(AccessLog::new(s))),
            (false, _) => None,
        })
    }
}
