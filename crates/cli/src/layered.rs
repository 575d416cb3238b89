//! Every flag of every subcommand also from `KVROUTER_<FLAG>` and from `--config FILE`.
//!
//! Works on clap's command description, not on a list of flags: a flag added later is covered
//! without touching this file. Precedence: command line > environment > config file > default.
//! The sources are merged into the argument list (values checked by the flag's own parser) and
//! the result is parsed once more by clap, so validation stays in one place.

use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Command};
use std::collections::BTreeMap;
use std::ffi::OsString;

/// The flag naming the config file.
pub(crate) const CONFIG: &str = "config";
/// The flag that prints the effective configuration and exits.
pub(crate) const PRINT_CONFIG: &str = "print-config";
/// Prefix of the environment variables.
pub(crate) const ENV_PREFIX: &str = "KVROUTER_";

/// Adds `--config` and `--print-config` to every subcommand that runs something (a leaf:
/// `serve`, `weights stamp`; not `weights`, which only groups its own).
pub(crate) fn augment(cmd: Command) -> Command {
    each_subcommand(cmd, &|sub| with_config(negative_values(sub)))
}

/// `cmd` with `f` applied to each of its direct subcommands.
fn each_subcommand(cmd: Command, f: &dyn Fn(Command) -> Command) -> Command {
    let names: Vec<String> = cmd
        .get_subcommands()
        .map(|s| s.get_name().to_owned())
        .collect();
    names
        .iter()
        .fold(cmd, |cmd, name| cmd.mut_subcommand(name, f))
}

/// `--config` and `--print-config` on `cmd` if it is a leaf, else on each leaf below it.
fn with_config(cmd: Command) -> Command {
    if cmd.get_subcommands().next().is_some() {
        return each_subcommand(cmd, &with_config);
    }
    cmd.arg(
        Arg::new(CONFIG)
            .long(CONFIG)
            .value_name("FILE")
            .env("KVROUTER_CONFIG")
            .value_parser(clap::value_parser!(std::path::PathBuf))
            .help_heading("Configuration")
            .help(
                "TOML file of flag values (keys are flag names: port = 9000); \
                 command-line flags > KVROUTER_<FLAG> environment > this file > defaults",
            ),
    )
    .arg(
        Arg::new(PRINT_CONFIG)
            .long(PRINT_CONFIG)
            .action(ArgAction::SetTrue)
            .help_heading("Configuration")
            .help("Print the effective configuration as TOML (secrets redacted) and exit"),
    )
}

/// The subcommand that runs (the deepest one matched), its matches, and its path of names
/// (`["weights", "stamp"]`); `None` when none, or when the deepest one matched still groups
/// others (clap refuses that in its own pass).
pub(crate) fn leaf<'a>(
    cmd: &'a Command,
    matches: &'a ArgMatches,
) -> Option<(&'a Command, &'a ArgMatches, Vec<&'a str>)> {
    let (mut sub, mut m, mut path) = (cmd, matches, Vec::new());
    while let Some((name, next)) = m.subcommand() {
        sub = sub.find_subcommand(name)?;
        m = next;
        path.push(name);
    }
    (!path.is_empty() && sub.get_subcommands().next().is_none()).then_some((sub, m, path))
}

/// `--flag -1` reads `-1` as the flag's value (which its parser then refuses, naming the flag)
/// rather than as an unknown flag `-1`, in `cmd` and every subcommand below it.
fn negative_values(cmd: Command) -> Command {
    each_subcommand(cmd.allow_negative_numbers(true), &negative_values)
}

/// Where a flag's value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Source {
    CommandLine,
    Env(String),
    File { line: usize },
}

/// The argument list with environment and file values merged in, and where each came from.
#[derive(Debug)]
pub(crate) struct Layered {
    pub(crate) argv: Vec<OsString>,
    /// Flag long name -> source, for flags not left at their default.
    pub(crate) sources: BTreeMap<String, Source>,
}

/// Settable flags of a subcommand: long name -> arg (help, version and the config flags aside).
pub(crate) fn settable(sub: &Command) -> impl Iterator<Item = &Arg> {
    sub.get_arguments().filter(|a| {
        a.get_long().is_some()
            && !a.is_positional()
            && !matches!(a.get_action(), ArgAction::Help | ArgAction::Version)
            && a.get_long() != Some(CONFIG)
            && a.get_long() != Some(PRINT_CONFIG)
    })
}

/// The environment variable of a flag: `--router-mode` -> `KVROUTER_ROUTER_MODE`.
pub(crate) fn env_name(long: &str) -> String {
    format!("{ENV_PREFIX}{}", long.replace('-', "_").to_uppercase())
}

