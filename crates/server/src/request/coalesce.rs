//! Coalescing of the upstream's chunks: once a chunk has come, every further chunk that is
//! already there (up to a byte cap) goes on with it as one, so the client gets one write where
//! the engine's bytes came in one read. It never waits for data the router has not read: a
//! batch is passed on as soon as nothing else is ready, after at most `yields` turns of the
//! scheduler in a row that brought nothing (a turn that brings a chunk does not count), and
//! never later than `max_hold` after its first chunk came. The turns let the upstream
//! connection's task hand over chunks it already read: hyper hands them over one at a time,
//! each only after the previous one was taken. The bytes are passed on exactly (concatenated
//! in order), so SSE events split across chunks stay whole for whoever splits them.

use axum::body::Bytes;
use futures::Stream;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

/// A batch of the upstream's chunks: their bytes, and how many chunks they were.
pub(crate) struct Batch {
    pub(crate) bytes: Bytes,
    pub(crate) chunks: u64,
}

/// How long a batch may wait for chunks the upstream's connection already read.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Hold {
    /// Turns of the scheduler in a row that bring nothing, at most, before a batch goes on.
    pub(crate) yields: u32,
    /// The longest a batch waits after its first chunk came.
    pub(crate) max: Duration,
}

/// A batch kept over a turn of the scheduler.
struct Partial {
    first: Bytes,
    merged: Option<bytes::BytesMut>,
    chunks: u64,
    /// Turns in a row that brought nothing.
    idle_turns: u32,
    /// When the batch's first chunk came (read only when turns are allowed).
    since: Option<Instant>,
}

/// Wraps an upstream of chunks: each item is every chunk that was ready, merged.
pub(crate) struct Coalesce<S> {
    inner: S,
    cap: usize,
    /// An item taken from `inner` that could not join the last batch (an error, the end, or a
    /// chunk past the cap): it is the next item.
    held: Option<Option<Result<Bytes, String>>>,
    hold: Hold,
    partial: Option<Partial>,
}

impl<S> Coalesce<S> {
    /// Merges up to `cap` bytes (0 or 1: no merging); `hold`: see the module.
    pub(crate) fn new(inner: S, cap: usize, hold: Hold) -> Self {
        Self {
            inner,
            cap,
            held: None,
            hold,
            partial: None,
        }
    }
}

