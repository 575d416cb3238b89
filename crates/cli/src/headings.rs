//! Topics of `--help` (clap `help_heading`), one constant each so a typo cannot open a new group.

pub(crate) const LISTEN: &str = "Listening and workers";
pub(crate) const MOCK: &str = "Embedded mock workers";
pub(crate) const ROUTING: &str = "Routing";
pub(crate) const KV_EVENTS: &str = "KV events";
pub(crate) const ADMISSION: &str = "Admission (busy thresholds, router queue)";
pub(crate) const SESSIONS: &str = "Sessions";
pub(crate) const RL: &str = "RL (groups, policy versions, provenance)";
pub(crate) const HEALTH: &str = "Health";
pub(crate) const UPSTREAM: &str = "Upstream requests and streams";
pub(crate) const TOKENIZER: &str = "Tokenizer and chat template";
pub(crate) const ADMIN: &str = "Admin API";
pub(crate) const HTTP: &str = "Client connections and shutdown";
pub(crate) const OBSERVABILITY: &str = "Observability";
pub(crate) const REPLICAS: &str = "Router replicas (NATS sync)";
pub(crate) const PICKER: &str = "Pick API and Gateway endpoint picker (ext_proc)";
pub(crate) const DISCOVERY: &str = "Worker discovery (etcd, Kubernetes)";
pub(crate) const GLOBAL: &str = "Global routing (across clusters)";
pub(crate) const PLANNER: &str = "Planner (recommended workers per pool)";
