//! `kvrouter serve`'s flags of the pick API (`POST /v1/pick`) and its leases.

use clap::Args;
use kvrouter_server::PickConfig;

/// The pick API's leases and bounds.
#[derive(Args, Debug, Clone)]
pub(crate) struct PickerArgs {
    /// Seconds a pick (POST /v1/pick) may go without a first-token or finish report before it
    /// expires and its load is released.
    #[arg(long, default_value_t = 30.0)]
    pick_lease_secs: f64,
    /// Seconds a pick whose first token was reported may go without a finish report before it
    /// expires and its load is released.
    #[arg(long, default_value_t = 600.0)]
    pick_max_duration_secs: f64,
    /// Outstanding picks at most; more are refused with 529.
    #[arg(long, default_value_t = 65_536)]
    pick_max_outstanding: usize,
}

impl PickerArgs {
    /// The validated pick settings.
    pub(crate) fn picks(&self) -> anyhow::Result<PickConfig> {
        let positive = |v: f64, flag: &str| {
            std::time::Duration::try_from_secs_f64(v)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| anyhow::anyhow!("{flag} must be a positive number of seconds"))
        };
        if self.pick_max_outstanding == 0 {
            anyhow::bail!("--pick-max-outstanding must be at least 1");
        }
        Ok(PickConfig {
            lease: positive(self.pick_lease_secs, "--pick-lease-secs")?,
            max_duration: positive(self.pick_max_duration_secs, "--pick-max-duration-secs")?,
            max_outstanding: self.pick_max_outstanding,
        })
    }
}
