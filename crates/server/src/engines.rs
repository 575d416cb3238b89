//! The engine side of a weight update: what to call on a worker, per engine kind, behind one
//! trait. Each step is a plain description of HTTP calls ([`Call`]), so the calls per engine are
//! tested and documented (`docs/rl.md`) without an engine, and one executor sends them.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// The kind of engine behind a worker URL.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// `kvrouter mock-engine` (and the embedded mock workers).
    Mock,
    /// vLLM's OpenAI server (RL endpoints need `VLLM_SERVER_DEV_MODE=1`).
    Vllm,
    /// SGLang's HTTP server.
    Sglang,
}

impl EngineKind {
    /// Guesses the kind from a worker's `/server_info` answer (`None`: the endpoint is missing,
    /// as on vLLM).
    pub fn from_server_info(info: Option<&Value>) -> Self {
        match info {
            Some(v) if v["engine"] == "kvrouter-mock-engine" => EngineKind::Mock,
            Some(v) if v.get("model_path").is_some() || v.get("tp_size").is_some() => {
                EngineKind::Sglang
            }
            _ => EngineKind::Vllm,
        }
    }

    /// The control calls of this kind.
    pub fn control(self) -> &'static dyn EngineControl {
        match self {
            EngineKind::Mock => &MockControl,
            EngineKind::Vllm => &VllmControl,
            EngineKind::Sglang => &SglangControl,
        }
    }
}

/// One HTTP call on a worker: `POST {url}{path}` with a JSON body.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Call {
    /// Path and query.
    pub path: String,
    /// JSON body.
    pub body: Value,
}

impl Call {
    fn new(path: impl Into<String>, body: Value) -> Self {
        Self {
            path: path.into(),
            body,
        }
    }
}

/// Where the new weights come from, as the operator gave it (`load` in the update request): an
/// optional path override and a body merged into the engine's weight-load call.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadSpec {
    /// Path of the weight-load call instead of the engine kind's default.
    #[serde(default)]
    pub path: Option<String>,
    /// Fields of its JSON body (e.g. SGLang's `model_path`).
    #[serde(default)]
    pub body: serde_json::Map<String, Value>,
}

/// The engine calls of a weight update, in order: stop (aborting in-flight requests with their
/// partial output when asked), load the weights of a version, start again.
pub trait EngineControl: Sync {
    /// Stops generation; `abort` ends in-flight requests now with their partial output (finish
    /// reason `abort`), otherwise they are left as they are (the router drained them already).
    fn pause(&self, abort: bool) -> Call;
    /// Loads the weights of `version`; `flush` asks the engine to drop its prefix cache.
    fn load(&self, version: u64, spec: &LoadSpec, flush: bool) -> Vec<Call>;
    /// Starts generating again.
    fn resume(&self) -> Call;
}

fn merged(mut base: serde_json::Map<String, Value>, spec: &LoadSpec) -> Value {
    for (k, v) in &spec.body {
        base.insert(k.clone(), v.clone());
    }
    Value::Object(base)
}

fn object(v: Value) -> serde_json::Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => serde_json::Map::new(),
    }
}

/// `kvrouter mock-engine`: `/pause?mode=`, `/update_weights`, `/resume`.
struct MockControl;

impl EngineControl for MockControl {
    fn pause(&self, abort: bool) -> Call {
        Call::new(
            format!("/pause?mode={}", if abort { "abort" } else { "keep" }),
            json!({}),
        )
    }

    fn load(&self, version: u64, spec: &LoadSpec, flush: bool) -> Vec<Call> {
        let base = object(json!({"version": version, "clear_cache": flush}));
        vec![Call::new(
            spec.path
                .clone()
                .unwrap_or_else(|| "/update_weights".into()),
            merged(base, spec),
        )]
    }

    fn resume(&self) -> Call {
        Call::new("/resume", json!({}))
    }
}

