//! `batchfs-csi`, as the CSI tests run it: the plugin crate's own entry point.

fn main() -> anyhow::Result<()> {
    batchfs_csi::cli::run()
}
