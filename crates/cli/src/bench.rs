//! `kvrouter bench`: replay a trace or an RL workload against a live OpenAI-compatible endpoint
//! (kvrouter, a peer router, or one engine) and report what the simulator reports.
//!
//! Each workload request becomes a streaming `/v1/completions` call whose prompt is token ids
//! derived from the request's workload block ids, so requests that share blocks share a token
//! prefix and the endpoint's prefix cache sees the reuse the trace describes. Arrivals follow the
//! workload: open-loop arrival times, previous-turn chains with their delays, RL step barriers,
//! or a fixed concurrency (closed loop).

use crate::sim_table::print_table;
use crate::workload_args::load_workload;
use anyhow::{bail, Context};
use clap::Args;
use kvrouter_core::rng::mix64 as mix;
use kvrouter_core::time::Time;
use kvrouter_sim::{sent_only, summarize, Record, Summary};
use kvrouter_workload::replay::Replay;
use kvrouter_workload::Workload;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

mod client;
mod pick;
mod requests;

use client::{end_session, send, Outcome, Shared};

/// `kvrouter bench` flags.
#[derive(Debug, Args)]
pub(crate) struct BenchArgs {
    /// Base URL of the OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000. Repeat it to
    /// spread requests over several endpoints in turn (router replicas behind no balancer).
    #[arg(long, required = true)]
    pub(crate) url: Vec<String>,
    /// Trace file (Mooncake JSONL or Claude Code sessions; see docs/workloads.md).
    #[arg(long, conflicts_with = "workload")]
    pub(crate) trace: Option<PathBuf>,
    /// Generated workload instead of a trace: grpo, agentic or seed001.
    #[arg(long)]
    pub(crate) workload: Option<String>,
    /// Generator parameters as key=value,key=value (names as in docs/workloads.md).
    #[arg(long)]
    pub(crate) workload_args: Option<String>,
    /// Agentic session traces: mean gap between session starts, seconds.
    #[arg(long, default_value_t = 10.0)]
    pub(crate) session_gap_s: f64,
    /// Replay at most this many requests of the trace (0 = all).
    #[arg(long, default_value_t = 1000)]
    pub(crate) max_requests: usize,
    /// Closed loop: keep this many sessions in flight instead of following arrival times.
    #[arg(long)]
    pub(crate) concurrency: Option<usize>,
    /// Divide open-loop arrival times by this factor (2 = twice the trace's rate).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) arrival_speedup: f64,
    /// Stop sending new requests after this many seconds; requests in flight still finish.
    #[arg(long, default_value_t = 300.0)]
    pub(crate) duration_s: f64,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 600.0)]
    pub(crate) request_timeout_s: f64,
    /// Model name to send (default: the first model of GET /v1/models).
    #[arg(long)]
    pub(crate) model: Option<String>,
    /// Token ids in prompts are drawn from 0..VOCAB_SIZE (keep below the model's vocabulary).
    #[arg(long, default_value_t = 32_000)]
    pub(crate) vocab_size: u32,
    /// Prompt form: `tokens` (token ids on /v1/completions) or `text` (one two-letter word per
    /// token, for endpoints that take only text; exact for the built-in tokenizer).
    #[arg(long, default_value = "tokens")]
    pub prompt_format: String,
    /// Send each request's session as an `x-session-id` header (sticky-session routers).
    #[arg(long)]
    pub(crate) session_header: bool,
    /// End each session when its last turn finishes (or a turn fails, which ends it): `POST
    /// /finish_session` to the first --url, as an agent framework ending a trajectory does.
    /// It releases the session's pin (`serve`) and its home cluster (`serve --global`). Needs
    /// --session-header.
    #[arg(long, requires = "session_header")]
    pub(crate) end_sessions: bool,
    /// Send each request's RL group as an `x-kvrouter-group-id` header (group placement).
    #[arg(long)]
    pub(crate) group_header: bool,
    /// Also send the group's size as `x-kvrouter-group-size` (fair-share group placement).
    #[arg(long)]
    pub(crate) group_sizes: bool,
    /// First N of M: send `x-kvrouter-group-need: N` with the group id and size; samples the
    /// router ends early are counted as ended early, not as failures.
    #[arg(long)]
    pub(crate) group_need: Option<u32>,
    /// Drive the router's pick API instead of proxying: ask `POST /v1/pick` where each request
    /// goes (with its headers), send it to that worker directly, and report its first token
    /// and finish (the topology of a client that keeps its own engine connections).
    #[arg(long, conflicts_with = "group_need")]
    pub(crate) pick: bool,
    /// A header sent on every request to the --url endpoints, `NAME: VALUE` (repeatable), e.g.
    /// `Authorization: Bearer TOKEN` for a router run with `--pick-auth admin` or a gateway that
    /// wants a key. Not sent to the workers a pick names.
    #[arg(long = "header", value_name = "NAME: VALUE")]
    pub(crate) headers: Vec<String>,
    /// Name of the run in reports.
    #[arg(long, default_value = "bench")]
    pub(crate) name: String,
    /// Output directory for summary.json and requests.jsonl (one line per request sent).
    #[arg(long, default_value = "bench-out")]
    pub(crate) out: PathBuf,
    /// Write the request timeline as Chrome trace JSON (open in Perfetto).
    #[arg(long)]
    pub(crate) perfetto: Option<PathBuf>,
    /// No progress line on stderr.
    #[arg(long)]
    pub(crate) quiet: bool,
}

