//! A connection's streams: the table of calls by stream id, what each message, end, reset,
//! placement, health change and shutdown phase does to them, and the answers it writes into
//! the HTTP/2 connection's output.

use super::PROCESS_PATH;
use crate::exchange::{Exchange, Step};
use crate::grpc::{self, status, MessageError, Messages};
use crate::h2::{ById, Connection, Event};
use crate::health::{self, Health};
use crate::pb::envoy::service::ext_proc::v3 as ep;
use crate::service::{ExtProc, InFlight, Phase, Placed, Share};
use bytes::Bytes;
use futures::future::{AbortHandle, Abortable, BoxFuture, FutureExt};
use futures::stream::FuturesUnordered;
use prost::Message;
use std::collections::VecDeque;
use tokio::sync::watch;

mod phases;

/// One stream's call.
enum Call {
    /// Boxed: an exchange is some 600 bytes, a health call a tenth of that.
    Process(Box<Process>),
    Health(health::Call),
}

impl Call {
    fn messages(&mut self) -> &mut Messages {
        match self {
            Call::Process(p) => &mut p.messages,
            Call::Health(h) => h.messages(),
        }
    }
}

/// A `Process` stream.
struct Process {
    messages: Messages,
    exchange: Exchange,
    /// A placement is running: messages wait here, in order.
    placing: Option<(AbortHandle, VecDeque<ep::ProcessingRequest>)>,
    /// The bytes of the messages in `placing`'s queue.
    waiting_bytes: usize,
    /// The gateway ended its side.
    remote_ended: bool,
    _in_flight: InFlight,
}

impl Drop for Process {
    /// A stream that goes (ended, reset, or its connection stopped) gives up the placement it
    /// is still waiting for.
    fn drop(&mut self) {
        if let Some((abort, _)) = &self.placing {
            abort.abort();
        }
    }
}

/// A call's stream: whether its response headers went out.
struct Entry {
    call: Call,
    headers_sent: bool,
}

pub(super) type Placing = FuturesUnordered<BoxFuture<'static, (u32, Option<Placed>)>>;

/// What the connection's task holds besides the socket.
pub(super) struct Conn {
    service: ExtProc,
    pub(super) h2: Connection,
    calls: ById<Entry>,
    pub(super) phase: Phase,
    /// The picker's health now (read when a health call answers).
    health: watch::Receiver<Health>,
    /// `Watch` calls open.
    watchers: usize,
    /// Bytes of messages not yet whole, all calls together: at most `max_held` after a read,
    /// and all connections' at most `max_held_total` (the call whose bytes pass either ends
    /// `RESOURCE_EXHAUSTED`).
    held: Share,
    max_held: usize,
    max_held_total: usize,
    scratch: Vec<u8>,
}

impl Conn {
    pub(super) fn new(service: ExtProc, phase: Phase, health: watch::Receiver<Health>) -> Self {
        let limits = service.h2_limits();
        // Two messages of the largest size at once, whatever the streams; four over all
        // connections.
        let max_held = 2 * service.max_message();
        let max_held_total = 4 * service.max_message();
        let held = service.held_share();
        Self {
            service,
            h2: Connection::new(limits),
            calls: ById::default(),
            phase,
            health,
            watchers: 0,
            held,
            max_held,
            max_held_total,
            scratch: Vec::new(),
        }
    }

    /// Some stream watches the health.
    pub(super) fn watching(&self) -> bool {
        self.watchers > 0
    }

    /// No stream is open.
    pub(super) fn idle(&self) -> bool {
        self.calls.is_empty()
    }

    /// The picker's health as this connection answers it: not serving once it drains, even
    /// before the health report says so.
    fn serving(&self) -> bool {
        self.phase == Phase::Serving && self.health.borrow().serving
    }

    /// Forgets stream `id`'s call (dropping it: an exchange's drop releases its load).
    fn remove(&mut self, id: u32) -> Option<Entry> {
        let mut entry = self.calls.remove(&id)?;
        let gone = entry.call.messages().held();
        self.held.set(self.held.mine() - gone);
        if matches!(entry.call, Call::Health(health::Call::Watch { .. })) {
            self.watchers -= 1;
        }
        Some(entry)
    }

