//! Migration of streamed completions whose prompt is token ids: `kvrouter serve` in front of
//! two `kvrouter mock-engine` processes, the engine serving a stream paused and killed after a
//! few tokens, the answer continued on the other. A third engine, seen by no router, gives the
//! reference answers: the mock's output is a pure function of its seed and the prompt, so the
//! continued answer must be the first engine's first k tokens followed by what an engine answers
//! to the original ids followed by those k tokens' ids.

mod common;

use futures::{Stream, StreamExt};
use serde_json::{json, Value};
use std::pin::Pin;
use std::time::Duration;

/// Enough tokens that the test stops the engine long before it has produced them all, even on
/// a loaded machine (at `--speedup-ratio 1` a token takes milliseconds).
const MAX_TOKENS: usize = 100;
/// Content chunks the client reads before the serving engine is stopped.
const BEFORE_KILL: usize = 3;
const WITHIN: Duration = Duration::from_secs(60);

type Chunks = Pin<Box<dyn Stream<Item = reqwest::Result<bytes::Bytes>> + Send>>;

/// The SSE events of a response, one `data` payload at a time.
struct Events {
    stream: Chunks,
    buf: String,
}

impl Events {
    fn new(response: reqwest::Response) -> Self {
        assert_eq!(response.status().as_u16(), 200);
        Events {
            stream: Box::pin(response.bytes_stream()),
            buf: String::new(),
        }
    }

    /// The next event's data, `None` at the end of the stream (bounded by [`WITHIN`]).
    async fn next(&mut self) -> Option<String> {
        loop {
            if let Some(end) = self.buf.find("\n\n") {
                let event: String = self.buf.drain(..end + 2).collect();
                return Some(event.trim().trim_start_matches("data:").trim().to_owned());
            }
            let chunk = tokio::time::timeout(WITHIN, self.stream.next())
                .await
                .expect("the stream goes on or ends in time")?;
            self.buf.push_str(&String::from_utf8_lossy(
                &chunk.expect("no transport error"),
            ));
        }
    }
}

/// What a client saw of a streamed completion.
#[derive(Debug, Default)]
struct Answer {
    /// The text of each content chunk, in order.
    texts: Vec<String>,
    usage: Option<Value>,
    done: usize,
    errors: Vec<Value>,
    /// Events after `[DONE]`.
    after_done: usize,
}

impl Answer {
    fn take(&mut self, data: &str) {
        if self.done > 0 {
            self.after_done += 1;
        }
        if data == "[DONE]" {
            self.done += 1;
            return;
        }
        let v: Value = serde_json::from_str(data).expect("a JSON event");
        if v.get("error").is_some() {
            self.errors.push(v.clone());
        }
        if let Some(t) = v["choices"][0]["text"].as_str().filter(|t| !t.is_empty()) {
            self.texts.push(t.to_owned());
        }
        if v["usage"].is_object() {
            self.usage = Some(v["usage"].clone());
        }
    }

    async fn read_to_end(&mut self, events: &mut Events) {
        while let Some(data) = events.next().await {
            self.take(&data);
        }
    }
}

fn request(prompt: Value, max_tokens: usize) -> Value {
    json!({
        "model": "mock-model", "prompt": prompt, "max_tokens": max_tokens,
        "stream": true, "stream_options": {"include_usage": true}
    })
}

