//! `--provenance-log`: one JSON line per finished request (who served it, under which policy
//! version, how long it queued, prefilled and decoded). Handlers hand lines to a bounded channel
//! and never wait: a writer thread appends them and rotates the file at a size bound (the
//! previous file becomes `PATH.1`). Lines that do not fit in the channel are counted and dropped.

use serde::Serialize;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::time::Instant;

/// Lines waiting for the writer before new ones are dropped.
const CHANNEL: usize = 8192;

/// One request's provenance.
#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct Provenance {
    /// Wall-clock end time, ms since the Unix epoch.
    pub(crate) ts_ms: u64,
    pub(crate) request_id: u64,
    /// The request's `x-request-id` (the client's, or the one the router made).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) x_request_id: Option<String>,
    /// The body's `model`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) model: Option<String>,
    /// `x-session-id` / `x-dynamo-session-id` (the trajectory id for RL).
    pub(crate) session: Option<String>,
    /// `x-kvrouter-group-id`.
    pub(crate) group: Option<String>,
    /// The worker that ended it (`null`: never started).
    pub(crate) worker: Option<u64>,
    pub(crate) dp_rank: u32,
    pub(crate) policy_version: u64,
    pub(crate) prompt_tokens: u64,
    /// From the engine's usage, when it reports it.
    pub(crate) cached_tokens: Option<u64>,
    pub(crate) output_tokens: u64,
    /// Arrival to placement (tokenization and the router queue).
    pub(crate) queue_ms: f64,
    /// Arrival to first byte (queue and prefill).
    pub(crate) ttft_ms: Option<f64>,
    /// First byte to the end.
    pub(crate) decode_ms: Option<f64>,
    pub(crate) e2e_ms: f64,
    pub(crate) migrations: u32,
    /// Times a weight update aborted it (it was continued on an updated worker).
    pub(crate) update_aborts: u32,
    /// `ok`, `cancelled` (the client left), `failed`, or `aborted` (ended early).
    pub(crate) status: &'static str,
    /// Why it was ended early: `group-satisfied` (first-N-of-M).
    pub(crate) abort_reason: Option<&'static str>,
    /// A pick, whose caller sent the request itself: `api` (`POST /v1/pick`) or `ext_proc`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) pick: Option<&'static str>,
    /// The HTTP status the worker answered (the access log's; not in the provenance line).
    #[serde(skip)]
    pub(crate) http_status: Option<u16>,
    /// Whether the access log (`--access-log`) samples this request.
    #[serde(skip)]
    pub(crate) access: bool,
    /// Whether OTLP tracing (`--otlp-endpoint`) samples this request.
    #[serde(skip)]
    pub(crate) trace: bool,
    /// When it passed each step (for its trace).
    #[serde(skip)]
    pub(crate) timeline: Timeline,
}

/// When a request passed each step (for its trace, `otel`).
#[derive(Clone, Debug, Default)]
pub(crate) struct Timeline {
    /// Its prompt was tokenized and hashed.
    pub(crate) tokenized: Option<Instant>,
    /// It entered the router queue (`None`: placed at once).
    pub(crate) queued: Option<Instant>,
    /// Its first attempt was placed.
    pub(crate) placed: Option<Instant>,
    /// The worker of its first attempt.
    pub(crate) first_worker: u64,
    /// The chosen candidate's cost (lower is better), when the policy scored candidates.
    pub(crate) score: Option<f64>,
    /// Prompt tokens the router expected cached on the chosen worker.
    pub(crate) predicted_cached_tokens: u64,
}

/// The provenance log.
#[derive(Debug)]
pub struct ProvenanceLog {
    tx: SyncSender<String>,
    dropped: AtomicU64,
    path: PathBuf,
    writer: std::thread::JoinHandle<()>,
}

impl ProvenanceLog {
    /// Opens (appends to) `path`, rotating to `PATH.1` past `max_bytes`.
    pub fn open(path: &Path, max_bytes: u64) -> std::io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        let size = file.metadata()?.len();
        let (tx, rx) = sync_channel::<String>(CHANNEL);
        let owned = path.to_owned();
        let writer = std::thread::Builder::new()
            .name("provenance-log".into())
            .spawn(move || write_loop(rx, owned, file, size, max_bytes.max(4096)))?;
        Ok(Self {
            tx,
            dropped: AtomicU64::new(0),
            path: path.to_owned(),
            writer,
        })
    }

    /// Stops taking lines and waits until every accepted line is written.
    pub fn close(self) {
        let Self { tx, writer, .. } = self;
        drop(tx);
        let _ = writer.join();
    }

    /// The file written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Lines dropped because the writer fell behind.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    pub(crate) fn record(&self, p: &Provenance) {
        let Ok(line) = serde_json::to_string(p) else {
            return;
        };
        match self.tx.try_send(line) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

fn write_loop(rx: Receiver<String>, path: PathBuf, file: File, mut size: u64, max: u64) {
    let mut out = BufWriter::new(file);
    while let Ok(first) = rx.recv() {
        let mut next = Some(first);
        while let Some(line) = next {
            if size > 0 && size + line.len() as u64 + 1 > max {
                let _ = out.flush();
                let mut rotated = path.clone().into_os_string();
                rotated.push(".1");
                let reopened = std::fs::rename(&path, &rotated)
                    .and_then(|()| OpenOptions::new().create(true).append(true).open(&path));
                match reopened {
                    Ok(f) => {
                        out = BufWriter::new(f);
                        size = 0;
                    }
                    Err(e) => {
                        tracing::warn!("provenance log: cannot rotate {}: {e}", path.display())
                    }
                }
            }
            if writeln!(out, "{line}").is_ok() {
                size += line.len() as u64 + 1;
            }
            next = rx.try_recv().ok();
        }
        // The channel is empty: make what we have visible.
        let _ = out.flush();
    }
    let _ = out.flush();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_appended_and_rotated_at_the_bound() {
        let dir = std::env::temp_dir().join(format!("kvrouter-prov-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("prov.jsonl");
        let log = ProvenanceLog::open(&path, 4096).unwrap();
        for i in 0..100 {
            log.record(&Provenance {
                request_id: i,
                status: "ok",
                ..Default::default()
            });
        }
        log.close();
        let read = |p: &Path| std::fs::read_to_string(p).unwrap();
        let all = read(&dir.join("prov.jsonl.1")) + &read(&path);
        let lines: Vec<&str> = all.lines().collect();
        assert!(std::fs::metadata(dir.join("prov.jsonl.1")).unwrap().len() <= 4096);
        // Rotation keeps one old file: the newest lines survive, in order, as JSON.
        let ids: Vec<u64> = lines
            .iter()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["request_id"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        assert_eq!(ids.last(), Some(&99));
        assert!(ids.windows(2).all(|w| w[1] == w[0] + 1), "{ids:?}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
