//! `publish`: a version into object storage, continuing the chain pullers walk (the layout:
//! [`crate::store`]).

use crate::checkpoint;
use crate::diff::{self, CodecOptions};
use crate::error::{Result, WeightsError};
use crate::layout::MARKER;
use crate::store::{blocking, Store};
use serde::Serialize;
use std::path::Path;

/// What `publish` uploaded.
#[derive(Clone, Debug, Serialize)]
pub struct PublishReport {
    /// The version published.
    pub version: u64,
    /// Checkpoint bytes.
    pub checkpoint_bytes: u64,
    /// Bytes of the uploaded delta, if one was.
    pub delta_bytes: Option<u64>,
    /// Whether a full checkpoint was uploaded.
    pub full: bool,
}

/// Publishes `dir` as `version`: a delta against `prev` (the local copy of `version − 1`), and a
/// full checkpoint when there is no `prev` or `version` is a multiple of `full_every`; then
/// `latest`. Stamps `dir` (writes its `weights.json`) when it has no marker.
///
/// Versions only go forward: a `version` at or below the store's `latest` is refused before
/// anything is written, since replacing it would break the deltas that build on it.
pub async fn publish(
    store: &Store,
    dir: &Path,
    version: u64,
    prev: Option<&Path>,
    full_every: u64,
    opts: &CodecOptions,
) -> Result<PublishReport> {
    if full_every == 0 {
        return Err(WeightsError::Invalid(
            "--full-every must be at least 1".into(),
        ));
    }
    let latest = store.latest().await?;
    if let Some(latest) = latest {
        if version <= latest {
            return Err(WeightsError::Invalid(format!(
                "--version {version}: the store already has versions up to v{latest}; a \
                 published version is never replaced (publish v{} or later)",
                latest + 1
            )));
        }
    }
    let mut marker = blocking({
        let (dir, threads) = (dir.to_path_buf(), opts.threads);
        move || {
            let m = checkpoint::marker_or_stamp(&dir, Some(version), threads)?;
            checkpoint::write_marker(&dir, &m)?;
            Ok(m)
        }
    })
    .await?;
    let mut delta_bytes = None;
    if let Some(prev) = prev {
        let prev_version = version
            .checked_sub(1)
            .ok_or_else(|| WeightsError::Invalid("v0 has no previous version".into()))?;
        // A delta continues the chain pullers walk: it must start from the store's latest.
        match latest {
            None => {
                return Err(WeightsError::Invalid(format!(
                    "--prev: the store has no published version, so no puller has v{prev_version} \
                     to apply a delta to; publish v{version} without --prev (a full checkpoint)"
                )))
            }
            Some(l) if l != prev_version => {
                return Err(WeightsError::Invalid(format!(
                    "--prev: a delta to v{version} starts from v{prev_version}, but the store's \
                     latest is v{l}; publish v{} against it, or v{version} without --prev",
                    l + 1
                )))
            }
            Some(_) => {}
        }
        let published = store.version_marker(prev_version).await?;
        // The delta is built against --prev's bytes, and pullers apply it to the bytes the store
        // published: --prev must hold what its marker says (one read of it, checked, before the
        // marker's digest is compared with the store's).
        blocking({
            let (prev, threads) = (prev.to_path_buf(), opts.threads);
            move || match checkpoint::read_marker(&prev)? {
                Some(m) if m.version != prev_version => Err(WeightsError::Invalid(format!(
                    "--prev {}: it is stamped v{}; a delta to v{version} starts from \
                     v{prev_version}",
                    prev.display(),
                    m.version
                ))),
                Some(m) => checkpoint::verify(&prev, &m, threads).map_err(|e| {
                    WeightsError::Invalid(format!(
                        "--prev {}: its files are not those its marker names ({e})",
                        prev.display()
                    ))
                }),
                None => Ok(()),
            }
        })
        .await?;
        let tmp = diff::temp_path(&dir.with_extension(format!("delta-v{prev_version}")));
        let m = blocking({
            let (prev, dir, tmp, opts) = (
                prev.to_path_buf(),
                dir.to_path_buf(),
                tmp.clone(),
                opts.clone(),
            );
            // Straight into the publish's own partial (a killed publish leaves only that,
            // which the next one removes), not through the diff's temporary file.
            move || diff::write_delta(&prev, Some(prev_version), &dir, version, &tmp, &opts)
        })
        .await?;
        if m.base.version != prev_version {
            let _ = std::fs::remove_file(&tmp);
            return Err(WeightsError::Invalid(format!(
                "--prev holds v{}, v{prev_version} expected",
                m.base.version
            )));
        }
        if let Some(stored) = published.filter(|p| p.digest != m.base.digest) {
            let _ = std::fs::remove_file(&tmp);
            return Err(WeightsError::Invalid(format!(
                "--prev {}: not the v{prev_version} the store published (digest {}, the \
                 store's {}); pullers could not apply the delta",
                prev.display(),
                m.base.digest,
                stored.digest
            )));
        }
        let uploaded = store
            .put_file(
                &format!("delta/v{prev_version}-v{version}/delta.kvwd"),
                &tmp,
            )
            .await;
        delta_bytes = std::fs::metadata(&tmp).ok().map(|m| m.len());
        let _ = std::fs::remove_file(&tmp);
        uploaded?;
        // The delta names `dir`'s bytes by the marker the diff just made (the format written
        // now); a marker `dir` had from before (format 1) would give the same bytes a second
        // version id, and the next delta (its base) would not match what pullers rebuild.
        if m.new.digest != marker.digest {
            checkpoint::write_marker(dir, &m.new)?;
            marker = m.new.clone();
        }
        // The version's marker beside its delta: the next publish checks its --prev against it.
        store
            .put_bytes(
                &format!("delta/v{prev_version}-v{version}/{MARKER}"),
                serde_json::to_vec_pretty(&marker).expect("marker serializes"),
            )
            .await?;
    }
    let full = prev.is_none() || version % full_every == 0;
    if full {
        for f in &marker.files {
            store
                .put_file(&format!("base/v{version}/{}", f.name), &dir.join(&f.name))
                .await?;
        }
        store
            .put_bytes(
                &format!("base/v{version}/{MARKER}"),
                serde_json::to_vec_pretty(&marker).expect("marker serializes"),
            )
            .await?;
    }
    store
        .put_bytes(
            "latest",
            serde_json::to_vec(&serde_json::json!({"version": version})).expect("json"),
        )
        .await?;
    Ok(PublishReport {
        version,
        checkpoint_bytes: marker.total_bytes(),
        delta_bytes,
        full,
    })
}
