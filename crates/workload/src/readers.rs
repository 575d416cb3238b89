//! Trace readers and format detection. Errors name the file and the line (or request) they
//! cannot read.

use crate::bounds::MAX_TOKENS;
use crate::model::{Barrier, Workload, WorkloadRequest};
use kvrouter_core::rng::SeededRng;
use serde::Deserialize;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
#[error("{path}{}: {reason}", .line.map(|l| format!(":{l}")).unwrap_or_default())]
pub struct LoadError {
    /// The file.
    pub path: String,
    /// The 1-based line, for line-oriented formats.
    pub line: Option<usize>,
    /// What is wrong.
    pub reason: String,
}

fn err(path: &Path, line: Option<usize>, reason: impl Into<String>) -> LoadError {
    LoadError {
        path: path.display().to_string(),
        line,
        reason: reason.into(),
    }
}

/// Latest time a trace may name, ms (a year): past it a value is a typo, and it overflows the
/// simulator's clock.
pub const MAX_TRACE_MS: f64 = 365.0 * 86_400_000.0;

/// A time field of a trace (`field`, already in ms): a number from 0 to [`MAX_TRACE_MS`].
fn time_ms(path: &Path, line: Option<usize>, field: &str, v: f64) -> Result<f64, LoadError> {
    if v.is_finite() && (0.0..=MAX_TRACE_MS).contains(&v) {
        Ok(v)
    } else {
        Err(err(
            path,
            line,
            format!("{field} is {v}: expected milliseconds from 0 to {MAX_TRACE_MS}"),
        ))
    }
}

/// Options of the readers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReadOptions {
    /// Agentic sessions: mean gap between session starts, seconds (Poisson arrivals).
    pub session_gap_s: f64,
    /// Seed of the session start times.
    pub seed: u64,
    /// Keep at most this many requests (0 = all).
    pub max_requests: usize,
}

impl Default for ReadOptions {
    fn default() -> Self {
        Self {
            session_gap_s: 10.0,
            seed: 0,
            max_requests: 0,
        }
    }
}

#[derive(Deserialize)]
struct MooncakeLine {
    #[serde(alias = "created_time")]
    timestamp: f64,
    input_length: u32,
    output_length: u32,
    hash_ids: Vec<u64>,
    #[serde(default)]
    session_id: Option<serde_json::Value>,
    #[serde(default, alias = "delay_ms")]
    delay: Option<f64>,
}

#[derive(Deserialize)]
struct RolloutLine {
    step: u32,
    group: u64,
    trajectory: u64,
    turn: u32,
    prompt_blocks: Vec<u64>,
    prompt_tokens: u32,
    output_tokens: u32,
    #[serde(default)]
    tool_latency_ms: f64,
    #[serde(default)]
    policy_version: Option<u32>,
    #[serde(default)]
    block_size: Option<usize>,
}

/// A trace file's text: a regular file only (a device or FIFO, `/dev/zero` or one named
/// `*.json` in a sessions folder, was read without end or blocked on its open).
fn read_regular(path: &Path) -> Result<String, LoadError> {
    if path.exists() && !path.is_file() {
        return Err(err(path, None, "not a regular file"));
    }
    std::fs::read_to_string(path).map_err(|e| err(path, None, e.to_string()))
}

/// Reads a trace: a Mooncake JSONL file, an RL rollout JSONL file, one agentic session JSON, or
/// a folder of agentic session JSON files. The format is detected from the content.
pub fn load_trace(path: &Path, opts: ReadOptions) -> Result<Workload, LoadError> {
    if path.is_dir() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|e| err(path, None, e.to_string()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(err(path, None, "the folder holds no .json session files"));
        }
        return read_sessions(path, &files, opts);
    }
    let text = read_regular(path)?;
    let first = text
        .lines()
        .position(|l| !l.trim().is_empty())
        .ok_or_else(|| err(path, None, "the file is empty"))?;
    let head: serde_json::Value = serde_json::from_str(text.lines().nth(first).unwrap_or(""))
        .or_else(|_| serde_json::from_str(&text))
        .map_err(|e| err(path, Some(first + 1), format!("not JSON: {e}")))?;
    if head.get("requests").is_some() {
        return read_sessions(path, &[path.to_path_buf()], opts);
    }
    if head.get("prompt_blocks").is_some() {
        return read_rollouts(path, &text, opts);
    }
    if head.get("hash_ids").is_some() && head.get("input_length").is_some() {
        return read_mooncake(path, &text, opts);
    }
    Err(err(
        path,
        Some(first + 1),
        "unknown trace format (expected Mooncake JSONL, RL rollout JSONL or agentic session JSON)",
    ))
}

