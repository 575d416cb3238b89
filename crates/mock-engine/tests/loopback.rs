//! `start_on_loopback`: the engines a host (`kvrouter serve --mock-workers N`) starts for itself,
//! each on its own ports and with its own seed; an error when one cannot start.

use kvrouter_mock_engine::{start_on_loopback, MockEngineConfig, StartError};
use serde_json::{json, Value};

fn template() -> MockEngineConfig {
    MockEngineConfig {
        speedup_ratio: 50.0,
        kv_events_endpoint: Some("tcp://127.0.0.1:0".into()),
        kv_events_replay_endpoint: Some("tcp://127.0.0.1:0".into()),
        ..MockEngineConfig::default()
    }
}

/// The text engine `http` generates for a fixed prompt.
async fn text(client: &reqwest::Client, http: std::net::SocketAddr) -> String {
    let r: Value = client
        .post(format!("http://{http}/v1/completions"))
        .json(&json!({"model": "mock-model", "prompt": "the same prompt", "max_tokens": 8}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    r["choices"][0]["text"].as_str().expect("a text").to_owned()
}

#[tokio::test]
async fn each_engine_gets_its_own_ports_and_seed() {
    let engines = start_on_loopback(&template(), 2).await.unwrap();
    let (a, b) = (&engines[0].endpoints, &engines[1].endpoints);
    assert_ne!(a.http, b.http);
    assert!(a.http.ip().is_loopback() && b.http.ip().is_loopback());
    assert!(a.kv_events.is_some() && a.replay.is_some(), "{a:?}");
    assert_ne!(a.kv_events, b.kv_events);
    assert_ne!(a.replay, b.replay);
    let client = reqwest::Client::new();
    let (ta, tb) = (text(&client, a.http).await, text(&client, b.http).await);
    assert_eq!(
        ta,
        text(&client, a.http).await,
        "one engine is deterministic"
    );
    assert_ne!(
        ta, tb,
        "seeds differ, so the engines do not answer in lockstep"
    );
    for e in engines {
        e.stop().await;
    }
}

#[tokio::test]
async fn an_engine_that_cannot_bind_is_an_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut t = template();
    t.kv_events_endpoint = Some(format!("tcp://{}", taken.local_addr().unwrap()));
    match start_on_loopback(&t, 2).await {
        Err(StartError::Bind { what, .. }) => assert!(!what.is_empty()),
        Ok(engines) => panic!("{} engines started on a taken port", engines.len()),
    }
    assert!(start_on_loopback(&template(), 0).await.unwrap().is_empty());
}

/// A batch of several prompts is refused with an OpenAI-shaped 400 naming `prompt` (streamed or
/// not, text or token ids); a batch of one is served.
#[tokio::test]
async fn a_batch_of_several_prompts_is_refused_naming_prompt() {
    let engines = start_on_loopback(&template(), 1).await.unwrap();
    let http = engines[0].endpoints.http;
    let client = reqwest::Client::new();
    for prompt in [json!(["a", "b"]), json!([[1, 2], [3, 4]])] {
        for stream in [false, true] {
            let r = client
                .post(format!("http://{http}/v1/completions"))
                .json(&json!({"model": "mock-model", "prompt": prompt, "max_tokens": 2, "stream": stream}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 400);
            let body: Value = r.json().await.unwrap();
            let e = &body["error"];
            assert_eq!(
                (e["type"].as_str(), e["param"].as_str(), e["code"].as_u64()),
                (Some("invalid_request_error"), Some("prompt"), Some(400)),
                "{body}"
            );
            assert!(
                e["message"]
                    .as_str()
                    .unwrap()
                    .contains("one prompt per request"),
                "{body}"
            );
        }
    }
    let r = client
        .post(format!("http://{http}/v1/completions"))
        .json(&json!({"model": "mock-model", "prompt": ["hello there"], "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    for e in engines {
        e.stop().await;
    }
}

/// A body above 64 KiB (read on a blocking thread, off the async ones) is answered as a small
/// one is, errors included.
#[tokio::test]
async fn a_body_past_64_kib_is_answered_as_a_small_one_is() {
    let engines = start_on_loopback(&template(), 1).await.unwrap();
    let http = engines[0].endpoints.http;
    let client = reqwest::Client::new();
    let messages: Vec<Value> = (0..2_000)
        .map(|_| json!({"role": "user", "content": "hi there hi there hi there"}))
        .collect();
    let body = json!({"model": "mock-model", "messages": messages, "max_tokens": 2});
    assert!(body.to_string().len() > 64 * 1024);
    let r: Value = client
        .post(format!("http://{http}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(r["usage"]["prompt_tokens"].as_u64().unwrap() > 2_000, "{r}");
    let mut bad = body.clone();
    bad["max_tokens"] = json!("two");
    let r = client
        .post(format!("http://{http}/v1/chat/completions"))
        .json(&bad)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["param"], "max_tokens", "{e}");
    for e in engines {
        e.stop().await;
    }
}

/// A request the KV pool can never hold is a 400 naming what does not fit: the prompt, or,
/// when the prompt alone fits, the output budget.
#[tokio::test]
async fn a_request_that_cannot_fit_names_the_prompt_or_the_output_budget() {
    let mut t = template();
    t.engine.block_size = 16;
    t.engine.num_gpu_blocks = 8; // 128 tokens.
    let engines = start_on_loopback(&t, 1).await.unwrap();
    let http = engines[0].endpoints.http;
    let client = reqwest::Client::new();
    let few: Vec<u32> = (0..10).collect();
    let many: Vec<u32> = (0..200).collect();
    for (prompt, max_tokens, param) in [(&few, 1000, "max_tokens"), (&many, 1, "prompt")] {
        let r = client
            .post(format!("http://{http}/v1/completions"))
            .json(&json!({"model": "mock-model", "prompt": prompt, "max_tokens": max_tokens}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
        let e: Value = r.json().await.unwrap();
        assert_eq!(e["error"]["param"], param, "{e}");
    }
    for e in engines {
        e.stop().await;
    }
}

/// The cached prompt tokens the engine at `http` reports for `body`.
async fn cached(client: &reqwest::Client, http: std::net::SocketAddr, body: Value) -> u64 {
    let r: Value = client
        .post(format!("http://{http}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    r["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {r}"))
}

/// A request's `cache_salt` is part of the namespace its blocks are cached in, as in vLLM: a
/// salted prompt hits only blocks cached under the same salt.
#[tokio::test]
async fn a_cache_salt_keeps_its_blocks_apart() {
    let engines = start_on_loopback(&template(), 1).await.unwrap();
    let http = engines[0].endpoints.http;
    let client = reqwest::Client::new();
    let words: Vec<String> = (0..300).map(|i| format!("w{i}")).collect();
    let prompt = words.join(" ");
    let with = |salt: Option<&str>| {
        let mut b = json!({"model": "mock-model", "prompt": prompt, "max_tokens": 1});
        if let Some(s) = salt {
            b["cache_salt"] = json!(s);
        }
        b
    };
    assert_eq!(cached(&client, http, with(Some("t1"))).await, 0);
    assert!(
        cached(&client, http, with(Some("t1"))).await > 0,
        "same salt"
    );
    assert_eq!(cached(&client, http, with(None)).await, 0, "no salt");
    assert_eq!(
        cached(&client, http, with(Some("t2"))).await,
        0,
        "other salt"
    );
    assert!(
        cached(&client, http, with(None)).await > 0,
        "unsalted again"
    );
    for e in engines {
        e.stop().await;
    }
}
