//! The etcd source: list the prefix (a [`SourceEvent::Snapshot`]), then watch it from the next
//! revision. A broken watch lists again (its snapshot adds what is new and drains what is
//! gone), as does one whose start was compacted away or whose store went back. Failures wait
//! per [`Backoff`].

use super::{wire, Change, EtcdClient, EtcdError};
use crate::discovery::backoff::Backoff;
use crate::discovery::{Registration, SourceEvent};
use futures::StreamExt;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// How a watch ended.
enum End {
    /// List again, for this reason: the start revision was compacted away, the store's
    /// revision went back (etcd restarted without its data), or a catch-up message was past
    /// the bound.
    Relist(String),
    /// The driver is gone: stop.
    Closed,
}

/// A key's change as a source event; an unreadable value counts as the key gone.
fn event(prefix: &str, change: Change) -> SourceEvent {
    let key = change.key;
    match change.value {
        None => SourceEvent::Delete { key },
        Some(v) => match serde_json::from_slice::<Registration>(&v) {
            Ok(registration) => SourceEvent::Put { key, registration },
            Err(e) => {
                tracing::warn!(%key, prefix, "etcd registration is not a worker registration: {e}");
                SourceEvent::Delete { key }
            }
        },
    }
}

fn snapshot(prefix: &str, changes: Vec<Change>) -> SourceEvent {
    let all = changes
        .into_iter()
        .filter_map(|c| match event(prefix, c) {
            SourceEvent::Put { key, registration } => Some((key, registration)),
            _ => None,
        })
        .collect();
    SourceEvent::Snapshot(all)
}

/// Feeds `tx` from etcd until the receiver is gone.
pub(crate) async fn run(
    client: EtcdClient,
    prefix: String,
    backoff_max: Duration,
    metrics: Arc<dyn Fn() + Send + Sync>,
    tx: mpsc::Sender<SourceEvent>,
) {
    let mut backoff = Backoff::new(backoff_max);
    // The revision to watch from; `None`: list first.
    let mut next: Option<i64> = None;
    loop {
        let start = match next {
            Some(r) => r,
            None => match client.range_prefix(&prefix).await {
                Ok((revision, changes)) => {
                    if tx.send(snapshot(&prefix, changes)).await.is_err() {
                        return;
                    }
                    revision + 1
                }
                Err(e) => {
                    tracing::warn!("etcd discovery: listing {prefix}: {e}");
                    tokio::time::sleep(backoff.failed()).await;
                    continue;
                }
            },
        };
        next = Some(start);
        let began = std::time::Instant::now();
        let ended = watch(&client, &prefix, &mut next, &mut backoff, &tx).await;
        // A watch that lasted broke after working: the next try waits the least again.
        backoff.ran(began.elapsed());
        match ended {
            Ok(End::Closed) => return,
            Ok(End::Relist(why)) => {
                tracing::warn!("etcd discovery: {why}; listing {prefix} again");
                next = None;
            }
            Err(e) => {
                // Listed again rather than resumed: a store that restarted empty may have
                // reached the revision to resume from already, with other keys (found by
                // probing). The list's snapshot adds what is new and drains what is gone.
                tracing::warn!("etcd discovery: watch of {prefix} broke: {e}; listing again");
                next = None;
            }
        }
        metrics();
        tokio::time::sleep(backoff.failed()).await;
    }
}

/// One watch from `*next`, which follows each change seen.
async fn watch(
    client: &EtcdClient,
    prefix: &str,
    next: &mut Option<i64>,
    backoff: &mut Backoff,
    tx: &mpsc::Sender<SourceEvent>,
) -> Result<End, EtcdError> {
    let start = next.unwrap_or(0);
    let resp = client.watch(prefix, start).await?;
    let mut body = resp.bytes_stream();
    let mut lines = wire::Lines::default();
    loop {
        let chunk = tokio::select! {
            chunk = body.next() => chunk,
            () = tx.closed() => return Ok(End::Closed),
        };
        let chunk = match chunk {
            Some(Ok(c)) => c,
            Some(Err(e)) => return Err(EtcdError::Unreachable("watch".into(), e.to_string())),
            None => {
                return Err(EtcdError::Unreachable(
                    "watch".into(),
                    "stream ended".into(),
                ))
            }
        };
        let lines = match lines.push(&chunk) {
            Ok(lines) => lines,
            Err(EtcdError::TooLarge(why)) => return Ok(End::Relist(why)),
            Err(e) => return Err(e),
        };
        for line in lines {
            let message = wire::watch_line(&line)?;
            if message.compact_revision.is_some() {
                return Ok(End::Relist(format!("revision {start} compacted")));
            }
            if message.canceled {
                return Err(EtcdError::Protocol("watch canceled".into()));
            }
            // A store behind what was already seen lost its data (an etcd restarted empty):
            // a watch from the future would wait silently past every new registration.
            if let Some(now) = message
                .revision
                .filter(|r| message.created && *r < start - 1)
            {
                return Ok(End::Relist(format!(
                    "etcd's revision went back to {now} (this watch had seen {})",
                    start - 1
                )));
            }
            // Only changes delivered count as the source working: a watch that is set up and
            // then fails at once (a message it cannot read) keeps backing off.
            if !message.changes.is_empty() {
                backoff.succeeded();
            }
            for change in message.changes {
                *next = Some(next.unwrap_or(0).max(change.mod_revision + 1));
                if tx.send(event(prefix, change)).await.is_err() {
                    return Ok(End::Closed);
                }
            }
        }
    }
}
