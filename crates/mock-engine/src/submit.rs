//! Handing a request to the engine: submitted, accepted (or refused as too long), its
//! deliveries turned into response frames, cancelled when the response is dropped early.

use crate::driver::{Command, Delivery};
use crate::error::ApiError;
use crate::http::AppState;
use crate::openai::Usage;
use axum::body::Bytes;
use kvrouter_core::ids::RequestId;
use kvrouter_engine::{EngineError, EngineRequest, Prompt};
use tokio::sync::{mpsc, oneshot};

/// Cancels the engine request when the response (or the handler) is dropped early.
pub(crate) struct CancelGuard {
    id: RequestId,
    commands: mpsc::UnboundedSender<Command>,
    pub(crate) armed: bool,
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.commands.send(Command::Cancel(self.id));
        }
    }
}

/// An engine request admitted: its number, its deliveries, and the guard that cancels it if
/// the response is dropped early.
pub(crate) type Submitted = (u64, mpsc::UnboundedReceiver<Delivery>, CancelGuard);

/// Hands `prompt` to the engine and waits until it accepts them; a prompt that does not
/// fit is a 400 naming `param`.
pub(crate) async fn submit(
    s: &AppState,
    prompt: Prompt,
    max_tokens: u32,
    param: &'static str,
) -> Result<Submitted, ApiError> {
    let prompt_len = prompt.len_tokens();
    let n = s.next_request_number();
    let id = RequestId(n);
    let (deliver, rx) = mpsc::unbounded_channel();
    let (accepted_tx, accepted_rx) = oneshot::channel();
    let engine_request = EngineRequest {
        id,
        prompt,
        max_output_tokens: max_tokens,
    };
    s.commands()
        .send(Command::Add {
            request: engine_request,
            deliver,
            accepted: accepted_tx,
        })
        .map_err(|_| ApiError::internal("the engine has stopped"))?;
    let mut guard = CancelGuard {
        id,
        commands: s.commands().clone(),
        armed: true,
    };
    match accepted_rx.await {
        Ok(Ok(())) => {}
        Ok(Err(e @ EngineError::TooLong { .. })) => {
            guard.armed = false;
            // The prompt alone fits: it is the output budget that does not.
            let engine = &s.config().engine;
            let prompt_blocks = u64::from(prompt_len).div_ceil(engine.block_size.max(1) as u64);
            if prompt_blocks <= engine.num_gpu_blocks as u64 {
                return Err(ApiError::invalid(
                    format!(
                        "the prompt of {prompt_len} tokens fits, but not with up to {max_tokens} \
                         output tokens: {e}"
                    ),
                    Some("max_tokens"),
                ));
            }
            return Err(ApiError::invalid(
                format!("the prompt of {prompt_len} tokens does not fit: {e}"),
                Some(param),
            ));
        }
        Ok(Err(e)) => {
            guard.armed = false;
            return Err(ApiError::invalid(e.to_string(), None));
        }
        Err(_) => return Err(ApiError::internal("the engine has stopped")),
    }
    Ok((n, rx, guard))
}

/// A whole (non-streamed) answer: its token ids, its usage, and whether it was aborted.
pub(crate) struct Collected {
    pub(crate) ids: Vec<u32>,
    pub(crate) usage: Usage,
    pub(crate) aborted: bool,
}

/// Waits for every delivery of a non-streamed request. The guard is disarmed once the engine
/// ended the request; if the engine drops it, the guard cancels it on the way out.
pub(crate) async fn collect(
    mut rx: mpsc::UnboundedReceiver<Delivery>,
    mut guard: CancelGuard,
    capacity: usize,
) -> Result<Collected, ApiError> {
    let mut ids = Vec::with_capacity(capacity);
    loop {
        match rx.recv().await {
            Some(Delivery::Token { id }) => ids.push(id),
            Some(Delivery::Done {
                prompt_tokens,
                cached_tokens,
                completion_tokens,
                aborted,
            }) => {
                guard.armed = false;
                let usage = Usage {
                    prompt_tokens,
                    cached_tokens,
                    completion_tokens,
                };
                return Ok(Collected {
                    ids,
                    usage,
                    aborted,
                });
            }
            Some(Delivery::Failed(e)) => {
                guard.armed = false;
                return Err(ApiError::internal(e));
            }
            None => return Err(ApiError::internal("the engine dropped the request")),
        }
    }
}

/// Turns deliveries into SSE frames; the guard lives inside the stream, so dropping the response
/// body (client disconnect) cancels the engine request.
pub(crate) fn async_stream<F>(
    rx: mpsc::UnboundedReceiver<Delivery>,
    guard: CancelGuard,
    render: F,
) -> impl futures::Stream<Item = Result<Bytes, std::convert::Infallible>> + Send + 'static
where
    F: FnMut(Delivery, bool) -> Vec<Bytes> + Send + 'static,
{
    use futures::StreamExt;
    let state = (rx, guard, render, true, false);
    futures::stream::unfold(
        state,
        |(mut rx, mut guard, mut render, first, done)| async move {
            if done {
                return None;
            }
            let event = rx.recv().await?;
            let finished = matches!(event, Delivery::Done { .. } | Delivery::Failed(_));
            if finished {
                guard.armed = false;
            }
            let frames = render(event, first);
            Some((frames, (rx, guard, render, false, finished)))
        },
    )
    .flat_map(|frames| futures::stream::iter(frames.into_iter().map(Ok)))
}
