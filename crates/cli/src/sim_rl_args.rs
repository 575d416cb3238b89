//! The RL flags of `kvrouter sim`: group sizes, first-N-of-M and weight updates between steps.

use anyhow::bail;
use clap::Args;

/// The RL flags of `kvrouter sim`.
#[derive(Debug, Args)]
pub(crate) struct SimRlArgs {
    /// RL requests carry their group's size (as x-kvrouter-group-size): fair-share group
    /// placement.
    #[arg(long, conflicts_with = "clusters")]
    group_sizes: bool,
    /// RL requests carry no group id, as from a client that sends no x-kvrouter-group-id
    /// (`kvrouter bench` without --group-header): siblings are known only by their prompt.
    #[arg(long, conflicts_with_all = ["group_sizes", "group_need", "clusters"])]
    no_group_ids: bool,
    /// First-N-of-M: end a group's other samples once N finished (as x-kvrouter-group-need).
    #[arg(long, conflicts_with = "clusters")]
    group_need: Option<u32>,
    /// Weight updates between RL steps, run by the router: drain, abort or rolling.
    #[arg(long, conflicts_with = "clusters")]
    weight_update: Option<String>,
    /// Workers updated at a time with --weight-update rolling.
    #[arg(long, default_value_t = 1, conflicts_with = "clusters")]
    weight_update_batch: usize,
    /// Time an engine takes to load new weights, ms.
    #[arg(long, default_value_t = 1000.0, conflicts_with = "clusters")]
    weight_load_ms: f64,
}

impl SimRlArgs {
    /// --group-sizes.
    pub(crate) fn group_sizes(&self) -> bool {
        self.group_sizes
    }

    /// Whether requests carry their group id (not --no-group-ids).
    pub(crate) fn group_ids(&self) -> bool {
        !self.no_group_ids
    }

    /// --group-need.
    pub(crate) fn group_need(&self) -> Option<u32> {
        self.group_need
    }

    /// Whether --weight-update was given.
    pub(crate) fn updates_weights(&self) -> bool {
        self.weight_update.is_some()
    }

    /// The weight updates of --weight-update, --weight-update-batch and --weight-load-ms.
    pub(crate) fn weight_update(
        &self,
    ) -> anyhow::Result<Option<kvrouter_sim::config::WeightUpdate>> {
        Ok(match &self.weight_update {
            None => None,
            Some(mode) => Some(kvrouter_sim::config::WeightUpdate {
                mode: mode
                    .parse()
                    .map_err(|e: String| anyhow::anyhow!("--weight-update: {e}"))?,
                batch: self.weight_update_batch,
                load_ms: self.weight_load_ms,
            }),
        })
    }

    /// Checks the RL flags; errors name the flag.
    pub(crate) fn check(&self) -> anyhow::Result<()> {
        if self.group_need == Some(0) {
            bail!("--group-need must be at least 1");
        }
        if self.weight_update_batch == 0 {
            bail!("--weight-update-batch must be at least 1");
        }
        if !(self.weight_load_ms.is_finite() && self.weight_load_ms >= 0.0) {
            bail!("--weight-load-ms must be a non-negative number");
        }
        Ok(())
    }
}