/// A prompt or output length of a trace line, in `min..=`[`MAX_TOKENS`]: a larger one was
/// built as a prompt of that many tokens in memory by `bench` (2^32 − 1 of them aborted it) and
/// simulated at length; an empty prompt is no request.
fn length(
    path: &Path,
    line: Option<usize>,
    what: &str,
    v: f64,
    min: u32,
) -> Result<u32, LoadError> {
    if v.fract() == 0.0 && v >= f64::from(min) && v <= f64::from(MAX_TOKENS) {
        return Ok(v as u32);
    }
    Err(err(
        path,
        line,
        format!("{what} is {v}; it must be a whole number of tokens in {min}..={MAX_TOKENS}"),
    ))
}

fn read_mooncake(path: &Path, text: &str, opts: ReadOptions) -> Result<Workload, LoadError> {
    let mut requests = Vec::new();
    let mut last_of_session: HashMap<String, usize> = HashMap::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        if opts.max_requests > 0 && requests.len() >= opts.max_requests {
            break;
        }
        let l: MooncakeLine =
            serde_json::from_str(line).map_err(|e| err(path, Some(n + 1), e.to_string()))?;
        let line = Some(n + 1);
        length(path, line, "input_length", f64::from(l.input_length), 1)?;
        length(path, line, "output_length", f64::from(l.output_length), 1)?;
        let timestamp = time_ms(path, Some(n + 1), "timestamp", l.timestamp)?;
        let delay = time_ms(path, Some(n + 1), "delay", l.delay.unwrap_or(0.0))?;
        let session = l.session_id.as_ref().map(|s| s.to_string());
        let after = session
            .as_ref()
            .and_then(|s| last_of_session.get(s).copied());
        let i = requests.len();
        if let Some(s) = session {
            last_of_session.insert(s, i);
        }
        requests.push(WorkloadRequest {
            arrival_ms: if after.is_some() {
                None
            } else {
                Some(timestamp)
            },
            after,
            delay_ms: delay,
            session: None,
            blocks: l.hash_ids,
            input_tokens: l.input_length,
            output_tokens: l.output_length,
            group: None,
            step: None,
            policy_version: None,
        });
    }
    let name = path
        .file_stem()
        .map_or("trace".into(), |s| s.to_string_lossy().into_owned());
    Ok(Workload {
        name,
        block_size: 512,
        requests,
        barrier: None,
    })
}

#[derive(Deserialize)]
struct SessionFile {
    block_size: usize,
    requests: Vec<serde_json::Value>,
}

/// Flattens a session's requests (sub-agents' nested requests too) into chained turns.
fn session_turns(
    path: &Path,
    items: &[serde_json::Value],
    session: u64,
    namespace: u64,
    prev: Option<usize>,
    out: &mut Vec<WorkloadRequest>,
) -> Result<Option<usize>, LoadError> {
    let mut prev = prev;
    for (k, item) in items.iter().enumerate() {
        if item.get("type").and_then(|t| t.as_str()) == Some("subagent") {
            // A sub-agent runs its own chain after the request before it, in the same namespace.
            let nested = item
                .get("requests")
                .and_then(|r| r.as_array())
                .map(Vec::as_slice)
                .unwrap_or(&[]);
            session_turns(path, nested, session, namespace, prev, out)?;
            continue;
        }
        let field = |name: &str| item.get(name).and_then(serde_json::Value::as_f64);
        let (Some(input), Some(output)) = (field("in"), field("out")) else {
            return Err(err(path, None, format!("request {k} lacks `in` or `out`")));
        };
        let input = length(path, None, &format!("request {k}: `in`"), input, 1)?;
        let output = length(path, None, &format!("request {k}: `out`"), output, 0)?;
        let ids: Vec<u64> = item
            .get("hash_ids")
            .and_then(|h| h.as_array())
            .ok_or_else(|| err(path, None, format!("request {k} lacks `hash_ids`")))?
            .iter()
            .map(|v| v.as_u64().map(|id| namespace << 40 | id))
            .collect::<Option<_>>()
            .ok_or_else(|| err(path, None, format!("request {k} has a non-integer hash id")))?;
        let think = field("think_time").unwrap_or(0.0) * 1000.0;
        let delay_ms = time_ms(
            path,
            None,
            &format!("request {k}: think_time (s → ms)"),
            think,
        )?;
        let i = out.len();
        out.push(WorkloadRequest {
            arrival_ms: None,
            after: prev,
            delay_ms,
            session: Some(session),
            blocks: ids,
            input_tokens: input,
            output_tokens: output.max(1),
            group: None,
            step: None,
            policy_version: None,
        });
        prev = Some(i);
    }
    Ok(prev)
}

