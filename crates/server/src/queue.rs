//! The queue driver: places queued requests when load changes and ends them at their deadline.
//!
//! Handlers register a waiter before submitting, so a placement made by the driver always finds
//! the request's handler; a placement whose handler has gone is released at once.

use crate::state::Inner;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;

pub(crate) fn spawn(state: Arc<Inner>) -> JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let deadline = state.lock_core().next_deadline();
            let wait = deadline.map(|d| {
                let at = state.epoch + Duration::from_micros(d.as_micros());
                tokio::time::Instant::from_std(at)
            });
            match wait {
                Some(at) => {
                    tokio::select! {
                        _ = state.queue_notify.notified() => {}
                        _ = tokio::time::sleep_until(at) => {}
                    }
                }
                None => state.queue_notify.notified().await,
            }
            let placed = state.lock_core().poll(state.now());
            for (id, result) in placed {
                let waiter = state.waiters.lock().expect("waiters lock").remove(&id);
                let delivered = match waiter {
                    Some(tx) => tx.send(result.clone()).is_ok(),
                    None => false,
                };
                if !delivered && result.is_ok() {
                    let _ = state.lock_core().cancel(id);
                }
            }
        }
    })
}
