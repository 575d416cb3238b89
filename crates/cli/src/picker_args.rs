//! `kvrouter serve`'s flags of the pick API (`POST /v1/pick`) and its leases.

use crate::admin_args::AuthArg;
use crate::headings as H;
use clap::Args;
use kvrouter_server::PickConfig;

/// The pick API's leases and bounds.
#[derive(Args, Debug, Clone)]
pub(crate) struct PickerArgs {
    /// Seconds a pick (POST /v1/pick) may go without a first-token or finish report before it
    /// expires and its load is released.
    #[arg(help_heading = H::PICKER, long, default_value_t = 30.0)]
    pick_lease_secs: f64,
    /// Seconds a pick whose first token was reported may go without a finish report before it
    /// expires and its load is released.
    #[arg(help_heading = H::PICKER, long, default_value_t = 600.0)]
    pick_max_duration_secs: f64,
    /// Outstanding picks at most; more are refused with 529.
    #[arg(help_heading = H::PICKER, long, default_value_t = 65_536)]
    pick_max_outstanding: usize,
    /// Who may pick and report (POST /v1/pick and /v1/pick/...): open (any client) or admin
    /// (the admin token). Reports release load, and a failed one counts against its worker's
    /// health.
    #[arg(help_heading = H::PICKER, long, value_enum, default_value_t = AuthArg::Open)]
    pick_auth: AuthArg,
    /// Serve Envoy's external processing (ext_proc) gRPC service on this port, as a Gateway
    /// API Inference Extension endpoint picker (0 picks a free one; unset = off).
    #[arg(help_heading = H::PICKER, long)]
    pub(crate) ext_proc_port: Option<u16>,
    /// What the endpoint picker answers when it cannot place a request: closed (an immediate
    /// 503/429/400/504 response) or open (the request goes on without a destination).
    #[arg(help_heading = H::PICKER, long, value_enum, default_value_t = ExtProcFailureMode::Closed)]
    ext_proc_failure_mode: ExtProcFailureMode,
    /// Next-best workers the endpoint picker names after the chosen one (gateway fallbacks).
    #[arg(help_heading = H::PICKER, long, default_value_t = 1)]
    ext_proc_fallbacks: usize,
    /// Seconds a placement over ext_proc may take (router queue included) before the failure
    /// mode applies; keep it below the gateway's ext_proc message_timeout.
    #[arg(help_heading = H::PICKER, long, default_value_t = 10.0)]
    ext_proc_pick_timeout_secs: f64,
    /// How much of each answer the endpoint picker asks the gateway for: full (the response
    /// headers, every body chunk and the end: first token and usage are seen) or headers (only
    /// the response headers; their answer asks Envoy, which needs allow_mode_override, for no
    /// body, and the answer's end is the ext_proc stream's end). See docs/topologies.md.
    #[arg(help_heading = H::PICKER, long, value_enum, default_value_t = ExtProcObserve::Full)]
    ext_proc_observe: ExtProcObserve,
    /// Seconds a gateway connection may send nothing before the endpoint picker PINGs it; one
    /// that then sends nothing for as long again (a gateway gone without closing) is closed,
    /// and the load of its requests released.
    #[arg(help_heading = H::PICKER, long, default_value_t = 30.0)]
    ext_proc_keepalive_secs: f64,
    /// The largest request body the endpoint picker reads (1 to 1 GiB): a larger one is
    /// answered 413. The picker holds at most two such bodies' worth of messages not yet whole
    /// per gateway connection, and four over all of them.
    #[arg(help_heading = H::PICKER, long, default_value_t = 64 << 20)]
    ext_proc_max_body_bytes: usize,
}

/// `--ext-proc-observe`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ExtProcObserve {
    /// Every phase of the answer the gateway sends.
    Full,
    /// The response headers, then the stream's end.
    Headers,
}

/// `--ext-proc-failure-mode`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ExtProcFailureMode {
    /// Refuse the request with an immediate response.
    Closed,
    /// Let the request go on without a destination.
    Open,
}

impl PickerArgs {
    /// The validated pick settings (`admin_token`: whether the admin API has a token).
    pub(crate) fn picks(&self, admin_token: bool) -> anyhow::Result<PickConfig> {
        use crate::flag_values::positive;
        if self.pick_max_outstanding == 0 {
            anyhow::bail!("--pick-max-outstanding must be at least 1");
        }
        let auth = self.pick_auth.rule(admin_token, "--pick-auth")?;
        Ok(PickConfig {
            lease: positive(self.pick_lease_secs, "--pick-lease-secs")?,
            max_duration: positive(self.pick_max_duration_secs, "--pick-max-duration-secs")?,
            max_outstanding: self.pick_max_outstanding,
            auth,
        })
    }

    /// The validated ext_proc settings.
    pub(crate) fn ext_proc(&self) -> anyhow::Result<kvrouter_ext_proc::ExtProcConfig> {
        let pick_timeout = crate::flag_values::positive(
            self.ext_proc_pick_timeout_secs,
            "--ext-proc-pick-timeout-secs",
        )?;
        if !(1..=1 << 30).contains(&self.ext_proc_max_body_bytes) {
            anyhow::bail!(
                "--ext-proc-max-body-bytes must be from 1 to 1073741824, got {}",
                self.ext_proc_max_body_bytes
            );
        }
        let keepalive = crate::flag_values::positive(
            self.ext_proc_keepalive_secs,
            "--ext-proc-keepalive-secs",
        )?;
        Ok(kvrouter_ext_proc::ExtProcConfig {
            failure_mode: match self.ext_proc_failure_mode {
                ExtProcFailureMode::Closed => kvrouter_ext_proc::FailureMode::Closed,
                ExtProcFailureMode::Open => kvrouter_ext_proc::FailureMode::Open,
            },
            fallbacks: self.ext_proc_fallbacks,
            pick_timeout,
            keepalive,
            max_body_bytes: self.ext_proc_max_body_bytes,
            observe: match self.ext_proc_observe {
                ExtProcObserve::Full => kvrouter_ext_proc::Observe::Full,
                ExtProcObserve::Headers => kvrouter_ext_proc::Observe::Headers,
            },
            ..Default::default()
        })
    }
}
