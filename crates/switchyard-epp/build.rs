// Generates the tonic/prost code for Envoy's ext_proc service from the protos vendored under
// proto/envoy (see proto/envoy/README.md) with the system `protoc`, whose own include directory
// supplies google/protobuf (mapped to prost-types).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let files = [
        "envoy/service/ext_proc/v3/external_processor.proto",
        "envoy/config/core/v3/base.proto",
        "envoy/type/v3/http_status.proto",
        "envoy/extensions/filters/http/ext_proc/v3/processing_mode.proto",
    ]
    .map(|f| root.join(f));
    for file in &files {
        println!("cargo:rerun-if-changed={}", file.display());
    }
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_protos(&files, &[root])?;
    Ok(())
}
