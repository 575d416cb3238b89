//! The models a worker serves: asked at its `/v1/models` (again and again while it lists none),
//! and the names the router accepts recomputed from every worker's.

use super::get_json;
use crate::pools::{cards_of, ModelCard};
use crate::state::AppState;
use kvrouter_core::ids::WorkerId;
use std::time::Duration;

/// Records the models `id` serves (`None`: it left) and recomputes the names the router
/// accepts: `--model-name` when given, else every model some worker serves. Models of a worker
/// no longer registered are not recorded (a late answer racing its removal).
pub(super) fn set_models(state: &AppState, id: WorkerId, cards: Option<Vec<ModelCard>>) {
    // A worker came or left: readiness reports look again.
    state.inner.roster.send_replace(state.worker_count());
    let inner = &state.inner;
    let mut pools = inner.pools.write().expect("pools lock");
    match cards {
        // Checked under the pools lock: a removal records its `None` after this, or is seen.
        Some(cards)
            if inner
                .workers
                .lock()
                .expect("workers lock")
                .contains_key(&id) =>
        {
            pools.set(id, cards)
        }
        Some(_) => return,
        None => pools.remove(id),
    }
    if inner.config.model_names.is_empty() {
        let names: Vec<String> = pools.union().into_iter().map(|c| c.id).collect();
        let mut models = inner.models.write().expect("models lock");
        let gone: Vec<String> = models
            .iter()
            .filter(|m| !names.contains(m))
            .cloned()
            .collect();
        *models = names;
        drop(models);
        // A model no worker serves any more takes its series with it.
        for model in &gone {
            inner.metrics.forget_model(model);
        }
    }
}

/// First and longest wait between two askings of a worker's `/v1/models` while it lists none.
const MODEL_LEARN_FIRST: Duration = Duration::from_secs(1);
const MODEL_LEARN_MAX: Duration = Duration::from_secs(30);

/// Asks `url`'s `/v1/models` again (after 1 s, then twice as long each time up to 30 s) until
/// it lists models, and records them: until then the worker may serve any model and the router
/// lists none of its models. Ends when it has them; aborted with the worker's other tasks when
/// it leaves.
pub(super) fn spawn_model_learning(
    state: AppState,
    id: WorkerId,
    url: String,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut wait = MODEL_LEARN_FIRST;
        loop {
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(MODEL_LEARN_MAX);
            let cards = learn_models(&state, &url).await;
            if cards.is_empty() {
                continue;
            }
            tracing::info!(worker = %id, url = %url, "learned the worker's models");
            set_models(&state, id, Some(cards));
            return;
        }
    })
}

/// The models an engine lists at `/v1/models` (none when it does not answer, body included,
/// within 2 s: then it may serve any model).
pub(super) async fn learn_models(state: &AppState, url: &str) -> Vec<ModelCard> {
    let url = format!("{}/v1/models", url.trim_end_matches('/'));
    get_json(state, &url)
        .await
        .map_or_else(Vec::new, |list| cards_of(&list))
}