/// The prompt of request `i` as token ids: `block_size` ids per workload block id (equal block
/// ids give equal tokens), truncated or padded (with ids unique to the request) to its length.
pub(crate) fn prompt_tokens(workload: &Workload, i: usize, vocab_size: u32) -> Vec<u32> {
    let req = &workload.requests[i];
    let vocab = u64::from(vocab_size.max(2));
    let n = req.input_tokens as usize;
    let mut out = Vec::with_capacity(n);
    'blocks: for &b in &req.blocks {
        let seed = mix(b ^ 0x6b76_726f_7574_6572);
        for pos in 0..workload.block_size as u64 {
            if out.len() == n {
                break 'blocks;
            }
            out.push((mix(seed ^ pos) % vocab) as u32);
        }
    }
    let salt = mix(i as u64 ^ 0x7061_6464_696e_6721);
    while out.len() < n {
        out.push((mix(salt ^ out.len() as u64) % vocab) as u32);
    }
    out
}

/// The prompt of request `i` as text: one word `" xy"` per token of [`prompt_tokens`] (676
/// two-letter words), so equal block ids give equal text and, with the built-in tokenizer (and
/// most BPE vocabularies, which hold common two-letter words), one token per word.
pub(crate) fn prompt_text(workload: &Workload, i: usize) -> String {
    let mut out = String::with_capacity(workload.requests[i].input_tokens as usize * 3);
    for t in prompt_tokens(workload, i, 26 * 26) {
        out.push(' ');
        out.push(char::from(b'a' + (t / 26) as u8));
        out.push(char::from(b'a' + (t % 26) as u8));
    }
    out
}

/// `--header NAME: VALUE` entries as a header map, each checked.
fn router_headers(given: &[String]) -> anyhow::Result<reqwest::header::HeaderMap> {
    let mut out = reqwest::header::HeaderMap::new();
    for h in given {
        let (name, value) = h
            .split_once(':')
            .with_context(|| format!("--header {h:?}: expected NAME: VALUE"))?;
        let name = reqwest::header::HeaderName::from_bytes(name.trim().as_bytes())
            .with_context(|| format!("--header {h:?}: not a header name"))?;
        // The request's framing is the client's: a given length or encoding would contradict
        // the body it sends, and the host is the URL's.
        use reqwest::header::{CONNECTION, CONTENT_LENGTH, HOST, TRANSFER_ENCODING};
        if [CONTENT_LENGTH, TRANSFER_ENCODING, HOST, CONNECTION].contains(&name) {
            bail!("--header {h:?}: {name} is set by the request itself");
        }
        let value = reqwest::header::HeaderValue::from_str(value.trim())
            .with_context(|| format!("--header {h:?}: not a header value"))?;
        out.append(name, value);
    }
    Ok(out)
}

