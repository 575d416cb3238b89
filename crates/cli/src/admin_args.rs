//! `kvrouter serve`'s admin token (flag, environment or file) and who may release sessions.

use crate::headings as H;
use anyhow::{bail, Context};
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
    /// Who may release session affinity (DELETE /v1/sessions/{id}, POST /finish_session):
    /// open (any client) or admin (the admin token).
    #[arg(help_heading = H::SESSIONS, long, value_enum, default_value_t = AuthArg::Open)]
    session_release_auth: AuthArg,
}

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
    /// The admin token (if any) and the session-release rule.
    pub(crate) fn config(&self) -> anyhow::Result<(Option<String>, SessionReleaseAuth)> {
        let admin_token = admin_token(
            self.admin_token.as_deref(),
            self.admin_token_file.as_deref(),
        )?;
        let session_release_auth = self
            .session_release_auth
            .rule(admin_token.is_some(), "--session-release-auth")?;
        Ok((admin_token, session_release_auth))
    }
}

/// The longest `--admin-token-file` read; a token file holds only the token.
const MAX_TOKEN_FILE_BYTES: u64 = 4096;

/// Reads `--admin-token-file`: a regular file of at most [`MAX_TOKEN_FILE_BYTES`] (a device or
/// a FIFO such as `/dev/zero` could otherwise be read without end).
fn read_token_file(path: &Path) -> anyhow::Result<String> {
    use std::io::Read;
    let flag = || format!("--admin-token-file {}", path.display());
    let meta = std::fs::metadata(path).with_context(flag)?;
    if !meta.is_file() {
        bail!("{}: not a regular file", flag());
    }
    let mut text = String::new();
    std::fs::File::open(path)
        .with_context(flag)?
        .take(MAX_TOKEN_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .with_context(flag)?;
    if text.len() as u64 > MAX_TOKEN_FILE_BYTES {
        bail!(
            "{}: longer than {MAX_TOKEN_FILE_BYTES} bytes (the file holds only the token)",
            flag()
        );
    }
    Ok(text)
}

/// The admin token from --admin-token / KVROUTER_ADMIN_TOKEN or --admin-token-file (not both).
fn admin_token(flag: Option<&str>, file: Option<&Path>) -> anyhow::Result<Option<String>> {
    let token = match (flag, file) {
        (Some(_), Some(_)) => bail!(
            "--admin-token (or KVROUTER_ADMIN_TOKEN) and --admin-token-file are both given; use one"
        ),
        (Some(t), None) => t.trim().to_owned(),
        (None, Some(path)) => read_token_file(path)?.trim().to_owned(),
        (None, None) => return Ok(None),
    };
    if token.is_empty() {
        bail!(
            "the admin token (--admin-token, KVROUTER_ADMIN_TOKEN or --admin-token-file) is empty"
        );
    }
    Ok(Some(token))
}
