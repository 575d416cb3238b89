//! The engine driver: one task owns the engine, adds and cancels requests, and steps it against
//! the wall clock, delivering each step's tokens when the timing model says the step ends.
//!
//! Steps follow the model's clock, not the host's: while the engine keeps working, the next step
//! starts where the last one ended ([`step_start`]), so a late timer tick or a busy CPU delays
//! the delivery of a step's tokens but does not stretch the steps after it (the engine catches
//! up, up to `max_step_lag`). The driver sleeps until a step's end (tokio's timer, 1 ms
//! resolution) and never spins: a fast profile's steps shorter than a tick are delivered a few at
//! a time, each no earlier than its end.

use crate::config::MockEngineConfig;
use crate::publisher::{Published, PublisherHandle};
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
    /// Event batches dropped because the publisher's queue was full.
    pub(crate) kv_batches_dropped: u64,
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
    let pacing = Pacing {
        max_lag: config.max_step_lag,
    };
    tokio::spawn(run(engine, rx, shared, publisher, weight_load, pacing));
    tx
}

/// How steps follow the model's clock.
#[derive(Clone, Copy, Debug)]
struct Pacing {
    /// How far the host may fall behind the model before the engine restarts from the wall
    /// clock instead of catching up.
    max_lag: Duration,
}

/// Where the next step starts on the model's clock. While the engine keeps working
/// (`last_end`: the end of its previous step) it starts there, however late the host is, so
/// host delays are caught up instead of stretching every later step; but never before the
/// newest request it admits arrived (`newest_arrival`), and from the wall clock `now` after
/// idling or when the host fell more than `max_lag` behind (a stalled process is not replayed).
pub(crate) fn step_start(
    last_end: Option<Time>,
    newest_arrival: Option<Time>,
    now: Time,
    max_lag: Duration,
) -> Time {
    match last_end {
        Some(end) if now.since(end) <= max_lag => newest_arrival.map_or(end, |a| a.max(end)),
        _ => now,
    }
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
    pacing: Pacing,
) {
    let epoch = Instant::now();
    let clock = || Time::from_micros(epoch.elapsed().as_micros() as u64);
    // The end of the last step while the engine keeps working, and when the newest request
    // added since it arrived (see `step_start`).
    let mut last_end: Option<Time> = None;
    let mut newest_arrival: Option<Time> = None;
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
            last_end = None;
            match rx.recv().await {
                Some(cmd) => {
                    note(&cmd, &mut last_end, &mut newest_arrival, clock());
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
            note(&cmd, &mut last_end, &mut newest_arrival, clock());
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
        let now = step_start(last_end, newest_arrival.take(), clock(), pacing.max_lag);
        let outcome = match engine.step(now) {
            Ok(Some(out)) => out,
            Ok(None) => {
                last_end = None;
                continue;
            }
            Err(e) => {
                last_end = None;
                for (id, tx) in streams.drain() {
                    let _ = tx.send(Delivery::Failed(e.to_string()));
                    engine.cancel(id);
                }
                continue;
            }
        };
        last_end = Some(outcome.end);
        let due = epoch + Duration::from_micros(outcome.end.as_micros());
        if due > Instant::now() {
            tokio::time::sleep_until(due).await;
        } else {
            // Catching up: let the host's other tasks (HTTP, an embedding router) run between
            // steps.
            tokio::task::yield_now().await;
        }
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
            (Some(p), false) => Some(p.publish(outcome.events)),
            _ => None,
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
        count_published(&mut snap, published);
    }
}

/// Notes a command for the step clock: a request's arrival (the step admitting it starts no
/// earlier); pausing, resuming or loading weights take real time, so the next step starts from
/// the wall clock.
fn note(cmd: &Command, last_end: &mut Option<Time>, newest_arrival: &mut Option<Time>, now: Time) {
    match cmd {
        Command::Add { .. } => *newest_arrival = Some(now),
        Command::Cancel(_) => {}
        Command::Pause { .. } | Command::Resume(_) | Command::LoadWeights { .. } => {
            *last_end = None
        }
    }
}

/// Counts a batch handed to the publisher (`None`: the step had no events).
fn count_published(snap: &mut Snapshot, published: Option<Published>) {
    match published {
        Some(Published::Queued) => snap.kv_batches_published += 1,
        Some(Published::Dropped) => snap.kv_batches_dropped += 1,
        Some(Published::Closed) | None => {}
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
                    let published = p.publish(events);
                    count_published(
                        &mut shared.snapshot.lock().expect("snapshot lock"),
                        Some(published),
                    );
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

#[cfg(test)]
mod tests {
    use super::step_start;
    use kvrouter_core::time::Time;
    use std::time::Duration;

    #[test]
    fn steps_follow_the_model_clock_and_catch_up_within_the_lag() {
        let ms = Time::from_millis;
        let lag = Duration::from_millis(50);
        // Idle: from the wall clock.
        assert_eq!(step_start(None, None, ms(100), lag), ms(100));
        // Working, host 3 ms late (a timer tick, a busy CPU): where the last step ended.
        assert_eq!(step_start(Some(ms(97)), None, ms(100), lag), ms(97));
        // A request that arrived after the last step ended: not before it arrived.
        assert_eq!(step_start(Some(ms(97)), Some(ms(99)), ms(100), lag), ms(99));
        assert_eq!(step_start(Some(ms(97)), Some(ms(90)), ms(100), lag), ms(97));
        // More than the lag behind: restart from the wall clock.
        assert_eq!(step_start(Some(ms(40)), None, ms(100), lag), ms(100));
    }
}
