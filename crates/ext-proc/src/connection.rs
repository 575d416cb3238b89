//! One gateway connection: a task that reads a batch of HTTP/2 frames, answers every gRPC
//! message in it (placing requests through [`ExtProc::place`]), and writes all the answers
//! at once. No task or channel per stream: a stream is an entry in this task's table.
//!
//! Streams by path:
//! - `Process` ([`PROCESS_PATH`]): one gateway request, driven by its `Exchange`. A
//!   placement that must wait (the router queue) runs beside the connection's other streams;
//!   the messages that arrive meanwhile wait their turn. The stream's end or reset drops the
//!   exchange, which releases a placement whose answer had not ended; a reset also gives up a
//!   placement still waiting.
//! - `grpc.health.v1.Health/Check` and `/Watch` ([`crate::health`]).
//! - Anything else: `UNIMPLEMENTED`.
//!
//! A connection silent through a PING is closed ([`keepalive`]).
//!
//! Shutdown ([`Phase`]): while draining, new `Process` streams are refused `UNAVAILABLE` (the
//! gateway's failure mode applies) and the others go on; at the cut, the open `Process`
//! streams end `UNAVAILABLE`; at the stop, the connection ends with GOAWAY.

mod keepalive;
mod streams;

use crate::health::Health;
use crate::service::{ExtProc, Phase};
use bytes::BytesMut;
use futures::future::FutureExt;
use futures::stream::StreamExt;
use keepalive::{Due, Keepalive};
use streams::{Conn, Placing};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Instant;

/// The ext_proc method's path.
pub(crate) const PROCESS_PATH: &str = "/envoy.service.ext_proc.v3.ExternalProcessor/Process";

/// How much is read from the socket at a time, at least.
const READ_CHUNK: usize = 64 * 1024;
/// Answers written and not yet taken by the gateway past which the connection stops reading
/// (a peer that sends and never reads: PINGs, resets, headers are not flow-controlled).
const MAX_UNWRITTEN: usize = 4 << 20;
/// Answers waiting for the gateway's flow-control windows past which the connection is cut
/// (`ENHANCE_YOUR_CALM`): past `service::MAX_WAITING` the gateway gets no more connection
/// window, so only a gateway that takes no answers and sends many small messages gets here.
const MAX_WAITING_CUT: usize = 64 << 20;
/// The same over all connections: past it, a connection holding more than
/// `service::MAX_WAITING` (the bound past which it gets no more window) is cut.
const MAX_WAITING_TOTAL: usize = 256 << 20;

/// Whether a connection with `own` bytes of answers waiting, of `total` over all connections,
/// is cut.
fn too_much_waiting(own: usize, total: usize) -> bool {
    own > MAX_WAITING_CUT || (total > MAX_WAITING_TOTAL && own > crate::service::MAX_WAITING)
}

/// How long a stopping connection's last bytes (answers, GOAWAY) may take to be written; a
/// gateway that does not read them is cut.
const STOP_WRITE_LIMIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Serves one accepted connection until it closes or the server stops.
pub(crate) async fn run(
    mut tcp: TcpStream,
    service: ExtProc,
    mut phase: watch::Receiver<Phase>,
    mut health: watch::Receiver<Health>,
) {
    let _open = service.open();
    let mut waiting = service.waiting_share();
    let mut keepalive = Keepalive::new(service.config().keepalive, Instant::now());
    let timer = tokio::time::sleep_until(keepalive.first());
    tokio::pin!(timer);
    let mut conn = Conn::new(service, *phase.borrow_and_update(), health.clone());
    let mut placing = Placing::new();
    let mut read = BytesMut::with_capacity(READ_CHUNK);
    let mut events = Vec::new();
    // Bytes being written, and how many of them went.
    let (mut write, mut written): (Vec<u8>, usize) = (Vec::new(), 0);
    // Once stopped, how long the GOAWAY and the last answers may take to go out.
    let mut stop_by = None;
    let (mut rd, mut wr) = tcp.split();
    loop {
        let own = conn.h2.waiting();
        if own != waiting.mine() {
            let total = waiting.set(own);
            if too_much_waiting(own, total) && conn.phase != Phase::Stopped {
                tracing::warn!(
                    "ext_proc: a gateway connection left {own} bytes of answers untaken \
                     ({total} over all connections); closing it"
                );
                conn.stop(crate::h2::frame::code::ENHANCE_YOUR_CALM);
            }
        }
        if written == write.len() {
            write.clear();
            written = 0;
            std::mem::swap(&mut write, conn.h2.output());
        }
        let over = conn.phase == Phase::Stopped
            || (conn.h2.peer_gone() && conn.idle() && conn.h2.open_streams() == 0);
        if over {
            if write.is_empty() {
                let _ = wr.shutdown().await;
                return;
            }
            stop_by.get_or_insert_with(|| tokio::time::Instant::now() + STOP_WRITE_LIMIT);
        }
        read.reserve(READ_CHUNK);
        let watching = conn.watching();
        let unwritten = write.len() - written + conn.h2.unwritten();
        let reading = conn.phase != Phase::Stopped && unwritten < MAX_UNWRITTEN;
        tokio::select! {
            biased;
            w = wr.write(&write[written..]), if written < write.len() => match w {
                Ok(n) if n > 0 => written += n,
                _ => return,
            },
            r = rd.read_buf(&mut read), if reading => match r {
                Ok(n) if n > 0 => {
                    keepalive.on_read(Instant::now());
                    if let Err(e) = conn.h2.receive(&mut read, &mut events) {
                        tracing::debug!("ext_proc: connection error: {}", e.reason);
                        conn.stop(e.code);
                        continue;
                    }
                    for event in events.drain(..) {
                        conn.on_event(event, &mut placing);
                    }
                }
                _ => return,
            },
            Some((id, placed)) = placing.next(), if !placing.is_empty() => {
                conn.on_placed(id, placed, &mut placing);
            }
            Ok(()) = phase.changed() => {
                let now = *phase.borrow_and_update();
                conn.on_phase(now);
            }
            Ok(()) = health.changed(), if watching => {
                health.borrow_and_update();
                conn.on_health();
            }
            () = tokio::time::sleep_until(stop_by.unwrap_or_else(Instant::now)), if stop_by.is_some() => return,
            () = &mut timer => match keepalive.on_timer(Instant::now()) {
                Due::At(next) => timer.as_mut().reset(next),
                Due::Ping(next) => {
                    conn.h2.ping();
                    timer.as_mut().reset(next);
                }
                Due::Dead => {
                    tracing::warn!("ext_proc: a gateway connection sent nothing through a PING; closing it");
                    return;
                }
            },
        }
        // Placements that finished at once are answered in the same write.
        while let Some(Some((id, placed))) = placing.next().now_or_never() {
            conn.on_placed(id, placed, &mut placing);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_connection_is_cut_past_its_own_bound_or_holding_a_share_past_the_total() {
        use super::*;
        let mib = 1 << 20;
        assert!(!too_much_waiting(64 * mib, 64 * mib));
        assert!(too_much_waiting(64 * mib + 1, 64 * mib + 1));
        // Over all connections past the total: those holding more than the share go.
        assert!(!too_much_waiting(4 * mib, 300 * mib));
        assert!(too_much_waiting(4 * mib + 1, 300 * mib));
        assert!(!too_much_waiting(60 * mib, 256 * mib));
    }
}
