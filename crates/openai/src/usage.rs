//! Token usage: finding a response's `usage`, and folding the usages of an answer continued over
//! several attempts into the one usage the client sees.

use crate::sse;
use serde_json::{json, Value};

/// The non-null `usage` of a parsed body or chunk.
pub fn of(v: &Value) -> Option<&Value> {
    v.get("usage").filter(|u| !u.is_null())
}

/// The non-null `usage` of a whole JSON object body, read from its text: only that field's value
/// is parsed. `None` when the body is not one the top-level walk takes (see
/// [`crate::scan::slot`]); the caller then reads it whole. `raw` must be valid JSON.
pub fn in_text(raw: &[u8]) -> Option<Option<Value>> {
    use crate::scan::{slot, Slot};
    Some(match slot(raw, "usage")? {
        Slot::Value(range) => serde_json::from_slice::<Value>(&raw[range])
            .ok()
            .filter(|u| !u.is_null()),
        Slot::Absent { .. } => None,
    })
}

/// The `usage` of a response: of the body (`stream` false), or of the last event carrying one.
pub fn find(tail: &[u8], stream: bool) -> Option<Value> {
    if !stream {
        return of(&serde_json::from_slice::<Value>(tail).ok()?).cloned();
    }
    sse::events(tail)
        .filter_map(sse::json)
        .filter_map(|v| of(&v).cloned())
        .last()
}

/// The usage a client sees: prompt, completion, their total, and cached prompt tokens if known.
pub fn value(prompt_tokens: u64, completion_tokens: u64, cached_tokens: Option<u64>) -> Value {
    let mut u = json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    });
    if let Some(cached) = cached_tokens {
        u["prompt_tokens_details"] = json!({ "cached_tokens": cached });
    }
    u
}

/// Folds the usage of a continuation's stream into the whole answer's: `carried` tokens were
/// streamed by earlier attempts, and the continuation's prompt held them. The folded usage
/// describes the client's request, not the last attempt:
/// - `prompt_tokens`: the client's prompt: `first_prompt` (the original prompt's count, if an
///   earlier attempt reported it), else the continuation's prompt less the carried tokens;
/// - `completion_tokens`: every token of the answer, from all attempts;
/// - `prompt_tokens_details.cached_tokens`: the tokens of the client's prompt that the engine
///   which finished the answer found in its prefix cache, so never more than `prompt_tokens`.
///   The continuation's prompt is the client's prompt followed by the carried tokens and a
///   prefix cache matches from the start, so that is the continuation's count capped at the
///   client's prompt; the carried tokens it found cached (or prefilled again) are in neither
///   count.
pub fn fold_continued(usage: &mut Value, carried: u64, first_prompt: Option<u64>) {
    if !usage.is_object() {
        return;
    }
    let completion = usage["completion_tokens"].as_u64().unwrap_or(0) + carried;
    let prompt = first_prompt.unwrap_or_else(|| {
        usage["prompt_tokens"]
            .as_u64()
            .unwrap_or(0)
            .saturating_sub(carried)
    });
    usage["completion_tokens"] = json!(completion);
    usage["prompt_tokens"] = json!(prompt);
    usage["total_tokens"] = json!(completion + prompt);
    if let Some(cached) = usage["prompt_tokens_details"]["cached_tokens"].as_u64() {
        usage["prompt_tokens_details"]["cached_tokens"] = json!(cached.min(prompt));
    }
}

/// The usage of a whole answer joined from parts: the first part's usage (its prompt, its
/// cached tokens) with the completion tokens of all parts.
pub fn joined(mut first: Value, completion_tokens: u64) -> Value {
    if !first.is_object() {
        return first;
    }
    let prompt = first["prompt_tokens"].as_u64().unwrap_or(0);
    first["completion_tokens"] = json!(completion_tokens);
    first["total_tokens"] = json!(prompt + completion_tokens);
    first
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_usage_of_a_stream_is_found() {
        let tail = b"data: {\"usage\":null}\n\ndata: {\"usage\":{\"prompt_tokens\":3}}\n\ndata: {\"choices\":[]}\n\ndata: [DONE]\n\n";
        assert_eq!(find(tail, true).unwrap()["prompt_tokens"], 3);
        assert_eq!(
            find(b"{\"usage\":{\"completion_tokens\":2}}", false).unwrap()["completion_tokens"],
            2
        );
        assert_eq!(find(b"{\"usage\":null}", false), None);
        assert_eq!(find(b"not json", false), None);
        // A last event cut short still counts.
        assert_eq!(
            find(b"data: {\"usage\":{\"prompt_tokens\":1}}", true).unwrap()["prompt_tokens"],
            1
        );
    }

    #[test]
    fn a_continued_usage_reports_the_whole_answer() {
        // The continuation's prompt held 2 carried tokens; it produced 3 more.
        let mut u = value(7, 3, None);
        fold_continued(&mut u, 2, None);
        assert_eq!(u, value(5, 5, None));
        let mut u = value(7, 3, Some(4));
        fold_continued(&mut u, 2, Some(6));
        assert_eq!(
            (u["prompt_tokens"].as_u64(), u["total_tokens"].as_u64()),
            (Some(6), Some(11))
        );
        assert_eq!(
            u["prompt_tokens_details"]["cached_tokens"], 4,
            "details kept"
        );
        // The continuation found the whole client prompt and 2 carried tokens cached: only the
        // client's prompt counts (before, cached 8 > prompt 6).
        let mut u = value(9, 3, Some(8));
        fold_continued(&mut u, 3, Some(6));
        assert_eq!(u, value(6, 6, Some(6)));
        // Part of the client prompt cached: unchanged; no prompt count from before: the
        // continuation's prompt less the carried tokens bounds it.
        let mut u = value(9, 3, Some(4));
        fold_continued(&mut u, 3, Some(6));
        assert_eq!(u, value(6, 6, Some(4)));
        let mut u = value(9, 1, Some(9));
        fold_continued(&mut u, 3, None);
        assert_eq!(u, value(6, 4, Some(6)));
        // A malformed usage is left alone, never a panic.
        let mut odd = json!(3);
        fold_continued(&mut odd, 2, None);
        assert_eq!((odd, joined(json!("x"), 1)), (json!(3), json!("x")));
        let j = joined(value(5, 1, Some(2)), 9);
        assert_eq!(j, value(5, 9, Some(2)));
    }
}
