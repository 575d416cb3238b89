//! What replicas send each other over NATS: names of subjects and buckets, the delta message,
//! and the values kept in the key-value buckets. Pure: encoding and names only.

use crate::health::Reason;
use kvrouter_core::router::RemoteEvent;
use serde::{Deserialize, Serialize};

/// One published batch of a replica's events (core NATS, `<cluster>.replica.<id>`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Message {
    /// The sender.
    pub(crate) replica: u64,
    /// The sending process: random per process, so two processes started with one replica id
    /// tell each other apart (0 from replicas that predate it: not checked).
    #[serde(default)]
    pub(crate) instance: u64,
    /// Per-sender sequence number (gaps are lost messages).
    pub(crate) seq: u64,
    /// When it was sent, Unix milliseconds (for the lag metric).
    pub(crate) sent_unix_ms: u64,
    /// The sender's worker table (id, URL), sent with every heartbeat: receivers translate
    /// worker ids through the URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) workers: Option<Vec<(u64, String)>>,
    /// The events, oldest first.
    pub(crate) events: Vec<RemoteEvent>,
    /// Changes of the sender's own worker health verdicts, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) verdicts: Vec<Verdict>,
    /// Every worker the sender's own observations keep out now (with each heartbeat).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) ejected: Option<Vec<Verdict>>,
    /// The sender repaired the shared state after reconnecting (wrote into the buckets what
    /// a server restart lost): receivers read the buckets again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) rejoined: bool,
}

/// A replica's health verdict on a worker, named by URL (replicas number workers differently;
/// verdicts are rare, so they carry the URL rather than wait for the sender's worker table).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Verdict {
    pub(crate) url: String,
    /// Why it was ejected; `None`: it recovered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) ejected: Option<Reason>,
}

/// A session binding as kept in the sessions bucket (read by a joining replica).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SessionValue {
    pub(crate) url: String,
    pub(crate) dp_rank: u32,
    /// The binding's length when it was written.
    pub(crate) ttl_ms: u64,
    /// When it ends, Unix milliseconds: a reader binds for what is left of it, so reading the
    /// bucket again does not lengthen it (absent from older replicas: `ttl_ms` from the read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) expires_unix_ms: Option<u64>,
}

impl SessionValue {
    /// A binding to `url` rank `dp_rank` for `ttl_ms` from `now_unix_ms`.
    pub(crate) fn new(url: String, dp_rank: u32, ttl_ms: u64, now_unix_ms: u64) -> Self {
        Self {
            url,
            dp_rank,
            ttl_ms,
            expires_unix_ms: Some(now_unix_ms.saturating_add(ttl_ms)),
        }
    }

    /// The milliseconds left of the binding at `now_unix_ms` (0: it ended).
    pub(crate) fn left_ms(&self, now_unix_ms: u64) -> u64 {
        self.expires_unix_ms
            .map_or(self.ttl_ms, |end| end.saturating_sub(now_unix_ms))
    }
}

/// A worker's policy version and operator pause as kept in the policy bucket.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WorkerPolicy {
    pub(crate) url: String,
    #[serde(default)]
    pub(crate) version: Option<u64>,
    #[serde(default)]
    pub(crate) paused: Option<bool>,
}

/// The weight-update lease's value.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct LeaseValue {
    /// The replica driving the update.
    pub(crate) replica: u64,
    /// Its progress (`GET /admin/policy` of the driver), for the other replicas.
    #[serde(default)]
    pub(crate) status: Option<serde_json::Value>,
}

/// Names of one logical router's subjects and buckets.
#[derive(Clone, Debug)]
pub(crate) struct Names {
    cluster: String,
}

