//! An engine's side of etcd discovery (`kvrouter mock-engine --register etcd://...`): its
//! [`Registration`] under a lease, kept alive every third of the TTL, written again under a new
//! lease if etcd lost the old one, and revoked on a clean stop (the router drains it at once,
//! instead of after the TTL).

use super::{EtcdClient, EtcdError};
use crate::discovery::Registration;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// A live registration; [`Registered::revoke`] ends it.
pub struct Registered {
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

async fn write(
    client: &EtcdClient,
    key: &str,
    value: &[u8],
    ttl: Duration,
) -> Result<i64, EtcdError> {
    let lease = client.grant(ttl.as_secs().max(1)).await?;
    client.put(key, value, lease).await?;
    Ok(lease)
}

impl Registered {
    /// Writes `registration` under `key` with a lease of `ttl` (whole seconds, at least 1) and
    /// keeps it alive until [`Registered::revoke`]. Fails if etcd cannot be reached now.
    pub async fn start(
        client: EtcdClient,
        key: String,
        registration: &Registration,
        ttl: Duration,
    ) -> Result<Self, EtcdError> {
        let value = serde_json::to_vec(registration).expect("a registration serializes");
        let mut lease = write(&client, &key, &value, ttl).await?;
        let (stop, mut stopped) = watch::channel(false);
        let every = (ttl / 3).max(Duration::from_millis(100));
        let task = tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = tokio::time::sleep(every) => {}
                    _ = stopped.changed() => break,
                }
                match client.keep_alive(lease).await {
                    Ok(ttl_left) if ttl_left > 0 => {}
                    Ok(_) => {
                        tracing::warn!(%key, "etcd lease {lease} is gone; registering again");
                        match write(&client, &key, &value, ttl).await {
                            Ok(l) => lease = l,
                            Err(e) => tracing::warn!(%key, "etcd registration: {e}"),
                        }
                    }
                    Err(e) => tracing::warn!(%key, "etcd keep-alive: {e}"),
                }
            }
            if let Err(e) = client.revoke(lease).await {
                tracing::warn!(%key, "etcd revoke on stop: {e}");
            }
        });
        Ok(Self { stop, task })
    }

    /// Stops the keep-alives and revokes the lease (its key is deleted at once).
    pub async fn revoke(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
    }
}