async fn first_model(
    client: &reqwest::Client,
    url: &str,
    headers: &reqwest::header::HeaderMap,
    timeout: Duration,
) -> anyhow::Result<String> {
    // Bounded by --request-timeout-s: an endpoint that accepts and never answers hung here.
    let v: serde_json::Value = client
        .get(format!("{url}/v1/models"))
        .headers(headers.clone())
        .timeout(timeout)
        .send()
        .await
        .with_context(|| format!("--url {url}: GET /v1/models"))?
        .error_for_status()
        .with_context(|| format!("--url {url}: GET /v1/models"))?
        .json()
        .await
        .context("GET /v1/models: bad JSON")?;
    v["data"][0]["id"]
        .as_str()
        .map(str::to_owned)
        .with_context(|| format!("--url {url}: /v1/models lists no model; pass --model"))
}

/// Runs `kvrouter bench`.
pub(crate) async fn run(args: BenchArgs) -> anyhow::Result<()> {
    if !args.arrival_speedup.is_finite()
        || args.arrival_speedup < crate::flag_values::MIN_ARRIVAL_SPEEDUP
    {
        bail!(
            "--arrival-speedup must be a number of at least {}",
            crate::flag_values::MIN_ARRIVAL_SPEEDUP
        );
    }
    if args.vocab_size < 2 {
        bail!("--vocab-size must be at least 2 (prompts draw token ids from 0..VOCAB_SIZE)");
    }
    if args.concurrency == Some(0) {
        bail!("--concurrency must be at least 1");
    }
    if args.group_need == Some(0) {
        bail!("--group-need must be at least 1");
    }
    let positive = |v: f64| v.is_finite() && v > 0.0 && v <= 86_400.0;
    if !positive(args.duration_s) || !positive(args.request_timeout_s) {
        bail!("--duration-s and --request-timeout-s must be positive, at most 86400");
    }
    if !matches!(args.prompt_format.as_str(), "tokens" | "text") {
        bail!(
            "--prompt-format {:?}: expected tokens or text",
            args.prompt_format
        );
    }
    let urls = args
        .url
        .iter()
        .map(|u| client::base_url(u))
        .collect::<anyhow::Result<Vec<_>>>()?;
    // Shared with the tasks that build each request's body.
    let workload = Arc::new(load_workload(
        args.trace.as_deref(),
        args.workload.as_deref(),
        args.workload_args.as_deref(),
        args.session_gap_s,
        args.max_requests,
    )?);
    workload
        .validate(1)
        .map_err(|e| anyhow::anyhow!("workload: {e}"))?;
    let multi_turn = workload
        .requests
        .iter()
        .any(|r| r.group.is_some() && r.after.is_some());
    if multi_turn && (args.group_sizes || args.group_need.is_some()) {
        bail!(
            "--group-sizes and --group-need count single-request samples; this workload's groups \
             are multi-turn trajectories (the router cannot tell a trajectory's last turn)"
        );
    }
    let headers = router_headers(&args.headers)?;
    crate::outputs::check_dir(&args.out, "--out")?;
    if let Some(p) = &args.perfetto {
        crate::outputs::check_not_out(p, &args.out)?;
        crate::outputs::check_file(p, "--perfetto")?;
    }
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .build()
        .context("HTTP client")?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => {
            let timeout = Duration::from_secs_f64(args.request_timeout_s);
            first_model(&client, &urls[0], &headers, timeout).await?
        }
    };
    let (summary, lines) = replay(&args, &workload, client, urls, model, headers).await?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("--out {}: cannot create", args.out.display()))?;
    let path = args.out.join("summary.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&[&summary])?)
        .with_context(|| format!("--out: cannot write {}", path.display()))?;
    requests::write(&args.out, &lines)?;
    print_table(std::slice::from_ref(&summary));
    println!(
        "completed {} refused {} failed {}; summary in {}",
        summary.completed,
        summary.rejected,
        summary.failed,
        path.display()
    );
    if summary.completed == 0 && summary.requests > 0 {
        bail!(
            "no request completed ({} refused, {} failed)",
            summary.rejected,
            summary.failed
        );
    }
    Ok(())
}

