//! The engine driver: one task owns the engine, adds and cancels requests, and steps it against
//! the wall clock, delivering each step's tokens when the timing model says the step ends.

use crate::config::MockEngineConfig;
use crate::publisher::PublisherHandle;
use kvrouter_core::ids::{RequestId, WorkerId, WorkerRank};
use kvrouter_core::time::Time;
use kvrouter_engine::{Engine, EngineError, EngineRequest, EngineStats};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// What a request's stream receives.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Delivery {
    /// One generated token.
    Token { id: u32 },
    /// The request finished.
    Done {
        prompt_tokens: u32,
        cached_tokens: u32,
        completion_tokens: u32,
        /// Ended by an abort (finish reason `abort`), not by its token budget.
        aborted: bool,
    },
    /// The engine failed the request.
    Failed(String),
}

pub(crate) enum Command {
    Add {
        request: EngineRequest,
        deliver: mpsc::UnboundedSender<Delivery>,
        accepted: tokio::sync::oneshot::Sender<Result<(), EngineError>>,
    },
    Cancel(RequestId),
    /// Stop stepping (requests are still accepted and wait); answers when paused. With `abort`,
    /// requests in flight end first, with their partial output.
    Pause {
        abort: bool,
        done: tokio::sync::oneshot::Sender<usize>,
    },
    /// Step again.
    Resume(tokio::sync::oneshot::Sender<()>),
    /// Load the weights of a policy version: pause for the weight-load time, drop the prefix
    /// cache (announced as `AllBlocksCleared`), take the version, and carry on as before.
    LoadWeights {
        version: u64,
        clear_cache: bool,
        done: tokio::sync::oneshot::Sender<u64>,
    },
}

/// Step lateness against the timing model, as a histogram in milliseconds.
pub(crate) const LATENESS_BUCKETS_MS: [f64; 10] =
    [0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0];

/// Counters the HTTP side reads.
#[derive(Debug, Default)]
pub(crate) struct Snapshot {
    pub(crate) stats: EngineStats,
    pub(crate) steps: u64,
    pub(crate) lateness_counts: [u64; LATENESS_BUCKETS_MS.len() + 1],
    pub(crate) lateness_sum_ms: f64,
    pub(crate) kv_batches_published: u64,
    pub(crate) paused: bool,
    pub(crate) policy_version: u64,
}

#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) snapshot: Mutex<Snapshot>,
}

impl Shared {
    pub(crate) fn new(_config: &MockEngineConfig) -> Self {
        Self {
            snapshot: Mutex::new(Snapshot::default()),
        }
    }
}

/// Spawns the driver; returns the command channel.
pub(crate) fn spawn(
    config: &MockEngineConfig,
    shared: Arc<Shared>,
    publisher: Option<PublisherHandle>,
) -> mpsc::UnboundedSender<Command> {
    let (tx, rx) = mpsc::unbounded_channel();
    let rank = WorkerRank::new(WorkerId(0), config.dp_rank);
    let mut engine = Engine::new(
        config.engine.clone(),
        rank,
        config.timing.model(config.speedup_ratio),
    );
    let tokenizer = config.tokenizer.clone();
    engine.set_token_mapper(Box::new(move |raw| tokenizer.filler_token(raw)));
    let weight_load = config.weight_load.div_f64(config.speedup_ratio.max(1e-9));
    tokio::spawn(run(engine, rx, shared, publisher, weight_load));
    tx
}

/// Driver state the control commands change.
struct Control {
    paused: bool,
    weight_load: Duration,
}

