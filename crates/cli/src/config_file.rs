//! The `--config FILE` of a subcommand: TOML whose keys are flag names (`port = 9000`).
//!
//! One file may serve several subcommands (`KVROUTER_CONFIG` exported once for a whole
//! deployment): a table named after a subcommand holds its keys only (`[serve]`,
//! `[weights.stamp]`); its keys override the same top-level keys. Top-level keys are for the
//! subcommand that runs. Every key is checked against the flags of the subcommand it is for and
//! every table name against the subcommands, so a typo anywhere is an error naming its line,
//! whichever subcommand reads the file.

use crate::layered::{settable, CONFIG, PRINT_CONFIG};
use clap::Command;
use std::collections::BTreeMap;
use toml_edit::{ImDocument, Item, TableLike, Value};

/// A value read from a config file: the key as written, its line and its value.
pub(crate) struct FileValue {
    pub(crate) key: String,
    pub(crate) line: usize,
    pub(crate) value: toml::Value,
}

/// What one config file says to the subcommand `path` of `root` (`leaf` is that subcommand):
/// flag long name -> value. Unknown keys and tables are errors naming the key and its line.
pub(crate) fn read(
    root: &Command,
    leaf: &Command,
    path: &[&str],
    shown: &str,
    text: &str,
) -> anyhow::Result<BTreeMap<String, FileValue>> {
    let doc = ImDocument::parse(text).map_err(|e| anyhow::anyhow!("--config {shown}: {e}"))?;
    let file = File { shown, text };
    let mut top = BTreeMap::new();
    let mut section = BTreeMap::new();
    for (key, line, item) in file.entries(doc.as_table()) {
        match item.as_table_like() {
            None => file.put(&mut top, leaf, path, key, line, item)?,
            Some(t) => file.section(root, &[], (key, line), t, path, &mut section)?,
        }
    }
    top.extend(section);
    Ok(top)
}

struct File<'a> {
    shown: &'a str,
    text: &'a str,
}

impl File<'_> {
    /// The entries of `table`, each with its key's line.
    fn entries<'t>(&self, table: &'t dyn TableLike) -> Vec<(String, usize, &'t Item)> {
        table
            .iter()
            .map(|(k, item)| {
                let at = table.key(k).and_then(|k| k.span()).map_or(0, |s| s.start);
                let line = self.text[..at.min(self.text.len())].matches('\n').count() + 1;
                (k.to_owned(), line, item)
            })
            .collect()
    }

    /// Checks `key = item` as a flag of `sub` (named `path`) and adds it to `out`.
    fn put(
        &self,
        out: &mut BTreeMap<String, FileValue>,
        sub: &Command,
        path: &[&str],
        written: String,
        line: usize,
        item: &Item,
    ) -> anyhow::Result<()> {
        let shown = self.shown;
        let long = written.replace('_', "-");
        if long == CONFIG || long == PRINT_CONFIG {
            anyhow::bail!(
                "--config {shown} line {line}: `{written}` cannot be set in a config file"
            );
        }
        if !settable(sub).any(|a| a.get_long() == Some(long.as_str())) {
            let name = path.join(" ");
            anyhow::bail!(
                "--config {shown} line {line}: unknown key `{written}` of `kvrouter {name}` \
                 (`kvrouter {name} --help` lists the flags; keys are their names; a file shared \
                 by several subcommands puts each one's keys under a table named after it: \
                 [serve], [weights.stamp])"
            );
        }
        if let Some(first) = out.get(&long) {
            anyhow::bail!(
                "--config {shown} line {line}: `{written}` repeats `{}` of line {}",
                first.key,
                first.line
            );
        }
        let Some(value) = item.as_value().and_then(to_toml) else {
            anyhow::bail!("--config {shown} line {line}: `{written}` is not a flag value");
        };
        out.insert(
            long,
            FileValue {
                key: written,
                line,
                value,
            },
        );
        Ok(())
    }

    /// Table `name` (at `line`) below the subcommands `parent` of `group`: it must name one of
    /// `group`'s subcommands. A leaf's table holds its flags (checked, and kept in `out` when that
    /// leaf is `running`); a group's holds its subcommands' tables.
    fn section(
        &self,
        group: &Command,
        parent: &[&str],
        (name, line): (String, usize),
        table: &dyn TableLike,
        running: &[&str],
        out: &mut BTreeMap<String, FileValue>,
    ) -> anyhow::Result<()> {
        let shown = self.shown;
        let mut path = parent.to_vec();
        path.push(name.as_str());
        let dotted = path.join(".");
        let Some(sub) = group.find_subcommand(&name) else {
            let parent: String = parent.iter().map(|p| format!("{p} ")).collect();
            anyhow::bail!(
                "--config {shown} line {line}: table [{dotted}] names no subcommand \
                 (`kvrouter {parent}--help` lists them)"
            );
        };
        let is_leaf = sub.get_subcommands().next().is_none();
        let mut mine = BTreeMap::new();
        for (key, at, item) in self.entries(table) {
            match (item.as_table_like(), is_leaf) {
                (None, true) => self.put(&mut mine, sub, &path, key, at, item)?,
                (Some(t), false) => self.section(sub, &path, (key, at), t, running, out)?,
                (Some(_), true) => anyhow::bail!(
                    "--config {shown} line {at}: `{key}` is a table, but `kvrouter {}` has no \
                     subcommands: its table holds flag values",
                    path.join(" ")
                ),
                (None, false) => anyhow::bail!(
                    "--config {shown} line {at}: `{key}` is a value, but [{dotted}] groups \
                     subcommands: put it under [{dotted}.SUBCOMMAND]"
                ),
            }
        }
        if path == running {
            out.extend(mine);
        }
        Ok(())
    }
}

/// A flag value of the file as a `toml::Value` (tables have no flag form: `None`).
fn to_toml(v: &Value) -> Option<toml::Value> {
    Some(match v {
        Value::String(s) => toml::Value::String(s.value().clone()),
        Value::Integer(i) => toml::Value::Integer(*i.value()),
        Value::Float(f) => toml::Value::Float(*f.value()),
        Value::Boolean(b) => toml::Value::Boolean(*b.value()),
        Value::Datetime(d) => toml::Value::String(d.value().to_string()),
        Value::Array(a) => toml::Value::Array(a.iter().map(to_toml).collect::<Option<_>>()?),
        Value::InlineTable(_) => return None,
    })
}
