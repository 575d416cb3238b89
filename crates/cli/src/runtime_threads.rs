//! The async runtime's worker threads: `serve --worker-threads` and `TOKIO_WORKER_THREADS`,
//! checked before the runtime starts (tokio panics on a bad variable and takes no bound).

/// Largest `--worker-threads`.
pub(crate) const MAX_WORKER_THREADS: usize = 1024;

/// The runtime's worker threads for a command given `--worker-threads flag` (0 for commands
/// without the flag), checking `TOKIO_WORKER_THREADS` (lossily decoded: a value that is not
/// UTF-8 is refused too); `None`: tokio's own choice, one per CPU.
pub(crate) fn runtime_worker_threads(flag: usize) -> anyhow::Result<Option<usize>> {
    let env = std::env::var_os("TOKIO_WORKER_THREADS").map(|v| v.to_string_lossy().into_owned());
    worker_threads(flag, env.as_deref())
}

/// `--worker-threads n`, given the `TOKIO_WORKER_THREADS` variable's value `env`: the flag
/// wins; without it a set variable must be a count in 1..=1024 (tokio itself would panic on
/// a bad one and take no bound), and otherwise tokio chooses.
fn worker_threads(n: usize, env: Option<&str>) -> anyhow::Result<Option<usize>> {
    if n > 0 {
        return Ok(Some(n));
    }
    let Some(v) = env else { return Ok(None) };
    match v.trim().parse::<usize>() {
        Ok(k) if (1..=MAX_WORKER_THREADS).contains(&k) => Ok(Some(k)),
        _ => anyhow::bail!(
            "TOKIO_WORKER_THREADS: `{v}` is not a worker count from 1 to {MAX_WORKER_THREADS} \
             (unset it, or give --worker-threads, which takes precedence)"
        ),
    }
}

#[cfg(test)]
mod worker_thread_tests {
    #[test]
    fn the_flag_wins_then_a_checked_variable_then_tokios_choice() {
        use super::worker_threads;
        assert_eq!(worker_threads(3, Some("x")).unwrap(), Some(3));
        assert_eq!(worker_threads(0, None).unwrap(), None);
        assert_eq!(worker_threads(0, Some("4")).unwrap(), Some(4));
        assert_eq!(worker_threads(0, Some("1024")).unwrap(), Some(1024));
        for bad in ["x", "0", "-1", "1025", "", "2.5"] {
            let e = worker_threads(0, Some(bad)).unwrap_err().to_string();
            assert!(e.contains("TOKIO_WORKER_THREADS"), "{bad}: {e}");
        }
    }
}
