//! The step-time profiles the `cost` policy prices workers with: a fleet default
//! (`--router-cost-profile`) and each worker's own (`profile` in `--workers-file`,
//! `POST /admin/workers`, an etcd registration or the `kvrouter.io/profile` pod annotation).
//! Profiles live in the engine crate, which the server does not depend on, so the binary
//! supplies the lookup.

use kvrouter_core::timing::TimingModel;
use std::sync::Arc;

/// Turns a profile's name (`dynamo-poly`, a built-in such as `h100-llama3-8b`, or a JSON
/// profile's path) into its model, or says why it cannot.
pub type ProfileLookup = dyn Fn(&str) -> Result<Arc<dyn TimingModel>, String> + Send + Sync;

/// The profiles a router prices its workers with.
#[derive(Clone, Default)]
pub struct Profiles {
    /// The profile of workers that name none (`None`: `dynamo-poly` at
    /// `--router-cost-speedup-ratio`, or the online fit with `--router-cost-fit`).
    pub default: Option<String>,
    /// The lookup (`None`: no profile can be named; a worker that names one is refused).
    pub lookup: Option<Arc<ProfileLookup>>,
}

impl std::fmt::Debug for Profiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Profiles")
            .field("default", &self.default)
            .field("lookup", &self.lookup.as_ref().map(|_| "..."))
            .finish()
    }
}

impl Profiles {
    /// The model of a worker naming `own` (else the default, unless `default_applies` is false:
    /// with the online fit on, a worker naming none is fitted); `None` when neither is set.
    pub fn of(
        &self,
        own: Option<&str>,
        default_applies: bool,
    ) -> Result<Option<Arc<dyn TimingModel>>, String> {
        let default = self.default.as_deref().filter(|_| default_applies);
        let Some(name) = own.or(default) else {
            return Ok(None);
        };
        match &self.lookup {
            Some(lookup) => lookup(name).map(Some),
            None => Err(format!(
                "profile {name:?}: this router was started without step-time profiles"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrouter_core::timing::DynamoPoly;

    fn lookup(name: &str) -> Result<Arc<dyn TimingModel>, String> {
        match name {
            "poly" => Ok(Arc::new(DynamoPoly)),
            _ => Err(format!("no profile {name}")),
        }
    }

    #[test]
    fn a_workers_own_profile_wins_over_the_default_and_unknown_names_are_refused() {
        let none = Profiles::default();
        assert!(
            none.of(None, true).unwrap().is_none(),
            "neither: the router's own"
        );
        assert!(none.of(Some("poly"), true).unwrap_err().contains("without"));
        let with = Profiles {
            default: Some("missing".into()),
            lookup: Some(Arc::new(lookup)),
        };
        assert!(with.of(Some("poly"), true).unwrap().is_some());
        assert_eq!(with.of(None, true).unwrap_err(), "no profile missing");
        assert!(with.of(None, false).unwrap().is_none(), "fitted instead");
        assert_eq!(with.of(Some("x"), false).unwrap_err(), "no profile x");
    }
}
