//! Shutdown signals of the long-running commands (`serve`, `serve --global`, `mock-engine`).

use anyhow::Context;

/// Takes SIGINT and SIGTERM from now on (Kubernetes stops pods with SIGTERM): the future
/// resolves on the first; a second one ends the process at once. Installed before a command
/// says it is ready, so a signal sent as soon as it says so drains rather than kills.
pub(crate) fn shutdown_signal(
) -> anyhow::Result<impl std::future::Future<Output = anyhow::Result<()>>> {
    use tokio::signal::unix::{signal, SignalKind};
    let term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    Ok(first_signal(term, int))
}

/// Waits for the first signal on `term` or `int`, then arms the second.
async fn first_signal(
    mut term: tokio::signal::unix::Signal,
    mut int: tokio::signal::unix::Signal,
) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let name = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    // The second signal is awaited on a thread of its own with its own small runtime: the
    // server's worker threads may all be busy (CPU-heavy requests) or already shut down, and
    // the second signal must stop the process either way. Until that thread listens, these
    // listeners are kept, so a signal in between is not lost; the message comes once it does.
    let (armed, ready) = tokio::sync::oneshot::channel::<Result<(), String>>();
    std::thread::Builder::new()
        .name("second-signal".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(r) => r,
                Err(e) => return drop(armed.send(Err(e.to_string()))),
            };
            runtime.block_on(async move {
                let listeners = signal(SignalKind::terminate())
                    .and_then(|t| Ok((t, signal(SignalKind::interrupt())?)));
                let (mut term, mut int) = match listeners {
                    Ok(l) => l,
                    Err(e) => return drop(armed.send(Err(e.to_string()))),
                };
                let _ = armed.send(Ok(()));
                tokio::select! {
                    _ = term.recv() => {},
                    _ = int.recv() => {},
                }
                eprintln!("second signal: stopping now");
                std::process::exit(130);
            });
        })
        .context("starting the second-signal thread")?;
    let second_already = tokio::select! {
        r = ready => match r {
            Ok(Ok(())) => false,
            Ok(Err(e)) => anyhow::bail!("installing the second-signal handler: {e}"),
            Err(_) => anyhow::bail!("installing the second-signal handler: its thread ended"),
        },
        _ = term.recv() => true,
        _ = int.recv() => true,
    };
    if second_already {
        eprintln!("second signal: stopping now");
        std::process::exit(130);
    }
    drop((term, int));
    eprintln!("{name}: draining (a second signal stops at once)");
    Ok(())
}
