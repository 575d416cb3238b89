//! `kvrouter serve`'s checks of every value a start reads, before it binds or starts anything
//! ([`ServeArgs::checked`]); `--print-config` runs them too, opening nothing.

use super::ServeArgs;
use kvrouter_mock_engine::MockEngineConfig;
use kvrouter_server::ServeConfig;

/// Whether building the configuration opens its outputs (the OTLP exporter, the provenance
/// log), as a start does, or only checks their values, as `--print-config` does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outputs {
    Open,
    CheckOnly,
}

/// Everything a start needs from the flags, checked (`ServeArgs::checked`).
pub(crate) struct Checked {
    pub(super) config: ServeConfig,
    pub(super) mock_engine: MockEngineConfig,
    /// `--global`: the global router's settings (nothing below applies then).
    pub(super) global: Option<kvrouter_server::global::GlobalServeConfig>,
    /// The ext_proc picker's settings (the defaults under `--global`, which runs none).
    pub(super) ext_proc: kvrouter_ext_proc::ExtProcConfig,
    /// Flags given that the settings in effect do not read.
    pub(super) warnings: Vec<String>,
}

impl ServeArgs {
    /// Every value a start reads, checked before it binds a port or starts anything: a start
    /// runs it first with [`Outputs::Open`], and `--print-config` after printing with
    /// [`Outputs::CheckOnly`] (which opens no log or exporter, so it cannot tell that the
    /// provenance log's file cannot be created).
    pub(crate) fn checked(&self, outputs: Outputs) -> anyhow::Result<Checked> {
        // First: `--cluster` without `--global` is named before the workers it then lacks.
        let global = self.global.config()?;
        let mut config = self.config(outputs)?;
        // What is in effect (`--load-aware` replaces the mode).
        let mode = config.router.router_mode;
        let mock_engine = self.mock_engine(&config)?;
        // A global router runs no ext_proc picker: its settings are not read there.
        let (warnings, ext_proc) = if global.is_some() {
            (
                self.routing.global_warnings()?,
                kvrouter_ext_proc::ExtProcConfig::default(),
            )
        } else {
            let mut warnings = self.routing.mode_warnings(&[mode])?;
            if self.router_cost_profile.is_some() && mode != kvrouter_core::policy::RouterMode::Cost
            {
                warnings.push(format!(
                    "--router-cost-profile is set but the router mode in effect ({mode}) does not read it"
                ));
            }
            if self.mock_workers > 0 {
                crate::global_args::speeds_from_mocks(
                    &mut config.cluster_summary,
                    &mock_engine,
                    self.mock_workers,
                )?;
            }
            (warnings, self.picker.ext_proc()?)
        };
        Ok(Checked {
            config,
            mock_engine,
            global,
            ext_proc,
            warnings,
        })
    }
}
