//! `kvrouter serve`'s secrets (the admin token, the data plane's API keys, the workers' key:
//! each from a flag, the environment or a file) and who may release sessions.

use crate::headings as H;
use anyhow::bail;
use clap::Args;
use kvrouter_server::SessionReleaseAuth;
use std::path::{Path, PathBuf};

/// The admin API's token and the session-release rule that may need it.
#[derive(Debug, Args)]
pub(crate) struct AdminArgs {
    /// Enable the admin API with this bearer token. Prefer the environment variable or
    /// --admin-token-file: a flag's value is visible to every user in `ps`.
    #[arg(help_heading = H::ADMIN, long, env = "KVROUTER_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// Read the admin API's bearer token from this file (surrounding whitespace trimmed).
    #[arg(help_heading = H::ADMIN, long)]
    admin_token_file: Option<PathBuf>,
    /// Require this bearer key (`Authorization: Bearer KEY`) on the data plane: the OpenAI
    /// endpoints, the pick API and session release (the admin token is taken too); /health,
    /// /live, /ready and /metrics stay open. Prefer the environment variable or --api-key-file.
    #[arg(help_heading = H::ADMIN, long, env = "KVROUTER_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Read the data plane's keys from this file: one per line (several while rotating keys;
    /// blank lines skipped).
    #[arg(help_heading = H::ADMIN, long)]
    api_key_file: Option<PathBuf>,
    /// Send this key to every worker as `Authorization: Bearer KEY` (engines started with
    /// `--api-key`, as vLLM and SGLang take it). Prefer the variable or --worker-api-key-file.
    #[arg(
        help_heading = H::ADMIN,
        long,
        env = "KVROUTER_WORKER_API_KEY",
        hide_env_values = true
    )]
    worker_api_key: Option<String>,
    /// Read the workers' key from this file (surrounding whitespace trimmed).
    #[arg(help_heading = H::ADMIN, long)]
    worker_api_key_file: Option<PathBuf>,
    /// Who may release session affinity (DELETE /v1/sessions/{id}, POST /finish_session):
    /// open (any client) or admin (the admin token).
    #[arg(help_heading = H::SESSIONS, long, value_enum, default_value_t = AuthArg::Open)]
    session_release_auth: AuthArg,
}

/// The secrets and the session-release rule, read and checked.
#[derive(Debug)]
pub(crate) struct Access {
    pub(crate) admin_token: Option<String>,
    pub(crate) api_keys: Vec<String>,
    pub(crate) worker_api_key: Option<String>,
    pub(crate) session_release_auth: SessionReleaseAuth,
}

/// How one secret is given: its flag, its variable and its file flag.
struct Secret {
    flag: &'static str,
    env: &'static str,
    file_flag: &'static str,
    what: &'static str,
    /// Checked as a bearer token (printable ASCII, no spaces). Not the admin token, whose
    /// rule predates the keys: any text (a token with a space works as the header's rest).
    token_chars: bool,
}

const ADMIN_TOKEN: Secret = Secret {
    flag: "--admin-token",
    env: "KVROUTER_ADMIN_TOKEN",
    file_flag: "--admin-token-file",
    what: "the admin token",
    token_chars: false,
};
const API_KEY: Secret = Secret {
    flag: "--api-key",
    env: "KVROUTER_API_KEY",
    file_flag: "--api-key-file",
    what: "the API key",
    token_chars: true,
};
const WORKER_API_KEY: Secret = Secret {
    flag: "--worker-api-key",
    env: "KVROUTER_WORKER_API_KEY",
    file_flag: "--worker-api-key-file",
    what: "the workers' API key",
    token_chars: true,
};

/// Who may call a data-plane control endpoint (`--session-release-auth`, `--pick-auth`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AuthArg {
    /// Any client of the data plane.
    Open,
    /// Callers with the admin token.
    Admin,
}

