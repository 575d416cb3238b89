//! The request-level histograms by `model` label, and the bound on the labels made for names
//! no worker was known to serve.

use super::{escape, Histogram, SECONDS};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::{Arc, Mutex};

/// The request-level histograms of one model (`model` label): TTFT, ITL, duration. A request's
/// guard holds its model's set, so observing costs what an unlabeled histogram does.
#[derive(Debug)]
pub(crate) struct ModelMetrics {
    model: String,
    /// Made for a name no worker was known to serve (one of [`Labels::unserved`]).
    unserved: bool,
    pub(crate) ttft: Histogram,
    pub(crate) itl: Histogram,
    pub(crate) duration: Histogram,
}

impl ModelMetrics {
    /// The model, for the `model` label of counters.
    pub(crate) fn model(&self) -> &str {
        &self.model
    }
}

/// The [`ModelMetrics`] of every model requests named. A request's model is one the workers
/// serve, or it is refused before it gets here, except while the workers list no model (none
/// registered yet, or their `/v1/models` fails): then any name passes. Names the workers serve
/// (`served`) always get their label; the others share at most [`MAX_MODEL_LABELS`] labels of at
/// most [`MAX_MODEL_LABEL_BYTES`] bytes, and past those are counted together as [`OTHER_MODELS`].
#[derive(Debug, Default)]
pub(crate) struct ByModel {
    labels: Mutex<Labels>,
}

/// The `model` labels made so far.
#[derive(Debug, Default)]
struct Labels {
    by_name: BTreeMap<String, Arc<ModelMetrics>>,
    /// Those made for names no worker was known to serve.
    unserved: usize,
}

/// Labels kept for names no worker was known to serve, at most (besides [`OTHER_MODELS`]).
pub(crate) const MAX_MODEL_LABELS: usize = 64;
/// The longest model name kept as a label value, in bytes.
pub(crate) const MAX_MODEL_LABEL_BYTES: usize = 256;
/// The `model` label of models past the bounds.
pub(crate) const OTHER_MODELS: &str = "_other";

impl ByModel {
    /// The histograms of `model`, if a request named it.
    pub(crate) fn peek(&self, model: &str) -> Option<Arc<ModelMetrics>> {
        let labels = self.labels.lock().expect("model metrics lock");
        labels.by_name.get(model).cloned()
    }

    /// The histograms of `model`, made on first use (those of [`OTHER_MODELS`] past the
    /// bounds): their [`ModelMetrics::model`] is the request's `model` label.
    pub(crate) fn get(&self, model: &str, served: bool) -> Arc<ModelMetrics> {
        let mut labels = self.labels.lock().expect("model metrics lock");
        let Labels { by_name, unserved } = &mut *labels;
        if let Some(m) = by_name.get(model) {
            return m.clone();
        }
        let over =
            !served && (*unserved >= MAX_MODEL_LABELS || model.len() > MAX_MODEL_LABEL_BYTES);
        let label = match over {
            true => OTHER_MODELS,
            false => {
                *unserved += usize::from(!served);
                model
            }
        };
        let m = by_name.entry(label.to_owned()).or_insert_with(|| {
            Arc::new(ModelMetrics {
                model: label.to_owned(),
                unserved: !served,
                ttft: Histogram::new(SECONDS),
                itl: Histogram::new(SECONDS),
                duration: Histogram::new(SECONDS),
            })
        });
        m.clone()
    }

    /// Drops the label of `model` (no worker serves it any more): a fleet whose model names
    /// change (an adapter or a name per RL step) would otherwise keep every name's series for
    /// good. Requests in flight keep their histograms, which no scrape shows any more.
    pub(crate) fn forget(&self, model: &str) {
        let mut labels = self.labels.lock().expect("model metrics lock");
        if let Some(m) = labels.by_name.remove(model) {
            labels.unserved -= usize::from(m.unserved);
        }
    }

    pub(super) fn render(
        &self,
        out: &mut String,
        name: &str,
        help: &str,
        pick: fn(&ModelMetrics) -> &Histogram,
    ) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (model, m) in &self.labels.lock().expect("model metrics lock").by_name {
            let labels = format!("model=\"{}\",", escape(model));
            pick(m).render_series(out, name, &labels);
        }
    }
}
