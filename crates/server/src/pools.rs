//! Model pools: which models (and LoRA adapters) each worker serves, learned from its
//! `/v1/models` at registration (or given as `models` in its worker entry). A request is placed
//! only on the workers that serve its `model`; workers whose models are unknown (their
//! `/v1/models` did not answer) may serve any. Pure bookkeeping: the registry feeds it.

use kvrouter_core::ids::WorkerId;
use serde_json::Value;
use std::collections::BTreeMap;

/// One model a worker serves: a base model, or a LoRA adapter on `parent`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ModelCard {
    pub(crate) id: String,
    /// The base model of an adapter (vLLM lists adapters with `parent`).
    pub(crate) parent: Option<String>,
    /// The longest context the engine takes (vLLM's `max_model_len`), if it says.
    pub(crate) max_model_len: Option<u64>,
    /// When the engine says the model was created (Unix seconds), if it says.
    pub(crate) created: Option<u64>,
}

/// The models of a `/v1/models` list (vLLM's shape: adapters carry `parent`, or a `root` other
/// than their id).
pub(crate) fn cards_of(list: &Value) -> Vec<ModelCard> {
    list["data"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| {
            let id = m["id"].as_str()?.to_owned();
            let parent = m["parent"]
                .as_str()
                .or_else(|| m["root"].as_str().filter(|r| *r != id))
                .filter(|p| *p != id)
                .map(str::to_owned);
            Some(ModelCard {
                id,
                parent,
                max_model_len: m["max_model_len"].as_u64(),
                created: m["created"].as_u64(),
            })
        })
        .collect()
}

/// The models of every worker.
#[derive(Debug, Default)]
pub(crate) struct Pools {
    by_worker: BTreeMap<WorkerId, Vec<ModelCard>>,
}

impl Pools {
    /// Records what `worker` serves (an empty list: unknown, it may serve any model).
    pub(crate) fn set(&mut self, worker: WorkerId, cards: Vec<ModelCard>) {
        self.by_worker.insert(worker, cards);
    }

    /// Forgets a removed worker.
    pub(crate) fn remove(&mut self, worker: WorkerId) {
        self.by_worker.remove(&worker);
    }

    /// Every model some worker serves, each once (base models before the adapters on them),
    /// with the shortest `max_model_len` its workers state: a request must fit whichever serves
    /// it.
    pub(crate) fn union(&self) -> Vec<ModelCard> {
        let mut out: Vec<ModelCard> = Vec::new();
        for card in self.by_worker.values().flatten() {
            match out.iter_mut().find(|c| c.id == card.id) {
                Some(c) => {
                    c.max_model_len = match (c.max_model_len, card.max_model_len) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    };
                }
                None => out.push(card.clone()),
            }
        }
        out.sort_by_key(|c| c.parent.is_some());
        out
    }

    /// The workers that may serve `model`: those that list it, and those whose models are
    /// unknown. `None` when no worker's models are known (no restriction).
    pub(crate) fn workers_for(&self, model: &str) -> Option<Vec<WorkerId>> {
        if self.by_worker.values().all(Vec::is_empty) {
            return None;
        }
        Some(
            self.by_worker
                .iter()
                .filter(|(_, cards)| cards.is_empty() || cards.iter().any(|c| c.id == model))
                .map(|(w, _)| *w)
                .collect(),
        )
    }

    /// Whether `model` is a LoRA adapter (`None`: no worker lists it).
    pub(crate) fn is_adapter(&self, model: &str) -> Option<bool> {
        self.by_worker
            .values()
            .flatten()
            .find(|c| c.id == model)
            .map(|c| c.parent.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn card(id: &str, parent: Option<&str>) -> ModelCard {
        ModelCard {
            id: id.into(),
            parent: parent.map(Into::into),
            max_model_len: None,
            created: None,
        }
    }

    #[test]
    fn adapters_are_read_from_parent_or_root() {
        let list = json!({"data": [
            {"id": "base", "root": "base", "parent": null},
            {"id": "sql", "root": "base", "parent": "base"},
            {"id": "math", "root": "base"},
        ]});
        assert_eq!(
            cards_of(&list),
            vec![
                card("base", None),
                card("sql", Some("base")),
                card("math", Some("base"))
            ]
        );
    }

    /// Found by a probe: `/v1/models` dropped vLLM's `max_model_len` and `created`.
    #[test]
    fn a_models_context_length_is_the_shortest_its_workers_state() {
        let list = |len: u64| json!({"data": [{"id": "m", "created": 7, "max_model_len": len}]});
        let mut p = Pools::default();
        p.set(WorkerId(0), cards_of(&list(8192)));
        p.set(WorkerId(1), cards_of(&list(4096)));
        p.set(WorkerId(2), vec![card("m", None)]);
        let m = &p.union()[0];
        assert_eq!((m.max_model_len, m.created), (Some(4096), Some(7)));
    }

    #[test]
    fn requests_go_to_the_pool_of_their_model_or_adapter() {
        let mut p = Pools::default();
        assert_eq!(p.workers_for("a"), None);
        p.set(
            WorkerId(0),
            vec![card("a", None), card("a-lora", Some("a"))],
        );
        p.set(WorkerId(1), vec![card("a", None)]);
        p.set(WorkerId(2), vec![card("b", None)]);
        assert_eq!(p.workers_for("a"), Some(vec![WorkerId(0), WorkerId(1)]));
        assert_eq!(p.workers_for("a-lora"), Some(vec![WorkerId(0)]));
        assert_eq!(p.workers_for("b"), Some(vec![WorkerId(2)]));
        p.set(WorkerId(3), vec![]);
        assert_eq!(p.workers_for("b"), Some(vec![WorkerId(2), WorkerId(3)]));
        let ids: Vec<String> = p.union().into_iter().map(|c| c.id).collect();
        assert_eq!(ids, ["a", "b", "a-lora"]);
        assert_eq!(p.is_adapter("a-lora"), Some(true));
        assert_eq!(p.is_adapter("b"), Some(false));
        assert_eq!(p.is_adapter("c"), None);
        p.remove(WorkerId(2));
        assert_eq!(p.workers_for("b"), Some(vec![WorkerId(3)]));
    }
}
