//! OpenTelemetry traces (`--otlp-endpoint`): one trace per sampled request, exported over
//! OTLP/HTTP with protobuf bodies by a batch processor on its own thread.
//!
//! Spans are built when the request ends, from the times its provenance line recorded (the
//! same completion point as the provenance and access logs), with explicit start and end
//! times: `request` (the root, kind server) with children `tokenize`, `route` (the chosen
//! worker and its score), `queue_wait` (only when the router queue held it), `upstream_first_byte`
//! and `stream`. A request that is not sampled builds nothing.

use crate::provenance::Provenance;
use opentelemetry::trace::{Span, SpanKind, Status, TraceContextExt, Tracer, TracerProvider};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

/// How long finished spans wait before a batch is sent.
pub const EXPORT_DELAY: Duration = Duration::from_millis(500);

/// Where request timelines become OTLP spans.
#[derive(Debug)]
pub struct Otel {
    provider: SdkTracerProvider,
    tracer: opentelemetry_sdk::trace::SdkTracer,
    sample: f64,
    seen: AtomicU64,
}

/// Why the exporter could not be built.
#[derive(Debug, thiserror::Error)]
#[error("OTLP exporter: {0}")]
pub struct OtelError(String);

impl Otel {
    /// Exports to `endpoint` (the collector's base URL; spans go to `ENDPOINT/v1/traces`),
    /// sampling a fraction `sample` (0 to 1) of requests. Starts the batch processor's thread.
    pub fn open(endpoint: &str, sample: f64) -> Result<Self, OtelError> {
        let url = format!("{}/v1/traces", endpoint.trim_end_matches('/'));
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(url)
            .build()
            .map_err(|e| OtelError(e.to_string()))?;
        let batch = BatchConfigBuilder::default()
            .with_scheduled_delay(EXPORT_DELAY)
            .build();
        let processor = BatchSpanProcessor::builder(exporter)
            .with_batch_config(batch)
            .build();
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name("kvrouter")
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_resource(resource)
            .build();
        let tracer = provider.tracer("kvrouter");
        Ok(Self {
            provider,
            tracer,
            sample: if sample.is_finite() {
                sample.clamp(0.0, 1.0)
            } else {
                0.0
            },
            seen: AtomicU64::new(0),
        })
    }

    /// Whether the next request is traced (the n-th when `floor(n * sample)` steps up).
    pub(crate) fn sampled(&self) -> bool {
        let n = self.seen.fetch_add(1, Ordering::Relaxed);
        ((n + 1) as f64 * self.sample).floor() > (n as f64 * self.sample).floor()
    }

    /// Sends what is buffered and stops the exporter (at shutdown).
    pub fn shutdown(&self) {
        let _ = self.provider.shutdown();
    }

    /// The spans of a request that ended at `end`.
    pub(crate) fn record(
        &self,
        p: &Provenance,
        arrival: Instant,
        first: Option<Instant>,
        end: Instant,
    ) {
        // Instants become wall-clock times relative to now.
        let (now_i, now_s) = (Instant::now(), SystemTime::now());
        let wall = |t: Instant| now_s - now_i.saturating_duration_since(t);
        let t = &p.timeline;
        let mut attrs = vec![
            KeyValue::new(
                "kvrouter.request_id",
                p.x_request_id.clone().unwrap_or_default(),
            ),
            KeyValue::new("kvrouter.status", p.status),
            KeyValue::new("kvrouter.prompt_tokens", p.prompt_tokens as i64),
            KeyValue::new("kvrouter.completion_tokens", p.output_tokens as i64),
            KeyValue::new("kvrouter.migrations", i64::from(p.migrations)),
        ];
        if let Some(m) = &p.model {
            attrs.push(KeyValue::new("gen_ai.request.model", m.clone()));
        }
        if let Some(w) = p.worker {
            attrs.push(KeyValue::new("kvrouter.worker", w as i64));
        }
        if let Some(s) = p.http_status {
            attrs.push(KeyValue::new("http.response.status_code", i64::from(s)));
        }
        if let Some(source) = p.pick {
            attrs.push(KeyValue::new("kvrouter.pick", source));
        }
        let mut root = self
            .tracer
            .span_builder("request")
            .with_kind(SpanKind::Server)
            .with_start_time(wall(arrival))
            .with_attributes(attrs)
            .start(&self.tracer);
        if p.status == "failed" {
            root.set_status(Status::error("the stream failed"));
        }
        let cx = Context::current_with_span(root);
        let child = |name: &'static str, from: Instant, to: Instant, attrs: Vec<KeyValue>| {
            let mut s = self
                .tracer
                .span_builder(name)
                .with_kind(SpanKind::Internal)
                .with_start_time(wall(from))
                .with_attributes(attrs)
                .start_with_context(&self.tracer, &cx);
            s.end_with_timestamp(wall(to.max(from)));
        };
        if let Some(tokenized) = t.tokenized {
            child("tokenize", arrival, tokenized, Vec::new());
            if let Some(placed) = t.placed {
                let mut route = vec![
                    KeyValue::new("kvrouter.worker", t.first_worker as i64),
                    KeyValue::new("kvrouter.dp_rank", i64::from(p.dp_rank)),
                    KeyValue::new(
                        "kvrouter.predicted_cached_tokens",
                        t.predicted_cached_tokens as i64,
                    ),
                ];
                if let Some(score) = t.score {
                    route.push(KeyValue::new("kvrouter.score", score));
                }
                child("route", tokenized, placed, route);
                if let Some(queued) = t.queued {
                    child("queue_wait", queued, placed, Vec::new());
                }
                if let Some(first) = first {
                    child("upstream_first_byte", placed, first, Vec::new());
                    child("stream", first, end, Vec::new());
                }
            }
        }
        cx.span().end_with_timestamp(wall(end));
    }
}
