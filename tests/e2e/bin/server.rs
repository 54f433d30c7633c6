//! `batchfs-server`, as the tests that kill it start it: the same entry point as the server's binary.

fn main() -> anyhow::Result<()> {
    batchfs_server::cli::run()
}
