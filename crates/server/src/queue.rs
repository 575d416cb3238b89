//! The queue driver: places queued requests when load changes and ends them at their deadline.
//!
//! Handlers register a waiter before submitting, so a placement made by the driver always finds
//! the request's handler; a placement whose handler has gone is released at once. Releases of
//! load place queued requests themselves ([`crate::state::Inner::release`]); this driver covers
//! the rest: deadlines, first tokens, workers coming back.

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
                        _ = state.queue_woken() => {}
                        _ = tokio::time::sleep_until(at) => {}
                    }
                }
                None => state.queue_woken().await,
            }
            let placed = state.lock_core().poll(state.now());
            state.apply(kvrouter_core::router::Effects {
                placed,
                update: Vec::new(),
            });
        }
    })
}
