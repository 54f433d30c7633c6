fn main() -> std::process::ExitCode {
    match batchfs_server::cli::run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // Each cause once, on one line (an object store's errors quote their sources).
            eprintln!("Error: {}", batchfs_server::cli::error_text(&e));
            std::process::ExitCode::FAILURE
        }
    }
}
