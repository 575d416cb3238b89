//! The workers `kvrouter serve` starts with (`--workers-file`) and the step-time profiles the
//! `cost` policy prices them with (`--router-cost-profile`, each entry's `profile`).

use anyhow::{bail, Context};
use kvrouter_core::timing::TimingModel;
use kvrouter_server::config::Profiles;
use kvrouter_server::{WorkerEntry, WorkersFile};
use std::sync::Arc;

/// The profile `name` as the router prices with it, every time divided by `speedup`.
fn model(name: &str, speedup: f64) -> Result<Arc<dyn TimingModel>, String> {
    kvrouter_engine::timing::for_router(name, speedup)
        .map(Arc::from)
        .map_err(|e| e.to_string())
}

/// The entries of a `--workers-file`, each checked; an error names the file and the entry.
pub(crate) fn read_workers_file(path: &std::path::Path) -> anyhow::Result<Vec<WorkerEntry>> {
    let text = crate::files::read_bounded(path, crate::files::MAX_SETTINGS_FILE_BYTES)
        .with_context(|| format!("--workers-file {}", path.display()))?;
    let file: WorkersFile =
        toml::from_str(&text).with_context(|| format!("--workers-file {}", path.display()))?;
    for (i, w) in file.workers.iter().enumerate() {
        if let Err(e) = w.validate() {
            bail!("--workers-file {}: workers[{i}].{e}", path.display());
        }
        // Read here too, so that a bad one is named by its entry (registration reads it again).
        if let Some(Err(e)) = w.profile.as_deref().map(|p| model(p, 1.0)) {
            bail!(
                "--workers-file {}: workers[{i}].profile: {e}",
                path.display()
            );
        }
    }
    Ok(file.workers)
}

/// The `cost` policy's profiles: `default` (`--router-cost-profile`, checked here), and the
/// lookup of a worker's own, each time divided by `speedup` (`--router-cost-speedup-ratio`).
pub(crate) fn profiles(default: Option<&str>, speedup: f64) -> anyhow::Result<Profiles> {
    let lookup = move |name: &str| model(name, speedup);
    if let Some(name) = default {
        lookup(name).map_err(|e| anyhow::anyhow!("--router-cost-profile: {e}"))?;
    }
    Ok(Profiles {
        default: default.map(str::to_owned),
        lookup: Some(Arc::new(lookup)),
    })
}
