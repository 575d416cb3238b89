//! Flags > environment > config file > defaults, on the real `kvrouter` command.

use super::*;
use crate::print_config::print;
use clap::ArgMatches;
use clap::{CommandFactory, FromArgMatches};
use std::collections::HashMap;

fn cli() -> Command {
    augment(crate::Cli::command())
}

/// Layers `args` with `env` and a config file holding `file` (at path "k.toml"), then parses.
fn run(
    args: &[&str],
    env: &[(&str, &str)],
    file: &str,
) -> anyhow::Result<(ArgMatches, BTreeMap<String, Source>)> {
    let cmd = cli();
    let env: HashMap<String, String> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let file = file.to_owned();
    let argv = std::iter::once("kvrouter")
        .chain(args.iter().copied())
        .map(OsString::from)
        .collect();
    let layered = layer(&cmd, argv, &|k| env.get(k).cloned(), &|_| Ok(file.clone()))?;
    let matches = cmd.try_get_matches_from(&layered.argv)?;
    Ok((matches, layered.sources))
}

fn serve_value(m: &ArgMatches, id: &str) -> Option<String> {
    let (_, sub) = m.subcommand().unwrap();
    sub.get_raw(id)
        .and_then(|mut v| v.next_back())
        .map(|v| v.to_string_lossy().into_owned())
}