async fn streamed(client: &reqwest::Client, base: &str, body: &Value) -> Answer {
    let r = client
        .post(format!("{base}/v1/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    let mut answer = Answer::default();
    answer.read_to_end(&mut Events::new(r)).await;
    answer
}

/// The ids `text` tokenizes to on `engine` (the tokenizer the router and the engines share).
async fn tokenize(client: &reqwest::Client, engine: &str, text: &str) -> Vec<u32> {
    let v: Value = client
        .post(format!("{engine}/tokenize"))
        .json(&json!({"model": "mock-model", "prompt": text}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    serde_json::from_value(v["tokens"].clone()).expect("token ids")
}

async fn engine() -> common::Proc {
    common::spawn(&["mock-engine", "--port", "0", "--speedup-ratio", "1"]).await
}

/// The reference engine: the same seed, so the same tokens, faster (timing plays no part).
async fn reference_engine() -> common::Proc {
    common::spawn(&["mock-engine", "--port", "0", "--speedup-ratio", "100"]).await
}

/// Streams `prompt` (the ids `ids`, flat or as a batch of one) through a router over two engines,
/// stops and kills the engine serving it after [`BEFORE_KILL`] tokens, and checks the answer the
/// client got against the reference engine.
async fn continued_after_a_kill(prompt: Value, ids: &[u32]) {
    let mut engines = vec![engine().await, engine().await];
    let reference = reference_engine().await;
    let urls: Vec<String> = engines.iter().map(common::Proc::http).collect();
    let router = common::spawn(&[
        "serve",
        "--port",
        "0",
        "--router-mode",
        "round-robin",
        "--no-router-kv-events",
        "--migration-limit",
        "1",
        "--worker",
        &urls[0],
        "--worker",
        &urls[1],
    ])
    .await;
    let base = router.http();
    let client = reqwest::Client::new();

    let response = client
        .post(format!("{base}/v1/completions"))
        .json(&request(prompt, MAX_TOKENS))
        .send()
        .await
        .unwrap();
    let mut events = Events::new(response);
    let mut answer = Answer::default();
    while answer.texts.len() < BEFORE_KILL {
        let data = events.next().await.expect("the first tokens");
        answer.take(&data);
    }
    // The engine running it: paused (no more tokens), then killed mid-answer.
    let serving = common::until("an engine running the request", WITHIN, || async {
        for (i, url) in urls.iter().enumerate() {
            let running = common::metric(url, "kvrouter_mock_running_requests").await;
            if running == Some(1.0) {
                return Some(i);
            }
        }
        None
    })
    .await;
    let paused = client
        .post(format!("{}/pause", urls[serving]))
        .send()
        .await
        .unwrap();
    assert!(paused.status().is_success());
    let mut killed = engines.remove(serving);
    killed.child.start_kill().unwrap();
    killed.child.wait().await.unwrap();
    answer.read_to_end(&mut events).await;
    let other = &urls[1 - serving];

    assert!(answer.errors.is_empty(), "{:?}", answer.errors);
    assert_eq!(
        (answer.done, answer.after_done),
        (1, 0),
        "[DONE] once, last"
    );
    assert_eq!(answer.texts.len(), MAX_TOKENS, "{:?}", answer.texts);
    let usage = answer.usage.clone().expect("a usage chunk");
    assert_eq!(usage["prompt_tokens"], json!(ids.len()), "{usage}");
    assert_eq!(usage["completion_tokens"], json!(MAX_TOKENS), "{usage}");
    assert_eq!(
        common::metric(&base, "kvrouter_migrations_total").await,
        Some(1.0)
    );

    // The other engine's prompt: the original ids and the k generated before the kill.
    let continued_prompt = common::metric(other, "kvrouter_mock_prompt_tokens_total")
        .await
        .expect("the other engine served the continuation") as usize;
    assert!(continued_prompt > ids.len(), "{continued_prompt}");
    let k = continued_prompt - ids.len();
    assert!(
        (BEFORE_KILL..MAX_TOKENS).contains(&k),
        "continued after {k} tokens"
    );
    let generated = tokenize(&client, &reference.http(), &answer.texts[..k].concat()).await;
    assert_eq!(generated.len(), k, "one id per streamed token");

    // Against the reference: the first k tokens as the original prompt gives them, then what
    // the original ids followed by the generated ones give.
    let first = streamed(&client, &reference.http(), &request(json!(ids), MAX_TOKENS)).await;
    assert_eq!(answer.texts[..k], first.texts[..k]);
    let continuation: Vec<u32> = ids.iter().chain(&generated).copied().collect();
    let rest = streamed(
        &client,
        &reference.http(),
        &request(json!(continuation), MAX_TOKENS - k),
    )
    .await;
    assert_eq!(rest.texts.len(), MAX_TOKENS - k);
    assert_eq!(
        answer.texts[k..],
        rest.texts[..],
        "the continuation is the answer to the ids followed by the generated ones"
    );
    assert_ne!(
        answer.texts[k..],
        first.texts[k..],
        "the mock's output depends on the prompt (else this test could not fail)"
    );
}

fn prompt_ids() -> Vec<u32> {
    (0..70u32).map(|i| 1000 + i * 7).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_id_prompt_is_continued_with_its_ids_and_the_generated_ones() {
    let ids = prompt_ids();
    continued_after_a_kill(json!(ids), &ids).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_one_token_id_prompt_is_continued_the_same_way() {
    let ids = prompt_ids();
    continued_after_a_kill(json!([ids]), &ids).await;
}

/// A non-streamed answer is continued only after a weight update's abort (a broken connection
/// retries it whole): the answer to a token-id prompt, aborted after a few tokens, is joined
/// from the first engine run and the continuation of the ids followed by the generated ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_token_id_answer_aborted_by_an_update_is_continued_with_the_generated_ids() {
    let ids = prompt_ids();
    whole_continued_after_an_update(json!(ids), &ids).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_answer_to_a_batch_of_one_is_continued_the_same_way() {
    let ids = prompt_ids();
    whole_continued_after_an_update(json!([ids]), &ids).await;
}

/// Asks for a whole answer to `prompt` (the ids `ids`, flat or as a batch of one), aborts it by
/// a weight update after a few tokens, and checks the joined answer against the reference.
async fn whole_continued_after_an_update(prompt: Value, ids: &[u32]) {
    const TOKEN: &str = "t0ken";
    let serving = engine().await;
    let reference = reference_engine().await;
    let url = serving.http();
    let router = common::spawn(&[
        "serve",
        "--port",
        "0",
        "--admin-token",
        TOKEN,
        "--worker",
        &url,
    ])
    .await;
    let base = router.http();
    let client = reqwest::Client::new();
    let steps = || async { common::metric(&url, "kvrouter_mock_steps_total").await };
    let before = steps().await.unwrap_or(0.0);
    let body = json!({"model": "mock-model", "prompt": prompt, "max_tokens": MAX_TOKENS});
    let task = {
        let (client, base) = (client.clone(), base.clone());
        tokio::spawn(async move {
            let r = client
                .post(format!("{base}/v1/completions"))
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status().as_u16(), 200);
            r.json::<Value>().await.unwrap()
        })
    };
    // A prefill step and a few decode steps: some tokens generated, most not.
    common::until("a few tokens generated", WITHIN, || async {
        steps().await.unwrap_or(0.0) >= before + 1.0 + BEFORE_KILL as f64
    })
    .await;
    let update = client
        .post(format!("{base}/admin/policy/update"))
        .bearer_auth(TOKEN)
        .json(&json!({"version": 1, "mode": "abort"}))
        .send()
        .await
        .unwrap();
    assert_eq!(update.status().as_u16(), 202);
    let answer = tokio::time::timeout(WITHIN, task)
        .await
        .expect("the answer in time")
        .unwrap();

    let text = answer["choices"][0]["text"].as_str().expect("a text");
    assert_eq!(answer["choices"][0]["finish_reason"], "length", "{answer}");
    // The mock's tokens are three ASCII bytes each (" xy").
    let tokens: Vec<String> = text
        .as_bytes()
        .chunks(3)
        .map(|c| String::from_utf8(c.to_vec()).unwrap())
        .collect();
    assert_eq!(tokens.len(), MAX_TOKENS, "{text:?}");
    assert_eq!(
        answer["usage"]["prompt_tokens"],
        json!(ids.len()),
        "{answer}"
    );
    assert_eq!(
        answer["usage"]["completion_tokens"],
        json!(MAX_TOKENS),
        "{answer}"
    );
    assert_eq!(
        common::metric(&base, "kvrouter_migrations_total").await,
        Some(1.0)
    );

    let first = streamed(&client, &reference.http(), &request(json!(ids), MAX_TOKENS)).await;
    let k = tokens
        .iter()
        .zip(&first.texts)
        .take_while(|(a, b)| a == b)
        .count();
    assert!((1..MAX_TOKENS).contains(&k), "continued after {k} tokens");
    let generated = tokenize(&client, &reference.http(), &tokens[..k].concat()).await;
    assert_eq!(generated.len(), k);
    let continuation: Vec<u32> = ids.iter().chain(&generated).copied().collect();
    let rest = streamed(
        &client,
        &reference.http(),
        &request(json!(continuation), MAX_TOKENS - k),
    )
    .await;
    assert_eq!(tokens[k..], rest.texts[..]);
    // The serving engine was asked for the original prompt, then for the continuation.
    assert_eq!(
        common::metric(&url, "kvrouter_mock_prompt_tokens_total").await,
        Some((2 * ids.len() + k) as f64)
    );
}
