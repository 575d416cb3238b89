//! The binary allocates with jemalloc (bench/overhead/results.md: glibc malloc cost 10–27 % more
//! router CPU per streamed request).

#![allow(missing_docs)]

#[cfg(all(unix, not(target_env = "musl")))]
#[test]
fn the_binary_allocates_with_jemalloc() {
    // tikv-jemallocator's jemalloc reads its options from `_RJEM_MALLOC_CONF`; `stats_print`
    // makes it print its statistics when the process exits. glibc ignores the variable.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvrouter"))
        .arg("--version")
        .env("_RJEM_MALLOC_CONF", "stats_print:true")
        .output()
        .expect("run kvrouter --version");
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("Begin jemalloc statistics"),
        "no jemalloc statistics on exit; stderr: {}",
        &stderr[..stderr.len().min(500)]
    );
}
