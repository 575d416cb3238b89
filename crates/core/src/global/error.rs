//! Why the global router refused a request, a summary or a cluster.

use super::ClusterId;

/// Why a request or summary was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GlobalError {
    /// No cluster has a fresh summary and is up: nothing to route to (retry later).
    #[error(
        "no cluster is available (every summary is stale or missing, or every cluster is down)"
    )]
    NoCluster,
    /// Clusters are available, but none of those whose models are known serves the request's.
    #[error("no available cluster serves the model {0:?}")]
    ModelNotServed(String),
    /// The id names no cluster.
    #[error("unknown cluster {0}")]
    UnknownCluster(ClusterId),
    /// A summary's block size differs from the router's.
    #[error("cluster {cluster}: summary block size {got}, global router uses {expected}")]
    BlockSize {
        /// The cluster.
        cluster: ClusterId,
        /// The router's block size.
        expected: u32,
        /// The summary's.
        got: u32,
    },
    /// A cluster spec with a bad round trip or weight.
    #[error("cluster {0:?}: round trip must be from 0 to 60,000 ms and weight from above 0 to 1,000,000")]
    InvalidSpec(String),
}