impl Names {
    pub(crate) fn new(cluster: &str) -> Self {
        Self {
            cluster: cluster.to_owned(),
        }
    }
    /// Where replica `id` publishes its deltas.
    pub(crate) fn deltas(&self, id: u64) -> String {
        format!("{}.replica.{id}", self.cluster)
    }
    /// Every replica's deltas.
    pub(crate) fn all_deltas(&self) -> String {
        format!("{}.replica.*", self.cluster)
    }
    /// Heartbeats with worker tables, key = replica id, and each replica's own health
    /// ejections, key [`health_key`] (max age = the replica TTL).
    pub(crate) fn members(&self) -> String {
        format!("{}_members", self.cluster)
    }
    /// Session bindings, key = session key in hex (max age = the session TTL).
    pub(crate) fn sessions(&self) -> String {
        format!("{}_sessions", self.cluster)
    }
    /// Policy versions and pauses, key = hash of the worker URL.
    pub(crate) fn policy(&self) -> String {
        format!("{}_policy", self.cluster)
    }
    /// The weight-update lease, key `update` (max age = the replica TTL).
    pub(crate) fn lease(&self) -> String {
        format!("{}_lease", self.cluster)
    }
    /// The subject a key-value put of `key` in `bucket` goes to: replicas put with a plain
    /// publish (no acknowledgement to wait for), and JetStream stores it.
    pub(crate) fn kv_subject(bucket: &str, key: &str) -> String {
        format!("$KV.{bucket}.{key}")
    }
}

/// Where replica `id` keeps its own health ejections in the members bucket.
pub(crate) fn health_key(id: u64) -> String {
    format!("health.{id}")
}

/// The replica whose ejections a members-bucket key holds, if it is such a key.
pub(crate) fn health_key_replica(key: &str) -> Option<u64> {
    key.strip_prefix("health.")?.parse().ok()
}

/// A session's key in the sessions bucket.
pub(crate) fn session_key(session: u64) -> String {
    format!("{session:016x}")
}

/// The key of a worker's version or pause (`field`) in the policy bucket: one key each, so a
/// replica writing one never writes back a stale value of the other.
pub(crate) fn policy_key(url: &str, field: PolicyField) -> String {
    let field = match field {
        PolicyField::Version => "version",
        PolicyField::Paused => "paused",
    };
    format!(
        "{:016x}.{field}",
        xxhash_rust::xxh3::xxh3_64(url.as_bytes())
    )
}

/// Which part of a worker's policy a key of the policy bucket holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PolicyField {
    Version,
    Paused,
}

/// Unix milliseconds of `t`.
pub(crate) fn unix_ms(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_read_again_binds_for_what_is_left_of_it() {
        let v = SessionValue::new("http://a".into(), 0, 60_000, 1_000);
        assert_eq!(v.left_ms(1_000), 60_000);
        assert_eq!(v.left_ms(31_000), 30_000);
        assert_eq!(v.left_ms(90_000), 0);
        // An older replica's value: its length, from the read.
        let old: SessionValue =
            serde_json::from_str(r#"{"url":"http://a","dp_rank":0,"ttl_ms":500}"#).unwrap();
        assert_eq!(old.left_ms(1_000_000), 500);
    }
    use kvrouter_core::ids::{ReplicaId, RequestId, WorkerId, WorkerRank};

    #[test]
    fn a_message_without_an_instance_is_from_an_older_replica() {
        let m: Message =
            serde_json::from_str(r#"{"replica":7,"seq":0,"sent_unix_ms":1,"events":[]}"#).unwrap();
        assert_eq!(m.instance, 0, "0: not checked for a shared id");
    }

    #[test]
    fn messages_round_trip() {
        let m = Message {
            replica: 7,
            instance: 12,
            seq: 3,
            sent_unix_ms: 1,
            workers: Some(vec![(0, "http://a".into())]),
            events: vec![
                RemoteEvent::Begin {
                    replica: ReplicaId(7),
                    request: RequestId(1),
                    rank: WorkerRank::new(WorkerId(0), 0),
                    prefill_tokens: 5,
                    blocks: vec![],
                    private_blocks: 1,
                },
                RemoteEvent::Finish {
                    replica: ReplicaId(7),
                    request: RequestId(1),
                },
            ],
            verdicts: vec![Verdict {
                url: "http://a".into(),
                ejected: Some(Reason::FailedRequests),
            }],
            ejected: Some(vec![]),
            rejoined: true,
        };
        let bytes = serde_json::to_vec(&m).unwrap();
        assert_eq!(serde_json::from_slice::<Message>(&bytes).unwrap(), m);
        let names = Names::new("c1");
        assert_eq!(names.deltas(7), "c1.replica.7");
        assert_eq!(health_key_replica(&health_key(7)), Some(7));
        assert_eq!(health_key_replica("7"), None);
        assert_eq!(
            Names::kv_subject(&names.sessions(), &session_key(255)),
            "$KV.c1_sessions.00000000000000ff"
        );
    }
}
