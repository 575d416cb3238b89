//! Runs each `kvrouter weights` subcommand from its parsed flags (the flags: the parent module).

use super::*;

/// `--work`'s default: `OUT.work`, the output's whole name and `.work` (not its extension
/// replaced: `ckpt.v1` and `ckpt.v2` pulled side by side must not share `ckpt.work`, which a
/// success removes).
fn default_work(out: &std::path::Path) -> std::path::PathBuf {
    let mut name = out.components().as_path().as_os_str().to_owned();
    name.push(".work");
    name.into()
}

fn print(v: impl serde::Serialize) {
    println!("{}", serde_json::to_string(&v).expect("report serializes"));
}

/// Runs `kvrouter weights …`.
pub(crate) async fn run(args: WeightsArgs) -> anyhow::Result<()> {
    match args.command {
        WeightsCommand::Diff(a) => {
            let opts = a.codec.options()?;
            let m = blocking(move || {
                Ok(kvrouter_weights::diff(
                    &a.base,
                    a.base_version,
                    &a.new,
                    a.new_version,
                    &a.out,
                    &opts,
                )?)
            })
            .await?;
            print(
                serde_json::json!({"base": m.base, "new_version": m.new.version, "new_digest": m.new.digest, "checkpoint_bytes": m.new.total_bytes(), "delta_data_bytes": m.data_len, "data_sha256": m.data_sha256}),
            );
        }
        WeightsCommand::Apply(a) => {
            let threads = a.threads.get()?;
            let m = blocking(move || {
                Ok(kvrouter_weights::apply_recycling(
                    &a.base,
                    &a.delta,
                    &a.out,
                    threads,
                    a.recycle.as_deref(),
                )?)
            })
            .await?;
            print(
                serde_json::json!({"version": m.version, "digest": m.digest, "bytes": m.total_bytes()}),
            );
        }
        WeightsCommand::Stamp(a) => {
            let threads = a.threads.get()?;
            let m = blocking(move || {
                let m = checkpoint::stamp(&a.dir, a.version, threads)?;
                checkpoint::write_marker(&a.dir, &m)?;
                Ok(m)
            })
            .await?;
            print(
                serde_json::json!({"version": m.version, "digest": m.digest, "bytes": m.total_bytes()}),
            );
        }
        WeightsCommand::Verify(a) => {
            let threads = a.threads.get()?;
            let v = blocking(move || match (a.dir, a.delta) {
                (Some(dir), None) => {
                    if !dir.is_dir() {
                        bail!("--dir {}: not a directory", dir.display());
                    }
                    let m = checkpoint::read_marker(&dir)?.with_context(|| format!("--dir {}: no weights.json (run `kvrouter weights stamp`)", dir.display()))?;
                    checkpoint::verify(&dir, &m, threads)?;
                    Ok(serde_json::json!({"ok": true, "version": m.version, "digest": m.digest}))
                }
                (None, Some(delta)) => {
                    let m = kvrouter_weights::delta::verify_file(&delta)?;
                    Ok(serde_json::json!({"ok": true, "base": m.base.version, "new": m.new.version}))
                }
                _ => bail!("give --dir or --delta"),
            })
            .await?;
            print(v);
        }
        WeightsCommand::Publish(a) => {
            let store = a.store.require()?;
            let r = store::publish(
                &store,
                &a.dir,
                a.version,
                a.prev.as_deref(),
                a.full_every,
                &a.codec.options()?,
            )
            .await?;
            print(r);
        }
        WeightsCommand::Pull(a) => {
            let threads = a.threads.get()?;
            let work = a.work.clone().unwrap_or_else(|| default_work(&a.out));
            // Checked with or without --peer: a bad value is refused, not ignored.
            use crate::flag_values::{at_most, positive};
            let secs = |v: f64, flag: &str| positive(at_most(v, 86_400.0, flag)?, flag);
            let read_timeout = secs(a.peer_read_timeout_secs, "--peer-read-timeout-secs")?;
            let marker_timeout = secs(a.peer_marker_timeout_secs, "--peer-marker-timeout-secs")?;
            if let Some(peer) = &a.peer {
                let version = a.version.context("--version is required with --peer")?;
                if a.store.store.is_some() || a.have.is_some() || a.recycle.is_some() {
                    bail!("--peer pulls whole files from the peer: --store, --have and --recycle do not apply");
                }
                let client =
                    transfer::PeerClient::with_marker_timeout(read_timeout, marker_timeout)?;
                let n = transfer::pull_from_peer(&client, peer, version, &a.out, &work, threads)
                    .await?;
                // As after a pull from the store: the work folder's use is over.
                kvrouter_weights::workdir::release(&work);
                print(
                    serde_json::json!({"version": version, "peer": peer, "bytes_transferred": n, "store_reads": 0}),
                );
            } else {
                let store = a.store.require()?;
                let r = store::pull_recycling(
                    &store,
                    a.version,
                    &a.out,
                    a.have.as_deref(),
                    &work,
                    threads,
                    a.recycle.as_deref(),
                )
                .await?;
                kvrouter_weights::workdir::release(&work);
                print(r);
            }
        }
        WeightsCommand::Serve(a) => {
            if a.dir.exists() && !a.dir.is_dir() {
                bail!("--dir {} is not a directory", a.dir.display());
            }
            let peer = kvrouter_weights::serve::Peer::new(
                a.dir.clone(),
                a.store.open()?,
                a.threads.get()?,
                a.keep_versions as usize,
            );
            let listener = tokio::net::TcpListener::bind(&a.listen)
                .await
                .with_context(|| format!("--listen {}", a.listen))?;
            println!(
                "kvrouter weights serve listening on http://{} dir={}",
                listener.local_addr()?,
                a.dir.display()
            );
            axum::serve(listener, kvrouter_weights::serve::app(peer)).await?;
        }
        WeightsCommand::Gen(a) => {
            let threads = a.threads.get()?;
            if a.size_mib == 0 || a.files == 0 {
                bail!("--size-mib and --files must be at least 1");
            }
            if a.size_mib > MAX_MIB {
                bail!("--size-mib must be at most {MAX_MIB} (1 TiB)");
            }
            if !a.lr.is_finite() {
                bail!("--lr must be a finite number");
            }
            let spec = GenSpec {
                total_bytes: a.size_mib << 20,
                tensor_bytes: 16 << 20,
                cols: 1024,
                files: a.files,
                seed: a.seed,
            };
            let update = if a.adversarial {
                Update::Adversarial
            } else {
                Update::Rl {
                    lr: a.lr,
                    steps: a.steps,
                }
            };
            let out = a.out.clone();
            blocking(move || Ok(write_checkpoint(&out, &spec, update, threads)?)).await?;
            print(
                serde_json::json!({"out": a.out, "steps": a.steps, "lr": a.lr, "adversarial": a.adversarial}),
            );
        }
        WeightsCommand::Bench(a) => {
            let codec = a.codec.options()?;
            if a.size_mib == 0 || a.sweep_mib == 0 {
                bail!("--size-mib and --sweep-mib must be at least 1");
            }
            if a.size_mib > MAX_MIB || a.sweep_mib > MAX_MIB {
                bail!("--size-mib and --sweep-mib must be at most {MAX_MIB} (1 TiB)");
            }
            if a.chunks_kib
                .iter()
                .any(|&k| !CHUNK_KIB.contains(&(k as u64)))
            {
                bail!("--chunks-kib values must be from 4 to 262144");
            }
            let o = BenchOptions {
                checkpoint_bytes: a.size_mib << 20,
                sweep_bytes: a.sweep_mib << 20,
                threads: codec.threads,
                lr: a.lr,
                lrs: a.lrs,
                levels: a.levels,
                chunks: a.chunks_kib.iter().map(|k| k << 10).collect(),
                codec,
            };
            let scratch = a.scratch;
            let r = blocking(move || {
                Ok(kvrouter_weights::bench::run(&scratch, &o, &mut |s| {
                    eprintln!("weights bench: {s}")
                })?)
            })
            .await?;
            println!("{}", serde_json::to_string_pretty(&r)?);
        }
    }
    Ok(())
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
) -> anyhow::Result<T> {
    tokio::task::spawn_blocking(f).await?
}

#[cfg(test)]
mod tests {
    use super::default_work;
    use std::path::Path;

    #[test]
    fn the_default_work_folder_is_the_whole_output_name_and_work() {
        for (out, work) in [
            ("data.v1", "data.v1.work"),
            ("ckpt/a", "ckpt/a.work"),
            ("/w/ck.b/", "/w/ck.b.work"),
            ("model", "model.work"),
        ] {
            assert_eq!(default_work(Path::new(out)), Path::new(work), "{out}");
        }
    }
}
