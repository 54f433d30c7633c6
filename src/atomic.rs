//! Files replaced whole: written to a temporary name beside them, flushed to disk, then renamed into
//! place, so that a reader (or a process started after a crash) finds the old file or the new one, never
//! a part. What the index files, the CSI plugin's records and tokens, and the programs it installs use.

use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Replaces `path` by a file holding `bytes`, with permission bits `mode` (`0o644`, `0o600`...), making
/// its directory if missing.
pub fn write(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    // The process id keeps two processes writing the same file from sharing a temporary name.
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let written = (|| {
        let mut file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_file_is_replaced_whole_with_its_mode_and_no_temporary_is_left() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/record.json");
        super::write(&path, b"one", 0o600).unwrap();
        super::write(&path, b"two", 0o600).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::read_dir(path.parent().unwrap()).unwrap().count(), 1, "no temporary left");
        // A path that cannot be renamed onto (a directory there): an error, and no temporary left.
        assert!(super::write(dir.path().join("sub").as_path(), b"x", 0o644).is_err());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