async fn run(
    mut engine: Engine,
    mut rx: mpsc::UnboundedReceiver<Command>,
    shared: Arc<Shared>,
    publisher: Option<PublisherHandle>,
    weight_load: Duration,
) {
    let epoch = Instant::now();
    let mut streams: HashMap<RequestId, mpsc::UnboundedSender<Delivery>> = HashMap::new();
    let mut control = Control {
        paused: false,
        weight_load,
    };
    loop {
        if control.paused || !engine.has_work() {
            // Steps refresh the figures; an engine about to wait (a cancel or an abort left it
            // idle) takes none, so refresh them here.
            shared.snapshot.lock().expect("snapshot lock").stats = engine.stats();
            match rx.recv().await {
                Some(cmd) => {
                    handle(
                        &mut engine,
                        &mut streams,
                        cmd,
                        &mut control,
                        &shared,
                        &publisher,
                    )
                    .await
                }
                None => return,
            }
        }
        while let Ok(cmd) = rx.try_recv() {
            handle(
                &mut engine,
                &mut streams,
                cmd,
                &mut control,
                &shared,
                &publisher,
            )
            .await;
        }
        if control.paused {
            continue;
        }
        let now = Time::from_micros(epoch.elapsed().as_micros() as u64);
        let outcome = match engine.step(now) {
            Ok(Some(out)) => out,
            Ok(None) => continue,
            Err(e) => {
                for (id, tx) in streams.drain() {
                    let _ = tx.send(Delivery::Failed(e.to_string()));
                    engine.cancel(id);
                }
                continue;
            }
        };
        let due = epoch + Duration::from_micros(outcome.end.as_micros());
        wait_until(due).await;
        let late_ms = Instant::now().saturating_duration_since(due).as_secs_f64() * 1e3;
        for t in &outcome.tokens {
            if let Some(tx) = streams.get(&t.id) {
                if tx.send(Delivery::Token { id: t.token }).is_err() {
                    // The client went away: stop the request.
                    streams.remove(&t.id);
                    engine.cancel(t.id);
                }
            }
        }
        for f in &outcome.finished {
            if let Some(tx) = streams.remove(&f.id) {
                let _ = tx.send(Delivery::Done {
                    prompt_tokens: f.prompt_tokens,
                    cached_tokens: f.cached_tokens,
                    completion_tokens: f.output_tokens,
                    aborted: false,
                });
            }
        }
        let published = match (&publisher, outcome.events.is_empty()) {
            (Some(p), false) => p.publish(outcome.events),
            _ => false,
        };
        let mut snap = shared.snapshot.lock().expect("snapshot lock");
        snap.stats = engine.stats();
        snap.steps += 1;
        let bucket = LATENESS_BUCKETS_MS
            .iter()
            .position(|b| late_ms <= *b)
            .unwrap_or(LATENESS_BUCKETS_MS.len());
        snap.lateness_counts[bucket] += 1;
        snap.lateness_sum_ms += late_ms;
        snap.kv_batches_published += u64::from(published);
    }
}

/// Waits until `due` with sub-millisecond accuracy: tokio's timer has a 1 ms resolution, so it
/// sleeps until about a millisecond before and yields for the rest. Steps shorter than that (fast
/// profiles, large speed-ups) are then not stretched to a whole timer tick.
async fn wait_until(due: Instant) {
    let margin = Duration::from_millis(1);
    if due.saturating_duration_since(Instant::now()) > 2 * margin {
        tokio::time::sleep_until(due - margin).await;
    }
    while Instant::now() < due {
        tokio::task::yield_now().await;
    }
}

async fn handle(
    engine: &mut Engine,
    streams: &mut HashMap<RequestId, mpsc::UnboundedSender<Delivery>>,
    cmd: Command,
    control: &mut Control,
    shared: &Shared,
    publisher: &Option<PublisherHandle>,
) {
    match cmd {
        Command::Add {
            request,
            deliver,
            accepted,
        } => {
            let id = request.id;
            let result = engine.add_request(request);
            if result.is_ok() {
                streams.insert(id, deliver);
            }
            let _ = accepted.send(result);
        }
        Command::Cancel(id) => {
            streams.remove(&id);
            engine.cancel(id);
        }
        Command::Pause { abort, done } => {
            let mut aborted = 0;
            if abort {
                for f in engine.abort_all() {
                    if let Some(tx) = streams.remove(&f.id) {
                        aborted += 1;
                        let _ = tx.send(Delivery::Done {
                            prompt_tokens: f.prompt_tokens,
                            cached_tokens: f.cached_tokens,
                            completion_tokens: f.output_tokens,
                            aborted: true,
                        });
                    }
                }
            }
            control.paused = true;
            let mut snap = shared.snapshot.lock().expect("snapshot lock");
            snap.paused = true;
            snap.stats = engine.stats();
            let _ = done.send(aborted);
        }
        Command::Resume(done) => {
            control.paused = false;
            shared.snapshot.lock().expect("snapshot lock").paused = false;
            let _ = done.send(());
        }
        Command::LoadWeights {
            version,
            clear_cache,
            done,
        } => {
            tokio::time::sleep(control.weight_load).await;
            if clear_cache {
                let events = engine.clear_cache();
                if let (Some(p), false) = (publisher, events.is_empty()) {
                    p.publish(events);
                }
            }
            shared
                .snapshot
                .lock()
                .expect("snapshot lock")
                .policy_version = version;
            let _ = done.send(version);
        }
    }
}