/// vLLM (`vllm/entrypoints/serve/rlhf`): `/pause?mode=abort|keep&clear_cache=`, the weight
/// transfer's `/update_weights` with the operator's body, `/resume`.
struct VllmControl;

impl EngineControl for VllmControl {
    fn pause(&self, abort: bool) -> Call {
        Call::new(
            format!(
                "/pause?mode={}&clear_cache=false",
                if abort { "abort" } else { "keep" }
            ),
            json!({}),
        )
    }

    fn load(&self, version: u64, spec: &LoadSpec, flush: bool) -> Vec<Call> {
        let base = object(json!({"weight_version": version.to_string()}));
        let mut calls = vec![Call::new(
            spec.path
                .clone()
                .unwrap_or_else(|| "/update_weights".into()),
            merged(base, spec),
        )];
        if flush {
            calls.push(Call::new("/reset_prefix_cache", json!({})));
        }
        calls
    }

    fn resume(&self) -> Call {
        Call::new("/resume", json!({}))
    }
}

/// SGLang: `/pause_generation {"mode"}`, `/update_weights_from_disk` with the operator's body
/// (`model_path`), `/flush_cache`, `/continue_generation`.
struct SglangControl;

impl EngineControl for SglangControl {
    fn pause(&self, abort: bool) -> Call {
        Call::new(
            "/pause_generation",
            json!({"mode": if abort { "abort" } else { "in_place" }}),
        )
    }

    fn load(&self, version: u64, spec: &LoadSpec, flush: bool) -> Vec<Call> {
        let base = object(json!({"weight_version": version.to_string()}));
        let mut calls = vec![Call::new(
            spec.path
                .clone()
                .unwrap_or_else(|| "/update_weights_from_disk".into()),
            merged(base, spec),
        )];
        if flush {
            calls.push(Call::new("/flush_cache", json!({})));
        }
        calls
    }

    fn resume(&self) -> Call {
        Call::new("/continue_generation", json!({}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kind_is_read_from_server_info() {
        let mock = json!({"engine": "kvrouter-mock-engine"});
        assert_eq!(EngineKind::from_server_info(Some(&mock)), EngineKind::Mock);
        let sglang = json!({"model_path": "Qwen/Qwen3-8B", "tp_size": 1});
        assert_eq!(
            EngineKind::from_server_info(Some(&sglang)),
            EngineKind::Sglang
        );
        assert_eq!(EngineKind::from_server_info(None), EngineKind::Vllm);
    }

    #[test]
    fn each_kind_names_its_own_calls_and_takes_the_operators_load_body() {
        let spec = LoadSpec {
            path: None,
            body: object(json!({"model_path": "/ckpt/step-7"})),
        };
        let sglang = EngineKind::Sglang.control();
        assert_eq!(sglang.pause(true).body, json!({"mode": "abort"}));
        let load = sglang.load(7, &spec, true);
        assert_eq!(load[0].path, "/update_weights_from_disk");
        assert_eq!(
            load[0].body,
            json!({"weight_version": "7", "model_path": "/ckpt/step-7"})
        );
        assert_eq!(load[1].path, "/flush_cache");
        assert_eq!(sglang.resume().path, "/continue_generation");

        let vllm = EngineKind::Vllm.control();
        assert_eq!(vllm.pause(true).path, "/pause?mode=abort&clear_cache=false");
        assert_eq!(vllm.load(7, &spec, false).len(), 1, "no flush asked");
        let custom = LoadSpec {
            path: Some("/collective_rpc".into()),
            body: object(json!({"method": "reload"})),
        };
        assert_eq!(vllm.load(7, &custom, false)[0].path, "/collective_rpc");

        let mock = EngineKind::Mock.control();
        assert_eq!(mock.pause(false).path, "/pause?mode=keep");
        assert_eq!(
            mock.load(3, &LoadSpec::default(), true)[0].body,
            json!({"version": 3, "clear_cache": true})
        );
    }
}