fn error_of(args: &[&str], env: &[(&str, &str)], file: &str) -> String {
    match run(args, env, file) {
        Ok(_) => panic!("{args:?} {env:?} {file:?} was accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn command_line_beats_environment_beats_file_beats_default() {
    let file = "port = 9001\nhost = \"0.0.0.0\"\nretries = 7\n";
    let env = [("KVROUTER_PORT", "9002"), ("KVROUTER_RETRIES", "5")];
    let (m, sources) = run(
        &["serve", "--config", "k.toml", "--port", "9003"],
        &env,
        file,
    )
    .unwrap();
    assert_eq!(serve_value(&m, "port").as_deref(), Some("9003"));
    assert_eq!(sources["port"], Source::CommandLine);
    assert_eq!(serve_value(&m, "retries").as_deref(), Some("5"));
    assert_eq!(sources["retries"], Source::Env("KVROUTER_RETRIES".into()));
    assert_eq!(serve_value(&m, "host").as_deref(), Some("0.0.0.0"));
    assert_eq!(sources["host"], Source::File { line: 2 });
    assert_eq!(serve_value(&m, "migration_limit").as_deref(), Some("0"));
    assert!(!sources.contains_key("migration-limit"));
    // The typed arguments see the layered values too.
    let cli = crate::Cli::from_arg_matches(&m).unwrap();
    let crate::Command::Serve(args) = cli.command else {
        panic!("not serve")
    };
    assert_eq!(format!("{args:?}").matches("port: 9003").count(), 1);
}

#[test]
fn flags_of_flattened_groups_and_other_subcommands_are_covered() {
    // A routing flag (flattened RoutingArgs), an HTTP one, and mock-engine's own flags.
    let file = "router-mode = \"random\"\nshutdown_grace_secs = 3\n";
    let (m, _) = run(&["serve", "--config", "k.toml"], &[], file).unwrap();
    assert_eq!(serve_value(&m, "router_mode").as_deref(), Some("random"));
    assert_eq!(serve_value(&m, "shutdown_grace_secs").as_deref(), Some("3"));
    let (m, _) = run(&["mock-engine"], &[("KVROUTER_BLOCK_SIZE", "16")], "").unwrap();
    assert_eq!(serve_value(&m, "block_size").as_deref(), Some("16"));
}

#[test]
fn a_flag_added_later_is_covered_without_listing_it() {
    let cmd = augment(
        Command::new("kvrouter")
            .subcommand(Command::new("serve").arg(Arg::new("brand-new").long("brand-new"))),
    );
    let argv = vec!["kvrouter".into(), "serve".into()];
    let layered = layer(
        &cmd,
        argv,
        &|k| (k == "KVROUTER_BRAND_NEW").then(|| "yes".to_owned()),
        &|_| Ok(String::new()),
    )
    .unwrap();
    let m = cmd.try_get_matches_from(&layered.argv).unwrap();
    let (_, sub) = m.subcommand().unwrap();
    assert_eq!(
        sub.get_one::<String>("brand-new").map(String::as_str),
        Some("yes")
    );
}

#[test]
fn switches_and_lists() {
    let file = "expose-decisions = true\nworker = [\"http://a:1\", \"http://b:2\"]\n";
    let (m, _) = run(&["serve", "--config", "k.toml"], &[], file).unwrap();
    assert_eq!(serve_value(&m, "expose_decisions").as_deref(), Some("true"));
    let (_, sub) = m.subcommand().unwrap();
    let workers: Vec<&String> = sub.get_many::<String>("workers").unwrap().collect();
    assert_eq!(workers, ["http://a:1", "http://b:2"]);
    // The environment turns the file's switch off again and replaces the whole list.
    let env = [
        ("KVROUTER_EXPOSE_DECISIONS", "false"),
        ("KVROUTER_WORKER", "http://c:3,http://d:4"),
    ];
    let (m, _) = run(&["serve", "--config", "k.toml"], &env, file).unwrap();
    assert_eq!(
        serve_value(&m, "expose_decisions").as_deref(),
        Some("false")
    );
    let (_, sub) = m.subcommand().unwrap();
    let workers: Vec<&String> = sub.get_many::<String>("workers").unwrap().collect();
    assert_eq!(workers, ["http://c:3", "http://d:4"]);
}

#[test]
fn unknown_keys_name_the_key_and_line() {
    let e = error_of(
        &["serve", "--config", "k.toml"],
        &[],
        "port = 1\n\nrouter-mdoe = \"kv\"\n",
    );
    assert!(
        e.contains("line 3") && e.contains("unknown key `router-mdoe`"),
        "{e}"
    );
    let e = error_of(&["serve", "--config", "k.toml"], &[], "config = \"x\"\n");
    assert!(e.contains("`config` cannot be set in a config file"), "{e}");
    let e = error_of(
        &["serve", "--config", "k.toml"],
        &[],
        "mock-workers = 1\nmock_workers = 2\n",
    );
    assert!(
        e.contains("line 2") && e.contains("repeats `mock-workers`"),
        "{e}"
    );
    let e = error_of(&["serve", "--config", "k.toml"], &[], "port = \n");
    assert!(e.contains("k.toml"), "{e}");
}

#[test]
fn a_negative_value_after_a_space_is_refused_naming_its_flag() {
    for args in [
        &["serve", "--port", "-1"][..],
        &["serve", "--worker-threads", "-1"],
        &["sim", "--workers", "-3"],
        &["weights", "bench", "--threads", "-2"],
    ] {
        let e = error_of(args, &[], "");
        let flag = args[args.len() - 2];
        assert!(
            e.contains(flag) && e.contains(args[args.len() - 1]),
            "{args:?}: {e}"
        );
        assert!(!e.contains("unexpected argument"), "{args:?}: {e}");
    }
}

#[test]
fn bad_values_name_the_key_or_variable() {
    let e = error_of(
        &["serve", "--config", "k.toml"],
        &[],
        "\nport = \"eighty\"\n",
    );
    assert!(
        e.contains("line 2: key `port`") && e.contains("`eighty`"),
        "{e}"
    );
    let e = error_of(&["serve", "--config", "k.toml"], &[], "port = [1, 2]\n");
    assert!(e.contains("key `port`") && e.contains("not a list"), "{e}");
    let e = error_of(&["serve"], &[("KVROUTER_PORT", "70000")], "");
    assert!(e.contains("KVROUTER_PORT") && e.contains("70000"), "{e}");
    let e = error_of(&["serve"], &[("KVROUTER_LOAD_AWARE", "maybe")], "");
    assert!(
        e.contains("KVROUTER_LOAD_AWARE") && e.contains("maybe"),
        "{e}"
    );
    let e = error_of(&["serve", "--config", "k.toml"], &[], "load-aware = 1\n");
    assert!(
        e.contains("key `load-aware`") && e.contains("true or false"),
        "{e}"
    );
}

#[test]
fn print_config_redacts_secrets_and_reads_back_unchanged() {
    let file = "admin-token = \"s3cret\"\nmock-workers = 2\nworker = [\"http://a:1\"]\nrouter-ttl-secs = 7\n";
    let (m, sources) = run(&["serve", "--config", "k.toml", "--port", "0"], &[], file).unwrap();
    let text = print(&cli(), &m, &sources);
    assert!(!text.contains("s3cret"), "{text}");
    assert!(
        text.contains("admin-token = \"<redacted>\"  # config file line 1"),
        "{text}"
    );
    assert!(text.contains("port = 0  # command line"), "{text}");
    assert!(
        text.contains("router-ttl-secs = 7.0  # config file line 4"),
        "{text}"
    );
    assert!(text.contains("# tokenizer: unset"), "{text}");
    assert!(text.contains("\n# Routing\n"), "{text}");
    // Printed output is itself a valid config file (less the redacted secret) giving the same.
    let again = text.replace("admin-token = \"<redacted>\"", "admin-token = \"s3cret\"");
    let (m2, sources2) = run(&["serve", "--config", "k.toml"], &[], &again).unwrap();
    let strip = |t: &str| -> Vec<String> {
        t.lines()
            .map(|l| l.split("  #").next().unwrap().to_owned())
            .collect()
    };
    assert_eq!(strip(&print(&cli(), &m2, &sources2)), strip(&text));
}

/// Found by a docs audit: `sim --print-config` printed the planner-in-the-loop flags' defaults,
/// which were refused without `--planner` when read back (and so was any `KVROUTER_PLANNER_*`
/// variable meant for them). Every command's printed configuration reads back to itself.
#[test]
fn every_commands_printed_configuration_reads_back() {
    let commands: [&[&str]; 5] = [
        &["sim", "--workload", "seed001"],
        &["plan", "--workload", "seed001", "--ttft-p99-ms", "100"],
        &[
            "bench",
            "--url",
            "http://127.0.0.1:1",
            "--workload",
            "seed001",
        ],
        &["mock-engine"],
        &["serve", "--mock-workers", "1"],
    ];
    let strip = |t: &str| -> Vec<String> {
        t.lines()
            .map(|l| l.split("  #").next().unwrap().to_owned())
            .collect()
    };
    for args in commands {
        let (m, sources) = run(args, &[], "").unwrap();
        let text = print(&cli(), &m, &sources);
        let again = run(&[args[0], "--config", "k.toml"], &[], &text);
        let (m2, sources2) = again.unwrap_or_else(|e| panic!("{args:?}: {e}\n{text}"));
        assert_eq!(
            strip(&print(&cli(), &m2, &sources2)),
            strip(&text),
            "{args:?}"
        );
    }
}

#[test]
fn every_serve_flag_has_a_help_topic() {
    let cmd = cli();
    let serve = cmd.find_subcommand("serve").unwrap();
    let loose: Vec<&str> = settable(serve)
        .filter(|a| a.get_help_heading().is_none())
        .filter_map(|a| a.get_long())
        .collect();
    assert!(
        loose.is_empty(),
        "serve flags without help_heading (crates/cli/src/headings.rs): {loose:?}"
    );
}

#[test]
fn environment_names() {
    assert_eq!(env_name("router-mode"), "KVROUTER_ROUTER_MODE");
    assert_eq!(env_name("admin-token"), "KVROUTER_ADMIN_TOKEN");
}

/// Found by probing: the router's `KVROUTER_API_KEY`, in an environment shared with mock
/// engines, also set `mock-engine --api-key` (whose variable is `KVROUTER_MOCK_API_KEY`), so the
/// mocks wanted the clients' key. A flag with a variable of its own takes only that one.
#[test]
fn a_flag_with_its_own_variable_takes_no_other() {
    let env = [("KVROUTER_API_KEY", "router-key")];
    let (m, sources) = run(&["mock-engine"], &env, "").unwrap();
    assert_eq!(serve_value(&m, "api_key"), None);
    assert!(!sources.contains_key("api-key"));
    let (m, _) = run(&["serve"], &env, "").unwrap();
    assert_eq!(serve_value(&m, "api_key").as_deref(), Some("router-key"));
}

#[test]
fn a_refused_value_names_where_it_was_set() {
    let (_, sources) = run(
        &["serve", "--router-mode", "kv", "--config", "k.toml"],
        &[("KVROUTER_ROUTER_COST_SPEEDUP_RATIO", "0")],
        "retries = 2\n",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let from_env = name_sources(
        anyhow::anyhow!("invalid --router-cost-speedup-ratio: 0 is below 0.001"),
        &sources,
    );
    assert_eq!(
        from_env.to_string(),
        "invalid --router-cost-speedup-ratio: 0 is below 0.001\n  \
         (--router-cost-speedup-ratio was set by KVROUTER_ROUTER_COST_SPEEDUP_RATIO)"
    );
    let from_file = name_sources(anyhow::anyhow!("--retries: too many"), &sources);
    assert!(
        from_file
            .to_string()
            .ends_with("(--retries was set by the --config file, line 1)"),
        "{from_file}"
    );
    // A flag given on the command line, and one named only as the start of a longer flag, get
    // no note.
    for plain in ["--router-mode: bad", "--retries-budget: bad"] {
        assert_eq!(
            name_sources(anyhow::anyhow!("{plain}"), &sources).to_string(),
            plain
        );
    }
}

#[test]
fn nested_subcommands_take_the_environment_and_a_config_file_too() {
    // `weights stamp` and the other `weights` commands: their flags were reachable from the
    // command line only (`KVROUTER_THREADS=0` passed unchecked, a file's `threads` was an
    // unknown key of `weights`).
    let leaf_value = |m: &ArgMatches, id: &str| {
        let (_, w) = m.subcommand().unwrap();
        let (_, s) = w.subcommand().unwrap();
        s.get_raw(id)
            .and_then(|mut v| v.next_back())
            .map(|v| v.to_string_lossy().into_owned())
    };
    let args = ["weights", "stamp", "--dir", "d", "--version", "1"];
    let (m, sources) = run(&args, &[("KVROUTER_THREADS", "3")], "").unwrap();
    assert_eq!(leaf_value(&m, "threads").as_deref(), Some("3"));
    assert_eq!(
        sources.get("threads"),
        Some(&Source::Env("KVROUTER_THREADS".into()))
    );
    let with_file: Vec<&str> = args.iter().copied().chain(["--config", "k.toml"]).collect();
    let (m, _) = run(&with_file, &[], "threads = 2\n").unwrap();
    assert_eq!(leaf_value(&m, "threads").as_deref(), Some("2"));
    // The command line still wins, and a bad value names where it was set.
    let mut given = with_file.clone();
    given.extend(["--threads", "4"]);
    let (m, _) = run(&given, &[("KVROUTER_THREADS", "3")], "threads = 2\n").unwrap();
    assert_eq!(leaf_value(&m, "threads").as_deref(), Some("4"));
    let e = error_of(&with_file, &[], "nonsense = 1\n");
    assert!(
        e.contains("unknown key `nonsense`") && e.contains("kvrouter weights stamp --help"),
        "{e}"
    );
    // `weights` alone groups commands: no --config of its own.
    assert!(cli()
        .find_subcommand("weights")
        .unwrap()
        .get_arguments()
        .all(|a| a.get_long() != Some(CONFIG)));
    // --print-config prints the leaf's flags.
    let mut printing: Vec<&str> = args.to_vec();
    printing.push("--print-config");
    let (m, sources) = run(&printing, &[("KVROUTER_THREADS", "3")], "").unwrap();
    let text = print(&cli(), &m, &sources);
    assert!(text.starts_with("# kvrouter weights stamp:"), "{text}");
    assert!(text.contains("threads = 3"), "{text}");
}

#[test]
fn weights_commands_that_write_no_delta_take_no_codec_flags() {
    // They were accepted, checked and ignored (apply --zstd-level 22 wrote what the default did).
    for args in [
        &[
            "weights",
            "apply",
            "--base",
            "b",
            "--delta",
            "d",
            "--out",
            "o",
            "--zstd-level",
            "3",
        ][..],
        &[
            "weights",
            "stamp",
            "--dir",
            "d",
            "--version",
            "1",
            "--chunk-kib",
            "64",
        ],
        &["weights", "serve", "--dir", "d", "--zstd-level", "3"],
    ] {
        let e = error_of(args, &[], "");
        assert!(e.contains("unexpected argument"), "{args:?}: {e}");
    }
    let args = [
        "weights",
        "diff",
        "--base",
        "b",
        "--new",
        "n",
        "--new-version",
        "2",
        "--out",
        "o",
    ];
    let with: Vec<&str> = args.iter().copied().chain(["--zstd-level", "3"]).collect();
    run(&with, &[], "").unwrap();
}

#[test]
fn one_file_serves_several_subcommands_through_tables() {
    // `KVROUTER_CONFIG` exported for `serve` made every other subcommand fail on serve's keys:
    // a table per subcommand lets one file serve them all.
    let file = "port = 1\n\n[serve]\nport = 9000\nrouter-mode = \"kv\"\n\n\
                [weights.stamp]\nthreads = 2\n\n[mock-engine]\nspeedup-ratio = 5\n";
    let (m, sources) = run(&["serve", "--config", "k.toml"], &[], file).unwrap();
    assert_eq!(serve_value(&m, "port").as_deref(), Some("9000"));
    assert_eq!(serve_value(&m, "router_mode").as_deref(), Some("kv"));
    assert_eq!(sources.get("port"), Some(&Source::File { line: 4 }));
    let (m, _) = run(&["mock-engine", "--config", "k.toml"], &[], file).unwrap();
    assert_eq!(serve_value(&m, "port").as_deref(), Some("1"));
    assert_eq!(serve_value(&m, "speedup_ratio").as_deref(), Some("5"));
    let stamp = ["weights", "stamp", "--dir", "d", "--version", "1"];
    let args: Vec<&str> = stamp
        .iter()
        .copied()
        .chain(["--config", "k.toml"])
        .collect();
    let (m, _) = run(&args, &[], &file.replace("port = 1\n", "")).unwrap();
    let (_, w) = m.subcommand().unwrap();
    let (_, s) = w.subcommand().unwrap();
    assert_eq!(
        s.get_raw("threads").unwrap().next().unwrap().to_str(),
        Some("2")
    );
    // The top-level `port` is still for the subcommand that runs, which has none.
    let e = error_of(&args, &[], file);
    assert!(
        e.contains("line 1") && e.contains("unknown key `port` of `kvrouter weights stamp`"),
        "{e}"
    );
    // Typos anywhere are found, whichever subcommand reads the file.
    let serve = ["serve", "--config", "k.toml"];
    let e = error_of(&serve, &[], "[serv]\nport = 1\n");
    assert!(
        e.contains("line 1") && e.contains("[serv] names no subcommand"),
        "{e}"
    );
    let e = error_of(&serve, &[], "[weights.stamp]\nthreds = 1\n");
    assert!(
        e.contains("line 2") && e.contains("unknown key `threds` of `kvrouter weights stamp`"),
        "{e}"
    );
    let e = error_of(&serve, &[], "[weights.stmp]\n");
    assert!(e.contains("[weights.stmp] names no subcommand"), "{e}");
    let e = error_of(&serve, &[], "[weights]\nthreads = 1\n");
    assert!(
        e.contains("line 2") && e.contains("[weights] groups subcommands"),
        "{e}"
    );
    let e = error_of(&serve, &[], "[serve.x]\nport = 1\n");
    assert!(e.contains("`x` is a table"), "{e}");
    // A bad value in a table names its line.
    let e = error_of(&serve, &[], "\n[serve]\nport = \"x\"\n");
    assert!(e.contains("line 3"), "{e}");
}
