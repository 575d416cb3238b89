//! `--print-config`: the effective configuration of a subcommand as TOML, grouped like `--help`,
//! each value's source as a comment, secrets redacted. Its output reads back as a config file.

use crate::layered::{parse_bool, settable, Source, ENV_PREFIX};
use clap::{Arg, ArgAction, ArgMatches, Command};
use std::collections::BTreeMap;

/// What a secret's value is printed as.
const REDACTED: &str = "<redacted>";

/// `raw` with the credentials of a URL in it (`scheme://user:password@host...`, as in
/// `--cluster NAME=URL` or `--worker URL`) redacted.
pub(crate) fn without_credentials(raw: &str) -> std::borrow::Cow<'_, str> {
    let Some(at) = raw.find("://").map(|i| i + 3) else {
        return raw.into();
    };
    let authority = raw[at..]
        .split(['/', '?', '#', ','])
        .next()
        .unwrap_or_default();
    match authority.rfind('@') {
        Some(end) => format!("{}{REDACTED}{}", &raw[..at], &raw[at + end..]).into(),
        None => raw.into(),
    }
}

/// TOML text of one flag's final value, typed by the flag's parser.
fn value_text(arg: &Arg, raw: &str) -> String {
    use std::any::TypeId;
    let id = arg.get_value_parser().type_id();
    macro_rules! is {
        ($($t:ty),*) => { false $(|| id == TypeId::of::<$t>())* };
    }
    if is!(bool) {
        if let Some(b) = parse_bool(raw) {
            return toml::Value::Boolean(b).to_string();
        }
    }
    if is!(u8, u16, u32, u64, usize, i8, i16, i32, i64, isize) {
        if let Ok(i) = raw.parse::<i64>() {
            return toml::Value::Integer(i).to_string();
        }
    }
    if is!(f32, f64) {
        if let Ok(f) = raw.parse::<f64>() {
            return toml::Value::Float(f).to_string();
        }
    }
    toml::Value::String(without_credentials(raw).into_owned()).to_string()
}

/// The effective configuration of the matched subcommand as TOML: every settable flag under its
/// help heading, its source as a comment, secrets (flags whose environment values clap hides)
/// redacted, unset flags commented out.
pub(crate) fn print(
    cmd: &Command,
    matches: &ArgMatches,
    sources: &BTreeMap<String, Source>,
) -> String {
    let Some((sub, m, path)) = crate::layered::leaf(cmd, matches) else {
        return String::new();
    };
    let name = path.join(" ");
    let mut out = format!(
        "# kvrouter {name}: effective configuration (command line > {ENV_PREFIX}<FLAG> environment > --config file > defaults)\n"
    );
    // Grouped like --help: headings in order of first appearance.
    let mut headings: Vec<Option<&str>> = Vec::new();
    for arg in settable(sub) {
        if !headings.contains(&arg.get_help_heading()) {
            headings.push(arg.get_help_heading());
        }
    }
    let grouped = headings
        .iter()
        .flat_map(|h| settable(sub).filter(move |a| a.get_help_heading() == *h));
    let mut heading: Option<&str> = None;
    for arg in grouped {
        let long = arg.get_long().expect("long");
        if arg.get_help_heading() != heading {
            heading = arg.get_help_heading();
            out.push_str(&format!("\n# {}\n", heading.unwrap_or("Other")));
        }
        let raw: Vec<String> = m
            .get_raw(arg.get_id().as_str())
            .map(|vals| vals.map(|v| v.to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        let secret = arg.is_hide_env_values_set();
        let many = matches!(arg.get_action(), ArgAction::Append);
        let value = if raw.is_empty() && !many {
            out.push_str(&format!("# {long}: unset\n"));
            continue;
        } else if secret {
            toml::Value::String(REDACTED.into()).to_string()
        } else if many {
            format!(
                "[{}]",
                raw.iter()
                    .map(|v| value_text(arg, v))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        } else {
            value_text(arg, &raw[raw.len() - 1])
        };
        let from = match sources.get(long) {
            Some(Source::CommandLine) => "  # command line".to_owned(),
            Some(Source::Env(var)) => format!("  # environment {var}"),
            Some(Source::File { line }) => format!("  # config file line {line}"),
            None => String::new(),
        };
        out.push_str(&format!("{long} = {value}{from}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::without_credentials;

    #[test]
    fn url_credentials_are_redacted_and_nothing_else() {
        for (raw, shown) in [
            (
                "eu=http://user:pw@10.0.0.1:8000/x,rtt_ms=3",
                "eu=http://<redacted>@10.0.0.1:8000/x,rtt_ms=3",
            ),
            ("https://token@host", "https://<redacted>@host"),
            ("http://host:8000/a@b", "http://host:8000/a@b"),
            (
                "eu=http://10.0.0.1:8000,rtt_ms=3",
                "eu=http://10.0.0.1:8000,rtt_ms=3",
            ),
            ("plain@text", "plain@text"),
        ] {
            assert_eq!(without_credentials(raw), shown, "{raw}");
        }
    }
}