impl AuthArg {
    /// The rule `flag` sets; `admin` needs the admin token (`admin_token`: whether one is set).
    pub(crate) fn rule(self, admin_token: bool, flag: &str) -> anyhow::Result<SessionReleaseAuth> {
        match self {
            AuthArg::Open => Ok(SessionReleaseAuth::Open),
            AuthArg::Admin if admin_token => Ok(SessionReleaseAuth::Admin),
            AuthArg::Admin => bail!("{flag} admin needs an admin token (--admin-token)"),
        }
    }
}

impl AdminArgs {
    /// The secrets (each checked) and the session-release rule.
    pub(crate) fn config(&self) -> anyhow::Result<Access> {
        let admin_token = secret(
            &ADMIN_TOKEN,
            self.admin_token.as_deref(),
            self.admin_token_file.as_deref(),
        )?
        .map(|mut t| t.remove(0));
        let api_keys = secret(
            &API_KEY,
            self.api_key.as_deref(),
            self.api_key_file.as_deref(),
        )?
        .unwrap_or_default();
        let worker_api_key = secret(
            &WORKER_API_KEY,
            self.worker_api_key.as_deref(),
            self.worker_api_key_file.as_deref(),
        )?
        .map(|mut k| k.remove(0));
        let session_release_auth = self
            .session_release_auth
            .rule(admin_token.is_some(), "--session-release-auth")?;
        Ok(Access {
            admin_token,
            api_keys,
            worker_api_key,
            session_release_auth,
        })
    }
}

/// The longest secret file read; such a file holds only its secrets.
const MAX_TOKEN_FILE_BYTES: u64 = 4096;

/// Reads a secret file: a regular file of at most [`MAX_TOKEN_FILE_BYTES`] (a device or a
/// FIFO such as `/dev/zero` could otherwise be read without end).
fn read_token_file(path: &Path, file_flag: &str) -> anyhow::Result<String> {
    let flag = || format!("{file_flag} {}", path.display());
    crate::files::read_bounded(path, MAX_TOKEN_FILE_BYTES).map_err(|e| match e.kind() {
        std::io::ErrorKind::FileTooLarge => {
            anyhow::anyhow!("{}: {e} (the file holds only its secret)", flag())
        }
        std::io::ErrorKind::InvalidInput => anyhow::anyhow!("{}: {e}", flag()),
        _ => anyhow::Error::new(e).context(flag()),
    })
}

/// A secret from its flag (or variable) or its file (not both): one value, trimmed; a file may
/// hold several, one per line (only the API keys take more than the first). A key must be
/// printable ASCII without spaces, as a bearer token is.
fn secret(
    s: &Secret,
    flag: Option<&str>,
    file: Option<&Path>,
) -> anyhow::Result<Option<Vec<String>>> {
    let values: Vec<String> = match (flag, file) {
        (Some(_), Some(_)) => bail!(
            "{} (or {}) and {} are both given; use one",
            s.flag,
            s.env,
            s.file_flag
        ),
        (Some(t), None) => vec![t.trim().to_owned()],
        (None, Some(path)) => read_token_file(path, s.file_flag)?
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect(),
        (None, None) => return Ok(None),
    };
    let empty = || {
        format!(
            "{} ({}, {} or {}) is empty",
            s.what, s.flag, s.env, s.file_flag
        )
    };
    match values.first() {
        None => bail!(empty()),
        Some(v) if v.is_empty() => bail!(empty()),
        _ => {}
    }
    if values.len() > 1 && s.flag != API_KEY.flag {
        bail!(
            "{}: holds {} lines; it takes one",
            s.file_flag,
            values.len()
        );
    }
    let bad = |v: &String| !v.bytes().all(|b| b.is_ascii_graphic());
    if let Some(at) = values.iter().position(bad).filter(|_| s.token_chars) {
        let which = match file {
            Some(_) => format!("{}, key {} of {}", s.file_flag, at + 1, values.len()),
            None => format!("{} or {}", s.flag, s.env),
        };
        bail!(
            "{} ({which}) has a character that cannot be in a bearer token (printable ASCII, \
             no spaces)",
            s.what
        );
    }
    Ok(Some(values))
}
