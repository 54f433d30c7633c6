//! `batchfs`, as the takeover tests start it: the same entry point as mount-tool's binary.

fn main() -> anyhow::Result<()> {
    batchfs_mount::cli::run()
}
