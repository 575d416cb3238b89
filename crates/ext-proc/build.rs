//! Generates the ext_proc messages (and a tonic client, for tests and benches) from the vendored, published protocol
//! files in `proto/` with `protoc` (Debian's `protobuf-compiler`; `PROTOC` overrides its path).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let service = root.join("envoy/service/ext_proc/v3/external_processor.proto");
    println!("cargo:rerun-if-changed={}", root.display());
    tonic_build::configure()
        .build_server(false)
        .build_client(true)
        .compile_protos(&[service], &[root])
        .map_err(|e| {
            format!(
                "generating the ext_proc service from proto/ failed ({e}); it needs `protoc` \
                 (apt-get install protobuf-compiler, or set PROTOC)"
            )
            .into()
        })
}