    pub(super) fn on_event(&mut self, event: Event, placing: &mut Placing) {
        match event {
            Event::Open {
                id,
                path,
                encoding,
                end,
            } => self.open(id, &path, encoding, end, placing),
            Event::Data { id, data, end } => self.data(id, data, end, placing),
            // Dropping the call drops its exchange (releasing its load) and gives up its
            // placement.
            Event::Reset { id } => drop(self.remove(id)),
        }
    }

    fn open(
        &mut self,
        id: u32,
        path: &str,
        encoding: Option<String>,
        end: bool,
        placing: &mut Placing,
    ) {
        if let Some(e) = encoding {
            let message = format!("grpc-encoding {e} is not supported (send identity)");
            self.h2
                .send_trailers(id, status::UNIMPLEMENTED, &message, true);
            return;
        }
        let max = self.service.max_message();
        let call = if path == PROCESS_PATH {
            if self.phase != Phase::Serving {
                let message = "kvrouter is draining for shutdown and takes no new requests";
                self.h2
                    .send_trailers(id, status::UNAVAILABLE, message, true);
                return;
            }
            Call::Process(Box::new(Process {
                messages: Messages::new(max),
                exchange: Exchange::new(self.service.config()),
                placing: None,
                waiting_bytes: 0,
                remote_ended: false,
                _in_flight: self.service.in_flight(),
            }))
        } else if let Some(call) = health::Call::of(path, max) {
            if matches!(call, health::Call::Watch { .. }) {
                self.watchers += 1;
            }
            Call::Health(call)
        } else {
            let message = format!("no method {path} here");
            self.h2
                .send_trailers(id, status::UNIMPLEMENTED, &message, true);
            return;
        };
        // A streaming call's response headers go out at once: a client's call (tonic's
        // `streaming`) returns once it has them, before the first message.
        let streaming = !matches!(call, Call::Health(health::Call::Check { .. }));
        if streaming {
            self.h2.send_headers(id);
        }
        self.calls.insert(
            id,
            Entry {
                call,
                headers_sent: streaming,
            },
        );
        if end {
            self.data(id, Bytes::new(), true, placing);
        }
    }

    fn data(&mut self, id: u32, data: Bytes, end: bool, placing: &mut Placing) {
        let Some(entry) = self.calls.get_mut(&id) else {
            return;
        };
        let mut msgs = Vec::new();
        let messages = entry.call.messages();
        let before = messages.held();
        let read = messages.push(data, end, &mut msgs);
        let total = self.held.set(self.held.mine() - before + messages.held());
        if let Err(e) = read {
            self.fail(id, &e);
            return;
        }
        if self.held.mine() > self.max_held || total > self.max_held_total {
            let message = format!(
                "the picker holds over {} bytes of messages not yet whole on this gateway \
                 connection, or {} on all",
                self.max_held, self.max_held_total
            );
            self.end(id, status::RESOURCE_EXHAUSTED, &message);
            return;
        }
        for m in msgs {
            if !self.message(id, m, placing) {
                return;
            }
        }
        if end {
            self.remote_end(id);
        }
    }

    /// A message was read whole; false when the stream ended with it.
    fn message(&mut self, id: u32, bytes: Bytes, placing: &mut Placing) -> bool {
        let Some(entry) = self.calls.get_mut(&id) else {
            return false;
        };
        match &mut entry.call {
            Call::Process(p) => {
                let size = bytes.len();
                let msg = match ep::ProcessingRequest::decode(bytes) {
                    Ok(m) => m,
                    Err(e) => {
                        let message = format!("not an ext_proc message stream: {e}");
                        self.end(id, status::INVALID_ARGUMENT, &message);
                        return false;
                    }
                };
                if let Some((_, waiting)) = &mut p.placing {
                    // Bounded: a gateway waits for answers; one that does not is cut.
                    p.waiting_bytes += size;
                    if p.waiting_bytes > self.service.max_message() {
                        let message = format!(
                            "over {} bytes of messages came while the request was being placed",
                            self.service.max_message()
                        );
                        self.end(id, status::RESOURCE_EXHAUSTED, &message);
                        return false;
                    }
                    waiting.push_back(msg);
                    return true;
                }
                self.process(id, msg, placing)
            }
            Call::Health(h) => match h.request(&bytes) {
                Ok(()) => {
                    if matches!(h, health::Call::Watch { .. }) {
                        self.send_health(id);
                    }
                    true
                }
                Err(message) => {
                    self.end(id, status::INVALID_ARGUMENT, &message);
                    false
                }
            },
        }
    }

