// Generates the tonic/prost code for proto/switchyard/v1 with the system `protoc`
// (Debian's protobuf-compiler; PROTOC overrides the path).
// The manifest directory is read when the script runs, not when it is compiled: a build script
// binary can be reused from a checkout at another path sharing the target directory.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let worker = root.join("switchyard/v1/worker.proto");
    println!("cargo:rerun-if-changed={}", worker.display());
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // Hand-written (src/stored_block.rs): the same wire form, decoded with one allocation.
        .extern_path(
            ".switchyard.v1.StoredBlock",
            "crate::stored_block::StoredBlock",
        )
        // Hand-written (src/generate_request.rs): the same wire form, the prompt encoded in one pass.
        .extern_path(
            ".switchyard.v1.GenerateRequest",
            "crate::generate_request::GenerateRequest",
        )
        .compile_protos(&[worker], &[root])?;
    Ok(())
}
