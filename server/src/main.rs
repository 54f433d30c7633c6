fn main() -> anyhow::Result<()> {
    batchfs_server::cli::run()
}