    /// Hands one message to a `Process` stream's exchange; false when the stream ended.
    fn process(&mut self, id: u32, msg: ep::ProcessingRequest, placing: &mut Placing) -> bool {
        let Some(Entry {
            call: Call::Process(p),
            ..
        }) = self.calls.get_mut(&id)
        else {
            return false;
        };
        match p.exchange.on_message(msg) {
            Step::Reply(out) => self.replies(id, &out),
            place => {
                let (abort, registration) = AbortHandle::new_pair();
                let future = Abortable::new(self.service.place(place), registration);
                p.placing = Some((abort, VecDeque::new()));
                placing.push(async move { (id, future.await.ok()) }.boxed());
                true
            }
        }
    }

    pub(super) fn on_placed(&mut self, id: u32, placed: Option<Placed>, placing: &mut Placing) {
        let Some(placed) = placed else {
            return; // given up with its stream
        };
        let Some(Entry {
            call: Call::Process(p),
            ..
        }) = self.calls.get_mut(&id)
        else {
            return; // the stream went: dropping the placement releases it
        };
        let waiting = p.placing.take().map(|(_, w)| w).unwrap_or_default();
        p.waiting_bytes = 0;
        let out = p.exchange.placed(placed.result, placed.body);
        if !self.replies(id, &out) {
            return;
        }
        for msg in waiting {
            let Some(Entry {
                call: Call::Process(p),
                ..
            }) = self.calls.get_mut(&id)
            else {
                return;
            };
            if let Some((_, later)) = &mut p.placing {
                later.push_back(msg);
                continue;
            }
            if !self.process(id, msg, placing) {
                return;
            }
        }
        self.remote_end_if_idle(id);
    }

    /// Writes a `Process` stream's answers; ends the stream when the exchange is over. False
    /// when it ended.
    fn replies(&mut self, id: u32, out: &[ep::ProcessingResponse]) -> bool {
        for r in out {
            self.scratch.clear();
            grpc::encode(r, &mut self.scratch);
            self.send(id);
        }
        let over = matches!(
            self.calls.get(&id),
            Some(Entry { call: Call::Process(p), .. }) if p.exchange.over()
        );
        if over {
            self.end(id, status::OK, "");
        }
        !over
    }

    /// Writes the message in `scratch` on stream `id`, after its response headers.
    fn send(&mut self, id: u32) {
        if let Some(entry) = self.calls.get_mut(&id) {
            if !entry.headers_sent {
                entry.headers_sent = true;
                self.h2.send_headers(id);
            }
            self.h2.send_data(id, &self.scratch);
        }
    }

    /// The gateway ended its side of stream `id`.
    fn remote_end(&mut self, id: u32) {
        let serving = self.serving();
        match self.calls.get_mut(&id).map(|e| &mut e.call) {
            Some(Call::Process(p)) => {
                p.remote_ended = true;
                self.remote_end_if_idle(id);
            }
            Some(Call::Health(h)) => {
                if let Some((code, message)) = h.answer(serving) {
                    match code {
                        status::OK => {
                            self.scratch.clear();
                            grpc::encode(&health::response(serving), &mut self.scratch);
                            self.send(id);
                            self.end(id, status::OK, "");
                        }
                        _ => self.end(id, code, &message),
                    }
                }
            }
            None => {}
        }
    }

    /// Ends a `Process` stream whose gateway side ended, once nothing of it is pending: its
    /// end drops the exchange (a placement whose answer had not ended is released).
    fn remote_end_if_idle(&mut self, id: u32) {
        let idle = matches!(
            self.calls.get(&id),
            Some(Entry { call: Call::Process(p), .. }) if p.remote_ended && p.placing.is_none()
        );
        if idle {
            self.end(id, status::OK, "");
        }
    }

    /// Ends stream `id` with `code`, dropping its call.
    fn end(&mut self, id: u32, code: u32, message: &str) {
        if let Some(entry) = self.remove(id) {
            self.h2
                .send_trailers(id, code, message, !entry.headers_sent);
        }
    }

    fn fail(&mut self, id: u32, e: &MessageError) {
        let (code, message) = e.status();
        self.end(id, code, &message);
    }
}
