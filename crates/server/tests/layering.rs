//! The server's modules form layers: no module reaches (through `crate::` paths, in any of its
//! files) a module that reaches it back. Modules are the top-level files and folders of
//! `src/`; the submodules of `src/request/` are checked among themselves the same way
//! (`super::` paths).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

type Graph = BTreeMap<String, BTreeSet<String>>;

/// Every `.rs` file under `dir`, with its text.
fn sources(dir: &Path, out: &mut Vec<(std::path::PathBuf, String)>) {
    for entry in std::fs::read_dir(dir).expect("readable src") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).expect("utf-8 source");
            out.push((path, text));
        }
    }
}

/// The names following `prefix` in `text` (`crate::state::Inner` gives `state`).
fn referenced<'t>(text: &'t str, prefix: &'t str) -> impl Iterator<Item = &'t str> + 't {
    text.match_indices(prefix).filter_map(move |(at, _)| {
        let rest = &text[at + prefix.len()..];
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        (end > 0).then(|| &rest[..end])
    })
}

/// The graph of the modules under `dir` (by first path component), through `prefix` paths.
fn graph(dir: &Path, prefix: &str) -> Graph {
    let mut files = Vec::new();
    sources(dir, &mut files);
    let mut g = Graph::new();
    for (path, text) in &files {
        let rel = path.strip_prefix(dir).expect("under dir");
        let first = rel.components().next().expect("a component");
        let module = first.as_os_str().to_string_lossy();
        let module = module.trim_end_matches(".rs").to_owned();
        let edges = g.entry(module.clone()).or_default();
        for to in referenced(text, prefix) {
            if to != module && to != "tests" {
                edges.insert(to.to_owned());
            }
        }
    }
    g
}

/// Edges `a -> b` where `b` reaches `a` back.
fn cycles(g: &Graph) -> Vec<(String, String)> {
    let reach = |from: &str| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_owned()];
        while let Some(m) = todo.pop() {
            for next in g.get(&m).into_iter().flatten() {
                if seen.insert(next.clone()) {
                    todo.push(next.clone());
                }
            }
        }
        seen
    };
    let mut out = Vec::new();
    for (a, edges) in g {
        for b in edges {
            if reach(b).contains(a) {
                out.push((a.clone(), b.clone()));
            }
        }
    }
    out
}

#[test]
fn no_server_module_imports_one_that_imports_it_back() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let top = graph(&src, "crate::");
    assert!(
        top.contains_key("request") && top.contains_key("state"),
        "{top:?}"
    );
    assert_eq!(cycles(&top), Vec::<(String, String)>::new(), "{top:?}");
    let request = graph(&src.join("request"), "super::");
    assert!(request.contains_key("attempt"), "{request:?}");
    assert_eq!(
        cycles(&request),
        Vec::<(String, String)>::new(),
        "{request:?}"
    );
}

#[test]
fn the_cycle_check_finds_cycles() {
    let mut g = Graph::new();
    let edge = |g: &mut Graph, a: &str, b: &str| {
        g.entry(a.into()).or_default().insert(b.into());
    };
    edge(&mut g, "config", "health");
    edge(&mut g, "health", "state");
    edge(&mut g, "app", "state");
    assert!(cycles(&g).is_empty());
    edge(&mut g, "state", "config");
    let found = cycles(&g);
    assert_eq!(found.len(), 3, "{found:?}");
    assert!(!found.iter().any(|(a, _)| a == "app"));
    let text = "use crate::state::Inner; crate::health::observe(); crate::";
    assert_eq!(
        referenced(text, "crate::").collect::<Vec<_>>(),
        ["state", "health"]
    );
}
