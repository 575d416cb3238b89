//! The process's log: `--log-format text|json` and `--log-level` (an `EnvFilter` directive
//! such as `info` or `warn,kvrouter::access=info`; without it `RUST_LOG`, else `info`), on
//! stderr. JSON lines are written by [`JsonLines`]: one object per event with `ts_ms`,
//! `level`, `target`, `message` and the event's fields at the top level.

use clap::{Args, ValueEnum};
use serde_json::{Map, Value};
use std::fmt;
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

use crate::headings as H;

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub(crate) enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// The log flags of `serve`.
#[derive(Clone, Debug, Default, Args)]
pub(crate) struct LogArgs {
    /// Log lines as text or as JSON objects (one per line, on stderr).
    #[arg(help_heading = H::OBSERVABILITY, long, value_enum, default_value = "text")]
    pub(crate) log_format: LogFormat,
    /// Log filter: a level (error, warn, info, debug, trace) or tracing directives such as
    /// `warn,kvrouter::access=info` [default: RUST_LOG, else info].
    #[arg(help_heading = H::OBSERVABILITY, long)]
    pub(crate) log_level: Option<String>,
}

/// Installs the process's log subscriber (once, before anything logs).
pub(crate) fn init(args: &LogArgs) -> anyhow::Result<()> {
    let filter = filter(args)?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match args.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.event_format(JsonLines).init(),
    }
    Ok(())
}

/// The filter `--log-level` (else `RUST_LOG`, else `info`) sets, checked.
pub(crate) fn filter(args: &LogArgs) -> anyhow::Result<EnvFilter> {
    Ok(match &args.log_level {
        Some(directives) => {
            if let Some(word) = bare_target(directives) {
                // A bare word is a target with every level on, and everything else off: a
                // mistyped level (`warnn`) silenced every log line (found by a probe).
                anyhow::bail!(
                    "--log-level {directives:?}: `{word}` is not a level (trace, debug, info, \
                     warn, error, off); name a target's level as `{word}=LEVEL`"
                );
            }
            EnvFilter::try_new(directives)
                .map_err(|e| anyhow::anyhow!("--log-level {directives:?}: {e}"))?
        }
        None => {
            // RUST_LOG is the environment's own: a bare word there is warned about, not refused.
            if let Some(word) = std::env::var("RUST_LOG")
                .ok()
                .as_deref()
                .and_then(bare_target)
            {
                eprintln!(
                    "warning: RUST_LOG: `{word}` is not a level (trace, debug, info, warn, error, \
                     off): it names a target, and every other target logs nothing"
                );
            }
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"))
        }
    })
}

/// The first directive of `directives` that is a bare word other than a level.
fn bare_target(directives: &str) -> Option<&str> {
    const LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];
    directives.split(',').map(str::trim).find(|d| {
        !d.is_empty()
            && !d.contains(['=', '['])
            && !LEVELS.iter().any(|l| d.eq_ignore_ascii_case(l))
    })
}

/// Formats each event as one JSON object on one line.
pub(crate) struct JsonLines;

impl<S, N> FormatEvent<S, N> for JsonLines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        writeln!(writer, "{}", line(event, now_ms()))
    }
}

/// Milliseconds since the Unix epoch.
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The JSON object of `event` at `ts_ms`.
fn line(event: &Event<'_>, ts_ms: u64) -> Value {
    let meta = event.metadata();
    let mut fields = Fields(Map::new());
    fields.0.insert("ts_ms".into(), ts_ms.into());
    fields
        .0
        .insert("level".into(), meta.level().as_str().into());
    fields.0.insert("target".into(), meta.target().into());
    event.record(&mut fields);
    Value::Object(fields.0)
}

/// Collects an event's fields as JSON values.
struct Fields(Map<String, Value>);

impl Fields {
    fn put(&mut self, field: &Field, v: Value) {
        self.0.insert(field.name().to_owned(), v);
    }
}

impl Visit for Fields {
    fn record_f64(&mut self, field: &Field, v: f64) {
        self.put(
            field,
            serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number),
        );
    }
    fn record_i64(&mut self, field: &Field, v: i64) {
        self.put(field, v.into());
    }
    fn record_u64(&mut self, field: &Field, v: u64) {
        self.put(field, v.into());
    }
    fn record_bool(&mut self, field: &Field, v: bool) {
        self.put(field, v.into());
    }
    fn record_str(&mut self, field: &Field, v: &str) {
        self.put(field, v.into());
    }
    fn record_debug(&mut self, field: &Field, v: &dyn fmt::Debug) {
        self.put(field, format!("{v:?}").into());
    }
}

#[cfg(test)]
mod tests {
    use super::bare_target;

    #[test]
    fn a_bare_word_that_is_not_a_level_is_found() {
        for ok in [
            "warn",
            "INFO",
            "warn,kvrouter::access=info",
            "kvrouter=debug",
            "off",
            "[x]",
            "",
        ] {
            assert_eq!(bare_target(ok), None, "{ok}");
        }
        assert_eq!(bare_target("warnn"), Some("warnn"));
        assert_eq!(bare_target("info, kvrouter"), Some("kvrouter"));
    }
}
