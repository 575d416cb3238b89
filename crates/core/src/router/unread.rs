//! Which settings the router mode in effect does not read: a `kv` weight under `cost` (the
//! default since the cost model landed) or a `cost` weight under `kv` changes nothing, and a user
//! who set one should hear so rather than tune a knob that is not connected.

use super::RouterConfig;
use crate::policy::RouterMode;

/// A setting read by some router modes only: its flag, the modes that read it, and its value in
/// a configuration (a switch as 0 or 1): one moved off the default's was set.
struct ModeSetting {
    flag: &'static str,
    read_by: &'static [RouterMode],
    value: fn(&RouterConfig) -> f64,
}

/// `kv` scores also order a pinned worker's data-parallel ranks in `direct` mode.
const KV: &[RouterMode] = &[RouterMode::Kv, RouterMode::Direct];
const COST: &[RouterMode] = &[RouterMode::Cost];

const MODE_SETTINGS: &[ModeSetting] = &[
    ModeSetting {
        flag: "--router-temperature",
        read_by: KV,
        value: |c| c.router_temperature,
    },
    ModeSetting {
        flag: "--router-kv-overlap-score-credit",
        read_by: KV,
        value: |c| c.router_kv_overlap_score_credit,
    },
    ModeSetting {
        flag: "--router-kv-overlap-score-credit-decay",
        read_by: KV,
        value: |c| c.router_kv_overlap_score_credit_decay,
    },
    ModeSetting {
        flag: "--router-prefill-load-scale",
        read_by: KV,
        value: |c| c.router_prefill_load_scale,
    },
    ModeSetting {
        flag: "--router-decode-active-request-weight",
        read_by: KV,
        value: |c| c.router_decode_active_request_weight,
    },
    ModeSetting {
        flag: "--router-cost-decode-weight",
        read_by: COST,
        value: |c| c.router_cost_decode_weight,
    },
    ModeSetting {
        flag: "--router-cost-prefill-weight",
        read_by: COST,
        value: |c| c.router_cost_prefill_weight,
    },
    ModeSetting {
        flag: "--router-cost-session-margin",
        read_by: COST,
        value: |c| c.router_cost_session_margin,
    },
    ModeSetting {
        flag: "--router-cost-session-window-secs",
        read_by: COST,
        value: |c| c.router_cost_session_window_secs,
    },
    ModeSetting {
        flag: "--router-cost-replica-weight",
        read_by: COST,
        value: |c| c.router_cost_replica_weight,
    },
    ModeSetting {
        flag: "--router-cost-fit",
        read_by: COST,
        value: |c| f64::from(u8::from(c.router_cost_fit)),
    },
    ModeSetting {
        flag: "--router-cost-speedup-ratio",
        read_by: COST,
        value: |c| c.router_cost_speedup_ratio,
    },
];

impl RouterConfig {
    /// The flags of the settings only some modes read that are moved off their defaults, in
    /// flag order.
    pub fn moved_mode_settings(&self) -> Vec<&'static str> {
        let defaults = RouterConfig::default();
        MODE_SETTINGS
            .iter()
            .filter(|s| (s.value)(self) != (s.value)(&defaults))
            .map(|s| s.flag)
            .collect()
    }

    /// Whether `mode` reads the setting of `flag` (every mode reads a setting not listed as
    /// read by some modes only).
    pub fn mode_reads(mode: RouterMode, flag: &str) -> bool {
        MODE_SETTINGS
            .iter()
            .find(|s| s.flag == flag)
            .is_none_or(|s| s.read_by.contains(&mode))
    }

    /// The flags of settings moved off their defaults that the mode in effect does not read, in
    /// flag order (`--load-aware` is `kv` mode without credit, so its credit of 0 is read).
    pub fn unread_settings(&self) -> Vec<&'static str> {
        self.moved_mode_settings()
            .into_iter()
            .filter(|flag| !Self::mode_reads(self.router_mode, flag))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(mode: RouterMode) -> RouterConfig {
        RouterConfig {
            router_mode: mode,
            ..RouterConfig::default()
        }
    }

    #[test]
    fn defaults_are_read_or_harmless_in_every_mode() {
        for mode in RouterMode::ALL {
            assert!(with(mode).unread_settings().is_empty(), "{mode}");
        }
    }

    #[test]
    fn a_kv_weight_under_cost_and_a_cost_weight_under_kv_are_named() {
        let c = RouterConfig {
            router_kv_overlap_score_credit: 2.0,
            router_temperature: 0.5,
            router_cost_decode_weight: 0.7,
            ..with(RouterMode::Cost)
        };
        assert_eq!(
            c.unread_settings(),
            ["--router-temperature", "--router-kv-overlap-score-credit"]
        );
        let c = RouterConfig {
            router_mode: RouterMode::Kv,
            ..c
        };
        assert_eq!(c.unread_settings(), ["--router-cost-decode-weight"]);
        let c = RouterConfig {
            router_mode: RouterMode::RoundRobin,
            ..c
        };
        assert_eq!(c.unread_settings().len(), 3);
    }

    #[test]
    fn moved_settings_are_listed_whatever_the_mode() {
        let c = RouterConfig {
            router_cost_fit: true,
            ..with(RouterMode::Cost)
        };
        assert_eq!(c.moved_mode_settings(), ["--router-cost-fit"]);
        assert!(c.unread_settings().is_empty());
        assert!(RouterConfig::mode_reads(
            RouterMode::Cost,
            "--router-cost-fit"
        ));
        assert!(!RouterConfig::mode_reads(
            RouterMode::Kv,
            "--router-cost-fit"
        ));
        assert!(RouterConfig::mode_reads(
            RouterMode::Kv,
            "--router-ttl-secs"
        ));
    }

    #[test]
    fn load_aware_reads_its_zero_credit() {
        assert!(RouterConfig::load_aware().unread_settings().is_empty());
    }

    #[test]
    fn each_setting_is_noticed_by_its_own_field() {
        type Move = fn(&mut RouterConfig);
        let moves: [(&str, Move); 12] = [
            ("--router-temperature", |c| c.router_temperature = 0.5),
            ("--router-kv-overlap-score-credit", |c| {
                c.router_kv_overlap_score_credit = 2.0
            }),
            ("--router-kv-overlap-score-credit-decay", |c| {
                c.router_kv_overlap_score_credit_decay = 0.5
            }),
            ("--router-prefill-load-scale", |c| {
                c.router_prefill_load_scale = 2.0
            }),
            ("--router-decode-active-request-weight", |c| {
                c.router_decode_active_request_weight = 1.0
            }),
            ("--router-cost-decode-weight", |c| {
                c.router_cost_decode_weight = 0.7
            }),
            ("--router-cost-prefill-weight", |c| {
                c.router_cost_prefill_weight = 2.0
            }),
            ("--router-cost-session-margin", |c| {
                c.router_cost_session_margin = 0.3
            }),
            ("--router-cost-session-window-secs", |c| {
                c.router_cost_session_window_secs = 5.0
            }),
            ("--router-cost-replica-weight", |c| {
                c.router_cost_replica_weight = 0.0
            }),
            ("--router-cost-fit", |c| c.router_cost_fit = true),
            ("--router-cost-speedup-ratio", |c| {
                c.router_cost_speedup_ratio = 10.0
            }),
        ];
        assert_eq!(moves.len(), MODE_SETTINGS.len());
        for (flag, set) in moves {
            let mut c = with(RouterMode::LeastLoaded);
            set(&mut c);
            assert_eq!(c.unread_settings(), [flag]);
        }
    }
}
