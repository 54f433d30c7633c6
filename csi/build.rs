//! Compiles `proto/csi.proto` (the CSI v1 messages and services the plugin serves) into Rust.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/csi.proto");
    let files = protox::compile(["proto/csi.proto"], ["proto"])?;
    tonic_prost_build::configure().build_client(false).build_server(true).compile_fds(files)?;
    Ok(())
}
