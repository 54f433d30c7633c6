fn main() -> anyhow::Result<()> {
    batchfs_lab::run()
}
