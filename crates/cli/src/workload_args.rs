//! Where `kvrouter sim`'s requests come from: a trace or a generated workload (the loader is
//! shared with `bench`).

use anyhow::{bail, Context};
use clap::Args;
use kvrouter_workload::generators::{self, AgenticParams, GrpoParams, Seed001Params};
use kvrouter_workload::readers::ReadOptions;
use kvrouter_workload::{load_trace, Workload};
use std::path::PathBuf;

/// The workload flags of `kvrouter sim`.
#[derive(Debug, Args)]
pub(crate) struct WorkloadArgs {
    /// A trace: Mooncake JSONL, RL rollout JSONL, an agentic session JSON, or a folder of agentic
    /// session JSON files (`*.json`; other files in it are not read).
    #[arg(long, conflicts_with = "workload")]
    trace: Option<PathBuf>,
    /// A generated workload: grpo, agentic or seed001.
    #[arg(long)]
    workload: Option<String>,
    /// Generator parameters as key=value,key=value (names as in docs/workloads.md).
    #[arg(long)]
    workload_args: Option<String>,
}

impl WorkloadArgs {
    /// The generator named by --workload, if any.
    pub(crate) fn name(&self) -> Option<&str> {
        self.workload.as_deref()
    }

    /// The trace or the generated workload (`--session-gap-s` and `--max-requests` apply to
    /// traces).
    pub(crate) fn load(&self, session_gap_s: f64, max_requests: usize) -> anyhow::Result<Workload> {
        load_workload(
            self.trace.as_deref(),
            self.workload.as_deref(),
            self.workload_args.as_deref(),
            session_gap_s,
            max_requests,
        )
    }

    /// The workload as the report's head names it.
    pub(crate) fn describe(&self) -> String {
        match (&self.trace, &self.workload) {
            (Some(path), _) => format!("trace {}", path.display()),
            (None, Some(w)) => match &self.workload_args {
                Some(a) => format!("{w} ({a})"),
                None => w.clone(),
            },
            (None, None) => String::new(),
        }
    }
}

fn params<T: serde::de::DeserializeOwned + serde::Serialize + Default>(
    args: Option<&str>,
) -> anyhow::Result<T> {
    let mut value = serde_json::to_value(T::default())?;
    let mut given = std::collections::HashSet::new();
    for kv in args
        .unwrap_or("")
        .split(',')
        .filter(|s| !s.trim().is_empty())
    {
        let (k, v) = kv
            .split_once('=')
            .with_context(|| format!("--workload-args: {kv:?} is not key=value"))?;
        let k = k.trim();
        if !given.insert(k) {
            bail!("--workload-args: `{k}` is given twice");
        }
        value[k] = serde_json::from_str(v.trim())
            .unwrap_or_else(|_| serde_json::Value::String(v.trim().to_owned()));
    }
    // The path names the field whose value has the wrong type (`prompts=abc`).
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        match path.as_str() {
            "." | "" => anyhow::anyhow!("--workload-args: {}", e.inner()),
            field => anyhow::anyhow!("--workload-args: `{field}`: {}", e.inner()),
        }
    })
}

/// A generator's workload from `--workload-args`: parsed, range-checked (an error naming the
/// field), then generated.
fn generated<P: serde::de::DeserializeOwned + serde::Serialize + Default>(
    args: Option<&str>,
    validate: fn(&P) -> Result<(), String>,
    generate: fn(&P) -> Workload,
) -> anyhow::Result<Workload> {
    let p: P = params(args)?;
    validate(&p).map_err(|e| anyhow::anyhow!("--workload-args: {e}"))?;
    Ok(generate(&p))
}

/// The longest `--session-gap-s`: a day.
const MAX_SESSION_GAP_S: f64 = 86_400.0;

/// Loads a trace or generates a workload (shared by `sim` and `bench`).
pub(crate) fn load_workload(
    trace: Option<&std::path::Path>,
    workload: Option<&str>,
    workload_args: Option<&str>,
    session_gap_s: f64,
    max_requests: usize,
) -> anyhow::Result<Workload> {
    if !(session_gap_s.is_finite() && (0.0..=MAX_SESSION_GAP_S).contains(&session_gap_s)) {
        bail!("--session-gap-s must be a number of seconds in 0..={MAX_SESSION_GAP_S}, got {session_gap_s}");
    }
    if trace.is_some() && workload_args.is_some() {
        bail!("--workload-args sets a generator's parameters (--workload); a --trace takes none");
    }
    match (trace, workload) {
        (Some(path), _) => {
            let opts = ReadOptions {
                session_gap_s,
                seed: 0,
                max_requests,
            };
            Ok(load_trace(path, opts).map_err(|e| anyhow::anyhow!("--trace {e}"))?)
        }
        (None, Some("grpo")) => generated(workload_args, GrpoParams::validate, generators::grpo),
        (None, Some("agentic")) => {
            generated(workload_args, AgenticParams::validate, generators::agentic)
        }
        (None, Some("seed001")) => {
            generated(workload_args, Seed001Params::validate, generators::seed001)
        }
        (None, Some("seed002")) => generated(
            workload_args,
            kvrouter_workload::seed002::Seed002Params::validate,
            kvrouter_workload::seed002::seed002,
        ),
        (None, Some(other)) => {
            bail!("--workload {other:?}: expected grpo, agentic, seed001 or seed002")
        }
        (None, None) => bail!("give --trace PATH or --workload grpo|agentic|seed001|seed002"),
    }
}
