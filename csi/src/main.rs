//! `batchfs-csi`: the CSI node plugin and its holder (the command line is `cli.rs`).

fn main() -> anyhow::Result<()> {
    batchfs_csi::cli::run()
}