/// A scalar TOML value as the text a flag takes.
fn scalar_text(v: &toml::Value) -> Option<String> {
    match v {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        toml::Value::Boolean(b) => Some(b.to_string()),
        _ => None,
    }
}

pub(crate) fn parse_bool(text: &str) -> Option<bool> {
    match text.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Some(true),
        "false" | "0" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// The values one source gives a flag, as flag texts; `Ok(None)` for a switch that is off.
fn values_of(
    arg: &Arg,
    from_env: Option<&str>,
    from_file: Option<&toml::Value>,
) -> Result<Option<Vec<String>>, String> {
    let switch = matches!(arg.get_action(), ArgAction::SetTrue);
    let many = matches!(arg.get_action(), ArgAction::Append);
    if let Some(text) = from_env {
        if switch {
            return match parse_bool(text) {
                Some(true) => Ok(Some(vec![])),
                Some(false) => Ok(None),
                None => Err(format!("`{text}` is not true or false")),
            };
        }
        if many {
            return Ok(Some(
                text.split(',')
                    .map(|s| s.trim().to_owned())
                    .filter(|s| !s.is_empty())
                    .collect(),
            ));
        }
        return Ok(Some(vec![text.to_owned()]));
    }
    let Some(value) = from_file else {
        return Ok(None);
    };
    if switch {
        return match value {
            toml::Value::Boolean(true) => Ok(Some(vec![])),
            toml::Value::Boolean(false) => Ok(None),
            other => Err(format!("{other} is not true or false")),
        };
    }
    match value {
        toml::Value::Array(items) if many => items
            .iter()
            .map(|v| scalar_text(v).ok_or_else(|| format!("{v} is not a string or number")))
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        toml::Value::Array(_) => Err("takes one value, not a list".into()),
        other => scalar_text(other)
            .map(|t| Some(vec![t]))
            .ok_or_else(|| format!("{other} is not a string, number or boolean")),
    }
}

/// Checks one value with the flag's own parser (a one-flag command parses it). The flag is
/// rebuilt from its parser and action alone: its relations to other flags (`requires`,
/// `conflicts_with`) name flags the one-flag command lacks, which clap's debug checks refuse.
fn check(arg: &Arg, text: &str) -> Result<(), String> {
    let one = Command::new("check").no_binary_name(true).arg(
        Arg::new("value")
            .long("value")
            .action(arg.get_action().clone())
            .value_parser(arg.get_value_parser().clone()),
    );
    match one.try_get_matches_from([format!("--value={text}")]) {
        Ok(_) => Ok(()),
        Err(e) => {
            use std::error::Error;
            let possible: Vec<String> = arg
                .get_possible_values()
                .iter()
                .map(|p| p.get_name().to_owned())
                .collect();
            Err(match e.source() {
                Some(cause) => format!("invalid value `{text}`: {cause}"),
                None if !possible.is_empty() => {
                    format!("invalid value `{text}` (one of: {})", possible.join(", "))
                }
                None => format!("invalid value `{text}`"),
            })
        }
    }
}

/// Merges environment and config-file values into `argv`. `env` reads a variable; `read` reads
/// the config file. Pure apart from those two.
pub(crate) fn layer(
    cmd: &Command,
    argv: Vec<OsString>,
    env: &dyn Fn(&str) -> Option<String>,
    read: &dyn Fn(&std::path::Path) -> std::io::Result<String>,
) -> anyhow::Result<Layered> {
    let empty = Layered {
        argv: argv.clone(),
        sources: BTreeMap::new(),
    };
    // A tolerant first pass: which subcommand, which flags the command line gave, the file.
    let Ok(pre) = cmd.clone().ignore_errors(true).try_get_matches_from(&argv) else {
        return Ok(empty); // --help, --version: clap answers in the real pass
    };
    let Some((sub, sub_matches, path)) = leaf(cmd, &pre) else {
        return Ok(empty);
    };
    let file = match sub_matches.get_one::<std::path::PathBuf>(CONFIG) {
        None => BTreeMap::new(),
        Some(file) => {
            let shown = file.display().to_string();
            let text = read(file).map_err(|e| anyhow::anyhow!("--config {shown}: {e}"))?;
            crate::config_file::read(cmd, sub, &path, &shown, &text)?
        }
    };
    let config_name = sub_matches
        .get_one::<std::path::PathBuf>(CONFIG)
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    let mut sources = BTreeMap::new();
    let mut extra: Vec<OsString> = Vec::new();
    for arg in settable(sub) {
        let long = arg.get_long().expect("settable args are long");
        let id = arg.get_id().as_str();
        match sub_matches.value_source(id) {
            Some(ValueSource::CommandLine) => {
                sources.insert(long.to_owned(), Source::CommandLine);
                continue;
            }
            Some(ValueSource::EnvVariable) => {
                let var = arg
                    .get_env()
                    .map(|v| v.to_string_lossy().into_owned())
                    .unwrap_or_default();
                sources.insert(long.to_owned(), Source::Env(var));
                continue;
            }
            _ => {}
        }
        // A flag with a variable of its own (`env = ...`, read by clap above) takes only that
        // one: `mock-engine --api-key` is `KVROUTER_MOCK_API_KEY`, so the router's
        // `KVROUTER_API_KEY` in a shared environment does not reach a mock engine.
        let var = env_name(long);
        let from_env = match arg.get_env() {
            Some(own) if own.to_str() != Some(var.as_str()) => None,
            _ => env(&var),
        };
        let from_file = file.get(long);
        let (source, blame) = match (&from_env, from_file) {
            (Some(_), _) => (Source::Env(var.clone()), var.clone()),
            (None, Some(f)) => (
                Source::File { line: f.line },
                format!("--config {config_name} line {}: key `{}`", f.line, f.key),
            ),
            (None, None) => continue,
        };
        let values = values_of(arg, from_env.as_deref(), from_file.map(|f| &f.value))
            .map_err(|e| anyhow::anyhow!("{blame}: {e}"))?;
        let Some(values) = values else {
            continue; // a switch set to false: its default
        };
        if values.is_empty() && matches!(arg.get_action(), ArgAction::SetTrue) {
            extra.push(format!("--{long}").into());
        }
        for v in values {
            check(arg, &v).map_err(|e| anyhow::anyhow!("{blame} (--{long}): {e}"))?;
            extra.push(format!("--{long}={v}").into());
        }
        sources.insert(long.to_owned(), source);
    }
    // Right after the leaf's name (each name found after its parent's).
    let mut at = 0;
    for name in &path {
        at = argv[at..]
            .iter()
            .position(|a| a == *name)
            .map_or(argv.len(), |i| at + i + 1);
    }
    let mut merged = argv;
    merged.splice(at..at, extra);
    Ok(Layered {
        argv: merged,
        sources,
    })
}

/// The process's arguments, parsed with environment and config-file values merged in.
pub(crate) struct Parsed<C> {
    pub(crate) cli: C,
    /// Where each flag's value came from.
    pub(crate) sources: BTreeMap<String, Source>,
    /// `--print-config` printed the configuration: the caller checks it and exits.
    pub(crate) printed: bool,
}

/// Parses the process's arguments with environment and config-file values merged in, printing
/// the configuration for `--print-config`. Errors exit with code 2.
pub(crate) fn parse_args<C: clap::CommandFactory + clap::FromArgMatches>() -> Parsed<C> {
    let cmd = augment(C::command());
    let argv: Vec<OsString> = std::env::args_os().collect();
    let layered = layer(&cmd, argv, &|k| std::env::var(k).ok(), &|p| {
        crate::files::read_bounded(p, crate::files::MAX_SETTINGS_FILE_BYTES)
    })
    .unwrap_or_else(|e| {
        eprintln!("error: {e:#}");
        std::process::exit(2);
    });
    let matches = cmd
        .clone()
        .try_get_matches_from(&layered.argv)
        .unwrap_or_else(|e| e.exit());
    let printed = leaf(&cmd, &matches).is_some_and(|(_, m, _)| m.get_flag(PRINT_CONFIG));
    if printed {
        print!(
            "{}",
            crate::print_config::print(&cmd, &matches, &layered.sources)
        );
    }
    let cli = C::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    Parsed {
        cli,
        sources: layered.sources,
        printed,
    }
}

/// `error` with a line for each flag it names (`--flag` as a whole word) whose value came from
/// the environment or the config file, naming that source: a range check after parsing knows the
/// flag, not where its value was written.
pub(crate) fn name_sources(
    error: anyhow::Error,
    sources: &BTreeMap<String, Source>,
) -> anyhow::Error {
    let text = format!("{error:#}");
    let notes: Vec<String> = sources
        .iter()
        .filter(|(long, _)| names_flag(&text, long))
        .filter_map(|(long, source)| match source {
            Source::CommandLine => None,
            Source::Env(var) => Some(format!("--{long} was set by {var}")),
            Source::File { line } => Some(format!(
                "--{long} was set by the --config file, line {line}"
            )),
        })
        .collect();
    if notes.is_empty() {
        return error;
    }
    anyhow::anyhow!("{text}\n  ({})", notes.join("; "))
}

/// Whether `text` names `--long` as a whole flag (not as the start of a longer one).
fn names_flag(text: &str, long: &str) -> bool {
    let flag = format!("--{long}");
    text.match_indices(&flag).any(|(at, _)| {
        !text[at + flag.len()..]
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    })
}

#[cfg(test)]
#[path = "layered_tests.rs"]
mod tests;