async fn replay(
    args: &BenchArgs,
    workload: &Arc<Workload>,
    client: reqwest::Client,
    urls: Vec<String>,
    model: String,
    router_headers: reqwest::header::HeaderMap,
) -> anyhow::Result<(Summary, Vec<requests::Line>)> {
    let n = workload.requests.len();
    let shared = Arc::new(Shared {
        client,
        router_headers,
        urls,
        next_url: Default::default(),
        model,
        start: Instant::now(),
        timeout: Duration::from_secs_f64(args.request_timeout_s),
        session_header: args.session_header,
        group_header: args.group_header || args.group_sizes || args.group_need.is_some(),
        group_sizes: (args.group_sizes || args.group_need.is_some()).then(|| {
            let mut sizes = std::collections::HashMap::new();
            for g in workload.requests.iter().filter_map(|r| r.group) {
                *sizes.entry(g).or_insert(0u32) += 1;
            }
            sizes
        }),
        group_need: args.group_need,
        pick: args.pick,
    });
    let mut deadline = Time::from_secs_f64(args.duration_s);
    // Ctrl-C (SIGINT) ends the run as --duration-s would: nothing new is sent, what is in flight
    // finishes (each bounded by the request timeout) and the summary covers what was sent; a
    // second Ctrl-C stops at once.
    let interrupted = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let interrupt_listener = tokio::spawn({
        let interrupted = interrupted.clone();
        async move {
            if tokio::signal::ctrl_c().await.is_err() {
                return;
            }
            eprintln!("\nkvrouter bench: interrupted; finishing what is in flight (Ctrl-C again stops at once)");
            interrupted.store(true, std::sync::atomic::Ordering::Relaxed);
            if tokio::signal::ctrl_c().await.is_ok() {
                std::process::exit(130);
            }
        }
    });
    let mut cut_short = false;
    let mut endings = Vec::new();
    let text_prompts = args.prompt_format == "text";
    let (mut replay, start) = Replay::new(workload, args.concurrency, args.arrival_speedup);
    // (due time, request) min-heap.
    let mut due: BinaryHeap<Reverse<(Time, usize)>> = start.into_iter().map(Reverse).collect();
    let mut records: Vec<Record> = (0..n).map(|_| Record::default()).collect();
    let mut decisions: Vec<Option<serde_json::Value>> = vec![None; n];
    let (tx, mut rx) = mpsc::unbounded_channel::<(usize, Outcome)>();
    let (mut in_flight, mut settled, mut errors, mut refused) = (0usize, 0usize, 0usize, 0usize);
    let mut first_error: Option<String> = None;
    let mut last_progress = Instant::now();
    loop {
        if !cut_short && interrupted.load(std::sync::atomic::Ordering::Relaxed) {
            cut_short = true;
            deadline = deadline.min(shared.now());
        }
        // Send everything due.
        let now = shared.now();
        while let Some(Reverse((at, i))) = due.peek().copied() {
            if at > now {
                break;
            }
            due.pop();
            if at > deadline {
                continue;
            }
            // Its body is built in its own task, so a long prompt's body does not hold back the
            // requests due after it (they would reach the router in trace order, late, where a
            // simulator's arrive together). Its arrival becomes the time sending began.
            records[i].arrival = Some(shared.now());
            in_flight += 1;
            let (tx, shared, owned) = (tx.clone(), shared.clone(), workload.clone());
            let vocab_size = args.vocab_size;
            tokio::spawn(async move {
                let req = &owned.requests[i];
                let prompt = if text_prompts {
                    serde_json::Value::from(prompt_text(&owned, i))
                } else {
                    serde_json::Value::from(prompt_tokens(&owned, i, vocab_size))
                };
                let body = serde_json::json!({
                    "model": shared.model,
                    "prompt": prompt,
                    "max_tokens": req.output_tokens,
                    "min_tokens": req.output_tokens,
                    "ignore_eos": true,
                    "temperature": 0.0,
                    "stream": true,
                    "stream_options": {"include_usage": true},
                });
                let outcome = send(shared, body, req.session, req.group).await;
                let _ = tx.send((i, outcome));
            });
        }
        if in_flight == 0 && due.peek().is_none_or(|Reverse((at, _))| *at > deadline) {
            break;
        }
        // Wait for a completion or the next due time.
        let wait = due
            .peek()
            .map(|Reverse((at, _))| Duration::from_micros(at.0.saturating_sub(shared.now().0)))
            .unwrap_or(Duration::from_secs(3600))
            .min(Duration::from_millis(500));
        let got = tokio::time::timeout(wait, rx.recv()).await;
        if let Ok(Some((i, o))) = got {
            in_flight -= 1;
            settled += 1;
            let r = &mut records[i];
            r.arrival = o.sent.or(r.arrival);
            let failed = o.error.is_some();
            if let Some(e) = o.error {
                if o.refused {
                    refused += 1;
                } else {
                    errors += 1;
                }
                first_error.get_or_insert(e);
                // Not served: refused under overload, or failed (connection, timeout, a
                // broken stream, any other error answer), as the simulator marks them.
                r.rejected = true;
                r.failed = !o.refused;
            } else {
                r.first_token = o.first_token;
                r.last_token = o.last_token;
                r.itl_sum_ms = o.itl_sum_ms;
                r.itl_count = o.itl_count;
                r.finish = o.finish;
                r.output_tokens = o.output_tokens;
                // An engine cannot have cached more than the prompt; a count above it is
                // the engine's error, not a hit.
                r.served_cached = o.cached_tokens.min(workload.requests[i].input_tokens);
                r.worker = o.worker;
                r.ended_early = o.ended_early;
                decisions[i] = o.decision;
            }
            // A session ends with a failed turn or one no later turn follows.
            if let (true, Some(session)) = (args.end_sessions, workload.requests[i].session) {
                if failed || !replay.has_followers(i) {
                    endings.push(tokio::spawn(end_session(shared.clone(), session)));
                }
            }
            let at = o.finish.unwrap_or_else(|| shared.now());
            let released = replay.finished(i, at, failed);
            for f in released.dropped {
                records[f].rejected = true;
            }
            due.extend(released.start.into_iter().map(Reverse));
        }
        if !args.quiet && last_progress.elapsed() >= Duration::from_millis(500) {
            last_progress = Instant::now();
            eprint!(
                "\r[{:>6.1}s] sent {:>6}/{n} done {settled:>6} in flight {in_flight:>5} failed {errors:>4} refused {refused:>4}",
                shared.now().as_secs_f64(),
                settled + in_flight,
            );
            let _ = std::io::stderr().flush();
        }
    }
    if !args.quiet {
        eprintln!();
    }
    interrupt_listener.abort();
    // Each ending is bounded by the request timeout.
    let ended = futures::future::join_all(endings).await;
    let unended = ended.iter().filter(|e| !matches!(e, Ok(true))).count();
    if unended > 0 {
        eprintln!("kvrouter bench: {unended} session end(s) were not acknowledged");
    }
    if let Some(e) = &first_error {
        // Refused (429/503/529 under overload) and failed apart, as the summary counts them.
        eprintln!(
            "kvrouter bench: {errors} request(s) failed, {refused} refused; first error: {e}"
        );
    }
    // Only requests that were sent count: the rest of the trace was cut by --duration-s.
    let (cut, recs) = sent_only(workload, &records);
    let end = shared.now();
    if let Some(path) = &args.perfetto {
        // The full workload and records: turn links (`after`) index them.
        let file = std::fs::File::create(path)
            .with_context(|| format!("--perfetto {}: cannot create", path.display()))?;
        kvrouter_sim::perfetto::write(std::io::BufWriter::new(file), workload, &records, &[])
            .with_context(|| format!("--perfetto {}: cannot write", path.display()))?;
    }
    let lines = requests::lines(workload, &records, decisions);
    Ok((summarize(&args.name, "live", &cut, &recs, end), lines))
}

#[cfg(test)]
mod tests;
