//! Embeddings and vLLM's `/tokenize` and `/detokenize`, answered from the shared tokenizer
//! without the engine: embeddings are a fixed-size vector computed from the token ids alone
//! (the same tokens give the same vector, on any mock engine).

use crate::error::ApiError;
use crate::http::{parse_object, AppState};
use crate::openai::check_model;
use axum::body::Bytes;
use axum::extract::State;
use axum::Json;
use kvrouter_openai::passthrough::{detokenize_tokens, embeddings_input};
use kvrouter_openai::request::{self, Prompt};
use kvrouter_tokenizer::{ChatMessage, Tokenizer};
use serde_json::{json, Value};

/// The size of every embedding.
pub(crate) const EMBEDDING_DIMENSIONS: usize = 32;

/// A unit vector of [`EMBEDDING_DIMENSIONS`] computed from `tokens` (splitmix64 of each token and
/// coordinate, summed, normalized).
pub(crate) fn embedding(tokens: &[u32]) -> Vec<f32> {
    let mix = |mut z: u64| {
        z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut v = vec![0f64; EMBEDDING_DIMENSIONS];
    for (pos, t) in tokens.iter().enumerate() {
        for (i, x) in v.iter_mut().enumerate() {
            let h = mix((u64::from(*t) << 20) ^ ((pos as u64 % 64) << 8) ^ i as u64);
            *x += (h >> 11) as f64 / (1u64 << 53) as f64 - 0.5;
        }
    }
    let norm = v
        .iter()
        .map(|x| x * x)
        .sum::<f64>()
        .sqrt()
        .max(f64::MIN_POSITIVE);
    v.iter().map(|x| (x / norm) as f32).collect()
}

/// Every input of an embeddings body, tokenized.
fn inputs(body: &Value, tokenizer: &dyn Tokenizer) -> Result<Vec<Vec<u32>>, ApiError> {
    embeddings_input(body)?;
    let one = |p: Prompt<'_>| match p {
        Prompt::Ids(ids) => ids.into_owned(),
        Prompt::Text(t) => tokenizer.encode(&t),
    };
    let input = &body["input"];
    let items: Vec<Value> = match input {
        Value::Array(items) if !items.iter().all(Value::is_u64) => items.clone(),
        other => vec![other.clone()],
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            // Each item is read as a prompt; its errors name `input` (the field sent).
            let tokens = request::prompt(&json!({ "prompt": item }))
                .map(|p| one(p.first))
                .map_err(|e| {
                    ApiError::invalid(e.to_string().replace("`prompt`", "`input`"), Some("input"))
                })?;
            if tokens.is_empty() {
                // No token, no direction: it would be the zero vector, not a unit one.
                return Err(ApiError::invalid(
                    format!("`input` item {i} is empty: nothing to embed"),
                    Some("input"),
                ));
            }
            Ok(tokens)
        })
        .collect()
}

/// `POST /v1/embeddings`.
pub(crate) async fn embeddings(
    State(s): State<AppState>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let value = parse_object(&body)?;
    let c = s.config();
    let model = check_model(&value, &c.served_names())?;
    let all = inputs(&value, c.tokenizer.as_ref())?;
    let tokens: usize = all.iter().map(Vec::len).sum();
    let data: Vec<Value> = all
        .iter()
        .enumerate()
        .map(|(i, t)| json!({"object": "embedding", "index": i, "embedding": embedding(t)}))
        .collect();
    Ok(Json(json!({
        "object": "list", "data": data, "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    })))
}

/// `POST /tokenize` (vLLM): a `prompt`, or chat `messages` rendered with the chat template.
pub(crate) async fn tokenize(
    State(s): State<AppState>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let value = parse_object(&body)?;
    let c = s.config();
    check_model(&value, &c.served_names())?;
    let text = if value.get("messages").is_some_and(|m| !m.is_null()) {
        let chat = request::chat(&value)?;
        let messages: Vec<ChatMessage> = chat
            .messages
            .into_iter()
            .map(|m| ChatMessage {
                role: m.role,
                content: m.content,
            })
            .collect();
        c.chat_template
            .render(&messages, chat.add_generation_prompt)
            .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?
    } else {
        match value.get("prompt") {
            Some(Value::String(s)) => s.clone(),
            _ => {
                return Err(ApiError::invalid(
                    "`prompt` (a string) or `messages` is required",
                    Some("prompt"),
                ))
            }
        }
    };
    let tokens = c.tokenizer.encode(&text);
    let max_model_len = c.engine.num_gpu_blocks * c.engine.block_size;
    Ok(Json(json!({
        "count": tokens.len(), "max_model_len": max_model_len, "tokens": tokens, "token_strs": null,
    })))
}

/// `POST /detokenize` (vLLM): `tokens` back to text.
pub(crate) async fn detokenize(
    State(s): State<AppState>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let value = parse_object(&body)?;
    let c = s.config();
    check_model(&value, &c.served_names())?;
    let tokens = detokenize_tokens(&value)?;
    Ok(Json(json!({"prompt": c.tokenizer.decode(&tokens)})))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embeddings_are_unit_vectors_fixed_by_the_tokens() {
        let a = embedding(&[1, 2, 3]);
        assert_eq!(a.len(), EMBEDDING_DIMENSIONS);
        assert_eq!(a, embedding(&[1, 2, 3]));
        assert_ne!(a, embedding(&[1, 2, 4]));
        let norm: f32 = a.iter().map(|x| x * x).sum();
        assert!((norm - 1.0).abs() < 1e-4, "{norm}");
    }

    #[test]
    fn every_input_item_is_checked_and_errors_name_input() {
        let t = kvrouter_tokenizer::BuiltinTokenizer::new();
        let ok = inputs(&json!({"input": ["ab cd", [1, 2]]}), &t).unwrap();
        assert_eq!(ok.len(), 2);
        // An empty item (the zero vector, not a unit one) and a bad nested one name `input`.
        for body in [
            json!({"input": ""}),
            json!({"input": [[]]}),
            json!({"input": ["ab", ""]}),
            json!({"input": ["ab", {"x": 1}]}),
        ] {
            let e = inputs(&body, &t).unwrap_err();
            assert_eq!(e.body()["error"]["param"], "input", "{body}");
            assert!(!e.body()["error"]["message"]
                .as_str()
                .unwrap()
                .contains("`prompt`"));
        }
    }
}
