//! Coalescing of the upstream's chunks: once a chunk has come, every further chunk that is
//! already there (up to a byte cap) goes on with it as one, so the client gets one write where
//! the engine's bytes came in one read. It never waits for more data: a batch is passed on as
//! soon as nothing else is ready (with `yields` > 0, after up to that many turns of the
//! scheduler, which let the upstream connection's task hand over chunks it already read: hyper
//! hands them over one at a time). The bytes are passed on
//! exactly (concatenated in order), so SSE events split across chunks stay whole for whoever
//! splits them.

use axum::body::Bytes;
use futures::Stream;
use std::pin::Pin;
use std::task::{Context, Poll};

/// A batch of the upstream's chunks: their bytes, and how many chunks they were.
pub(crate) struct Batch {
    pub(crate) bytes: Bytes,
    pub(crate) chunks: u64,
}

/// Wraps an upstream of chunks: each item is every chunk that was ready, merged.
pub(crate) struct Coalesce<S> {
    inner: S,
    cap: usize,
    /// An item taken from `inner` that could not join the last batch (an error, the end, or a
    /// chunk past the cap): it is the next item.
    held: Option<Option<Result<Bytes, String>>>,
    /// Turns of the scheduler a batch may wait, at most, on `Pending` before it goes on.
    yields: u32,
    /// A batch kept over one yield: its bytes and chunk count.
    partial: Option<(Bytes, Option<bytes::BytesMut>, u64, u32)>,
}

impl<S> Coalesce<S> {
    /// Merges up to `cap` bytes (0 or 1: no merging); `yields`: see the module.
    pub(crate) fn new(inner: S, cap: usize, yields: u32) -> Self {
        Self {
            inner,
            cap,
            held: None,
            yields,
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
        // A batch kept over a yield goes on now, with whatever came meanwhile.
        let (first, mut merged, mut chunks, yielded) = match this.partial.take() {
            Some((first, merged, chunks, y)) => (first, merged, chunks, y),
            None => {
                let first = match this.held.take() {
                    Some(held) => held,
                    None => match Pin::new(&mut this.inner).poll_next(cx) {
                        Poll::Ready(item) => item,
                        Poll::Pending => return Poll::Pending,
                    },
                };
                match first {
                    Some(Ok(b)) => (b, None, 1, 0),
                    Some(Err(e)) => return Poll::Ready(Some(Err(e))),
                    None => return Poll::Ready(None),
                }
            }
        };
        let mut len = merged.as_ref().map_or(first.len(), |m| m.len());
        // Take what is ready, never waiting for data: `Pending` ends the batch.
        while len < this.cap {
            match Pin::new(&mut this.inner).poll_next(cx) {
                Poll::Ready(Some(Ok(b))) if len + b.len() <= this.cap => {
                    let m = merged.get_or_insert_with(|| {
                        let want = this.cap.min(2 * len.max(b.len()));
                        let mut m = bytes::BytesMut::with_capacity(want);
                        m.extend_from_slice(&first);
                        m
                    });
                    m.extend_from_slice(&b);
                    len += b.len();
                    chunks += 1;
                }
                Poll::Ready(other) => {
                    this.held = Some(other);
                    break;
                }
                Poll::Pending => {
                    if yielded < this.yields {
                        // A scheduler turn: the upstream's connection task may hand over
                        // chunks it already read. Woken at once; no data is waited for.
                        this.partial = Some((first, merged, chunks, yielded + 1));
                        cx.waker().wake_by_ref();
                        return Poll::Pending;
                    }
                    break;
                }
            }
        }
        let bytes = merged.map_or(first, bytes::BytesMut::freeze);
        Poll::Ready(Some(Ok(Batch { bytes, chunks })))
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

    fn pair(cap: usize) -> (Tx, Coalesce<Rx>) {
        let (tx, rx) = mpsc::unbounded();
        (tx, Coalesce::new(rx, cap, 0))
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
    fn with_one_yield_what_came_during_it_joins_the_batch_and_nothing_waits_longer() {
        let (tx, rx) = mpsc::unbounded();
        let mut s = Coalesce::new(rx, COALESCE_MAX_BYTES, 1);
        assert!(ready(&mut s).is_none());
        send(&tx, "a");
        // Nothing more ready: the batch is kept over one turn (and its task woken at once).
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        assert!(Pin::new(&mut s).poll_next(&mut cx).is_pending());
        send(&tx, "b");
        assert_eq!(
            ready(&mut s).unwrap().unwrap().unwrap(),
            ("ab".to_string(), 2)
        );
        // After its one turn a batch goes on even if nothing came.
        send(&tx, "c");
        assert!(Pin::new(&mut s).poll_next(&mut cx).is_pending());
        assert_eq!(
            ready(&mut s).unwrap().unwrap().unwrap(),
            ("c".to_string(), 1)
        );
        // A merge cap of 0 passes every chunk alone.
        let (tx, rx) = mpsc::unbounded();
        let mut s = Coalesce::new(rx, 0, 0);
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
}