impl<S> Stream for Coalesce<S>
where
    S: Stream<Item = Result<Bytes, String>> + Unpin,
{
    type Item = Result<Batch, String>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        // A batch kept over a turn goes on now, with whatever came meanwhile.
        let (mut p, resumed) = match this.partial.take() {
            Some(p) => (p, true),
            None => {
                let first = match this.held.take() {
                    Some(held) => held,
                    None => match Pin::new(&mut this.inner).poll_next(cx) {
                        Poll::Ready(item) => item,
                        Poll::Pending => return Poll::Pending,
                    },
                };
                let first = match first {
                    Some(Ok(b)) => b,
                    Some(Err(e)) => return Poll::Ready(Some(Err(e))),
                    None => return Poll::Ready(None),
                };
                let p = Partial {
                    first,
                    merged: None,
                    chunks: 1,
                    idle_turns: 0,
                    since: (this.hold.yields > 0).then(Instant::now),
                };
                (p, false)
            }
        };
        let mut len = p.merged.as_ref().map_or(p.first.len(), |m| m.len());
        let chunks_before = p.chunks;
        // Take what is ready, never waiting for data: `Pending` ends the batch.
        while len < this.cap {
            match Pin::new(&mut this.inner).poll_next(cx) {
                Poll::Ready(Some(Ok(b))) if len + b.len() <= this.cap => {
                    let m = p.merged.get_or_insert_with(|| {
                        let want = this.cap.min(2 * len.max(b.len()));
                        let mut m = bytes::BytesMut::with_capacity(want);
                        m.extend_from_slice(&p.first);
                        m
                    });
                    m.extend_from_slice(&b);
                    len += b.len();
                    p.chunks += 1;
                }
                Poll::Ready(other) => {
                    this.held = Some(other);
                    break;
                }
                Poll::Pending => {
                    if resumed && p.chunks == chunks_before {
                        p.idle_turns += 1;
                    } else if resumed {
                        p.idle_turns = 0;
                    }
                    let young = p.since.is_some_and(|t| t.elapsed() < this.hold.max);
                    if p.idle_turns < this.hold.yields && young {
                        // A scheduler turn: the upstream's connection task may hand over
                        // chunks it already read. Woken at once; no data is waited for.
                        this.partial = Some(p);
                        cx.waker().wake_by_ref();
                        return Poll::Pending;
                    }
                    break;
                }
            }
        }
        let bytes = p.merged.map_or(p.first, bytes::BytesMut::freeze);
        Poll::Ready(Some(Ok(Batch {
            bytes,
            chunks: p.chunks,
        })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::channel::mpsc;
    use futures::{FutureExt, StreamExt};

    type Tx = mpsc::UnboundedSender<Result<Bytes, String>>;

    const COALESCE_MAX_BYTES: usize = 64 * 1024;

    type Rx = mpsc::UnboundedReceiver<Result<Bytes, String>>;

    fn hold(yields: u32, max: Duration) -> Hold {
        Hold { yields, max }
    }

    const NO_TURNS: Hold = Hold {
        yields: 0,
        max: Duration::ZERO,
    };

    fn pair(cap: usize) -> (Tx, Coalesce<Rx>) {
        let (tx, rx) = mpsc::unbounded();
        (tx, Coalesce::new(rx, cap, NO_TURNS))
    }

    fn pending<S: Stream + Unpin>(s: &mut S) -> bool {
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        Pin::new(s).poll_next(&mut cx).is_pending()
    }

    fn send(tx: &Tx, s: &'static str) {
        tx.unbounded_send(Ok(Bytes::from_static(s.as_bytes())))
            .unwrap();
    }

    fn ready<S: Stream<Item = Result<Batch, String>> + Unpin>(
        s: &mut S,
    ) -> Option<Option<Result<(String, u64), String>>> {
        s.next().now_or_never().map(|item| {
            item.map(|r| r.map(|b| (String::from_utf8(b.bytes.to_vec()).unwrap(), b.chunks)))
        })
    }

    #[test]
    fn chunks_already_there_go_on_as_one_with_their_exact_bytes() {
        let (tx, mut s) = pair(COALESCE_MAX_BYTES);
        send(&tx, "data: {\"a\":1}\n\n");
        send(&tx, "data: {\"b\"");
        send(&tx, ":2}\n\ndata: [DONE]\n\n");
        let batch = ready(&mut s).unwrap().unwrap().unwrap();
        // Concatenated in order: the event split across chunks is whole again.
        assert_eq!(
            batch,
            (
                "data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: [DONE]\n\n".to_string(),
                3
            )
        );
        let events: Vec<_> = kvrouter_openai::sse::events(batch.0.as_bytes()).collect();
        assert_eq!(events.len(), 3);
    }

    #[test]
    fn a_lone_chunk_goes_on_without_waiting_for_more() {
        let (tx, mut s) = pair(COALESCE_MAX_BYTES);
        // Nothing there: the stream waits.
        assert!(ready(&mut s).is_none());
        send(&tx, "data: 1\n\n");
        // One chunk there and nothing else: it goes on at once, alone.
        assert_eq!(
            ready(&mut s).unwrap().unwrap().unwrap(),
            ("data: 1\n\n".to_string(), 1)
        );
        assert!(ready(&mut s).is_none());
        send(&tx, "data: 2\n\n");
        assert_eq!(
            ready(&mut s).unwrap().unwrap().unwrap(),
            ("data: 2\n\n".to_string(), 1)
        );
    }

    #[test]
    fn the_cap_bounds_a_batch_and_the_chunk_past_it_comes_next() {
        let (tx, mut s) = pair(10);
        send(&tx, "aaaa");
        send(&tx, "bbbb");
        send(&tx, "ccc"); // 11 bytes with the two before: past the cap
        send(&tx, "dd");
        send(&tx, "0123456789AB"); // alone past the cap
        send(&tx, "e");
        let mut got = Vec::new();
        while let Some(Some(Ok(b))) = ready(&mut s) {
            assert!(b.0.len() <= 10 || b.1 == 1, "{b:?}");
            got.push(b);
            if got.len() > 10 {
                break;
            }
        }
        assert_eq!(
            got,
            vec![
                ("aaaabbbb".to_string(), 2),
                ("cccdd".to_string(), 2),
                ("0123456789AB".to_string(), 1),
                ("e".to_string(), 1),
            ]
        );
    }

    #[test]
    fn an_error_or_the_end_after_ready_chunks_comes_after_them() {
        let (tx, mut s) = pair(COALESCE_MAX_BYTES);
        send(&tx, "x");
        send(&tx, "y");
        tx.unbounded_send(Err("reset".into())).unwrap();
        send(&tx, "z");
        drop(tx);
        assert_eq!(
            ready(&mut s).unwrap().unwrap().unwrap(),
            ("xy".to_string(), 2)
        );
        assert_eq!(ready(&mut s).unwrap().unwrap().unwrap_err(), "reset");
        assert_eq!(
            ready(&mut s).unwrap().unwrap().unwrap(),
            ("z".to_string(), 1)
        );
        assert!(ready(&mut s).unwrap().is_none());
    }

    #[test]
    fn turns_that_bring_chunks_do_not_count_and_an_idle_turn_ends_the_batch() {
        let (tx, rx) = mpsc::unbounded();
        let mut s = Coalesce::new(rx, COALESCE_MAX_BYTES, hold(1, Duration::from_secs(60)));
        assert!(ready(&mut s).is_none());
        send(&tx, "a");
        // Nothing more ready: the batch is kept over one turn (and its task woken at once).
        assert!(pending(&mut s));
        send(&tx, "b");
        // That turn brought "b": another turn is allowed.
        assert!(pending(&mut s));
        send(&tx, "c");
        assert!(pending(&mut s));
        // A turn that brought nothing ends the batch.
        assert_eq!(
            ready(&mut s).unwrap().unwrap().unwrap(),
            ("abc".to_string(), 3)
        );
        // After one idle turn a batch goes on even if nothing came.
        send(&tx, "d");
        assert!(pending(&mut s));
        assert_eq!(
            ready(&mut s).unwrap().unwrap().unwrap(),
            ("d".to_string(), 1)
        );
        // A merge cap of 0 passes every chunk alone.
        let (tx, rx) = mpsc::unbounded();
        let mut s = Coalesce::new(rx, 0, NO_TURNS);
        send(&tx, "x");
        send(&tx, "y");
        assert_eq!(
            ready(&mut s).unwrap().unwrap().unwrap(),
            ("x".to_string(), 1)
        );
        assert_eq!(
            ready(&mut s).unwrap().unwrap().unwrap(),
            ("y".to_string(), 1)
        );
    }

    #[test]
    fn a_batch_goes_on_once_it_has_been_held_max_hold_even_while_chunks_come() {
        let (tx, rx) = mpsc::unbounded();
        let max = Duration::from_millis(20);
        let mut s = Coalesce::new(rx, COALESCE_MAX_BYTES, hold(64, max));
        send(&tx, "0");
        let begun = Instant::now();
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let mut sent = 1;
        // A chunk every turn: only the hold bound ends the batch.
        let batch = loop {
            match Pin::new(&mut s).poll_next(&mut cx) {
                Poll::Ready(item) => break item.unwrap().unwrap(),
                Poll::Pending => {}
            }
            assert!(begun.elapsed() < Duration::from_secs(5), "{sent} sent");
            send(&tx, "x");
            sent += 1;
            std::thread::sleep(Duration::from_millis(1));
        };
        assert!(begun.elapsed() >= max);
        // Every chunk sent during the hold is in it.
        assert_eq!(batch.chunks, sent);
        assert!(sent > 2, "{sent}");
        // No turns at all with a zero bound: a lone chunk goes on at once.
        let (tx, rx) = mpsc::unbounded();
        let mut s = Coalesce::new(rx, COALESCE_MAX_BYTES, hold(4, Duration::ZERO));
        send(&tx, "y");
        assert_eq!(
            ready(&mut s).unwrap().unwrap().unwrap(),
            ("y".to_string(), 1)
        );
    }
}
