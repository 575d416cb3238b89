//! The mock engine's HTTP handlers, driven directly.

use super::*;

/// An engine whose task ended (a panic) answered every request 500 while its probes said
/// ok; they answer 503 now.
#[tokio::test]
async fn probes_fail_once_the_engine_has_stopped() {
    let config = MockEngineConfig::default();
    let (tx, rx) = mpsc::unbounded_channel();
    let shared = Arc::new(Shared::new(&config));
    let state = AppState::new(config, tx, shared, None, None);
    assert_eq!(health(State(state.clone())).await.0, StatusCode::OK);
    drop(rx);
    let (status, body) = health(State(state)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body.0["status"], "engine stopped");
}
