fn main() -> anyhow::Result<()> {
    batchfs_mount::cli::run()
}
