//! Generates Rust code for `tandem/v1/*.proto` with tonic-prost-build (needs `protoc`: Debian
//! `protobuf-compiler`, installed by scripts/setup.sh), plus a file descriptor set for gRPC
//! server reflection.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["tandem/v1/common.proto", "tandem/v1/inference.proto", "tandem/v1/internal.proto"];
    for p in &protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("tandem_v1_descriptor.bin"))
        .compile_protos(&protos, &["."])?;
    Ok(())
}