/// Agentic sessions: each file is a session, its turns chained closed-loop by `think_time`.
/// Hash ids are local to a session, so they are namespaced by session. Session start times: a
/// Poisson process with mean gap `session_gap_s`, seeded, in file-name order.
fn read_sessions(root: &Path, files: &[PathBuf], opts: ReadOptions) -> Result<Workload, LoadError> {
    let mut rng = SeededRng::new(opts.seed);
    let mut requests = Vec::new();
    let mut start_ms = 0.0;
    let mut block_size = None;
    for (s, file) in files.iter().enumerate() {
        let text = read_regular(file)?;
        let f: SessionFile =
            serde_json::from_str(&text).map_err(|e| err(file, Some(e.line()), e.to_string()))?;
        if *block_size.get_or_insert(f.block_size) != f.block_size {
            return Err(err(
                file,
                None,
                "sessions with different block sizes cannot be mixed",
            ));
        }
        let first = requests.len();
        session_turns(
            file,
            &f.requests,
            s as u64,
            s as u64 + 1,
            None,
            &mut requests,
        )?;
        if let Some(r) = requests.get_mut(first) {
            r.arrival_ms = Some(start_ms);
            r.after = None;
        }
        start_ms += crate::dist::exponential(&mut rng, opts.session_gap_s * 1000.0);
        if opts.max_requests > 0 && requests.len() >= opts.max_requests {
            requests.truncate(opts.max_requests);
            break;
        }
    }
    let name = root
        .file_stem()
        .map_or("sessions".into(), |s| s.to_string_lossy().into_owned());
    Ok(Workload {
        name,
        block_size: block_size.unwrap_or(64),
        requests,
        barrier: None,
    })
}

/// Our RL rollout JSONL: one line per request with step, group, trajectory and turn. Turns of a
/// trajectory chain closed-loop with the tool latency after each turn; steps are synchronous.
fn read_rollouts(path: &Path, text: &str, opts: ReadOptions) -> Result<Workload, LoadError> {
    let mut requests = Vec::new();
    let mut last_turn: HashMap<u64, (u32, usize, f64)> = HashMap::new();
    let mut block_size = None;
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        if opts.max_requests > 0 && requests.len() >= opts.max_requests {
            break;
        }
        let l: RolloutLine =
            serde_json::from_str(line).map_err(|e| err(path, Some(n + 1), e.to_string()))?;
        if let Some(bs) = l.block_size {
            // One block size for the file, at least one token: a later, different one was
            // ignored, and 0 took the hit ceiling to 0 without a word.
            if bs == 0 {
                return Err(err(path, Some(n + 1), "block_size must be at least 1"));
            }
            if *block_size.get_or_insert(bs) != bs {
                return Err(err(
                    path,
                    Some(n + 1),
                    format!(
                        "block_size {bs}, but earlier lines said {}",
                        block_size.unwrap_or(bs)
                    ),
                ));
            }
        }
        time_ms(path, Some(n + 1), "tool_latency_ms", l.tool_latency_ms)?;
        length(
            path,
            Some(n + 1),
            "prompt_tokens",
            f64::from(l.prompt_tokens),
            1,
        )?;
        length(
            path,
            Some(n + 1),
            "output_tokens",
            f64::from(l.output_tokens),
            0,
        )?;
        let prev = last_turn.get(&l.trajectory).copied();
        let (after, delay_ms) = match prev {
            Some((turn, i, latency)) if l.turn > turn => (Some(i), latency),
            Some(_) => {
                return Err(err(
                    path,
                    Some(n + 1),
                    format!("trajectory {} turns out of order", l.trajectory),
                ))
            }
            None => (None, 0.0),
        };
        let i = requests.len();
        last_turn.insert(l.trajectory, (l.turn, i, l.tool_latency_ms));
        requests.push(WorkloadRequest {
            arrival_ms: None,
            after,
            delay_ms,
            session: Some(l.trajectory),
            blocks: l.prompt_blocks,
            input_tokens: l.prompt_tokens,
            output_tokens: l.output_tokens.max(1),
            group: Some(l.group),
            step: Some(l.step),
            policy_version: l.policy_version,
        });
    }
    let name = path
        .file_stem()
        .map_or("rollouts".into(), |s| s.to_string_lossy().into_owned());
    Ok(Workload {
        name,
        block_size: block_size.unwrap_or(64),
        requests,
        barrier: Some(Barrier {
            pause_ms: 1000.0,
            staleness: 0,
            rollout_share: None,
        }),
    })
}
