use super::*;
use std::sync::Arc;

#[test]
fn a_prefix_renames_every_metric_and_nothing_else() {
    let text = "# HELP kvrouter_a_total A kvrouter_ thing.\n# TYPE kvrouter_a_total counter\nkvrouter_a_total{m=\"kvrouter_x\"} 1\n";
    assert_eq!(with_prefix(text, "kvrouter_"), text);
    assert_eq!(
        with_prefix(text, "llm_router_"),
        "# HELP llm_router_a_total A kvrouter_ thing.\n# TYPE llm_router_a_total counter\nllm_router_a_total{m=\"kvrouter_x\"} 1\n"
    );
    assert_eq!(
        with_prefix(text, ""),
        "# HELP a_total A kvrouter_ thing.\n# TYPE a_total counter\na_total{m=\"kvrouter_x\"} 1\n"
    );
}

#[test]
fn histograms_by_model_carry_the_model_label_and_escape_it() {
    let m = ByModel::default();
    m.get("llama", true).ttft.observe(0.2);
    m.get("q\"x", true).ttft.observe(0.3);
    assert!(Arc::ptr_eq(&m.get("llama", true), &m.get("llama", true)));
    let mut out = String::new();
    m.render(&mut out, "t", "T.", |m| &m.ttft);
    assert!(
        out.contains("t_bucket{model=\"llama\",le=\"0.25\"} 1\n"),
        "{out}"
    );
    assert!(out.contains("t_count{model=\"llama\"} 1\n"), "{out}");
    assert!(out.contains("t_count{model=\"q\\\"x\"} 1\n"), "{out}");
    assert_eq!(out.matches("# TYPE t histogram").count(), 1);
}

#[test]
fn the_model_label_keeps_a_bounded_set_of_names() {
    let m = ByModel::default();
    for i in 0..MAX_MODEL_LABELS {
        assert_eq!(m.get(&format!("m{i}"), false).model(), format!("m{i}"));
    }
    // Past the bound, and names too long at any time, are one `_other` label.
    let other = m.get("one-more", false);
    assert_eq!(other.model(), OTHER_MODELS);
    assert!(Arc::ptr_eq(&other, &m.get(&"x".repeat(10_000), false)));
    assert!(
        Arc::ptr_eq(&m.get("m3", false), &m.get("m3", true)),
        "kept names stay"
    );
    // A model the workers serve gets its label whatever names came before.
    assert_eq!(m.get("real-model", true).model(), "real-model");
    let fresh = ByModel::default();
    let long = "y".repeat(MAX_MODEL_LABEL_BYTES + 1);
    assert_eq!(fresh.get(&long, false).model(), OTHER_MODELS);
    assert_eq!(fresh.get(&long, true).model(), long.as_str());
    assert_eq!(
        fresh.get("after-a-long-one", false).model(),
        "after-a-long-one"
    );
    let mut out = String::new();
    m.render(&mut out, "t", "T.", |m| &m.ttft);
    assert_eq!(out.matches("t_count{").count(), MAX_MODEL_LABELS + 2);
}

#[test]
fn counters_of_fixed_labels_show_zero_before_their_first_increment() {
    let m = Metrics::new("kv");
    let mut out = String::new();
    m.render(&mut out);
    for line in [
        "kvrouter_rejections_total{reason=\"queue_full\"} 0\n",
        "kvrouter_rejections_total{reason=\"max_wait\"} 0\n",
        "kvrouter_migrations_total{migration_type=\"weight_update\"} 0\n",
        "kvrouter_upstream_timeouts_total{kind=\"stream_idle\"} 0\n",
        "kvrouter_upstream_retries_total{mode=\"kv\"} 0\n",
    ] {
        assert!(out.contains(line), "{line} missing from\n{out}");
    }
    m.retries.inc(&[("mode", "kv")]);
    let mut out = String::new();
    m.render(&mut out);
    assert!(out.contains("kvrouter_upstream_retries_total{mode=\"kv\"} 1\n"));
}

#[test]
fn an_empty_label_value_is_the_label_left_out() {
    let c = Counters::default();
    c.inc(&[("status", "client_error"), ("mode", "kv")]);
    c.inc(&[("status", "client_error"), ("mode", "kv"), ("model", "")]);
    let mut out = String::new();
    c.render(&mut out, "r", "R.");
    assert!(
        out.ends_with("r{status=\"client_error\",mode=\"kv\"} 2\n"),
        "one series, counted twice: {out}"
    );
}

#[test]
fn a_worker_that_left_takes_its_series_with_it() {
    let m = Metrics::new("kv");
    m.kv_stream_breaks
        .inc(&[("worker", "7"), ("reason", "disconnected")]);
    m.kv_stream_breaks
        .inc(&[("worker", "17"), ("reason", "disconnected")]);
    m.key_refusals.inc(&[("worker", "7")]);
    m.prompt_token_mismatches.inc(&[("worker", "7")]);
    m.kv_stream_resyncs
        .inc(&[("worker", "7"), ("reason", "gap")]);
    m.forget_worker("7");
    let mut out = String::new();
    m.render(&mut out);
    assert!(!out.contains("worker=\"7\""), "{out}");
    assert!(
        out.contains("kvrouter_kv_stream_breaks_total{worker=\"17\",reason=\"disconnected\"} 1"),
        "{out}"
    );
}

#[test]
fn a_model_no_worker_serves_any_more_takes_its_series_with_it() {
    // Names the workers serve bypass the label bound: a fleet whose model names change (an
    // adapter per RL step) had kept every name's histograms and counters.
    let m = Metrics::new("kv");
    for step in 0..100 {
        let model = format!("policy-step-{step}");
        m.by_model.get(&model, true).ttft.observe(0.1);
        m.requests
            .inc(&[("status", "ok"), ("mode", "kv"), ("model", &model)]);
        if step > 0 {
            m.forget_model(&format!("policy-step-{}", step - 1));
        }
    }
    let mut out = String::new();
    m.render(&mut out);
    assert!(!out.contains("policy-step-98\""), "{out}");
    assert!(out.contains("policy-step-99\""), "{out}");
    // An unchecked name's label is given back to the bound when forgotten.
    for i in 0..MAX_MODEL_LABELS {
        m.by_model.get(&format!("u{i}"), false);
    }
    assert_eq!(m.by_model.get("one-more", false).model(), OTHER_MODELS);
    m.forget_model("u0");
    assert_eq!(m.by_model.get("one-more", false).model(), "one-more");
}
